"""What the reward models a run loads in its training process keep on the device, for ``rlgen plan``: the
trained rewards (``reward.weights``), the guard's held-out monitors (``guard.monitors``, scored at every
evaluation and kept loaded after) and GARDO's feature encoder (``algo.gardo.feature_model`` with
``algo.gardo.diversity``). Each counts at a declared size (``plan.reward_memory_gb``), else the weights of
the modules it builds with empty weights and no network, else those of the model it loads on its first
score, read from a local config or safetensors header; CLIP rewards on the same checkpoint and dtype
share one loaded model (``rewards/clip.py``), counted once. One it cannot size stops the plan naming it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.recipes.plan_trace import META, empty_weights


@dataclass(frozen=True)
class Scored:
    """A reward model the run loads in its training process: ``name`` (a registered reward) built with
    ``kwargs``, shown as ``label`` (``reward NAME``, ``guard monitor NAME``)."""

    label: str
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)


def scored_rewards(cfg: Any) -> list[Scored]:
    """The trained rewards, then the guard's monitors (each its own instance, built as ``build_mix``
    builds it)."""
    found = [Scored(f"reward {n}", n, dict(cfg.reward.kwargs.get(n, {}))) for n in cfg.reward.weights]
    guard = getattr(cfg, "guard", None)
    if guard is not None and guard.enabled:
        found += [Scored(f"guard monitor {n}", n, dict(guard.kwargs.get(n, {}))) for n in guard.monitors]
    return found


def reward_rows(cfg: Any) -> tuple[list[Any], list[str]]:
    """What the reward models loaded in the training process keep on the device (served rewards live
    elsewhere): trained rewards, guard monitors and GARDO's feature encoder (:func:`scored_rewards`,
    :func:`gardo_encoder`). A declared size (``plan.reward_memory_gb.NAME``, for every copy of reward NAME)
    counts as given; else the weights of the modules it builds with empty weights and no network, or
    those its lazily loaded model has (:func:`lazy_weights`). One it cannot count stops the plan (exit
    code 2) naming it, with what to do; plus notes for the table."""
    from rlgen_cli.rewards.registry import REWARDS, build_reward
    from rlgen_cli.rewards.remote import client as remote
    from rlgen_cli.training.memory.plan import GIB, Row

    scored = scored_rewards(cfg)
    declared = dict(cfg.plan.reward_memory_gb)
    names = sorted({s.name for s in scored})
    unknown = sorted(set(declared) - set(names))
    if unknown:
        raise UserError(
            f"plan.reward_memory_gb names rewards that are not in reward.weights or guard.monitors: "
            f"{unknown}; the run scores {names}"
        )
    rows, notes, refused = [], [], []
    shared: dict[tuple[str, str], str] = {}  # a loaded CLIP model's (path, dtype) → who counted it
    for item in scored:
        name, kwargs = item.name, item.kwargs
        if getattr(REWARDS.get(name), "__module__", None) == remote.__name__:
            notes.append(f"{item.label} is served (its model lives in the reward server)")
            continue
        if name in declared:
            rows.append(Row(item.label, int(declared[name] * GIB), f"plan.reward_memory_gb.{name}"))
            continue
        try:
            with empty_weights(True), _offline():
                reward = build_reward(name, **kwargs)
        except (OSError, ValueError, ImportError, RuntimeError) as err:
            refused.append(f"{item.label} does not build offline ({str(err).splitlines()[0]})")
            continue
        modules = _modules_in(reward)
        if not modules and hasattr(reward, "device") and str(kwargs.get("device", "")) != "cpu":
            if _counted_before(reward, item.label, shared, notes):
                continue
            counted = lazy_weights(reward)
            if counted is None:
                refused.append(
                    f"{item.label} loads its model on the device at its first score, and none of its "
                    "sources is a config or a safetensors file readable offline"
                )
            else:
                rows.append(Row(f"{item.label} weights", *counted))
        for module in modules:
            rows.append(Row(f"{item.label} weights", _module_state_bytes(module), "built with empty weights"))
    encoder = gardo_encoder(cfg)
    gardo_refused = None
    if encoder is not None and not _counted_before(encoder, GARDO_LABEL, shared, notes):
        counted = lazy_weights(encoder)
        if counted is None:
            gardo_refused = (
                f"{GARDO_LABEL} ({encoder.model_path}) loads on the device at the first epoch, and it is "
                "neither a directory nor a cached hub id whose config reads offline: download it (e.g. "
                f"`huggingface-cli download {encoder.model_path}`) or point algo.gardo.feature_model at a local copy"
            )
        else:
            rows.append(Row(f"{GARDO_LABEL} weights", *counted))
    if refused or gardo_refused:
        fix = (
            "\nserve such a reward (rlgen serve-reward; its model then lives in the server), or declare its "
            "memory on the device with +plan.reward_memory_gb.NAME=GiB"
            if refused
            else ""
        )
        listed = [*refused, *([gardo_refused] if gardo_refused else [])]
        raise UserError("rlgen plan cannot count the memory of:\n  " + "\n  ".join(listed) + fix)
    return rows, notes


GARDO_LABEL = "GARDO feature model (algo.gardo.feature_model)"


def gardo_encoder(cfg: Any) -> Any:
    """The CLIP model GARDO's diversity shaping loads on the training device (``recipes/gardo.py``: its
    image embeddings, every process its own rollouts'), configured and not loaded; None when the run has
    no diversity shaping."""
    gardo = getattr(cfg.algo, "gardo", None)
    if gardo is None or not gardo.diversity:
        return None
    from rlgen_cli.rewards.clip import ClipReward

    return ClipReward("clipscore", gardo.feature_model)  # as GardoHooks.features builds it


def _counted_before(reward: Any, label: str, shared: dict[tuple[str, str], str], notes: list[str]) -> bool:
    """A CLIP reward whose model (checkpoint and dtype) an earlier row already counted: the loaded model is
    shared (``rewards/clip.py``'s cache), so a note instead of a second row. Records the first one."""
    from rlgen_cli.rewards.clip import ClipReward

    if not isinstance(reward, ClipReward):
        return False
    key = (reward.model_path, str(reward.dtype))
    if key in shared:
        notes.append(f"{label} shares the CLIP model of {shared[key]} ({reward.model_path}, loaded once)")
        return True
    shared[key] = label
    return False


def lazy_weights(reward: Any) -> tuple[int, str] | None:
    """Bytes of the weights a reward loads on its first score, counted without reading them, and how:
    its first source (``requirements()``) that is a ``from_pretrained`` directory (or cached hub id) with a
    config, built with empty weights, or a safetensors file, read from its header — in the reward's
    ``dtype`` where it sets one; None when none can be read offline."""
    from rlgen_cli.rewards.requirements import ModelSource, requirements_of

    dtype = getattr(reward, "dtype", None)
    dtype = dtype if isinstance(dtype, torch.dtype) else None
    for source in requirements_of(reward):
        if not isinstance(source, ModelSource):
            continue
        counted = (
            _safetensors_bytes(source.path, dtype)
            if source.single_file
            else _config_bytes(source.path, dtype)
        )
        if counted is not None:
            return (
                counted,
                f"{source.key}={source.path}: {'its header' if source.single_file else 'built from its config'}, weights not read",
            )
    return None


def _config_bytes(path: str, dtype: torch.dtype | None) -> int | None:
    """Bytes of the parameters of the model ``path``'s config describes (built with empty weights)."""
    from transformers import AutoConfig, AutoModel

    try:
        with _offline():
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        with empty_weights(True):
            model = AutoModel.from_config(config)
    except (OSError, ValueError, KeyError, ImportError):
        return None
    return _tensors_bytes(list(model.parameters()), dtype)


def _safetensors_bytes(path: str, dtype: torch.dtype | None) -> int | None:
    """Bytes of the tensors a local safetensors file holds, read from its header."""
    from safetensors import safe_open

    if not (path.endswith(".safetensors") and os.path.isfile(path)):
        return None
    with safe_open(path, framework="pt") as file:
        slices = [file.get_slice(key) for key in file.keys()]  # noqa: SIM118 (a safe_open is no mapping)
        tensors = [
            torch.empty(s.get_shape(), dtype=_safetensors_dtype(s.get_dtype()), device=META) for s in slices
        ]
    return _tensors_bytes(tensors, dtype)


def _safetensors_dtype(name: str) -> torch.dtype:
    return {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }[name]


def _tensors_bytes(tensors: list[Tensor], dtype: torch.dtype | None) -> int:
    """Bytes of ``tensors``, their floating ones in ``dtype`` where given (a reward loads in its own)."""
    loaded = None if dtype is None else torch.empty((), dtype=dtype).element_size()

    def size(tensor: Tensor) -> int:
        return loaded if loaded is not None and tensor.is_floating_point() else tensor.element_size()

    return sum(t.numel() * size(t) for t in tensors)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    saved = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved


def _modules_in(obj: Any) -> list[nn.Module]:
    if isinstance(obj, nn.Module):
        return [obj]
    return (
        [value for value in vars(obj).values() if isinstance(value, nn.Module)]
        if hasattr(obj, "__dict__")
        else []
    )


def _module_state_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
