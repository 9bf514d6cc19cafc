"""Every tiny model rlgen builds in memory: random weights, real classes, offline tokenizers.

The tiny variants run the same code paths as the real checkpoints (the same diffusers / transformers
classes, configs scaled down) in seconds on a CPU, for tests, smoke runs and the demo. Each builder is
deterministic in its ``seed``.

* flow families: :func:`tiny_sd3_pipeline` (sizes in :class:`SD3Sizes`), :func:`tiny_flux_pipeline`,
  :func:`tiny_flux_kontext_pipeline`, :func:`tiny_qwen_image_pipeline`,
  :func:`tiny_qwen_image_edit_pipeline`, :func:`tiny_wan_pipeline`, :func:`tiny_shapes_unet`;
* the Qwen2.5-VL / Qwen2-VL used as a text policy, a reward judge and Qwen-Image's text encoder:
  :func:`tiny_vlm_processor` (a byte-level BPE tokenizer over the 256 byte symbols, no merges, plus the
  Qwen chat special tokens; a minimal chat template; 4-pixel patches), :func:`tiny_vlm` (≈ 40 k
  parameters) and :func:`save_tiny_vlm`, which writes it where ``from_pretrained(...,
  local_files_only=True)`` loads it like a real checkpoint. Its answers are noise;
* a CLIP for the CLIP-backed pieces (``reward=image_similarity``, GARDO's feature model):
  ``rlgen_cli.models.tiny.clip.save_tiny_clip`` (also ``python -m rlgen_cli.models.tiny.clip DIR``; not
  imported here, so that ``-m`` runs it without a second copy of the module).
"""

from __future__ import annotations

from rlgen_cli.models.tiny.flux2 import tiny_flux2_klein_pipeline, tiny_flux2_pipeline
from rlgen_cli.models.tiny.image import (
    SD3Sizes,
    tiny_flux_kontext_pipeline,
    tiny_flux_pipeline,
    tiny_qwen_image_edit_pipeline,
    tiny_qwen_image_pipeline,
    tiny_sd3_pipeline,
    tiny_shapes_unet,
    tiny_wan_pipeline,
)
from rlgen_cli.models.tiny.qwen3_vl import save_tiny_qwen3_vl, tiny_qwen3_vl, tiny_qwen3_vl_processor
from rlgen_cli.models.tiny.qwen_image_edit_plus import tiny_qwen_image_edit_plus_pipeline
from rlgen_cli.models.tiny.vlm import (
    SPECIAL_TOKENS,
    save_tiny_vlm,
    tiny_qwen_tokenizer,
    tiny_vlm,
    tiny_vlm_processor,
)
from rlgen_cli.models.tiny.wan22 import tiny_wan22_pipeline
from rlgen_cli.models.tiny.z_image import tiny_z_image_pipeline

__all__ = [
    "SPECIAL_TOKENS",
    "SD3Sizes",
    "save_tiny_qwen3_vl",
    "save_tiny_vlm",
    "tiny_flux2_klein_pipeline",
    "tiny_flux2_pipeline",
    "tiny_flux_kontext_pipeline",
    "tiny_flux_pipeline",
    "tiny_qwen3_vl",
    "tiny_qwen3_vl_processor",
    "tiny_qwen_image_edit_pipeline",
    "tiny_qwen_image_edit_plus_pipeline",
    "tiny_qwen_image_pipeline",
    "tiny_qwen_tokenizer",
    "tiny_sd3_pipeline",
    "tiny_shapes_unet",
    "tiny_vlm",
    "tiny_vlm_processor",
    "tiny_wan22_pipeline",
    "tiny_wan_pipeline",
    "tiny_z_image_pipeline",
]
