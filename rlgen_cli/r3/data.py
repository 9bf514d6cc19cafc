"""R3 prompt sets: GenEval, GenEval++ and TIIF JSON lines (docs/maths.md §12).

* ``geneval`` — ``{"tag", "include": [{"class", "count", "color"?, "position"?: [relation, idx]}],
  "exclude"?: [{"class", "count"}], "prompt"}``; scored by the GenEval server.
* ``geneval_plus`` — the same, with include items that may add ``region`` (left / right / above /
  below) and ``size`` (larger / smaller); scored by a VLM judge. ``tag`` is optional (``"all"``).
* ``tiif`` — ``{"type", "short_description", "long_description"?, "yn_question_list",
  "yn_answer_list"}``; the prompt is ``short_description``, the tag ``type``; scored by a VLM judge.

Every row is checked when loading, so a malformed row fails before training starts with
``file:line`` and what to fix, as a :class:`~rlgen_cli.errors.UserError`. The whole row is kept as
the sample's metadata (the reward reads it). ``builtin:NAME`` names a file shipped in
``rlgen_cli/assets/prompts`` (``r3_geneval_tiny.jsonl``, ``r3_geneval_plus_tiny.jsonl``,
``r3_tiif_tiny.jsonl``: a handful of rows each, for tests and tiny runs).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlgen_cli.data.paths import read_utf8, resolve_data_path
from rlgen_cli.errors import UserError
from rlgen_cli.rewards.judge_prompts import tiif_questions

logger = logging.getLogger(__name__)

__all__ = ["DATASETS", "R3Sample", "load_r3_dataset", "parse_r3_row"]

RELATIONS = ("left of", "right of", "above", "below")
REGIONS = ("left", "right", "above", "below")
SIZES = ("larger", "smaller")
DEFAULT_TAG = "all"


@dataclass(frozen=True)
class R3Sample:
    """One prompt of an R3 dataset.

    Attributes:
        prompt: The text-to-image prompt.
        metadata: The whole JSON row (what GenEval / the judges score against).
        tag: Category for per-tag accuracy (GenEval ``tag``, TIIF ``type``).
        index: Position in the file: the GRPO group key.
    """

    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)
    tag: str = DEFAULT_TAG
    index: int = 0


# ------------------------------------------------------------------------------------ row checks
def _text(row: Mapping[str, Any], key: str, what: str) -> str:
    """The non-empty string under ``key``; raises ``ValueError`` naming the keys present."""
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f'{what} needs a non-empty string under "{key}"; keys present: {sorted(row)}')
    return value.strip()


def _clause(item: Any, key: str, i: int) -> Mapping[str, Any]:
    """One ``include`` / ``exclude`` item: a dict with a string ``class`` and an integer ``count`` ≥ 1."""
    where = f"{key}[{i}]"
    if not isinstance(item, Mapping):
        raise ValueError(f"{where} must be an object, got {type(item).__name__}")
    if not isinstance(item.get("class"), str) or not item["class"].strip():
        raise ValueError(f'{where} needs a non-empty string "class"')
    count = item.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f'{where} needs an integer "count" >= 1, got {count!r}')
    return item


def _choice(item: Mapping[str, Any], key: str, choices: tuple[str, ...], where: str) -> None:
    """Raise unless ``item[key]`` is absent or one of ``choices``."""
    if key in item and item[key] not in choices:
        raise ValueError(f'{where} "{key}" must be one of {list(choices)}, got {item[key]!r}')


def _position(item: Mapping[str, Any], i: int) -> None:
    """GenEval's ``position: [relation, idx]``: idx names an earlier include item."""
    if "position" not in item:
        return
    position = item["position"]
    ok = isinstance(position, list | tuple) and len(position) == 2
    if not ok or position[0] not in RELATIONS or isinstance(position[1], bool):
        raise ValueError(f'include[{i}] "position" must be [relation, index], relation in {list(RELATIONS)}')
    if not isinstance(position[1], int) or not 0 <= position[1] < i:
        raise ValueError(f'include[{i}] "position" index must name an earlier include item (0..{i - 1})')


