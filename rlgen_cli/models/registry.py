"""Model-family registry: ``model.family`` → the module whose ``build(cfg, device)`` returns the policy.

Each family lives in its own module under ``models/`` and exposes ``build(cfg: ModelConfig, device)``
(tiny variant when ``cfg.tiny``, the published architecture at random init when ``cfg.weights`` is
``random_init`` (``models/real_size.py``), else real loading; the prompt cache of ``models/prompt_cache.py``
installed around ``encode``). Modules are imported only when their family is
used, so a family's heavy imports never slow down another's.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from rlgen_cli.errors import UserError
from rlgen_cli.models.base import Cond, FlowPolicy
from rlgen_cli.schema.families import FAMILY_TABLE, families
from rlgen_cli.schema.run import ModelConfig

log = logging.getLogger(__name__)

FAMILIES: dict[str, str] = {row.name: row.module for row in FAMILY_TABLE.values() if row.kind == "flow"}
"""The flow families and the module that builds each (a view of ``schema/families.py``)."""


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
    policy = module.build(cfg, device)
    if not FAMILY_TABLE[cfg.family].takes_source_images:
        refuse_source_images(policy)
    return policy


def refuse_source_images(policy: FlowPolicy) -> None:
    """Make ``policy.encode`` refuse source images: a text-conditioned family would otherwise drop them
    silently and train on the prompt alone (the ``editing`` column of ``schema/families.py`` says which
    families take them)."""
    encode = policy.encode

    @functools.wraps(encode)  # keeps what the prompt cache hangs on it (``encode.cache``)
    def encode_text_only(prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        if images is not None:
            editing = ", ".join(families(editing=True))
            raise UserError(
                f"model.family={policy.family} is text-conditioned: it takes no source images; for editing "
                f"choose one of {editing}, or give prompts without an image"
            )
        return encode(prompts)

    policy.encode = encode_text_only  # type: ignore[method-assign]


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
