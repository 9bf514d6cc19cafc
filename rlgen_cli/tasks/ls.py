"""``rlgen ls --keys``: every setting with its type, default, valid values and docstring, and docs/settings.md.

Both read the same two sources, so neither can fall behind: the config schema (the rows of
``schema/describe.py``) and ``conf/`` (each group option's file name and the first sentence of its
header comment). ``rlgen ls --keys --markdown`` prints docs/settings.md and ``rlgen ls --markdown``
README's table of options (``tests/cli/test_ls_keys.py`` fails when either file is stale).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import shutil
import textwrap
from collections.abc import Iterable
from pathlib import Path

from rlgen_cli._hydra import conf_dir, config_groups
from rlgen_cli.errors import UserError
from rlgen_cli.schema.describe import (
    DEFAULT_RECIPE,
    TOP_LEVEL,
    VERB_SECTIONS,
    KeyRow,
    group_names,
    group_rows,
)
from rlgen_cli.schema.recipes import TRAIN_SCHEMAS

__all__ = [
    "complete_section",
    "keys_markdown",
    "keys_text",
    "option_summaries",
    "options_table",
    "require_group",
]

REGENERATE = "rlgen ls --keys --markdown > docs/settings.md"
_ROLE = re.compile(r":\w+:`")  # Sphinx roles (:data:`X`) read as plain code
_SUMMARY_CAP = 160  # characters of an option's summary before it is cut at a clause
_DEFAULT_CAP = 24  # widest default that sets the column; a longer one overflows its own line
_RECIPE_NAME = "the recipe's name"  # the default of ``recipe``, which every recipe's schema sets to itself


def _plain(text: str) -> str:
    """A docstring on one line, in Markdown's code spans (``x`` and :data:`x` → `x`)."""
    return " ".join(_ROLE.sub("`", text.replace("``", "`")).split())


# -- which group ----------------------------------------------------------------------------------------


def require_recipe(recipe: str) -> None:
    """A recipe of ``schema/recipes.py``, else a refusal naming them."""
    if recipe not in TRAIN_SCHEMAS:
        raise UserError(f"no recipe {recipe!r}; recipes: {', '.join(TRAIN_SCHEMAS)}")


def require_group(recipe: str, group: str) -> list[KeyRow]:
    """The rows of ``group`` for ``recipe``; a group this recipe lacks is refused with the valid names
    (and the recipes that have it)."""
    require_recipe(recipe)
    group = group.removesuffix(".*")  # the section rows' own spelling
    rows = group_rows(recipe, group)
    if rows:
        return rows
    elsewhere = [r for r in TRAIN_SCHEMAS if r != recipe and group_rows(r, group)]
    if elsewhere:
        hint = f"{group} belongs to recipe {', '.join(elsewhere)} (add --recipe NAME);"
    else:
        paths = {r.key.removesuffix(".*") for r in group_rows(recipe, TOP_LEVEL)} | _section_paths(recipe)
        close = difflib.get_close_matches(group, sorted(paths), n=1) or [
            p for p in sorted(paths) if p.endswith(f".{group}")
        ]
        hint = f"did you mean {close[0]}?" if close else ""
    raise UserError(
        f"no section or key {group!r} in recipe {recipe}'s keys; {hint + ' ' if hint else ''}sections: "
        f"{', '.join(group_names(recipe))} (or a nested one such as model.lora, or one key)"
    )


def complete_section(recipe: str | None, incomplete: str) -> list[str]:
    """``rlgen ls --keys <TAB>``: the sections of ``recipe`` (a bad recipe completes to nothing), nested
    ones once a dot is typed (``model.`` → ``model.lora``, ``model.vlm``, …)."""
    recipe = recipe or DEFAULT_RECIPE
    if recipe not in TRAIN_SCHEMAS:
        return []
    names = sorted(_section_paths(recipe)) if "." in incomplete else group_names(recipe)
    return [name for name in names if name.startswith(incomplete)]


def _section_paths(recipe: str) -> set[str]:
    """Every section and nested section of ``recipe`` (``model``, ``model.lora``, ``check``, …)."""
    rows = [row for group in group_names(recipe)[1:] for row in group_rows(recipe, group)]
    return {row.key.rsplit(".", 1)[0] for row in rows}


def _group_label(group: str) -> str:
    """A section's name as a heading: the top-level keys and the other verbs' sections say what they are."""
    if group == TOP_LEVEL:
        return f"{TOP_LEVEL} (the top-level keys: seed=…, epochs=…)"
    if group in VERB_SECTIONS:
        return f"{group} ({VERB_SECTIONS[group][1]} only)"
    return group


