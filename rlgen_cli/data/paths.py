"""Where prompt files live: a path on disk, or ``builtin:NAME`` for the sets that come with rlgen.

``builtin:`` names a file shipped under ``assets/prompts`` or a set generated in the run directory
(the tiny editing set, :mod:`rlgen_cli.data.edit_sets`). A path that does not exist is a user error
saying which file is expected where and how to point ``data.train=`` / ``data.test=`` elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from rlgen_cli.data.edit_sets import SPLIT_SIZES as GENERATED
from rlgen_cli.data.edit_sets import tiny_edit_set
from rlgen_cli.data.prompts import PromptDataset, read_text
from rlgen_cli.errors import UserError

BUILTIN_PREFIX = "builtin:"
ASSETS = Path(__file__).resolve().parent.parent / "assets" / "prompts"

FORMATS = {
    ".txt": "plain text, one prompt per line",
    ".jsonl": 'JSON lines, one object per line with a "prompt" (GenEval rewards read "tag"/"include"/'
    '"exclude", editing models an "image" path relative to the file)',
    ".json": "one JSON list of examples",
}
# The default data paths reproduce their upstream's folder layout; a missing file names where it comes from.
UPSTREAM_LAYOUTS = {
    "dataset": "Flow-GRPO's repository (github.com/yifan123/flow_grpo)",
    "data/R1-VL-10K": "R1-VL-10K (huggingface.co/datasets/jingyiZ00/R1-VL-10K)",
}
OTHER_SPLIT = {"data.train": "data.test", "data.test": "data.train"}


def missing_file_message(spec: str, key: str | None) -> str:
    """What ``spec`` should be, where it was looked for, and the override that points elsewhere."""
    path = Path(spec).expanduser()
    what = f"{key}: prompt file {spec}" if key else f"prompt file {spec}"
    lines = [f"{what} does not exist (looked at {path.resolve()})."]
    expected = FORMATS.get(path.suffix)
    origin = next((o for prefix, o in UPSTREAM_LAYOUTS.items() if spec.startswith(prefix + "/")), None)
    if origin:
        lines.append(
            f"It is laid out as in {origin}: put its {path.parent}/ folder under {Path.cwd()} "
            "(or run from the directory that holds it)."
        )
    if expected:
        lines.append(f"Expected format: {expected}.")
    if key:
        other = f" ({OTHER_SPLIT[key]}=… likewise)" if key in OTHER_SPLIT else ""
        lines.append(f"To use another file: {key}=/path/to/{path.name}{other}.")
    return " ".join(lines)


def resolve_data_path(spec: str, key: str | None = None, workdir: Path | None = None) -> Path:
    """``builtin:tiny_train.txt`` → the packaged file; ``builtin:tiny_edit_train.jsonl`` → generated under
    ``workdir`` (the run directory); anything else → that path, which must exist.

    ``key`` (``data.train``) names the setting in errors.
    """
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX) :]
        if name in GENERATED:
            if workdir is None:
                raise UserError(f"{spec} is generated in a run directory; this command has none")
            return tiny_edit_set(workdir) / name
        path = ASSETS / name
        if not path.is_file():
            shipped = ", ".join(sorted([p.name for p in ASSETS.iterdir()] + list(GENERATED)))
            raise UserError(f"{key or 'prompt file'}: no built-in prompt file {name!r}; built in: {shipped}")
        return path
    path = Path(spec).expanduser()
    if not path.is_file():
        raise UserError(missing_file_message(spec, key))
    return path


def read_utf8(path: Path, key: str | None = None) -> str:
    """A data file's UTF-8 text without a leading byte-order mark (:func:`~.prompts.read_text`), as every
    reader of prompts and rows takes it.

    Raises:
        UserError: A file that is not UTF-8, naming the byte (:func:`not_utf8`).
    """
    try:
        return read_text(path)
    except UnicodeDecodeError as err:
        raise not_utf8(path, err, key) from err


def not_utf8(path: Path, err: UnicodeDecodeError, key: str | None = None) -> UserError:
    """The error for a data file that is not UTF-8 text: which file, where, and how to convert it."""
    what = f"{key}: {path}" if key else str(path)
    return UserError(
        f"{what} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); convert it, e.g. "
        f"iconv -f latin1 -t utf-8 {path} > {path.with_stem(path.stem + '_utf8')}"
    )


def load_prompts(
    spec: str,
    workdir: Path | None = None,
    key: str | None = None,
    tag_repeats: Mapping[str, int] | None = None,
) -> PromptDataset:
    """Load a prompt dataset, each prompt of a tag repeated ``tag_repeats[tag]`` times
    (:meth:`PromptDataset.repeated_by_tag`); malformed or non-UTF-8 files and impossible repeats raise
    :class:`UserError` naming the file."""
    path = resolve_data_path(spec, key, workdir)
    try:
        return PromptDataset.from_file(path).repeated_by_tag(tag_repeats or {})
    except UnicodeDecodeError as err:
        raise not_utf8(path, err, key) from err
    except ValueError as err:
        raise UserError(str(err)) from err
