"""What a hosted reward computes, as a fingerprint the clients can pin: two servers hosting one reward
name with other settings (a JPEG quality, a detector, thresholds) must not be balanced over as if they
were one.

The fingerprint is ``<name>:<16 hex digits>:rlgen-<version>``, the digits a SHA-256 of the reward's
description (:func:`describe`): its class and its public settings. The server publishes it in
``GET /v1/rewards`` and in the :data:`~rlgen_cli.rewards.remote.wire.FINGERPRINT_HEADER` of every score
reply; a client pins the first one it gets and refuses an endpoint whose reply carries another
(:class:`~rlgen_cli.rewards.remote.transport.EndpointPool`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
import json
from typing import Any

import numpy as np
import torch

from rlgen_cli import __version__
from rlgen_cli.rewards.base import Reward

__all__ = ["describe", "fingerprint"]

_WHERE_NOT_WHAT = frozenset({"device", "local_files_only"})  # where it runs or loads from: not its scores
_MAX_DEPTH = 4  # a reward, its parts (a detector), their settings (thresholds), one more level
_SKIP = object()


def _value(value: Any, depth: int) -> Any:
    """A JSON-ready description of one setting, or :data:`_SKIP` for what is state, not a setting: models,
    tensors, devices, callables, private or too deeply nested objects."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, enum.Enum | torch.dtype | np.dtype):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple):
        return [v for v in (_value(item, depth + 1) for item in value) if v is not _SKIP]
    if isinstance(value, dict):
        items = ((str(k), _value(v, depth + 1)) for k, v in value.items())
        return {k: v for k, v in sorted(items) if v is not _SKIP}
    if depth >= _MAX_DEPTH or _is_state(value):
        return _SKIP
    if dataclasses.is_dataclass(value):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return _object(type(value), fields, depth)
    if hasattr(value, "__dict__"):
        return _object(type(value), vars(value), depth)
    return _SKIP


def _is_state(value: Any) -> bool:
    """Models, tensors, functions, modules and classes: what a reward holds, not how it is set."""
    if isinstance(value, type | torch.Tensor | torch.nn.Module | torch.device):
        return True
    return inspect.isroutine(value) or inspect.ismodule(value) or isinstance(value, functools.partial)


def _object(cls: type, attributes: dict[str, Any], depth: int) -> dict[str, Any]:
    """An object's class and its public settings (None left out: unset and not yet loaded look alike)."""
    out: dict[str, Any] = {"class": f"{cls.__module__}.{cls.__qualname__}"}
    for key, value in sorted(attributes.items()):
        if key.startswith("_") or key in _WHERE_NOT_WHAT:
            continue
        described = _value(value, depth + 1)
        if described is not _SKIP and described is not None:
            out[key] = described
    return out


def describe(reward: Reward) -> dict[str, Any]:
    """The reward's class and public settings, recursively (a detector's path, GenEval's thresholds):
    what two servers must share to score alike. Where it runs (``device``) is left out."""
    return _object(type(reward), vars(reward) if hasattr(reward, "__dict__") else {}, 0)


def fingerprint(name: str, reward: Reward) -> str:
    """``<name>:<hash of the description>:rlgen-<version>`` of the reward hosted as ``name``."""
    text = json.dumps(describe(reward), sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    return f"{name}:{digest}:rlgen-{__version__}"
