"""The project's docs stand alone: citations point at docs that exist, sections that exist.

Docstrings and configs cite formulas as ``docs/maths.md §N``. These tests fail when a citation names a
section that docs/maths.md does not have (a renumbering that left a citation behind) or when a file
cites material that is not part of the project.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MATHS = ROOT / "docs" / "maths.md"
SCANNED_DIRS = ("rlgen_cli", "conf", "docs", "tests", "benchmarks", "scripts")
SCANNED_FILES = ("README.md", "Makefile", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cfg"}

_SECTION_NUMBER = r"\d+(?:\.\d+)*"
_HEADING = re.compile(rf"^#{{1,6}}\s+({_SECTION_NUMBER})\.?\s", re.MULTILINE)
# "docs/maths.md §4.2", "docs/maths.md §9.1, §9.2", "maths.md §3 and §4" (a link from inside docs/)
_CITATION = re.compile(rf"maths\.md\s*((?:(?:,|;|and|\s)*§\s*{_SECTION_NUMBER})+)")
_SECTION_SIGN = re.compile(rf"§\s*({_SECTION_NUMBER})")
# Material that lives outside the repository; spelt in pieces so this file does not match itself.
OUTSIDE_WORD = "REFER" + "ENCE"
OUTSIDE_FILES = ("DESIGN" + ".md", "STYLE" + ".md", "/work/" + "shared", "seeds" + "/")
_OUTSIDE = re.compile(rf"\b{OUTSIDE_WORD}\b|" + "|".join(map(re.escape, OUTSIDE_FILES)))


def section_numbers(markdown: str) -> set[str]:
    """The numbers of the numbered headings (``## 4. Title``, ``### 4.2 Title``) of a Markdown text."""
    return set(_HEADING.findall(markdown))


def cited_sections(text: str) -> list[str]:
    """Every section number a text cites as ``maths.md §N`` (several may follow one file name)."""
    return [n for group in _CITATION.findall(text) for n in _SECTION_SIGN.findall(group)]


def scanned_files(root: Path) -> list[Path]:
    """The project's text files under ``root``: package, configs, docs, tests, scripts, top-level files."""
    files = [root / name for name in SCANNED_FILES if (root / name).is_file()]
    for folder in SCANNED_DIRS:
        files += sorted(p for p in (root / folder).rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    return [p for p in files if "__pycache__" not in p.parts]


def dangling_citations(files: Iterable[Path], sections: set[str], root: Path) -> list[str]:
    """``path:line: §N`` for every cited section that is not a heading in docs/maths.md."""
    found = []
    for path in files:
        for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            cited = cited_sections(line) if path.name != "maths.md" else _SECTION_SIGN.findall(line)
            found += [f"{path.relative_to(root)}:{lineno}: §{n}" for n in cited if n not in sections]
    return found


def outside_mentions(files: Iterable[Path], root: Path) -> list[str]:
    """``path:line: text`` for every line that cites a file the project does not contain."""
    found = []
    for path in files:
        for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if _OUTSIDE.search(line):
                found.append(f"{path.relative_to(root)}:{lineno}: {line.strip()}")
    return found


def test_maths_doc_numbers_its_sections_once_each() -> None:
    text = MATHS.read_text(encoding="utf-8")
    numbers = _HEADING.findall(text)
    assert len(numbers) == len(set(numbers)), f"duplicate section numbers: {sorted(numbers)}"
    tops = sorted(int(n) for n in numbers if "." not in n)
    assert tops == list(range(1, len(tops) + 1)) and len(tops) >= 12, f"top-level sections {tops}"
    orphans = [n for n in numbers if "." in n and n.rsplit(".", 1)[0] not in numbers]
    assert not orphans, f"subsections without a parent section: {orphans}"


def test_every_maths_citation_names_an_existing_section() -> None:
    files = scanned_files(ROOT)
    assert MATHS in files and ROOT / "rlgen_cli" / "sde" / "step.py" in files
    dangling = dangling_citations(files, section_numbers(MATHS.read_text(encoding="utf-8")), ROOT)
    assert not dangling, "citations of sections docs/maths.md does not have:\n" + "\n".join(dangling)


def test_no_file_cites_material_outside_the_project() -> None:
    mentions = outside_mentions(scanned_files(ROOT), ROOT)
    assert not mentions, "cite docs/maths.md §N (or another file in docs/) instead:\n" + "\n".join(mentions)


def test_the_package_cites_the_maths_doc() -> None:
    """The check above is not vacuous: the package does cite sections, and they parse."""
    cited = {n for p in scanned_files(ROOT) if p.suffix == ".py" for n in cited_sections(p.read_text())}
    assert {"2.2", "2.5", "3", "6"} <= cited, sorted(cited)


def test_checkers_flag_a_bogus_section_and_an_outside_file(tmp_path: Path) -> None:
    """A citation of a missing section (§99, and §7 inside the doc itself) and a line naming outside
    material are each reported with their file and line."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "maths.md").write_text("## 1. One\n\n### 1.2 Two\n\nSee §1.2 and §7.\n")
    module = tmp_path / "mod.py"
    bogus = "§" + "99"  # kept out of this file's own text, which the real scan reads
    module.write_text(
        f'"""Step (docs/maths.md §1.2, {bogus}); KL (docs/maths.md §1).\n\n'
        f'Defaults from {OUTSIDE_WORD} §5 and {OUTSIDE_FILES[0]}."""\n'
    )
    files = [tmp_path / "docs" / "maths.md", module]
    sections = section_numbers((tmp_path / "docs" / "maths.md").read_text())
    assert sections == {"1", "1.2"}
    assert cited_sections(module.read_text()) == ["1.2", "99", "1"]
    assert dangling_citations(files, sections, tmp_path) == ["docs/maths.md:5: §7", "mod.py:1: §99"]
    assert [m.split(":")[:2] for m in outside_mentions(files, tmp_path)] == [["mod.py", "3"]]


# -- the command-line examples of README.md and docs/*.md run -------------------------------------------
# An example is a line of a fenced code block that starts with ``rlgen `` (or ``$ rlgen ``), joined with its
# ``\`` continuation lines. Its shell comment may mark what it needs beyond a CPU, offline:
# ``[needs GPU]``, ``[needs weights]`` (a download or a local model), ``[needs a run]`` (a run directory or
# checkpoint of an earlier run), ``[needs a server]`` (reward or judge servers), ``[needs your files]``
# (data or config files of the user's); several: ``[needs GPU, weights]``.
#
# * Every example composes: ``rlgen VERB ARGS --cfg job`` exits 0 (in this process; the config a run would
#   start from, checked as a run checks it, nothing started). Arguments that load weights, name a CUDA
#   device or a server must carry the matching marker.
# * An unmarked example runs on the CPU, offline (the ``slow`` test): ``plan``, ``check-onpolicy``,
#   ``eval``, ``sample`` and ``ls`` as written; ``train`` as ``rlgen plan`` of its arguments where
#   ``rlgen plan`` models its recipe (training itself takes minutes), composed only otherwise.
#   ``serve-reward`` serves until stopped, ``plot`` reads runs: composed or not run.
# * ``$ rlgen …`` followed by output shows a refusal: it exits 2 and prints that output (up to a ``…``).
# * A template (an argument with ``…`` or ``<name>``) is neither composed nor run; an optional argument in
#   brackets (``[checkpoint=RUN/…]``) is left out.
EXAMPLE_FILES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
NEEDS = ("GPU", "weights", "a run", "a server", "your files")
HYDRA_VERBS = {
    "train": "train", "sample": "sample", "eval": "eval", "check-onpolicy": "check_onpolicy",
    "plan": "plan", "serve-reward": "serve_reward",
}  # fmt: skip
RUN_AS_WRITTEN = ("ls", "plan", "check-onpolicy", "eval", "sample")
KNOWN_FAILURES: dict[str, str] = {}
"""Examples that fail today (``file: rlgen ARGS``): their tests are xfail(strict), so a fix shows. An entry
whose example is reworded matches nothing and goes (its example is then tested like any other)."""
NEEDS_PACKAGE = {"algo.token.engine=vllm": "vllm"}
"""An argument that needs a package the CPU install does not have: composed where it is installed."""
_FENCE = re.compile(r"^\s*(```|~~~)")
_MARKER = re.compile(r"\[needs ([^\]]+)\]")
_PLACEHOLDER = re.compile(r"…|<\w+>|\[[A-Z_]+\]")  # algo.lr=…, model=<family>, urls=[HOST]
_OPTIONAL_ARG = re.compile(r"^\[[\w.+~/@-]+=.*\]$")


@dataclass(frozen=True)
class Example:
    """One ``rlgen …`` example: where it is, its arguments after ``rlgen``, what its marker says it needs
    and the output the docs show after it (a refusal), if any."""

    file: str
    line: int
    args: tuple[str, ...]
    needs: tuple[str, ...] = ()
    shown: str = ""

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def command(self) -> str:
        """``file: rlgen ARGS``: names the example whatever the lines around it."""
        return f"{self.file}: rlgen {shlex.join(self.args)}"

    @property
    def verb(self) -> str:
        return self.args[0] if self.args else ""

    @property
    def is_template(self) -> bool:
        return any(_PLACEHOLDER.search(arg) for arg in self.args)

    def __str__(self) -> str:
        return f"{self.where}: rlgen {shlex.join(self.args)}"


def split_comment(line: str) -> tuple[str, str]:
    """A shell line's command and its comment (after the first ``#`` that starts a word outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1 :]
    return line, ""


def parse_example(file: str, line: int, command: str, comment: str) -> Example:
    """The example of ``command`` (``rlgen`` first, continuations joined) with ``comment``'s marker."""
    words = [w for w in shlex.split(command) if not _OPTIONAL_ARG.match(w)]
    needs = tuple(n.strip() for m in _MARKER.findall(comment) for n in m.split(","))
    return Example(file, line, tuple(words[1:]), needs)


def examples_in(path: Path, root: Path) -> list[Example]:
    """Every ``rlgen …`` example of the fenced code blocks of ``path``, with the output lines that follow a
    ``$ rlgen …`` line."""
    found: list[Example] = []
    fenced, pending, output_of = False, None, None
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line):
            fenced, pending, output_of = not fenced, None, None
            continue
        if not fenced:
            continue
        command, comment = split_comment(line)
        stripped = command.strip()
        if pending is None:
            if output_of is not None and not stripped.startswith(("$ ", "rlgen ")):
                found[output_of] = dataclasses.replace(
                    found[output_of], shown=f"{found[output_of].shown} {line}"
                )
                continue
            output_of = None
            if not stripped.removeprefix("$ ").startswith("rlgen "):
                continue
            pending = (lineno, "", stripped.startswith("$ "))
            command = stripped.removeprefix("$ ")
        first, joined, prompted = pending
        if command.rstrip().endswith("\\"):
            pending = (first, joined + command.rstrip()[:-1] + " ", prompted)
            continue
        found.append(parse_example(str(path.relative_to(root)), first, joined + command, comment))
        output_of, pending = (len(found) - 1 if prompted else None), None
    return found


