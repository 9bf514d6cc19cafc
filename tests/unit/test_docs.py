"""The project's docs stand alone: citations point at docs that exist, sections that exist.

Docstrings and configs cite formulas as ``docs/maths.md §N``. These tests fail when a citation names a
section that docs/maths.md does not have (a renumbering that left a citation behind) or when a file
cites material that is not part of the project.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

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
