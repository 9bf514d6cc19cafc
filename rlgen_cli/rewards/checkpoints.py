"""Single-file reward checkpoints: find the file, read its tensors, build the model around them.

HPSv2, HPSv3 and ImageReward publish their weights as one state-dict file each (``HPS_v2.1_compressed.pt``,
``HPSv3.safetensors``, ``ImageReward.pt``), not as ``from_pretrained`` directories. Their rewards take
``model_path`` as either a local file or ``owner/repo/filename`` on the Hugging Face hub, read it on CPU
(``torch.load(weights_only=True)``: no code runs), rename the keys to a transformers model's and build that
model with empty weights first, so a multi-GB checkpoint is held in memory once.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

K = TypeVar("K")

__all__ = [
    "check_checkpoint_path", "check_image_batch", "load_state_dict_file", "materialise", "resolve_checkpoint",
    "typed_kwargs",
]  # fmt: skip


def _hub_parts(path: str) -> tuple[str, str] | None:
    """``("owner/repo", "file")`` when ``path`` reads as a hub file, else ``None`` (local-looking paths)."""
    if path.startswith(("/", ".", "~")) or "\\" in path:
        return None
    parts = path.split("/")
    if len(parts) < 3 or not all(parts):
        return None
    return "/".join(parts[:2]), "/".join(parts[2:])


def check_checkpoint_path(path: str, reward: str, key: str, hint: str) -> None:
    """Fail at build time when ``path`` names a local file that does not exist.

    A path that reads as ``owner/repo/filename`` is left to :func:`resolve_checkpoint` (first score).

    Raises:
        ValueError: Naming the reward, the config key, the path and ``hint`` (how to get the file).
    """
    if not path:
        raise ValueError(f"reward {reward!r} needs reward.kwargs.{reward}.{key}; {hint}")
    if _hub_parts(path) is None and not Path(path).expanduser().is_file():
        raise ValueError(
            f"reward {reward!r}: reward.kwargs.{reward}.{key}={path!r} is not a file; {hint} "
            f"(or give it as owner/repo/filename to download it from the hub)."
        )


def resolve_checkpoint(path: str, reward: str, key: str, hint: str, local_files_only: bool = False) -> Path:
    """Return the local file for ``path``: the path itself, or the hub file ``owner/repo/filename``.

    Raises:
        ValueError: If it is not a local file and cannot be fetched (offline, wrong name).
    """
    local = Path(path).expanduser()
    if local.is_file():
        return local
    check_checkpoint_path(path, reward, key, hint)
    repo, filename = _hub_parts(path)  # type: ignore[misc]  (checked above)
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, filename, local_files_only=local_files_only))
    except Exception as err:  # noqa: BLE001  (any hub failure becomes one config error)
        raise ValueError(
            f"reward {reward!r}: reward.kwargs.{reward}.{key}={path!r} is not a local file and downloading "
            f"{filename!r} from hub repo {repo!r} failed ({type(err).__name__}: {err}); {hint}"
        ) from err


def load_state_dict_file(path: Path, unwrap: tuple[str, ...] = ("state_dict", "model")) -> dict[str, Tensor]:
    """Read a ``.safetensors`` / ``.pt`` / ``.pth`` / ``.bin`` state dict on CPU, tensors only.

    Args:
        path: The checkpoint file.
        unwrap: Keys of a training checkpoint that hold the state dict (``{"state_dict": {...}}``).

    Returns:
        ``{name: tensor}`` with a leading ``module.`` (DDP) removed.

    Raises:
        ValueError: If the file holds no tensors.
    """
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state: object = load_file(str(path))
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(
                f"{path} holds objects other than tensors and plain containers, which rlgen does not unpickle "
                f"(it could run code): {err}. Re-save only its state dict (torch.save(state_dict, path))."
            ) from err
    for key in unwrap:
        if isinstance(state, Mapping) and isinstance(state.get(key), Mapping):
            state = state[key]
    if not isinstance(state, Mapping) or not any(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"{path} holds no state dict (a mapping of tensor names to tensors).")
    return {k.removeprefix("module."): v for k, v in state.items() if isinstance(v, Tensor)}


def materialise(
    build: Callable[[], nn.Module],
    state_dict: Mapping[str, Tensor],
    dtype: torch.dtype,
    device: str,
    what: str,
) -> nn.Module:
    """Build ``build()`` with empty parameters, then take ``state_dict``'s tensors as its parameters.

    Every parameter and persistent buffer must come from ``state_dict`` and every tensor of it must be used,
    so a checkpoint of another architecture fails loudly instead of leaving random weights.

    Args:
        build: Creates the model (parameters on the meta device while it runs).
        state_dict: Tensors under the model's own key names.
        dtype: Floating tensors are cast to it.
        device: Where the model goes.
        what: Names the checkpoint in errors.

    Returns:
        The model in eval mode without gradients.

    Raises:
        ValueError: On missing or unexpected keys, or a shape mismatch.
    """
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = build()
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state_dict) if expected[k].shape != state_dict[k].shape)
    if missing or unexpected or wrong:
        raise ValueError(
            f"{what} does not match the model it should load into: missing {missing[:4]}, unexpected "
            f"{unexpected[:4]}, wrong shape {wrong[:4]} ({len(missing)}/{len(unexpected)}/{len(wrong)} in "
            "all); check the file and the architecture settings (config_path / base_path)."
        )
    cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    model.load_state_dict(cast, strict=True, assign=True)
    return model.to(device).eval().requires_grad_(False)


def check_image_batch(images: Tensor | None, reward: str) -> Tensor:
    """Return ``images`` when they are a finite ``(B, 3, H, W)`` batch.

    Raises:
        ValueError: If images are missing, not RGB 4-D (videos: score frames) or not finite.
    """
    if images is None:
        raise ValueError(
            f"reward {reward!r} needs RewardBatch.images but it is None; decode the samples first."
        )
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(
            f"reward {reward!r} expects images (B, 3, H, W), got {tuple(images.shape)}; score videos frame by frame."
        )
    if images.is_floating_point() and not torch.isfinite(images).all():
        raise ValueError(f"reward {reward!r} got non-finite pixel values; check the decoder.")
    return images


def typed_kwargs(cls: type[K], reward: str, kwargs: Mapping[str, Any]) -> K:
    """Build the reward's kwargs dataclass ``cls`` from config kwargs.

    Raises:
        ValueError: Naming the unknown keys and the valid ones.
    """
    fields = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(kwargs) - set(fields))
    if unknown:
        raise ValueError(
            f"reward {reward!r} has no kwarg {', '.join(map(repr, unknown))} (reward.kwargs.{reward}); "
            f"valid: {', '.join(fields)}."
        )
    return cls(**kwargs)