# -- the terminal -----------------------------------------------------------------------------------------


def keys_text(recipe: str | None = None, group: str | None = None, width: int | None = None) -> str:
    """``rlgen ls --keys [GROUP] [--recipe NAME]``: a block per section, a key per line in aligned
    columns (key, type, default, valid values), its docstring wrapped below; ``recipe`` defaults to the
    one ``rlgen train`` composes."""
    recipe = recipe or DEFAULT_RECIPE
    require_recipe(recipe)
    width = width or min(max(shutil.get_terminal_size((100, 24)).columns, 60), 120)
    groups = [group.removesuffix(".*")] if group else group_names(recipe)
    rows = [require_group(recipe, name) for name in groups]  # a bad name stops before any output
    others = " | ".join(r for r in TRAIN_SCHEMAS if r != recipe)
    blocks = [
        textwrap.fill(
            f"Keys of recipe {recipe} (--recipe {others} for theirs). Defaults are the schema's: a group option "
            "(model=, algo=, experiment=…) sets its own, and `rlgen train … --cfg job` prints a run's values. "
            "All of them, described: docs/settings.md.",
            width,
        )
    ]
    blocks += [_text_block(name, section, width) for name, section in zip(groups, rows, strict=True)]
    return "\n\n".join(blocks) + "\n"