def _clauses(row: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    """The ``include`` / ``exclude`` list (``exclude`` may be absent)."""
    items = row.get(key, [] if key == "exclude" else None)
    if not isinstance(items, list) or (key == "include" and not items):
        raise ValueError(f'"{key}" must be a {"non-empty " if key == "include" else ""}list of objects')
    return [_clause(item, key, i) for i, item in enumerate(items)]


def _geneval(row: Mapping[str, Any], plus: bool) -> tuple[str, str]:
    """Check a GenEval (``plus``: GenEval++) row; returns ``(prompt, tag)``."""
    name = "a GenEval++ row" if plus else "a GenEval row"
    prompt = _text(row, "prompt", name)
    tag = _text(row, "tag", name) if not plus or "tag" in row else DEFAULT_TAG
    for i, item in enumerate(_clauses(row, "include")):
        if "color" in item and (not isinstance(item["color"], str) or not item["color"].strip()):
            raise ValueError(f'include[{i}] "color" must be a non-empty string, got {item["color"]!r}')
        _position(item, i)
        if plus:
            _choice(item, "region", REGIONS, f"include[{i}]")
            _choice(item, "size", SIZES, f"include[{i}]")
    _clauses(row, "exclude")
    return prompt, tag


def _tiif(row: Mapping[str, Any]) -> tuple[str, str]:
    """Check a TIIF row; returns ``(short_description, type)``."""
    prompt = _text(row, "short_description", "a TIIF row")
    tag = _text(row, "type", "a TIIF row")
    tiif_questions(row)  # the judge's own check: equal-length question / yes-no answer lists
    return prompt, tag


_PARSERS: dict[str, Callable[[Mapping[str, Any]], tuple[str, str]]] = {
    "geneval": lambda row: _geneval(row, plus=False),
    "geneval_plus": lambda row: _geneval(row, plus=True),
    "tiif": _tiif,
}
DATASETS: tuple[str, ...] = tuple(_PARSERS)


def _check_dataset(dataset_name: str) -> Callable[[Mapping[str, Any]], tuple[str, str]]:
    """The row parser of ``dataset_name``; raises :class:`UserError` listing the valid names."""
    if dataset_name not in _PARSERS:
        raise UserError(
            f"unknown R3 dataset_name {dataset_name!r}; valid names: {', '.join(DATASETS)} "
            "(docs/maths.md §12 describes their formats)."
        )
    return _PARSERS[dataset_name]


# --------------------------------------------------------------------------------------- loading
def parse_r3_row(line: str, dataset_name: str, where: str = "<row>", index: int = 0) -> R3Sample:
    """Parse and check one JSON line of an R3 dataset.

    Args:
        line: One JSON object.
        dataset_name: ``geneval``, ``geneval_plus`` or ``tiif``.
        where: ``"file:line"`` for errors.
        index: The sample's position in its dataset.

    Returns:
        The sample, with the whole row as metadata.

    Raises:
        UserError: On an unknown dataset name, invalid JSON, or a row that misses or mistypes a field.
    """
    parse = _check_dataset(dataset_name)
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(
            f"{where}: invalid JSON ({err.msg}); each line of a {dataset_name} file must be one JSON object."
        ) from err
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object (a {dataset_name} row), got {type(row).__name__}.")
    try:
        prompt, tag = parse(row)
    except ValueError as err:
        raise UserError(f"{where}: not a valid {dataset_name} row: {err}.") from err
    return R3Sample(prompt=prompt, metadata=row, tag=tag, index=index)


def load_r3_dataset(path: str | Path, dataset_name: str) -> list[R3Sample]:
    """Load a GenEval, GenEval++ or TIIF JSON-lines file (blank lines skipped).

    Args:
        path: A file path, or ``builtin:NAME`` for a file shipped with rlgen.
        dataset_name: ``geneval``, ``geneval_plus`` or ``tiif`` (upstream R3's ``dataset_name``).

    Returns:
        The samples in file order, ``index`` = position.

    Raises:
        UserError: On an unknown dataset name, a missing file, a malformed row (named ``file:line``) or a
            file without rows.
    """
    _check_dataset(dataset_name)
    file = resolve_data_path(str(path))
    samples: list[R3Sample] = []
    text = read_utf8(file)
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            samples.append(parse_r3_row(line, dataset_name, f"{file}:{number}", index=len(samples)))
    if not samples:
        raise UserError(f"{file}: no {dataset_name} rows; the file is empty.")
    logger.info("loaded %d %s prompts from %s", len(samples), dataset_name, file)
    return samples