def docs_examples() -> list[Example]:
    return [example for path in EXAMPLE_FILES for example in examples_in(path, ROOT)]


def expected_to_fail(example: Example):
    """``example`` as a parameter, xfail(strict) when it is a known failure."""
    reason = KNOWN_FAILURES.get(example.command)
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    marks += [
        pytest.mark.skipif(not importlib.util.find_spec(package), reason=f"{arg} needs {package}")
        for arg, package in NEEDS_PACKAGE.items()
        if arg in example.args
    ]
    return pytest.param(example, id=example.where, marks=marks)


EXAMPLES = docs_examples()
COMPOSED = [
    expected_to_fail(e)
    for e in sorted(EXAMPLES, key=lambda e: HYDRA_VERBS.get(e.verb, ""))  # schemas stored once per verb
    if e.verb in HYDRA_VERBS and not e.is_template and not e.shown
]
REFUSALS = [expected_to_fail(e) for e in EXAMPLES if e.shown]
RUN = [
    expected_to_fail(e)
    for e in EXAMPLES
    if e.verb in (*RUN_AS_WRITTEN, "train") and not e.is_template and not e.needs and not e.shown
]


def test_the_examples_are_found_and_their_markers_known() -> None:
    assert len(EXAMPLES) >= 80 and {e.verb for e in EXAMPLES} >= {*HYDRA_VERBS, "ls", "plot"}
    assert len(REFUSALS) >= 2 and all(p.values[0].verb == "train" for p in REFUSALS)
    unknown = [f"{e.where}: {n}" for e in EXAMPLES for n in e.needs if n not in NEEDS]
    assert not unknown, f"markers other than [needs {' | '.join(NEEDS)}]:\n" + "\n".join(unknown)


