"""Model-family registry: ``model.family`` → the module whose ``build(cfg, device)`` returns the policy.

Each family lives in its own module under ``models/`` and exposes ``build(cfg: ModelConfig, device)``
(tiny variant when ``cfg.tiny``, the published architecture at random init when ``cfg.weights`` is
``random_init`` (``models/real_size.py``), else real loading; the prompt cache of ``models/prompt_cache.py``
installed around ``encode``). Modules are imported only when their family is
used, so a family's heavy imports never slow down another's.
"""

from __future__ import annotations

import importlib
import logging

import torch

from rlgen_cli.models.base import FlowPolicy
from rlgen_cli.schema.errors import UserError
from rlgen_cli.schema.flow import ModelConfig

log = logging.getLogger(__name__)

FAMILIES: dict[str, str] = {
    "sd3": "rlgen_cli.models.sd3",
    "flux": "rlgen_cli.models.flux",
    "flux_kontext": "rlgen_cli.models.flux_kontext",
    "flux2": "rlgen_cli.models.flux2",
    "flux2_klein": "rlgen_cli.models.flux2_klein",
    "qwen_image": "rlgen_cli.models.qwen_image",
    "qwen_image_edit": "rlgen_cli.models.qwen_image_edit",
    "qwen_image_edit_plus": "rlgen_cli.models.qwen_image_edit_plus",
    "wan2_1": "rlgen_cli.models.wan",
    "wan2_2": "rlgen_cli.models.wan22",
    "wan2_2_i2v": "rlgen_cli.models.wan22",
    "z_image": "rlgen_cli.models.z_image",
    "qwen_image_2": "rlgen_cli.models.qwen_image_2",
    "bagel": "rlgen_cli.models.bagel",
    "bagel_edit": "rlgen_cli.models.bagel",
    "shapes": "rlgen_cli.models.shapes",
}


def build_policy(cfg: ModelConfig, device: torch.device) -> FlowPolicy:
    """Build the flow policy of ``cfg.family`` (tiny or loaded) on ``device``."""
    if cfg.family not in FAMILIES:
        raise UserError(f"model.family={cfg.family!r} is unknown; families: {', '.join(sorted(FAMILIES))}")
    try:
        module = importlib.import_module(FAMILIES[cfg.family])
    except ModuleNotFoundError as err:
        if err.name != FAMILIES[cfg.family]:
            raise
        raise UserError(f"model.family={cfg.family!r} is not available in this version of rlgen") from err
    warn_slow_dtype(cfg.dtype, device)
    return module.build(cfg, device)


def slow_dtype_advice(dtype: str, device: torch.device) -> str | None:
    """Why ``model.dtype`` cannot run well on ``device`` and what to set instead; None when it can.

    CPUs have no fast float16 matrix products (a 2048×1536 by 1536×1536 product: 17 s in fp16, 0.33 s in
    fp32, 0.13 s in bf16 on a 2-core AVX-512-BF16 CPU); GPUs before Ampere have no bfloat16 units."""
    if device.type == "cpu" and dtype == "float16":
        return (
            "model.dtype=float16 on the CPU runs far slower than float32 (CPUs have no fast fp16 matrix "
            "products: tens of times at real model sizes): set model.dtype=float32, or model.dtype=bfloat16 "
            "on a CPU with bf16 units"
        )
    if device.type == "cuda" and dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        return (
            f"model.dtype=bfloat16 on {torch.cuda.get_device_name(device)}, which has no bf16 units: set "
            "model.dtype=float16 (FLUX families overflow in fp16: use float32 there)"
        )
    return None


def warn_slow_dtype(dtype: str, device: torch.device) -> None:
    """Log :func:`slow_dtype_advice` once per model build."""
    advice = slow_dtype_advice(dtype, device)
    if advice:
        log.warning(advice)
