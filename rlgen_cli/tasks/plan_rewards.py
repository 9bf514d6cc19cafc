"""What the rewards a run scores in its training process keep on the device, for ``rlgen plan``: a declared
size (``plan.reward_memory_gb``), else the weights of the modules the reward builds with empty weights and no
network; a reward it cannot size stops the plan naming it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.recipes.plan_trace import META, empty_weights


def reward_rows(cfg: Any) -> tuple[list[Any], list[str]]:
    """What the rewards scored in the training process keep on the device (served ones live elsewhere):
    the declared size (``plan.reward_memory_gb``) of a reward, else the weights of the modules it builds
    with empty weights and no network. A reward that runs a model the plan cannot build, or that does not
    build offline, stops the plan (exit code 2) naming it, with what to do; plus notes for the table."""
    from rlgen_cli.rewards.registry import REWARDS, build_reward
    from rlgen_cli.rewards.remote import client as remote
    from rlgen_cli.training.memory.plan import GIB, Row

    declared = dict(cfg.plan.reward_memory_gb)
    unknown = sorted(set(declared) - set(cfg.reward.weights))
    if unknown:
        raise UserError(
            f"plan.reward_memory_gb names rewards that are not in reward.weights: {unknown}; "
            f"the run scores {sorted(cfg.reward.weights)}"
        )
    rows, notes, refused = [], [], []
    for name in cfg.reward.weights:
        if getattr(REWARDS.get(name), "__module__", None) == remote.__name__:
            notes.append(f"reward {name} is served (its model lives in the reward server)")
            continue
        if name in declared:
            rows.append(Row(f"reward {name}", int(declared[name] * GIB), f"plan.reward_memory_gb.{name}"))
            continue
        kwargs = dict(cfg.reward.kwargs.get(name, {}))
        try:
            with empty_weights(True), _offline():
                reward = build_reward(name, **kwargs)
        except (OSError, ValueError, ImportError, RuntimeError) as err:
            refused.append(f"reward {name} does not build offline ({str(err).splitlines()[0]})")
            continue
        modules = _modules_in(reward)
        if not modules and hasattr(reward, "device") and str(kwargs.get("device", "")) != "cpu":
            counted = lazy_weights(reward)
            if counted is None:
                refused.append(
                    f"reward {name} loads its model on the device at its first score, and none of its "
                    "sources is a config or a safetensors file readable offline"
                )
            else:
                rows.append(Row(f"reward {name} weights", *counted))
        for module in modules:
            rows.append(
                Row(f"reward {name} weights", _module_state_bytes(module), "built with empty weights")
            )
    if refused:
        raise UserError(
            "rlgen plan cannot count the memory of:\n  " + "\n  ".join(refused) + "\nserve such a reward "
            "(rlgen serve-reward; its model then lives in the server), or declare its memory on the device "
            "with +plan.reward_memory_gb.NAME=GiB"
        )
    return rows, notes


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