def test_examples_are_read_with_continuations_markers_refusals_and_templates(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "rlgen train outside=a_block\n"
        "```bash\n"
        "rlgen train model=tiny_sd3 'prompts=[a # b]'   # a comment [needs GPU, weights]\n"
        "# rlgen train commented=out\n"
        "rlgen eval model=sd3 \\\n"
        "    data=geneval [checkpoint=RUN/x]   # [needs a run]\n"
        "rlgen train model=<family> algo.lr=…\n"
        "rlgen train urls=[HOST]\n"
        "```\n"
        "```\n"
        "$ rlgen train launcher.num_processes=3\n"
        "error: cannot be split\n"
        "over 3 processes …\n"
        "```\n"
    )
    found = examples_in(doc, tmp_path)
    assert [(e.where, e.args, e.needs) for e in found] == [
        ("doc.md:3", ("train", "model=tiny_sd3", "prompts=[a # b]"), ("GPU", "weights")),
        ("doc.md:5", ("eval", "model=sd3", "data=geneval"), ("a run",)),
        ("doc.md:7", ("train", "model=<family>", "algo.lr=…"), ()),
        ("doc.md:8", ("train", "urls=[HOST]"), ()),
        ("doc.md:11", ("train", "launcher.num_processes=3"), ()),
    ]
    assert [e.is_template for e in found] == [False, False, True, True, False]
    assert " ".join(found[4].shown.split()) == "error: cannot be split over 3 processes …"
    assert found[1].command == "doc.md: rlgen eval model=sd3 data=geneval"


