"""``rlgen ls --keys`` prints every setting with its type, default, valid values and docstring, read from the
schema; docs/settings.md and README's table of options are generated from the same sources and must be
regenerated when those change."""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

from rlgen_cli.schema.choices import Dtype
from rlgen_cli.schema.describe import field_docs, group_rows, key_rows
from rlgen_cli.schema.families import FAMILY_NAMES
from rlgen_cli.tasks.ls import REGENERATE, _summary, keys_markdown, options_table

ROOT = Path(__file__).resolve().parents[2]
README_TABLE = re.compile(r"<!-- options table: .*? -->\n(.*?)\n<!-- end of options table -->", re.DOTALL)


def _key_line(out: str, key: str) -> tuple[list[str], str]:
    """The columns of ``key``'s line in ``rlgen ls --keys`` output and the docstring lines below it."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:1] == [key])
    doc = []
    for line in lines[at + 1 :]:
        if not line.startswith(" " * 6):
            break
        doc.append(line.strip())
    return re.split(r"\s{2,}", lines[at].strip()), " ".join(doc)


def test_keys_of_model_show_type_default_range_and_docstring(cli):
    code, out = cli("ls", "--keys", "model")
    assert code == 0, out
    assert _key_line(out, "model.lora.rank") == (["model.lora.rank", "int", "32", "≥ 1"], "LoRA rank r.")
    columns, doc = _key_line(out, "model.dtype")
    assert columns == ["model.dtype", "str", "float32", " | ".join(typing.get_args(Dtype))]
    assert doc.startswith("Dtype of") and "forward" in doc
    columns, doc = _key_line(out, "model.height")
    assert columns == ["model.height", "int | null", "null", "≥ 1"]
    assert "sampler.kind" not in out  # one section only


def test_keys_of_another_recipe_read_defaults_its_factories_set(cli):
    """R3's text policy is a ModelConfig built with family=qwen2_5_vl: the default shown is that one, not
    the class's sd3."""
    code, out = cli("ls", "--keys", "r3.policy.text", "--recipe", "r3")
    assert code == 0, out
    columns = _key_line(out, "r3.policy.text.family")[0]
    assert columns[:3] == ["r3.policy.text.family", "str", "qwen2_5_vl"]
    assert columns[3].split(" | ") == list(FAMILY_NAMES)  # a closed choice: the family table's rows
    assert _key_line(out, "r3.policy.text.tiny")[0] == ["r3.policy.text.tiny", "bool", "true"]


def test_bad_section_exits_2_with_the_valid_names(cli):
    code, out = cli("ls", "--keys", "modle")
    assert code == 2
    assert "did you mean model?" in out
    sections = out.split("sections: ", 1)[1]
    assert {"run", "model", "algo", "sampler", "reward", "launcher", "check", "plan", "server"} <= set(
        re.findall(r"\w+", sections.split("(")[0])
    )


def test_section_of_another_recipe_names_the_recipes_that_have_it(cli):
    code, out = cli("ls", "--keys", "sampler", "--recipe", "r3")
    assert code == 2
    assert "sampler belongs to recipe flow_grpo, flow_pref, flow_forward" in out
    code, out = cli("ls", "--keys", "--recipe", "nope")
    assert code == 2 and "recipes: flow_grpo" in out
    code, out = cli("ls", "model", "--recipe", "r3")
    assert code == 2 and "add --keys" in out


def test_docs_settings_is_generated_from_the_schema():
    """docs/settings.md is what ``rlgen ls --keys --markdown`` prints; change the schema or conf/, then
    regenerate it."""
    written = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert written == keys_markdown(), f"docs/settings.md is stale: run `{REGENERATE}`"


def test_readme_table_of_options_is_generated_from_conf():
    match = README_TABLE.search((ROOT / "README.md").read_text(encoding="utf-8"))
    assert match is not None, "README.md lost its options-table markers"
    assert match.group(1) + "\n" == options_table(), (
        "README's table of options is stale: replace it with the output of `rlgen ls --markdown`"
    )


