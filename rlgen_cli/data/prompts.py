"""Prompt datasets read from local files.

Two formats (docs/maths.md §12): plain text, one prompt per line (OCR / PickScore prompt sets),
and GenEval-style JSON lines, one object per line with at least a ``"prompt"`` key (the whole object is
kept as the example's metadata, for GenEval-style rewards). Each example carries its position in the
dataset, which is the group key for GRPO — never the decoded prompt, so duplicate prompts stay
distinct groups.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

logger = logging.getLogger(__name__)

__all__ = ["PromptDataset", "PromptExample"]

SUFFIXES = (".txt", ".jsonl")


@dataclass(frozen=True)
class PromptExample:
    """One prompt of a dataset.

    Attributes:
        index: Position in the dataset; the group key.
        prompt: The prompt text.
        metadata: The GenEval dict for ``.jsonl`` files, ``{}`` otherwise.
    """

    index: int
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)


BOM = "\ufeff"
"""The byte-order mark some editors (Notepad, Excel's "CSV UTF-8") write at the start of UTF-8 files."""


def read_text(path: Path) -> str:
    """The file's UTF-8 text without a leading byte-order mark (what ``utf-8-sig`` reads, but decoding the
    whole file, so a decoding error's offset is the file's own: ``paths.not_utf8`` reports it)."""
    return path.read_text(encoding="utf-8").removeprefix(BOM)


def _read_txt(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Read one prompt per line, stripping whitespace and skipping blank lines (and a leading BOM).

    Args:
        path: A ``.txt`` file.

    Returns:
        ``(prompt, {})`` pairs in file order.
    """
    lines = (line.strip() for line in read_text(path).splitlines())
    return [(line, {}) for line in lines if line]


def _parse_jsonl_line(line: str, where: str) -> tuple[str, dict[str, Any]]:
    """Parse one GenEval JSON line.

    Args:
        line: The stripped, non-empty line.
        where: ``"file:line"`` for errors.

    Returns:
        ``(prompt, metadata)``, metadata being the whole object.

    Raises:
        ValueError: If the line is not a JSON object with a non-empty string ``"prompt"``.
    """
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: invalid JSON ({err.msg}); each line must be one JSON object.") from err
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}.")
    prompt = record.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(
            f'{where}: missing prompt (need a non-empty string under key "prompt"); '
            f"keys present: {sorted(record)}."
        )
    return prompt.strip(), record


def _read_jsonl(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Read GenEval-style JSON lines, skipping blank lines (and a leading BOM).

    Args:
        path: A ``.jsonl`` file.

    Returns:
        ``(prompt, metadata)`` pairs in file order.
    """
    rows = []
    for number, line in enumerate(read_text(path).splitlines(), start=1):
        if line.strip():
            rows.append(_parse_jsonl_line(line.strip(), f"{path}:{number}"))
    return rows


class PromptDataset(Sequence[PromptExample]):
    """An immutable, indexable list of :class:`PromptExample`."""

    def __init__(self, examples: Sequence[PromptExample], source: str = "<in-memory prompts>") -> None:
        """Wrap examples; prefer :meth:`from_file` or :meth:`from_prompts`.

        Args:
            examples: Examples whose ``index`` equals their position.
            source: Where they came from, for errors and ``repr``.

        Raises:
            ValueError: If there are no examples or an index differs from its position.
        """
        if not examples:
            raise ValueError(f"prompt dataset {source} is empty; it needs at least one prompt.")
        for i, example in enumerate(examples):
            if example.index != i:
                raise ValueError(
                    f"prompt dataset {source}: example at position {i} has index {example.index}; "
                    "the index is the group key and must equal the position."
                )
        self._examples = tuple(examples)
        self.source = source

    @classmethod
    def from_file(cls, path: str | Path) -> PromptDataset:
        """Read a ``.txt`` (one prompt per line) or ``.jsonl`` (GenEval) prompt file.

        Args:
            path: The prompt file.

        Returns:
            The dataset, in file order.

        Raises:
            FileNotFoundError: If ``path`` does not exist.
            ValueError: On an unsupported suffix, a malformed line (named ``file:line``), or no prompts.
        """
        path = Path(path)
        if path.suffix not in SUFFIXES:
            raise ValueError(
                f"unsupported prompt file {path}: suffix {path.suffix!r} is not one of {SUFFIXES}; "
                "use a .txt file (one prompt per line) or a GenEval .jsonl file."
            )
        if not path.is_file():
            raise FileNotFoundError(f"prompt file not found: {path}; check the data path in your config.")
        rows = _read_txt(path) if path.suffix == ".txt" else _read_jsonl(path)
        examples = [PromptExample(i, prompt, meta) for i, (prompt, meta) in enumerate(rows)]
        logger.info("loaded %d prompts from %s", len(examples), path)
        return cls(examples, source=str(path))

    @classmethod
    def from_prompts(cls, prompts: Sequence[str]) -> PromptDataset:
        """Build a dataset from prompt strings (metadata ``{}``).

        Args:
            prompts: The prompts, in order.

        Returns:
            The dataset.

        Raises:
            TypeError: If a prompt is not a string.
            ValueError: If ``prompts`` is empty.
        """
        if isinstance(prompts, str):
            raise TypeError("from_prompts expects a sequence of prompts, got a single string.")
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                raise TypeError(f"prompt {i} is a {type(prompt).__name__}, expected str.")
        return cls([PromptExample(i, prompt, {}) for i, prompt in enumerate(prompts)])

    def repeated_by_tag(self, repeats: Mapping[str, int]) -> PromptDataset:
        """Return the dataset with each example of tag ``t`` appearing ``repeats[t]`` times in a row
        (tags not named: once; 0 leaves the tag out), re-indexed: each copy is its own group. Sampling
        passes over the result visit the named tags that many times more (or less) often.

        Args:
            repeats: ``{GenEval tag: copies per pass}``.

        Returns:
            The expanded dataset (``self`` when ``repeats`` is empty).

        Raises:
            ValueError: On a negative or non-integer count, a tag no example carries, or nothing left.
        """
        if not repeats:
            return self
        tags = {str(example.metadata.get("tag")) for example in self._examples if "tag" in example.metadata}
        for tag, count in repeats.items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"data.tag_repeats[{tag!r}] = {count!r}: give a whole number of copies ≥ 0.")
            if tag not in tags:
                raise ValueError(
                    f"data.tag_repeats names {tag!r}, which no prompt of {self.source} carries; its tags are "
                    f"{sorted(tags) or 'none (GenEval .jsonl prompts carry a tag)'}."
                )
        copies = [
            (example.prompt, example.metadata)
            for example in self._examples
            for _ in range(repeats.get(str(example.metadata.get("tag")), 1))
        ]
        if not copies:
            raise ValueError(
                f"data.tag_repeats={dict(repeats)} leaves no prompt of {self.source}; keep a count > 0."
            )
        examples = [PromptExample(i, prompt, metadata) for i, (prompt, metadata) in enumerate(copies)]
        return PromptDataset(examples, source=f"{self.source} (tag_repeats {dict(repeats)})")

    def __len__(self) -> int:
        """Return the number of prompts."""
        return len(self._examples)

    @overload
    def __getitem__(self, i: int) -> PromptExample: ...

    @overload
    def __getitem__(self, i: slice) -> list[PromptExample]: ...

    def __getitem__(self, i: int | slice) -> PromptExample | list[PromptExample]:
        """Return the example at position ``i`` (a list for a slice)."""
        if isinstance(i, slice):
            return list(self._examples[i])
        return self._examples[i]

    def __repr__(self) -> str:
        """Return a short description with the source and size."""
        return f"PromptDataset(source={self.source!r}, size={len(self)})"