@pytest.fixture(scope="module")
def schemas_once_per_verb():
    """``register_schemas`` re-stores every schema (≈ 0.6 s); the examples, grouped by verb, store them
    once per verb. Module-scoped: no other module composes meanwhile."""
    from rlgen_cli.schema import store

    register, registered = store.register_schemas, {}

    def once(verb: str = "train") -> None:
        if registered.get("verb") != verb:
            register(verb)
            registered["verb"] = verb

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(store, "register_schemas", once)
        yield


def rlgen(*args: str) -> tuple[int, str, str]:
    """``rlgen ARGS`` in this process, exactly as given: (exit code, stdout, stdout and stderr)."""
    from typer.testing import CliRunner

    from rlgen_cli.cli import app

    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stdout + result.stderr


def missing_markers(example: Example, config: dict) -> list[str]:
    """The markers ``example`` lacks for what its arguments or its composed ``config`` need."""
    missing = []
    model = config.get("model") or {}
    loads = model.get("tiny") is False and model.get("weights") != "random_init"
    if loads and not str(model.get("path")).startswith("builtin:") and example.verb not in ("plan",):
        missing.append(f"weights (model.path={model.get('path')})")
    values = [arg.split("=", 1)[-1] for arg in example.args[1:]]
    if any("cuda" in value for value in values):
        missing.append("GPU (a cuda device)")
    if any(re.search(r"(\.hosts|reward_server_urls)=", arg) for arg in example.args):
        missing.append("a server (hosts)")
    return [m for m in missing if m.split(" (")[0] not in example.needs]