def test_settings_cover_every_key_of_every_recipe():
    """Every option of every group and every key of every recipe appear in the reference."""
    from rlgen_cli._hydra import config_groups
    from rlgen_cli.schema.recipes import TRAIN_SCHEMAS, declared_paths

    text = keys_markdown()
    for group, options in config_groups().items():
        assert all(f"| `{option}` |" in text for option in options), group
    for recipe, schema in TRAIN_SCHEMAS.items():
        missing = [p for p in declared_paths(schema) if f"| `{p}` |" not in text]
        assert not missing, (recipe, missing)


@dataclass
class _Inner:
    """An inner section."""

    n: int | None = None
    """How many; null = all."""


@dataclass
class _Base:
    rate: float = 0.5
    """The base's rate."""
    names: list[str] = field(default_factory=lambda: ["a", "b"])
    undocumented: str = ""
    inner: _Inner = field(default_factory=lambda: _Inner(n=3))


@dataclass
class _Child(_Base):
    rate: float = 0.25  # redeclared without a docstring: the base's stays
    extra: bool = True
    """The child's own."""


def test_field_docs_read_the_string_below_each_field_through_the_bases():
    assert field_docs(_Child) == {"rate": "The base's rate.", "extra": "The child's own."}


def test_key_rows_format_types_defaults_and_follow_sections():
    rows = {row.key: row for row in key_rows(_Child)}
    assert list(rows) == ["rate", "names", "undocumented", "inner.*", "inner.n", "extra"]
    assert (rows["rate"].type, rows["rate"].default, rows["rate"].doc) == (
        "float",
        "0.25",
        "The base's rate.",
    )
    assert (rows["names"].type, rows["names"].default) == ("list[str]", "[a, b]")
    assert (rows["undocumented"].default, rows["undocumented"].doc) == ('""', "")
    assert rows["inner.*"].doc == "An inner section."
    assert (rows["inner.n"].type, rows["inner.n"].default) == ("int | null", "3")  # the factory's value


def test_group_rows_of_a_key_and_of_a_section():
    assert [r.key for r in group_rows("flow_grpo", "model.lora.rank")] == ["model.lora.rank"]
    assert group_rows("flow_grpo", "model.lora")[0].key == "model.lora.enabled"
    assert group_rows("r3", "sampler") == []


def test_option_summary_is_the_header_comment_first_sentence(tmp_path):
    yaml = tmp_path / "x.yaml"
    yaml.write_text(
        "# @package _global_\n# rlgen train experiment=x — the smallest demo: a tiny model (random\n"
        "# weights) learning. The test suite runs it.\nmodel: {}\n"
    )
    assert _summary(yaml) == "the smallest demo: a tiny model (random weights) learning."
    yaml.write_text("# Flow-DPO (Wallace et al. 2023). More.\nalgo: {}\n")
    assert _summary(yaml) == "Flow-DPO (Wallace et al. 2023)."


def _bash_completes(line: str) -> list[str]:
    from typer.testing import CliRunner

    from rlgen_cli.cli import app

    words = line.split()
    current = len(words) if line.endswith(" ") else len(words) - 1
    env = {"_RLGEN_COMPLETE": "complete_bash", "COMP_WORDS": " ".join(words), "COMP_CWORD": str(current)}
    result = CliRunner().invoke(app, [], prog_name="rlgen", env=env)
    assert result.exit_code == 0, result.output
    return result.output.split()


def test_tab_completes_sections_after_keys_and_the_recipes():
    assert {"run", "guard", "sampler"} <= set(_bash_completes("rlgen ls --keys "))
    assert {"run", "guard"}.isdisjoint(_bash_completes("rlgen ls "))  # without --keys: config groups
    assert "r3" in _bash_completes("rlgen ls --keys --recipe r3 ")
    nested = _bash_completes("rlgen ls --keys model.")
    assert "model.lora" in nested and all(name.startswith("model.") for name in nested)
    assert _bash_completes("rlgen ls --keys --recipe v") == ["vlm_rl", "vlm_sft"]
