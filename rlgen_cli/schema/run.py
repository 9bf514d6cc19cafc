"""Typed schemas of the flow-model configs: every field is declared, typed and documented here.

YAML files under ``conf/`` extend these schemas (Hydra ConfigStore, see ``schema/store.py``), so a
misspelt key or a wrong type fails at compose time with the key's full name. Checks that involve several
fields live in ``__post_init__``; ``OmegaConf.to_object`` runs them at task start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from rlgen_cli.errors import require
from rlgen_cli.schema.algo import SamplerConfig
from rlgen_cli.schema.choices import (
    ENGINE_LAUNCHERS,
    AdvAggregation,
    Attention,
    Dtype,
    ExpertsTrain,
    Family,
    Launcher,
    LoraInit,
    MixedPrecision,
    ModelWeights,
    RealSizeVariant,
    Recipe,
    TextEncoderSize,
    WandbMode,
)
from rlgen_cli.schema.families import FAMILY_TABLE, families, family_spec
from rlgen_cli.schema.fidelity import FidelityConfig
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


def check_real_size(cfg: ModelConfig) -> None:
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
    require(
        random_init or cfg.text_encoders == "real_size",
        "model.text_encoders=stand_in applies to model.weights=random_init only; add model.weights=random_init "
        "or drop it",
    )
    if not random_init:
        return
    variants = REAL_SIZE_VARIANTS.get(cfg.family)
    require(
        variants is not None,
        f"model.weights=random_init: model.family={cfg.family} has no real-size variant; families with one: "
        f"{', '.join(REAL_SIZE_VARIANTS)}",
    )
    require(
        cfg.variant == "auto" or cfg.variant in variants,
        f"model.variant={cfg.variant} is not a {cfg.family} checkpoint; choose auto or one of "
        f"{', '.join(variants)} (or the family that builds it: docs/real_size.md)",
    )
    require(
        not family_spec(cfg.family).own_language_model or cfg.text_encoders == "real_size",
        f"model.text_encoders=stand_in is for flow families with separate text encoders; {cfg.family} reads "
        "its prompt with its own language model: drop it",
    )


OptionalDtype = Literal[None, "float32", "float16", "bfloat16"]
"""A dtype, or null for the default a field names."""


WITHOUT_VAE = families(has_vae=False)
"""Families with no VAE of their own: the pixel-space ShapesEval models, the VLMs, and the R3 families,
whose models (``r3.policy.*``) carry their own settings."""
WITHOUT_FROZEN_DTYPE = (*families("vlm"), *families("unified"))
"""Families whose frozen weights ``model.frozen_dtype`` does not place (the VLM policy keeps them in
``model.dtype``)."""


def check_frozen_dtype(cfg: ModelConfig) -> None:
    """Frozen weights in fp32 or in the forward's dtype: below fp32 the forward runs under autocast, which
    takes fp32 weights; an fp32 forward has no autocast to take weights of a lower dtype, and weights of
    another low dtype would be rounded twice. A family the setting would not reach refuses it."""
    require(
        cfg.vae_dtype is None or cfg.family not in WITHOUT_VAE,
        f"model.vae_dtype={cfg.vae_dtype}: model.family={cfg.family} has no VAE; drop model.vae_dtype"
        + (" (set it on r3.policy.generator / editor / bagel)" if cfg.family.startswith("r3_") else ""),
    )
    require(
        cfg.frozen_dtype is None or cfg.family not in WITHOUT_FROZEN_DTYPE,
        f"model.frozen_dtype={cfg.frozen_dtype}: model.family={cfg.family} keeps its frozen weights in "
        "model.dtype; drop model.frozen_dtype"
        + (" (set it on r3.policy.generator / editor / bagel)" if cfg.family.startswith("r3_") else ""),
    )
    require(
        cfg.frozen_dtype in (None, "float32", cfg.dtype),
        f"model.frozen_dtype={cfg.frozen_dtype} with model.dtype={cfg.dtype}: frozen weights are kept in "
        f"float32 (upstream's choice) or in model.dtype (null, the memory-saving one); set "
        f"model.frozen_dtype=float32 or null, or model.dtype={cfg.frozen_dtype}",
    )


IMAGE_GUIDANCE_FAMILIES = families(image_guidance=True)
"""Families whose velocity has an image-guidance branch (``model.image_guidance_scale``)."""


def check_image_guidance(cfg: ModelConfig) -> None:
    """``model.image_guidance_scale`` is read by BAGEL alone, and (as in its reference) only on top of text
    guidance: anywhere else it would be silently ignored, so it is refused."""
    if cfg.image_guidance_scale == 1.0:
        return
    require(
        cfg.family in IMAGE_GUIDANCE_FAMILIES,
        f"model.image_guidance_scale={cfg.image_guidance_scale} applies to BAGEL editing (model=bagel_edit), "
        f"not model.family={cfg.family}: drop it",
    )
    require(
        cfg.guidance_scale > 1.0,
        f"model.image_guidance_scale={cfg.image_guidance_scale} acts on the text-guided velocity, and "
        f"model.guidance_scale={cfg.guidance_scale} turns text guidance off: set model.guidance_scale > 1 "
        "(4 for editing) or model.image_guidance_scale=1",
    )


@dataclass
class LoraConfig:
    enabled: bool = True
    """Train a LoRA adapter (False = full fine-tuning of the transformer)."""
    rank: int = 32
    """LoRA rank r."""
    alpha: int = 64
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
    guidance_scale_2: float | None = None
    """CFG scale of the low-noise expert; null = ``model.guidance_scale`` (as WanPipeline's default)."""


@dataclass
class ModelConfig:
    family: Annotated[str, Family] = "sd3"
    """The model family: a row of ``schema/families.py`` (``rlgen ls`` lists them)."""
    path: str | None = None
    """Hub id or local directory of the diffusers pipeline; ignored when ``tiny`` is set."""
    tiny: bool = False
    """Build the family's tiny variant in-process (random weights, offline tokenizers) instead of loading."""
    tiny_seed: int = 0
    """Seed of the random weights of the tiny variant or of ``weights=random_init`` (so a checkpoint's base
    can be rebuilt exactly)."""
    weights: Annotated[str, ModelWeights] = "pretrained"
    """``pretrained``: load ``path``. ``random_init``: build the published architecture of ``variant`` with
    random weights and no download, to measure production-size runs (docs/real_size.md); ``path`` is not
    read. ``tiny`` and ``random_init`` exclude each other."""
    variant: Annotated[str, RealSizeVariant] = "auto"
    """The checkpoint ``weights=random_init`` builds (:data:`REAL_SIZE_VARIANTS`); ``auto`` = the one the
    family's conf/model option loads (sd3 → sd3_5_medium, wan2_1 → wan2_1_t2v_1_3b, qwen2_5_vl →
    qwen2_5_vl_3b, …)."""
    text_encoders: Annotated[str, TextEncoderSize] = "real_size"
    """Flow families with ``weights=random_init``: ``real_size`` text encoders as published (T5-XXL 4.76 B,
    Qwen2.5-VL-7B 8.3 B), or ``stand_in``: two-layer encoders of the same output widths, so the transformer
    still sees production-shaped conditioning, from a few million parameters (quick benchmarks, small
    hosts)."""
    local_files_only: bool = False
    """Never touch the network when loading ``path``."""
    revision: str | None = None
    """Hub revision of ``path``."""
    dtype: Annotated[str, Dtype] = "float32"
    """Dtype of the transformer's forward (``torch.autocast`` below fp32) and of the frozen weights unless
    ``frozen_dtype`` says otherwise; the text encoders are kept in it (trainable weights stay fp32)."""
    frozen_dtype: Annotated[str | None, OptionalDtype] = None
    """Dtype the transformer is loaded in and its frozen weights kept in (the base under LoRA, an untrained
    expert). null = ``dtype``: half of fp32's bytes (rlgen's memory-saving choice). ``float32``: the
    weights as loaded, as Flow-GRPO's SD3 / FLUX / Kontext / Wan scripts keep them; the forward still runs
    under ``torch.autocast(dtype)``, which rounds each matrix product's operands to ``dtype`` on the fly
    (docs/precision.md). Under full fine-tuning ``float32`` loads the trained weights without a round trip
    through ``dtype``. Either null, ``float32`` or ``dtype``."""
    vae_dtype: Annotated[str | None, OptionalDtype] = None
    """Dtype of the VAE (decoding, and encoding the source images of editing families). null = the family's
    own: fp32 for Qwen-Image, Wan, Z-Image and BAGEL, ``dtype`` for SD3, FLUX.1, FLUX.1-Kontext and FLUX.2
    (docs/precision.md)."""
    resolution: int = 512
    """Image side in pixels (square images; ``height``/``width`` override it)."""
    height: int | None = None
    """Image height in pixels; null = resolution."""
    width: int | None = None
    """Image width in pixels; null = resolution."""
    num_frames: int = 1
    """Frames per sample (video families such as Wan2.1); 1 for images."""
    guidance_scale: float = 4.5
    """Classifier-free guidance scale; 1.0 means no unconditional branch ("nocfg")."""
    image_guidance_scale: float = 1.0
    """BAGEL editing (``bagel_edit``): the image-guidance scale (the reference's cfg_img_scale, 2.0 for
    editing), applied on top of the text guidance against the context without the source image; 1.0 = none."""
    negative_prompt: str = ""
    """Prompt of the unconditional branch when CFG is on."""
    shift: float = 3.0
    """Timestep shift of the sigma schedule (SD3: static shift). FLUX families: ≤ 0 = dynamic,
    resolution-dependent shift (μ from the image token count); > 0 = static shift of linspace(1, 0, T+1)."""
    num_steps: int = 10
    """Denoising steps of training rollouts."""
    eval_num_steps: int = 40
    """Denoising steps of evaluation (ODE) sampling."""
    noise_level: float = 0.7
    """The family's default SDE noise level a (``sampler.noise_level`` overrides it)."""
    max_sequence_length: int = 256
    """T5 tokens of the prompt."""
    prompt_cache_mb: float = 256.0
    """Keep the text conditioning of batches of prompts already encoded, up to this many MiB on the
    model's device (least recently used evicted first); 0 re-encodes every batch. Cached conditioning is
    bit-identical to a fresh encode (``models/prompt_cache.py``)."""
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
    vlm: VLMOptions = field(default_factory=VLMOptions)
    """Multimodal-LLM families only (processor pixel bounds, context)."""
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    """Two-expert families only (Wan2.2 A14B)."""

    def __post_init__(self) -> None:
        require(
            self.tiny or self.weights == "random_init" or bool(self.path),
            "model.path is empty: set model.path=HUB_ID_OR_DIR, model.tiny=true or model.weights=random_init",
        )
        check_real_size(self)
        check_image_guidance(self)
        check_frozen_dtype(self)


@dataclass
class RewardConfig:
    weights: dict[str, float] = field(default_factory=dict)
    """Reward mix {name: weight}; the final reward is Σ weight·score. Empty here on purpose: dicts merge,
    so a default entry would leak into every ``reward=`` option; the reward group fills it."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Per-reward constructor arguments: {name: {arg: value}}."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.kwargs) - set(self.weights))
        drop = " ".join(f"'~reward.kwargs.{name}'" for name in unknown)
        require(
            not unknown,
            f"reward.kwargs names rewards not in reward.weights: {unknown}. Settings an experiment gave a "
            f"reward that another reward= option replaced are not used: a served reward takes them on its "
            f"server (rlgen serve-reward reward.kwargs.NAME.…); drop them here with {drop}, or weight the "
            f"reward (+reward.weights.NAME=W)",
        )


@dataclass
class AdvantageRewardConfig(RewardConfig):
    """The reward section of the recipes that turn a reward mix into advantages."""

    aggregation: Annotated[str, AdvAggregation] = "sum_then_normalize"
    """``sum_then_normalize`` (Flow-GRPO), ``normalize_then_sum`` (MixGRPO's per-reward advantages) or
    ``gdpo`` (GDPO: per-reward advantages, their weighted sum normalised over the batch)."""


def require_rewards(reward: RewardConfig) -> None:
    """Checked by the configs that score (the schema default is empty so groups do not merge into it)."""
    require(
        bool(reward.weights),
        "reward.weights is empty: pick reward=NAME or give reward.weights={name: weight}",
    )


@dataclass
class DataConfig:
    train: str = "builtin:tiny_train.txt"
    """Training prompts: a .txt (one per line) or GenEval .jsonl; ``builtin:NAME`` = a packaged file."""
    test: str = "builtin:tiny_test.txt"
    """Evaluation prompts, same formats."""
    eval_num_prompts: int = 8
    """Test prompts used by periodic evaluation (0 = all)."""
    eval_images_per_prompt: int = 1
    """Images drawn per test prompt at each evaluation."""


@dataclass
class FlowDataConfig(DataConfig):
    """The flow recipes' prompts: what every run's data section holds, and how training samples them."""

    tag_repeats: dict[str, int] = field(default_factory=dict)
    """Sampling by tag: each training prompt of GenEval tag ``t`` appears ``tag_repeats[t]`` times per
    pass over ``train`` (tags not named: once, 0 leaves the tag out), e.g. ``{two_object: 2}`` trains
    twice as often on the prompts a model finds hard. Needs .jsonl prompts, which carry tags."""


@dataclass
class WandbConfig:
    enabled: bool = False
    """Also log to Weights & Biases (needs the wandb package)."""
    project: str = "rlgen"
    """The W&B project."""
    mode: Annotated[str, WandbMode] = "offline"
    """online | offline (no network; ``wandb sync`` later) | disabled."""
    name: str | None = None
    """The W&B run's name; null = the experiment and its overrides (``shapes_grpo_fast algo.lr=3e-4``)."""


@dataclass
class LoggingConfig:
    tensorboard: bool = False
    """Also write TensorBoard scalars and image grids under run_dir/tensorboard."""
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class LauncherConfig:
    name: Annotated[str, Launcher] = "local"
    """How ONE run spreads over devices: ``local`` (this process), ``accelerate`` (DDP over N processes,
    gloo on CPU), ``deepspeed_zero2`` / ``deepspeed_zero3`` (DeepSpeed ZeRO through accelerate), ``fsdp``
    (PyTorch FSDP2 through accelerate), ``multinode`` (several machines). Not Hydra's hydra/launcher,
    which places sweep jobs."""
    num_processes: int = 1
    """Processes per machine (one per GPU)."""
    num_machines: int = 1
    """Machines of one run (launcher=multinode); its processes: num_processes × num_machines."""
    machine_rank: int | None = None
    """This machine's rank; null reads MACHINE_RANK / NODE_RANK / SLURM_NODEID (else 0)."""
    main_process_ip: str | None = None
    """Rank-0 address; null reads MASTER_ADDR (else 127.0.0.1)."""
    main_process_port: int | None = None
    """Rank-0 port; null reads MASTER_PORT (else 29500)."""
    mixed_precision: Annotated[str, MixedPrecision] = "fp32"
    """Mixed precision of the launched workers: ``fp32`` (none), ``fp16`` or ``bf16``."""
    exact_reduction: bool | None = None
    """Sum each optimizer step's micro-batch gradients in float64 over every micro-batch and process
    before one cast back (``training/distributed/dist.py``), so a run's weights do not depend on the process count
    (README: process-count invariance). Needs the gradients in rlgen's hands: local, accelerate (DDP) and
    multinode; DeepSpeed and FSDP reduce their own. null (the default) = on where it can be, and an option
    that packs samples per process (``algo.drop_zero_advantage``) runs as upstream runs it, with a warning
    that the run depends on the process count; true refuses such an option."""
    config_file: str | None = None
    """Your own accelerate config (YAML) or DeepSpeed config (JSON), passed to ``accelerate launch`` as
    with ``accelerate launch --config_file``; with launcher=accelerate or multinode. The launcher.* values
    stay in charge: a process count (or machine, address, port, precision) the file sets differently
    stops the run with exit code 2, naming both."""

    def __post_init__(self) -> None:
        require(
            self.config_file is None or self.name in ("accelerate", "multinode"),
            f"launcher.config_file is passed to accelerate launch by launcher=accelerate or multinode, not "
            f"launcher={self.name}: add launcher=accelerate (and launcher.num_processes=N)",
        )
        require(
            not (self.exact_reduction is True and self.name in ENGINE_LAUNCHERS),
            f"launcher.exact_reduction=true needs the gradients in rlgen's hands, and launcher={self.name} "
            "reduces them inside its engine (results then depend on the process count to float rounding): "
            "pass launcher.exact_reduction=false, or launcher=accelerate for process-count invariant results",
        )
        require(
            self.name != "local" or self.num_processes * self.num_machines == 1,
            "launcher=local runs one process; use launcher=accelerate launcher.num_processes=N",
        )

    @property
    def world_size(self) -> int:
        return self.num_processes * self.num_machines

    @property
    def reduces_exactly(self) -> bool:
        """``exact_reduction``, with null resolved: on unless an engine reduces the gradients."""
        return self.name not in ENGINE_LAUNCHERS if self.exact_reduction is None else self.exact_reduction

    @property
    def shards_weights(self) -> bool:
        """Each process holds a shard of the weights (ZeRO-3, FSDP; ZeRO-2 shards optimizer state only)."""
        return self.name in ("deepspeed_zero3", "fsdp")

    @property
    def accelerate_mixed_precision(self) -> str:
        """``mixed_precision`` in accelerate's words (``no`` | ``fp16`` | ``bf16``)."""
        return "no" if self.mixed_precision == "fp32" else self.mixed_precision


def noise_level(sampler: SamplerConfig, model: ModelConfig) -> float:
    """The SDE noise level a run samples with: ``sampler.noise_level``, else the family's default."""
    return model.noise_level if sampler.noise_level is None else sampler.noise_level


def check_noise_level(sampler: SamplerConfig, model: ModelConfig) -> None:
    """CPS's noise level is an angle share: σ_t = σ′·sin(a·π/2) peaks at a = 1."""
    level = noise_level(sampler, model)
    require(
        sampler.kind != "cps" or level <= 1,
        f"sampler.kind=cps takes a noise level in [0, 1] (upstream 0.8), got {level}: set sampler.noise_level",
    )


@dataclass
class RunConfig:
    """What every training recipe reads; ``schema/recipes.py`` extends it once per recipe (``recipe``)."""

    recipe: Annotated[str, Recipe] = "flow_grpo"
    """Training loop, chosen by the ``algo`` (or unified ``model``) option, never set by hand: ``flow_grpo``
    (policy gradient on SDE rollouts), ``flow_pref`` (DPO / SFT), ``flow_pretrain``, ``flow_forward``
    (DiffusionNFT / AWM), ``vlm_rl`` (token GRPO), ``vlm_sft``, ``r3``. Each composes only its own keys."""
    seed: int = 42
    """The run's random streams (torch's global seed, each sample's initial and step noise, every epoch's
    draws) derive from it."""
    epochs: int = 100
    """Sampling rounds; each is rollout → reward → advantages → update."""
    eval_every: int = 10
    """Epochs between evaluations (ODE sampling on the test prompts); 0 = never."""
    save_every: int = 10
    """Epochs between checkpoints; 0 = only at the end."""
    keep_last: int = 3
    """Checkpoints kept on disk (older ones are deleted)."""
    resume: str | None = None
    """``auto`` (latest intact checkpoint of run_dir) or a checkpoint directory."""
    resume_unverified: bool = False
    """Resume from a checkpoint without ``manifest.json`` (its files cannot be checked: damaged, or saved by
    an rlgen before manifests); ``resume=auto`` skips such checkpoints unless this is true."""
    device: str = "auto"
    """``auto`` (cuda if available), ``cpu``, ``cuda``, ``cuda:N``."""
    run_dir: str | None = "${hydra:runtime.output_dir}"
    """Where resolved.yaml, metrics.jsonl, images, plots and checkpoints go (Hydra's output directory; it
    is null only in ``--cfg job --resolve`` output, which prints the config without starting a run)."""
    progress: bool = True
    """Show rich progress bars."""
    model: ModelConfig = field(default_factory=lambda: ModelConfig(tiny=True))
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """metrics.jsonl is always written; TensorBoard and W&B on request."""
    fidelity: FidelityConfig | None = None
    """Experiments named after an upstream recipe: its source and every knob that matches or differs."""

    def __post_init__(self) -> None:
        require_rewards(self.reward)


def require_whole_batches(cfg: Any) -> None:
    """Every process gets a whole number of sample and train batches (``algo.*_batch_size`` per process)."""
    world, algo = cfg.launcher.world_size, cfg.algo
    total = algo.prompts_per_epoch * algo.group_size
    step = world * math.lcm(algo.sample_batch_size, algo.train_batch_size)  # whole batches on every process
    require(
        total % step == 0,
        f"{total} samples per epoch over {world} processes must give every process a whole number of "
        f"sample/train batches (algo.sample_batch_size={algo.sample_batch_size}, "
        f"algo.train_batch_size={algo.train_batch_size} are per process): set algo.prompts_per_epoch to a "
        f"multiple of {step // math.gcd(step, algo.group_size)}, or smaller batches",
    )


def require_sde_sampler(sampler: SamplerConfig, model: ModelConfig) -> None:
    """A recipe that trains on rollout log-probabilities needs a stochastic step."""
    require(
        sampler.kind != "ode", "sampler.kind=ode has no log-probability to train; use flow_sde, dance or cps"
    )
    check_noise_level(sampler, model)


@dataclass
class SampleConfig:
    seed: int = 0
    device: str = "auto"
    run_dir: str | None = "${hydra:runtime.output_dir}"
    prompts: list[str] = field(default_factory=list)
    """Prompts to draw (alternatively ``prompts_file``; with neither, ``data.test``)."""
    prompts_file: str | None = None
    edit_set: bool = False
    """Build an editing set from a GenEval-style prompts_file: sources from ``source_prompt`` (or
    ``prompt``), written with their metadata to edit_set.jsonl."""
    checkpoint: str | None = None
    """A checkpoint directory from ``rlgen train``; its config rebuilds the model unless overridden."""
    images_per_prompt: int = 1
    batch_size: int = 8
    num_steps: int | None = None
    """Denoising steps; null = model.eval_num_steps."""
    sampler: SamplerConfig = field(default_factory=lambda: SamplerConfig(kind="ode"))
    progress: bool = True
    model: ModelConfig = field(default_factory=lambda: ModelConfig(tiny=True))
    data: DataConfig = field(default_factory=DataConfig)
    """``data.test`` is drawn when neither ``prompts`` nor ``prompts_file`` is given; a model picks its own
    (editing models: rows with source images)."""

    def __post_init__(self) -> None:
        check_noise_level(self.sampler, self.model)


@dataclass
class EvalConfig:
    seed: int = 0
    device: str = "auto"
    run_dir: str | None = "${hydra:runtime.output_dir}"
    checkpoint: str | None = None
    """Checkpoint to evaluate; null evaluates the base model."""
    ckpt: str | None = None
    """Short alias of ``checkpoint``."""
    images_per_prompt: int = 1
    batch_size: int = 8
    num_steps: int | None = None
    """Denoising steps; null = model.eval_num_steps."""
    max_prompts: int = 0
    """Evaluate only the first N test prompts (0 = all)."""
    save_images: bool = True
    progress: bool = True
    model: ModelConfig = field(default_factory=lambda: ModelConfig(tiny=True))
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algo: Any = None
    """Unused by eval: where a model's own training algorithm lands (the VLMs pick theirs); each recipe's
    eval schema types it (``schema/recipes.py``)."""
    fidelity: FidelityConfig | None = None
    """Carried by experiments named after an upstream recipe (see ``RunConfig.fidelity``)."""

    def __post_init__(self) -> None:
        require_rewards(self.reward)
        require(
            not (self.ckpt and self.checkpoint and self.ckpt != self.checkpoint),
            f"ckpt={self.ckpt} and checkpoint={self.checkpoint} disagree; pass one of them",
        )
        self.checkpoint = self.checkpoint or self.ckpt
