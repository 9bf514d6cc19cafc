"""Where prompt files live: a path on disk, or ``builtin:NAME`` for the files shipped with rlgen."""

from __future__ import annotations

from pathlib import Path

from rlgen_cli.data.prompts import PromptDataset
from rlgen_cli.schema.errors import UserError

BUILTIN_PREFIX = "builtin:"
ASSETS = Path(__file__).resolve().parent.parent / "assets" / "prompts"


def resolve_data_path(spec: str) -> Path:
    """``builtin:tiny_train.txt`` → the packaged file; anything else → that path (must exist)."""
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX) :]
        path = ASSETS / name
        if not path.is_file():
            shipped = ", ".join(sorted(p.name for p in ASSETS.iterdir()))
            raise UserError(f"no built-in prompt file {name!r}; shipped: {shipped}")
        return path
    path = Path(spec).expanduser()
    if not path.is_file():
        raise UserError(f"prompt file {spec!r} does not exist (looked at {path.resolve()})")
    return path


def load_prompts(spec: str) -> PromptDataset:
    """Load a prompt dataset; malformed files raise :class:`UserError` naming file and line."""
    path = resolve_data_path(spec)
    try:
        return PromptDataset.from_file(path)
    except ValueError as err:
        raise UserError(str(err)) from err
