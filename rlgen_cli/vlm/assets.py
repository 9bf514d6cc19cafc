"""Where a VLM's ``model.path`` points: ``builtin:NAME`` names a model shipped with rlgen (torch-free, so the
prerequisite checks can resolve it before anything loads)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["BUILTIN_PREFIX", "MODEL_ASSETS", "model_source"]

BUILTIN_PREFIX = "builtin:"
MODEL_ASSETS = Path(__file__).resolve().parent.parent / "assets" / "models"


def model_source(path: str) -> str:
    """``builtin:shapesqa_base`` → the directory of the shipped model; a hub id or a path stays as given."""
    if path.startswith(BUILTIN_PREFIX):
        return str(MODEL_ASSETS / path[len(BUILTIN_PREFIX) :])
    return path
