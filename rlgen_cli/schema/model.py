"""The ``model`` section: one schema per family, assembled from the facts of its row in ``schema/families.py``.

Every network shares :class:`ModelConfig` (where its weights come from, its dtype, LoRA); a flow family adds
:class:`FlowModelConfig` (geometry, guidance, steps) and a vision-language family :class:`VlmModelConfig`
(``model.vlm``). A family's own facts add the keys only it reads: a video family ``num_frames``, a two-expert
family ``experts``, an image-guidance family ``image_guidance_scale``, a family with a VAE ``vae_dtype``, a
family with real-size variants ``weights`` and ``variant`` (and ``text_encoders`` where it has separate text
encoders). A unified family (R3) configures its networks under ``r3.policy``: its ``model`` holds the family
alone. So a run composes no model key its family does not read.

Each family's schema is an option of the ``model_schema`` config group (``schema/store.py``), named after the
family, and its ``family`` defaults to that name: a model YAML picks it first in its defaults
(``- /model_schema@_here_: sd3``), as an algo YAML picks its recipe's schema.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from omegaconf import OmegaConf

from rlgen_cli.errors import require
from rlgen_cli.schema.choices import (
    Attention,
    Dtype,
    ExpertsTrain,
    Family,
    LoraInit,
    ModelWeights,
    RealSizeVariant,
    TextEncoderSize,
)
from rlgen_cli.schema.families import FAMILY_TABLE, FamilySpec, family_spec
from rlgen_cli.schema.ranges import ANY, COUNT, NON_NEGATIVE, POSITIVE, at_least
from rlgen_cli.schema.vlm import VLMOptions

SD3_LORA_TARGETS = [
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
]

REAL_SIZE_VARIANTS: dict[str, tuple[str, ...]] = {
    row.name: row.real_size_variants for row in FAMILY_TABLE.values() if row.real_size_variants
}
"""The checkpoints ``model.weights=random_init`` builds, per family; the first is ``model.variant=auto``
(the checkpoint the family's conf/model option loads): the ``real_size_variants`` column of
``schema/families.py``. Their architectures: ``models/real_size.py``."""

WEIGHT_KEYS = (
    "path",
    "revision",
    "tiny",
    "tiny_seed",
    "weights",
    "variant",
    "text_encoders",
    "lora",
    "experts.train",
)
"""The keys of a model section that decide which weights a checkpoint's tensors fit (the base they sit on,
the adapter's shape and scale, which experts were trained): with ``checkpoint=`` they keep the saved values
(``tasks/loading.py``); the others (dtype, decoding, geometry, guidance) may change."""

OptionalDtype = Literal[None, "float32", "float16", "bfloat16"]
"""A dtype, or null for the default a field names."""


@dataclass
class LoraConfig:
    enabled: bool = True
    """Train a LoRA adapter (False = full fine-tuning of the transformer)."""
    rank: Annotated[int, COUNT] = 32
    """LoRA rank r."""
    alpha: Annotated[int, POSITIVE] = 64
    """LoRA scaling α (the update is scaled by α / r)."""
    target_modules: list[str] = field(default_factory=lambda: list(SD3_LORA_TARGETS))
    """Module-name suffixes inside the transformer that get adapters."""
    init: Annotated[str, LoraInit] = "gaussian"
    """peft ``init_lora_weights``: ``gaussian`` (upstream) or ``kaiming`` (peft's default: Kaiming-uniform A,
    zero B)."""


@dataclass
class ExpertsConfig:
    """Two-expert families (Wan2.2 A14B): a high-noise and a low-noise transformer switched at the
    checkpoint's ``boundary_ratio``."""

    train: Annotated[str, ExpertsTrain] = "both"
    """``both`` experts get LoRA (or full FT), or only ``high_noise`` / ``low_noise`` (the other frozen)."""
    guidance_scale_2: Annotated[float | None, at_least(1)] = None
    """CFG scale of the low-noise expert; null = ``model.guidance_scale`` (as WanPipeline's default)."""


@dataclass
class ModelSection:
    """What every ``model`` section holds: the family, which decides the rest of the section's keys."""

    family: Annotated[str, Family] = "sd3"
    """The model family: a row of ``schema/families.py`` (``rlgen ls`` lists them)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """The section's cross-field checks; a subclass adds its own after ``super().check()``."""


@dataclass
class UnifiedModelConfig(ModelSection):
    """A unified family (R3): its networks are configured under ``r3.policy``."""


@dataclass
class ModelConfig(ModelSection):
    """One network: where its weights come from, the dtype it runs in, its adapter."""

    path: str | None = None
    """Hub id or local directory of the diffusers pipeline; ignored when ``tiny`` is set."""
    tiny: bool = False
    """Build the family's tiny variant in-process (random weights, offline tokenizers) instead of loading."""
    tiny_seed: Annotated[int, NON_NEGATIVE] = 0
    """Seed of the random weights of the tiny variant or of ``weights=random_init`` (so a checkpoint's base
    can be rebuilt exactly)."""
    local_files_only: bool = False
    """Never touch the network when loading ``path``."""
    revision: str | None = None
    """Hub revision of ``path``."""
    dtype: Annotated[str, Dtype] = "float32"
    """Dtype of the transformer's forward (``torch.autocast`` below fp32) and of the frozen weights unless
    ``frozen_dtype`` says otherwise; the text encoders are kept in it (trainable weights stay fp32)."""
    gradient_checkpointing: bool = False
    """Recompute the transformer's blocks (VLMs: decoder and vision layers) in the backward pass instead of
    keeping their activations: less memory, one more forward per update, the same loss and gradients. Only
    with gradients on: rollouts and evaluation are untouched (docs/memory_speed.md)."""
    attention: Annotated[str, Attention] = "sdpa"
    """Attention kernel of the trained network: ``sdpa`` (PyTorch's scaled_dot_product_attention, fused
    kernels) or ``eager`` (the explicit softmax(QKᵀ/√d)·V). Equal within rounding (docs/memory_speed.md)."""
    compile: bool = False
    """torch.compile (mode default, automatic dynamic shapes) the transformer's forward; VLMs: the training
    forward. Compiled and eager forwards differ by rounding (docs/memory_speed.md)."""
    lora: LoraConfig = field(default_factory=LoraConfig)

    @property
    def weights(self) -> str:
        """A family without real-size variants loads ``path`` (:class:`RealSizeFacet` makes it a key)."""
        return "pretrained"

    def check(self) -> None:
        super().check()
        require(
            self.tiny or self.weights == "random_init" or bool(self.path),
            "model.path is empty: set model.path=HUB_ID_OR_DIR, model.tiny=true or model.weights=random_init",
        )
        if isinstance(self, RealSizeFacet):
            check_real_size(self)


@dataclass
class FlowModelConfig(ModelConfig):
    """A flow-matching policy: its geometry, guidance and denoising steps."""

    frozen_dtype: Annotated[str | None, OptionalDtype] = None
    """Dtype the transformer is loaded in and its frozen weights kept in (the base under LoRA, an untrained
    expert). null = ``dtype``: half of fp32's bytes (rlgen's memory-saving choice). ``float32``: the
    weights as loaded, as Flow-GRPO's SD3 / FLUX / Kontext / Wan scripts keep them; the forward still runs
    under ``torch.autocast(dtype)``, which rounds each matrix product's operands to ``dtype`` on the fly
    (docs/precision.md). Under full fine-tuning ``float32`` loads the trained weights without a round trip
    through ``dtype``. Either null, ``float32`` or ``dtype``."""
    resolution: Annotated[int, COUNT] = 512
    """Image side in pixels (square images; ``height``/``width`` override it)."""
    height: Annotated[int | None, COUNT] = None
    """Image height in pixels; null = resolution."""
    width: Annotated[int | None, COUNT] = None
    """Image width in pixels; null = resolution."""
    guidance_scale: Annotated[float, at_least(1)] = 4.5
    """Classifier-free guidance scale; 1.0 means no unconditional branch ("nocfg")."""
    negative_prompt: str = ""
    """Prompt of the unconditional branch when CFG is on (family shapes: always the empty prompt, the only
    value it takes)."""
    shift: Annotated[float, ANY] = 3.0
    """Timestep shift of the sigma schedule (SD3: static shift). FLUX families: ≤ 0 = dynamic,
    resolution-dependent shift (μ from the image token count); > 0 = static shift of linspace(1, 0, T+1)."""
    num_steps: Annotated[int, COUNT] = 10
    """Denoising steps of training rollouts."""
    eval_num_steps: Annotated[int, COUNT] = 40
    """Denoising steps of evaluation (ODE) sampling."""
    noise_level: Annotated[float, NON_NEGATIVE] = 0.7
    """The family's default SDE noise level a (``sampler.noise_level`` overrides it)."""
    max_sequence_length: Annotated[int, COUNT] = 256
    """T5 tokens of the prompt (family shapes: its word tokenizer's own 16, the only value it takes)."""
    prompt_cache_mb: Annotated[float, NON_NEGATIVE] = 256.0
    """Keep the text conditioning of batches of prompts already encoded, up to this many MiB on the
    model's device (least recently used evicted first); 0 re-encodes every batch. Cached conditioning is
    bit-identical to a fresh encode (``models/prompt_cache.py``)."""

    @property
    def num_frames(self) -> int:
        """An image is one frame (:class:`VideoFacet` makes it a key)."""
        return 1

    @property
    def text_encoders(self) -> str:
        """As published (:class:`StandInEncodersFacet` makes it a key)."""
        return "real_size"

    def check(self) -> None:
        super().check()
        check_frozen_dtype(self)
        check_stand_in_encoders(self)
        check_own_prompt_settings(self)
        check_negative_prompt(self)
        if isinstance(self, ImageGuidanceFacet):
            check_image_guidance(self)


@dataclass
class VlmModelConfig(ModelConfig):
    """A vision-language policy (token GRPO, SFT, R3's text policy)."""

    vlm: VLMOptions = field(default_factory=VLMOptions)
    """Processor pixel bounds, context and evaluation decoding."""


# -- facets: the keys a column of the family table adds ---------------------------------------------------
@dataclass
class RealSizeFacet:
    """Families with real-size variants (``real_size_variants``)."""

    weights: Annotated[str, ModelWeights] = "pretrained"
    """``pretrained``: load ``path``. ``random_init``: build the published architecture of ``variant`` with
    random weights and no download, to measure production-size runs (docs/real_size.md); ``path`` is not
    read. ``tiny`` and ``random_init`` exclude each other."""
    variant: Annotated[str, RealSizeVariant] = "auto"
    """The checkpoint ``weights=random_init`` builds (:data:`REAL_SIZE_VARIANTS`); ``auto`` = the one the
    family's conf/model option loads (sd3 → sd3_5_medium, wan2_1 → wan2_1_t2v_1_3b, qwen2_5_vl →
    qwen2_5_vl_3b, …)."""


@dataclass
class StandInEncodersFacet:
    """Flow families with real-size variants and separate text encoders."""

    text_encoders: Annotated[str, TextEncoderSize] = "real_size"
    """With ``weights=random_init``: ``real_size`` text encoders as published (T5-XXL 4.76 B,
    Qwen2.5-VL-7B 8.3 B), or ``stand_in``: two-layer encoders of the same output widths, so the transformer
    still sees production-shaped conditioning, from a few million parameters (quick benchmarks, small
    hosts)."""


@dataclass
class VaeFacet:
    """Flow families with a VAE of their own (``has_vae``)."""

    vae_dtype: Annotated[str | None, OptionalDtype] = None
    """Dtype of the VAE (decoding, and encoding the source images of editing families). null = the family's
    own: fp32 for Qwen-Image, Wan, Z-Image and BAGEL, ``dtype`` for SD3, FLUX.1, FLUX.1-Kontext and FLUX.2
    (docs/precision.md)."""


@dataclass
class VideoFacet:
    """Video families (``video``)."""

    num_frames: Annotated[int, COUNT] = 1
    """Frames per sample (video families such as Wan2.1); 1 for images."""


@dataclass
class ImageGuidanceFacet:
    """Families whose velocity has an image-guidance branch (``image_guidance``)."""

    image_guidance_scale: Annotated[float, at_least(1)] = 1.0
    """BAGEL editing (``bagel_edit``): the image-guidance scale (the reference's cfg_img_scale, 2.0 for
    editing), applied on top of the text guidance against the context without the source image; 1.0 = none."""


@dataclass
class TwoExpertsFacet:
    """Two-expert families (``two_experts``: Wan2.2 A14B)."""

    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    """Two-expert families only (Wan2.2 A14B)."""


def check_real_size(cfg: Any) -> None:
    """``model.variant`` and ``model.text_encoders`` go with ``model.weights=random_init``, the variant with
    the family; with ``pretrained`` they would be silently ignored, so they are refused."""
    random_init = cfg.weights == "random_init"
    require(
        not (cfg.tiny and random_init),
        "model.tiny=true and model.weights=random_init both ask for random weights: model.tiny builds the tiny "
        "variant, model.weights=random_init the real-size one; set model.tiny=false for real size",
    )
    require(
        random_init or cfg.variant == "auto",
        f"model.variant={cfg.variant} names the architecture model.weights=random_init builds; add "
        "model.weights=random_init, or drop model.variant to load model.path",
    )
    if not random_init:
        return
    variants = REAL_SIZE_VARIANTS[cfg.family]
    require(
        cfg.variant == "auto" or cfg.variant in variants,
        f"model.variant={cfg.variant} is not a {cfg.family} checkpoint; choose auto or one of "
        f"{', '.join(variants)} (or the family that builds it: docs/real_size.md)",
    )


def check_stand_in_encoders(cfg: FlowModelConfig) -> None:
    """Stand-in text encoders are built by ``model.weights=random_init`` alone."""
    require(
        cfg.weights == "random_init" or cfg.text_encoders == "real_size",
        "model.text_encoders=stand_in applies to model.weights=random_init only; add model.weights=random_init "
        "or drop it",
    )


def check_image_guidance(cfg: Any) -> None:
    """``model.image_guidance_scale`` acts (as in BAGEL's reference) only on top of text guidance."""
    require(
        cfg.image_guidance_scale == 1.0 or cfg.guidance_scale > 1.0,
        f"model.image_guidance_scale={cfg.image_guidance_scale} acts on the text-guided velocity, and "
        f"model.guidance_scale={cfg.guidance_scale} turns text guidance off: set model.guidance_scale > 1 "
        "(4 for editing) or model.image_guidance_scale=1",
    )


def check_own_prompt_settings(cfg: FlowModelConfig) -> None:
    """A family whose text side fixes the unguided prompt or the prompt length (``own_negative_prompt``,
    ``own_prompt_tokens`` in ``schema/families.py``: ShapesEval) would silently ignore
    ``model.negative_prompt`` / ``model.max_sequence_length``: any value but its own is refused."""
    if not isinstance(cfg, model_schema(cfg.family)):
        return  # composed as another family's section: require_family_schema names that first
    row = family_spec(cfg.family)
    own = row.own_negative_prompt
    require(
        own is None or cfg.negative_prompt == own,
        f"model.negative_prompt={cfg.negative_prompt!r} does nothing for model.family={cfg.family}: its unguided "
        f"branch always encodes {own!r} ({row.module}). Drop model.negative_prompt: this family takes "
        "no negative prompt",
    )
    tokens = row.own_prompt_tokens
    require(
        tokens is None or cfg.max_sequence_length == tokens,
        f"model.max_sequence_length={cfg.max_sequence_length} does nothing for model.family={cfg.family}: its "
        f"tokenizer always reads {tokens} tokens, the length its checkpoint was built with (longer prompts "
        f"are refused when encoded). Drop model.max_sequence_length (or set it to {tokens})",
    )


def check_negative_prompt(cfg: FlowModelConfig) -> None:
    """``model.negative_prompt`` is encoded only by classifier-free guidance's unguided branch: a prompt
    (anything but blank: the Qwen pipelines' neutral ``" "``) where no such branch runs would do nothing."""
    if not cfg.negative_prompt.strip():
        return
    require(
        family_spec(cfg.family).negative_branch,
        f"model.negative_prompt={cfg.negative_prompt!r} does nothing for model.family={cfg.family}: its "
        "guidance scale is an input embedding (guidance-distilled) and it encodes no negative prompt. Drop "
        "model.negative_prompt",
    )
    require(
        cfg.guidance_scale > 1.0,
        f"model.negative_prompt={cfg.negative_prompt!r} is encoded by classifier-free guidance's unguided "
        f"branch, and model.guidance_scale={cfg.guidance_scale} runs none: set model.guidance_scale > 1 to "
        "guide away from it, or drop model.negative_prompt",
    )


def check_frozen_dtype(cfg: FlowModelConfig) -> None:
    """Frozen weights in fp32 or in the forward's dtype: below fp32 the forward runs under autocast, which
    takes fp32 weights; an fp32 forward has no autocast to take weights of a lower dtype, and weights of
    another low dtype would be rounded twice."""
    require(
        cfg.frozen_dtype in (None, "float32", cfg.dtype),
        f"model.frozen_dtype={cfg.frozen_dtype} with model.dtype={cfg.dtype}: frozen weights are kept in "
        f"float32 (upstream's choice) or in model.dtype (null, the memory-saving one); set "
        f"model.frozen_dtype=float32 or null, or model.dtype={cfg.frozen_dtype}",
    )


# -- one schema per family ----------------------------------------------------------------------------------
def _facets(row: FamilySpec) -> tuple[type, ...]:
    """The facet classes ``row``'s columns call for, in the order their keys are listed."""
    flow = row.kind == "flow"
    wanted = (
        (RealSizeFacet, bool(row.real_size_variants)),
        (StandInEncodersFacet, flow and bool(row.real_size_variants) and not row.own_language_model),
        (VaeFacet, flow and row.has_vae),
        (VideoFacet, row.video),
        (TwoExpertsFacet, row.two_experts),
        (ImageGuidanceFacet, flow and row.image_guidance),
    )
    return tuple(facet for facet, applies in reversed(wanted) if applies)


KIND_SCHEMAS: dict[str, type] = {
    "flow": FlowModelConfig,
    "vlm": VlmModelConfig,
    "unified": UnifiedModelConfig,
}
"""``kind`` column → the schema every family of that kind extends."""


def _class_name(family: str) -> str:
    return "".join(part.capitalize() for part in family.split("_")) + "ModelConfig"


def _family_schema(row: FamilySpec) -> type:
    """``row``'s schema: its kind's, the facets of its columns, ``family`` defaulting to its name, and the
    prompt settings its text side fixes (``own_negative_prompt``, ``own_prompt_tokens``) defaulting to
    those values."""
    own: list[Any] = [("family", Annotated[str, Family], field(default=row.name))]
    if row.own_negative_prompt is not None:  # the family's own value, the only one it takes
        own.append(("negative_prompt", str, field(default=row.own_negative_prompt)))
    if row.own_prompt_tokens is not None:
        own.append(("max_sequence_length", Annotated[int, COUNT], field(default=row.own_prompt_tokens)))
    cls = dataclasses.make_dataclass(
        _class_name(row.name), own, bases=(*_facets(row), KIND_SCHEMAS[row.kind])
    )
    cls.__module__ = __name__  # found where it is built (pickling, type hints, error messages)
    cls.__doc__ = f"``model.family={row.name}``: {KIND_SCHEMAS[row.kind].__doc__}"
    return cls


FAMILY_SCHEMAS: dict[str, type] = {name: _family_schema(row) for name, row in FAMILY_TABLE.items()}
"""``model.family`` → the schema of its ``model`` section (the ``model_schema`` config group's options)."""
globals().update({cls.__name__: cls for cls in FAMILY_SCHEMAS.values()})  # importable by name (pickling)


def model_schema(family: str) -> type:
    """The schema of ``family``'s model section."""
    return FAMILY_SCHEMAS[family]


def require_family_schema(section: ModelSection, key: str = "model") -> None:
    """``section`` holds exactly the keys its family reads: it was composed with its family's schema (the model
    option's ``model_schema`` default), or with one of the same keys (``model.family=qwen2_5_vl`` over
    ``model=tiny_qwen2_vl``)."""
    schema = model_schema(section.family)
    require(
        _keys(type(section)) == _keys(schema),
        f"{key}.family={section.family} has keys of its own ({schema.__name__}), and this section was composed "
        f"as {type(section).__name__}: pick a model option of that family (rlgen ls model) instead of "
        f"overriding {key}.family; a model YAML of your own starts its defaults with "
        f"'- /model_schema@_here_: {section.family}'",
    )


def _keys(schema: type) -> set[str]:
    return {f.name for f in dataclasses.fields(schema)}


def typed_model_section(saved: Any) -> Any:
    """A saved model section (a checkpoint's config) under its family's schema; keys the family does not
    read (saved by an rlgen with one model schema for every family) are dropped."""
    schema = model_schema(saved.family)
    declared = {f.name for f in dataclasses.fields(schema)}
    return OmegaConf.merge(OmegaConf.structured(schema), {k: v for k, v in saved.items() if k in declared})


def option_family(option: Any, package: str = "model") -> str | None:
    """The family whose schema a model YAML (``conf/model/NAME.yaml``, loaded) picks for ``package``
    (``model``; ``r3.policy.text`` and the like in a unified option), or None when it picks none."""
    targets = ("/model_schema@_here_", f"/model_schema@{package}")
    for entry in option.get("defaults", []):
        if isinstance(entry, Mapping):
            for target, family in entry.items():
                if target in targets and (target != targets[0] or package == "model"):
                    return str(family)
    return None


def option_section(option: Any) -> Any:
    """A model YAML (loaded) as a typed section of its family: the schema its defaults pick, its keys merged
    in (its other defaults, the data, reward or algo it picks for a run, are not model settings)."""
    family = option_family(option)
    if family is None:
        raise ValueError("the model option picks no /model_schema in its defaults")
    keys = {k: v for k, v in option.items() if k != "defaults"}
    return OmegaConf.merge(OmegaConf.structured(model_schema(family)), keys)


def model_config(family: str, **settings: object) -> ModelSection:
    """A typed model section of ``family`` (tests and code that build one without composing)."""
    return model_schema(family)(**settings)


def family_kind(family: str) -> str:
    """``flow``, ``vlm`` or ``unified``: the ``kind`` column of ``family``'s row."""
    return family_spec(family).kind
