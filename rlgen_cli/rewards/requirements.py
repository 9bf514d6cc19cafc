"""What a reward (or a model) needs before it can load, checked without loading anything.

A model-backed reward builds cheaply and loads its weights on the first score (or on :meth:`load`).
Its ``requirements()`` lists what that load will read — each a :class:`ModelSource` (a local directory or
file, or a hub repository or file) or a :class:`Package` — so ``rlgen train | sample | eval |
serve-reward`` can report every missing one together, before any model is built, instead of failing
after an epoch's rollouts or hanging a reward server's first request on hub retries.

A hub source that is not in the local hub cache is missing when the load may not download it
(``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``, the source's ``local_files_only``) or when the hub does
not accept a connection; otherwise it is downloaded when it loads.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "ModelSource", "Package", "Requirement", "hub_offline", "hub_unreachable", "kwargs_sources",
    "missing_requirements", "requirements_of",
]  # fmt: skip

_TRUE = {"1", "ON", "YES", "TRUE"}


class Requirement(Protocol):
    def problem(self) -> str | None:
        """Why the requirement is not met and how to meet it, or None when it is."""
        ...


def hub_offline() -> bool:
    """Whether the Hugging Face hub may not be reached (its offline switches, read now)."""
    return any(os.environ.get(var, "").upper() in _TRUE for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


@functools.cache
def hub_unreachable(timeout_s: float = 5.0) -> str | None:
    """Why a TCP connection to the hub (``HF_ENDPOINT``) fails, or None when it opens — once per process.
    Behind a proxy (``HTTPS_PROXY``) the direct connection says nothing, so it is not tried (None)."""
    import socket
    from urllib.parse import urlsplit

    if any(os.environ.get(var) for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname or "", port), timeout=timeout_s):
            return None
    except OSError as err:
        return f"{endpoint.hostname}: {err}"


def _looks_local(path: str) -> bool:
    """A filesystem path rather than a hub id (``owner/name`` or, for one file, ``owner/name/file``)."""
    return path.startswith(("/", ".", "~")) or "\\" in path


@dataclass(frozen=True)
class ModelSource:
    """Weights (or a tokenizer, a config) a load reads: a local path or a hub id.

    Attributes:
        key: The config key that names it (``reward.kwargs.pickscore.model_path``, ``model.path``).
        path: A local directory or file, a hub repository ``owner/name``, or with ``single_file`` a hub
            file ``owner/name/filename``.
        single_file: The source is one file (a state dict), not a ``from_pretrained`` directory.
        local_files_only: The load never reaches the hub, so a hub source must be cached.
    """

    key: str
    path: str
    single_file: bool = False
    local_files_only: bool = False

    def problem(self) -> str | None:
        path = Path(self.path).expanduser()
        if path.exists():
            return None
        hub = self._hub_parts()
        if hub is None:
            kind = "file" if self.single_file else "directory"
            return f"{self.key}={self.path}: no such {kind}; fix the path, or give a hub id to download it"
        if self._cached(*hub):
            return None
        if self.local_files_only:
            why = "local_files_only is set"
        elif hub_offline():
            why = "the hub is offline (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)"
        elif (unreachable := hub_unreachable()) is not None:
            why = f"the hub cannot be reached ({unreachable})"
        else:
            return None  # downloaded when it loads
        repo, filename = hub
        fetch = f"huggingface-cli download {repo}" + (f" {filename}" if filename else "")
        return (
            f"{self.key}={self.path}: not in the local hub cache and {why}; fetch it with `{fetch}` "
            f"(online), or set {self.key}=LOCAL_{'FILE' if self.single_file else 'DIR'}"
        )

    def _hub_parts(self) -> tuple[str, str | None] | None:
        """``(repo, filename or None)`` when :attr:`path` reads as a hub id, else None."""
        if _looks_local(self.path):
            return None
        parts = self.path.split("/")
        if not all(parts):
            return None
        if self.single_file:
            return ("/".join(parts[:2]), "/".join(parts[2:])) if len(parts) >= 3 else None
        return (self.path, None) if len(parts) <= 2 else None

    @staticmethod
    def _cached(repo: str, filename: str | None) -> bool:
        from huggingface_hub import snapshot_download, try_to_load_from_cache

        if filename is not None:
            return isinstance(try_to_load_from_cache(repo, filename), str)
        try:
            snapshot_download(repo, local_files_only=True)
        except Exception:  # noqa: BLE001  (not cached, whichever way the hub client says so)
            return False
        return True


@dataclass(frozen=True)
class Package:
    """A Python package a load imports (``module``), and how to install it."""

    needed_by: str
    module: str
    install: str

    def problem(self) -> str | None:
        if importlib.util.find_spec(self.module) is not None:
            return None
        return f"{self.needed_by} needs the Python package {self.module}: {self.install}"


def requirements_of(reward: Any) -> list[Requirement]:
    """What ``reward`` reads when it loads (its ``requirements()``; none for a reward without a model)."""
    listed = getattr(reward, "requirements", None)
    return list(listed()) if callable(listed) else []


def missing_requirements(reward: Any) -> list[str]:
    """The problems of every requirement of ``reward`` that is not met, in its order."""
    return [problem for req in requirements_of(reward) if (problem := req.problem()) is not None]


def kwargs_sources(
    reward: str, kwargs: Any, files: tuple[str, ...] = (), dirs: tuple[str, ...] = ()
) -> list[ModelSource]:
    """The :class:`ModelSource` of each set ``reward.kwargs.<reward>.<key>`` of a kwargs dataclass:
    ``files`` name single files (state dicts), ``dirs`` ``from_pretrained`` sources; ``local_files_only``
    is the dataclass's own."""
    offline = bool(getattr(kwargs, "local_files_only", False))
    return [
        ModelSource(f"reward.kwargs.{reward}.{key}", str(path), key in files, offline)
        for key in (*files, *dirs)
        if (path := getattr(kwargs, key))
    ]
