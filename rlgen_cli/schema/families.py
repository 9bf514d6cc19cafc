"""Every model family, one row each: the single place a family's facts are written.

``model.family`` takes the names of :data:`FAMILY_TABLE` (``schema/choices.py: Family``, checked when the
config is composed); the lists other modules branch on (the flow registry, the editing families, the
real-size variants, the diffusers pipelines, the image-guidance families, …) are views of it. Plain
strings and a frozen dataclass: reading it imports no torch, so config checks and ``rlgen ls`` stay fast.
A new family adds one row here (docs/adding_a_model.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FamilyKind = Literal["flow", "vlm", "unified"]
"""``flow``: a flow-matching policy built by ``models/registry.py``; ``vlm``: a vision-language policy
(``vlm/policy.py``); ``unified``: the R3 recipe's text + image policies (``r3/``)."""


@dataclass(frozen=True)
class FamilySpec:
    """The facts about one model family that code outside its module branches on."""

    name: str
    """The ``model.family`` value."""
    module: str
    """The module that builds it (``build(cfg, device)`` for flow families)."""
    kind: FamilyKind
    editing: bool = False
    """Needs a source image per prompt (its policy declares ``capabilities.takes_source_images``)."""
    edits_on_request: bool = False
    """Not an editing family, but ``encode`` takes source images when given (BAGEL); every other
    non-editing family refuses them."""
    video: bool = False
    """Generates videos (its policy declares ``capabilities.is_video``)."""
    two_experts: bool = False
    """Two transformers, a high-noise and a low-noise one, switched at the checkpoint's boundary
    (``model.experts``)."""
    real_size_variants: tuple[str, ...] = ()
    """The checkpoints ``model.weights=random_init`` builds (``models/real_size.py``); the first is
    ``model.variant=auto``, the one the family's conf/model option loads."""
    diffusers_pipeline: str | None = None
    """The diffusers pipeline whose ``load_lora_weights`` reads the family's checkpoints (the class its
    ``DiffusersCheckpoint`` saves through); None: loaded through rlgen (or peft) only."""
    image_guidance: bool = False
    """The velocity has an image-guidance branch (``model.image_guidance_scale``)."""
    has_vae: bool = True
    """Owns a VAE that ``model.vae_dtype`` places."""
    own_language_model: bool = False
    """Reads the prompt with its own language model (no separate text encoders to stand in for)."""
    negative_branch: bool = True
    """Classifier-free guidance runs an unguided branch on ``model.negative_prompt``, at
    ``model.guidance_scale`` > 1 only; False: guidance-distilled (FLUX.1-dev, FLUX.1-Kontext, FLUX.2-dev),
    the guidance scale an input embedding and no negative prompt ever encoded."""
    own_negative_prompt: str | None = None
    """The prompt its unguided (CFG) branch always encodes, whatever ``model.negative_prompt`` says
    (ShapesEval: the empty prompt); None: it encodes ``model.negative_prompt``. The family's schema
    defaults the key to it and refuses any other value (``schema/model.py``)."""
    own_prompt_tokens: int | None = None
    """The prompt length its tokenizer always reads, whatever ``model.max_sequence_length`` says
    (ShapesEval: the 16 word tokens of its checkpoint, ``<bos>`` included); None: it reads
    ``model.max_sequence_length``. The family's schema defaults the key to it and refuses any other value."""

    @property
    def takes_source_images(self) -> bool:
        """``encode`` accepts source images (editing families, and BAGEL on request)."""
        return self.editing or self.edits_on_request


def _flow(name: str, module: str, **facts) -> FamilySpec:
    return FamilySpec(name, f"rlgen_cli.models.{module}", "flow", **facts)


def _vlm(name: str, variants: tuple[str, ...] = ()) -> FamilySpec:
    return FamilySpec(
        name,
        "rlgen_cli.vlm.policy",
        "vlm",
        real_size_variants=variants,
        has_vae=False,
        own_language_model=True,
    )