def _text_block(group: str, rows: list[KeyRow], width: int) -> str:
    keys = [r for r in rows if not r.is_section]
    own = rows[0] if rows[0].key == f"{group}.*" else None  # the section's docstring, as its title
    rows = rows[1:] if own else rows
    kw = max(len(r.key) for r in rows)
    tw = max(len("TYPE"), *(len(r.type) for r in keys))
    dw = max(len("DEFAULT"), min(max(len(r.default) for r in keys), _DEFAULT_CAP))
    title = f"{_group_label(group)}: {_plain(own.doc)}" if own else _group_label(group)
    lines = textwrap.wrap(title, width, subsequent_indent="  ")
    lines.append(f"  {'KEY':<{kw}}  {'TYPE':<{tw}}  {'DEFAULT':<{dw}}  VALID")
    for row in rows:
        head = (
            row.key
            if row.is_section
            else f"{row.key:<{kw}}  {row.type:<{tw}}  {row.default:<{dw}}  {row.valid}"
        )
        lines.append(f"  {head}".rstrip())
        if row.doc:
            lines += textwrap.wrap(_plain(row.doc), width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


# -- conf/: the groups' options ----------------------------------------------------------------------------


def option_summaries() -> dict[str, dict[str, str]]:
    """{group: {option: the first sentence of its file's header comment}} of every group under ``conf/``."""
    root = conf_dir()
    return {
        group: {option: _summary(root / group / f"{option}.yaml") for option in options}
        for group, options in config_groups().items()
    }


def _summary(path: Path) -> str:
    """What an option is: its header comment's first sentence (after a usage line's " — "), cut at a
    clause when long."""
    header = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            header.append(line.lstrip("#").strip())
    text = " ".join(header)
    if text.startswith("rlgen "):  # a usage line: what follows its dash says what the option is
        text = text.split(" — ", 1)[1] if " — " in text else " ".join(header[1:])
    sentence = re.split(r"(?<=\.)\s+(?=[A-Z`(]|rlgen )", text, maxsplit=1)[0]
    return _shortened(sentence)


def _shortened(sentence: str) -> str:
    """``sentence``, or its head up to the first top-level ``:`` or ``;`` when it runs past the cap."""
    if len(sentence) <= _SUMMARY_CAP:
        return sentence
    depth = 0
    for i, char in enumerate(sentence):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(char, 0)
        if depth == 0 and char in ":;" and i >= 20:
            return sentence[:i]
    cut = sentence.rfind(" ", 0, _SUMMARY_CAP)
    return sentence[:cut].rstrip(",") + " …"


def options_table(only: str | None = None) -> str:
    """``rlgen ls --markdown [GROUP]``, README's table: every group (or ``only``) with all its options'
    names (docs/settings.md says what each is)."""
    groups = config_groups()
    if only is not None and only not in groups:
        raise UserError(f"no config group {only!r}; groups: {', '.join(groups)}")
    lines = ["| group | options |", "|---|---|"]
    for group, options in groups.items():
        if only in (None, group):
            lines.append(f"| `{group}=` | {', '.join(f'`{o}`' for o in options)} |")
    return "\n".join(lines) + "\n"


# -- docs/settings.md -------------------------------------------------------------------------------------


def _md(text: str) -> str:
    """``text`` as one Markdown table cell: pipes escaped; ``<`` escaped outside code spans (so ``<think>``
    shows instead of becoming an HTML tag)."""
    parts = _plain(text).replace("|", "\\|").split("`")
    return "`".join(part if i % 2 else part.replace("<", "&lt;") for i, part in enumerate(parts))


def _merged_rows(group: str) -> list[tuple[KeyRow, list[str]]]:
    """Every row of ``group`` over the training recipes, each with the recipes that have it as it is
    (a key whose default or docstring differs by recipe gets a row per variant, next to each other)."""
    recipes = [r for r in TRAIN_SCHEMAS if group in group_names(r)]
    merged: dict[KeyRow, list[str]] = {}
    for recipe in recipes:
        for row in group_rows(recipe, group):
            row = dataclasses.replace(row, default=_RECIPE_NAME) if row.key == "recipe" else row
            merged.setdefault(row, []).append(recipe)
    order = {row.key: i for i, row in reversed(list(enumerate(merged)))}
    return sorted(merged.items(), key=lambda item: order[item[0].key])


def _recipes_cell(recipes: list[str]) -> str:
    return "all" if set(recipes) == set(TRAIN_SCHEMAS) else ", ".join(recipes)


def _key_table(rows: Iterable[tuple[KeyRow, list[str]]], by_recipe: bool) -> list[str]:
    """A Markdown table of ``rows``; ``by_recipe`` adds the column of the recipes that have each row (the
    other verbs' sections have none: they are the same whatever the recipe)."""
    head = ["key", "type", "default", "valid", *(["recipes"] if by_recipe else []), "what it does"]
    lines = [f"| {' | '.join(head)} |", "|" + "---|" * len(head)]
    for row, recipes in rows:
        cells = [f"`{row.key}`", *_described(row), *([_recipes_cell(recipes)] if by_recipe else [])]
        lines.append(f"| {' | '.join(cells)} | {_md(row.doc)} |")
    return lines


def _described(row: KeyRow) -> list[str]:
    """The type, default and valid-values cells of ``row`` (blank but the type for a section)."""
    if row.is_section:
        return ["section", "", ""]
    default = row.default if row.default == _RECIPE_NAME else f"`{_md(row.default)}`"
    return [row.type.replace("|", "\\|"), default, _md(row.valid)]


def _all_groups() -> list[str]:
    """Every section of every recipe, in the order the recipes declare them, the other verbs' last."""
    names: list[str] = []
    for recipe in TRAIN_SCHEMAS:
        names += [g for g in group_names(recipe) if g not in names and g not in VERB_SECTIONS]
    return [*names, *VERB_SECTIONS]


def keys_markdown() -> str:
    """docs/settings.md: every option of every config group, then every key of every recipe by section."""
    lines = [
        "# Settings",
        "",
        f"<!-- Generated from conf/ and rlgen_cli/schema by `{REGENERATE}`: edit those, not this file. -->",
        "",
        "Every option of every config group and every key a run can set, generated from `conf/` and the config",
        "schema (`rlgen_cli/schema`). On the command line, `rlgen ls [GROUP]` lists the groups' options and",
        "`rlgen ls --keys [SECTION] [--recipe NAME]` prints the keys of one recipe (`flow_grpo` unless named).",
        "",
        "## Config groups",
        "",
        "Pick one option per group with `group=option` (`rlgen train model=sd3 algo=grpo_fast`); what each is,",
        "from the first lines of its file under `conf/` (they say more).",
    ]
    for group, options in option_summaries().items():
        lines += ["", f"### `{group}=`", "", "| option | what it is |", "|---|---|"]
        lines += [f"| `{option}` | {_md(summary)} |" for option, summary in options.items()]
    lines += [
        "",
        "## Keys",
        "",
        "Override any key with `key=value` (`algo.lr=3e-4`). A key's default is the schema's: a group option",
        "sets its own values, and `rlgen train … --cfg job` prints the values a run gets. Each recipe (picked",
        "by the `algo` option, or by a unified `model`) composes only the keys it reads: *recipes* names them",
        "where not every recipe has the key, and a key overridden in a recipe that lacks it stops the run with",
        "exit code 2. *valid* is what the one validation pass accepts (of each element, for lists and maps).",
    ]
    for group in _all_groups():
        lines += [
            "",
            f"### {_group_label(group)}",
            "",
            *_key_table(_merged_rows(group), group not in VERB_SECTIONS),
        ]
    return "\n".join(lines) + "\n"