def jobs(args: tuple[str, ...]) -> list[list[str]]:
    """The command lines ``--cfg job`` can print for ``args``: one per job of a sweep (``-m a=1,2``), whose
    ``--cfg`` Hydra refuses; ``args`` itself otherwise."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    if "-m" not in args and "--multirun" not in args:
        return [list(args)]
    verb, *rest = (a for a in args if a not in ("-m", "--multirun"))
    choices = [
        [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
        if o.is_sweep_override()
        else [o.input_line]
        for o in OverridesParser.create().parse_overrides(rest)
    ]
    return [[verb, *job] for job in itertools.product(*choices)]


@pytest.mark.parametrize("example", COMPOSED)
def test_the_example_composes(example: Example, schemas_once_per_verb) -> None:
    import yaml

    for job in jobs(example.args):
        code, config, out = rlgen(*job, *([] if "--cfg" in job else ["--cfg", "job"]))
        assert code == 0, f"{example} (composed: {shlex.join(job)}) --cfg job exits {code}:\n{out[-3000:]}"
        missing = missing_markers(example, yaml.safe_load(config) or {})
        assert not missing, f"{example}: mark what it needs: [needs {', '.join(missing)}]"


def test_a_sweep_composes_each_of_its_jobs() -> None:
    assert jobs(("train", "-m", "algo.lr=1e-4,3e-4", "model=sd3")) == [
        ["train", "algo.lr=0.0001", "model=sd3"],
        ["train", "algo.lr=0.0003", "model=sd3"],
    ]
    assert jobs(("train", "model=sd3")) == [["train", "model=sd3"]]


@pytest.mark.parametrize("example", REFUSALS)
def test_the_refusal_shown_is_the_one_printed(example: Example, tmp_path: Path, monkeypatch) -> None:
    """``$ rlgen …`` with its output: the docs show a refusal (exit 2) and the words it prints."""
    monkeypatch.chdir(tmp_path)
    code, _, out = rlgen(*example.args, f"hydra.run.dir={tmp_path / 'run'}")
    shown = " ".join(example.shown.split("…")[0].split())
    assert code == 2 and shown in " ".join(out.split()), f"{example}: exit {code}, printed:\n{out}"


def cpu_run(job: list[str]) -> list[str] | None:
    """What an unmarked example's ``job`` runs on the CPU: itself, ``train`` as ``plan`` where ``rlgen plan``
    models its recipe, None where composing it is the whole check (``train`` of other recipes)."""
    import yaml

    from rlgen_cli.tasks.plan import MODELLED_RECIPES

    if job[0] != "train":
        return job
    _, config, _ = rlgen(*job, *([] if "--cfg" in job else ["--cfg", "job"]))
    return ["plan", *job[1:]] if (yaml.safe_load(config) or {}).get("recipe") in MODELLED_RECIPES else None


@pytest.mark.slow  # ≈ 15 min on two busy cores (ShapesEval's held-out evaluation 6 of them, real-size plans)
@pytest.mark.parametrize("example", RUN)
def test_the_example_runs_on_the_cpu_offline(example: Example, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # what a run writes outside its run directory stays here
    runs = [run for run in map(cpu_run, jobs(example.args)) if run is not None]
    if not runs:
        pytest.skip(f"rlgen plan does not model this recipe: composed only ({example.where})")
    for n, args in enumerate(runs):
        args = [*args, f"hydra.run.dir={tmp_path / str(n)}"] if args[0] != "ls" else args
        code, _, out = rlgen(*args)
        fits_or_not = (0, 1) if args[0] == "plan" else (0,)  # rlgen plan: 1 = does not fit
        assert code in fits_or_not, f"{example} (ran: rlgen {shlex.join(args)}) exits {code}:\n{out[-3000:]}"