_ROWS = (
    _flow(
        "sd3",
        "sd3",
        real_size_variants=("sd3_5_medium", "sd3_5_large"),
        diffusers_pipeline="StableDiffusion3Pipeline",
    ),
    _flow(
        "flux",
        "flux",
        real_size_variants=("flux_1_dev",),
        diffusers_pipeline="FluxPipeline",
        negative_branch=False,
    ),
    _flow(
        "flux_kontext",
        "flux_kontext",
        editing=True,
        real_size_variants=("flux_1_kontext_dev",),
        diffusers_pipeline="FluxKontextPipeline",
        negative_branch=False,
    ),
    _flow("flux2", "flux2", diffusers_pipeline="Flux2Pipeline", negative_branch=False),
    _flow("flux2_klein", "flux2_klein", diffusers_pipeline="Flux2KleinPipeline"),
    _flow(
        "qwen_image", "qwen_image", real_size_variants=("qwen_image",), diffusers_pipeline="QwenImagePipeline"
    ),
    _flow(
        "qwen_image_edit",
        "qwen_image_edit",
        editing=True,
        real_size_variants=("qwen_image_edit",),
        diffusers_pipeline="QwenImageEditPipeline",
    ),
    _flow(
        "qwen_image_edit_plus",
        "qwen_image_edit_plus",
        editing=True,
        diffusers_pipeline="QwenImageEditPlusPipeline",
    ),
    _flow("qwen_image_2", "qwen_image_2", diffusers_pipeline="QwenImage21Pipeline"),
    _flow("qwen_image_2_edit", "qwen_image_2_edit", editing=True, diffusers_pipeline="QwenImage21Pipeline"),
    _flow(
        "wan2_1",
        "wan",
        video=True,
        real_size_variants=("wan2_1_t2v_1_3b", "wan2_1_t2v_14b"),
        diffusers_pipeline="WanPipeline",
    ),
    _flow("wan2_2", "wan22", video=True, two_experts=True, diffusers_pipeline="WanPipeline"),
    _flow(
        "wan2_2_i2v",
        "wan22",
        editing=True,
        video=True,
        two_experts=True,
        diffusers_pipeline="WanImageToVideoPipeline",
    ),
    _flow("z_image", "z_image", diffusers_pipeline="ZImagePipeline"),
    _flow(
        "bagel",
        "bagel",
        edits_on_request=True,
        real_size_variants=("bagel_7b_mot",),
        image_guidance=True,
        own_language_model=True,
    ),
    _flow("bagel_edit", "bagel", editing=True, image_guidance=True, own_language_model=True),
    _flow("shapes", "shapes", has_vae=False, own_negative_prompt="", own_prompt_tokens=16),
    _vlm("qwen2_vl", ("qwen2_vl_2b", "qwen2_vl_7b")),
    _vlm("qwen2_5_vl", ("qwen2_5_vl_3b", "qwen2_5_vl_7b")),
    _vlm("qwen3_vl"),
    FamilySpec("r3_composite", "rlgen_cli.r3.composite", "unified", has_vae=False),
    FamilySpec("r3_bagel", "rlgen_cli.r3.bagel", "unified", image_guidance=True, has_vae=False),
)

FAMILY_TABLE: dict[str, FamilySpec] = {row.name: row for row in _ROWS}
"""Every family by ``model.family`` value, in the table's order."""
FAMILY_NAMES: tuple[str, ...] = tuple(FAMILY_TABLE)


def families(kind: FamilyKind | None = None, **facts: object) -> tuple[str, ...]:
    """The names of the families of ``kind`` (any when None) whose columns equal ``facts``
    (``families(editing=True)``)."""
    return tuple(
        row.name
        for row in _ROWS
        if (kind is None or row.kind == kind) and all(getattr(row, k) == v for k, v in facts.items())
    )


def family_spec(name: str) -> FamilySpec:
    """The row of ``name`` (a checked ``model.family``: an unknown name is a programming error here)."""
    return FAMILY_TABLE[name]
