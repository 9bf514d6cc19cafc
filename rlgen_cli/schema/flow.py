"""Typed schemas of the flow-model configs: every field is declared, typed and documented here.

YAML files under ``conf/`` extend these schemas (Hydra ConfigStore, see ``schema/store.py``), so a
misspelt key or a wrong type fails at compose time with the key's full name. Checks that involve several
fields live in ``__post_init__``; ``OmegaConf.to_object`` runs them at task start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlgen_cli.schema.errors import UserError
from rlgen_cli.schema.fidelity import FidelityConfig
from rlgen_cli.schema.vlm import LR_SCHEDULES, TokenGRPOOptions, VLMOptions

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
DTYPES = ("float32", "float16", "bfloat16")
STEP_KINDS = ("ode", "flow_sde", "dance", "cps")
WINDOW_KINDS = ("all", "random_window", "sliding", "random_subset", "single")
WINDOW_OPTIONS = {
    "all": ("timestep_fraction",),
    "random_window": ("size", "range"),
    "sliding": (
        "size", "stride", "shift_every", "strategy", "roll_back", "end_offset", "shrink_at_end",
        "min_shift_every", "max_shift_every", "exp_decay_rate", "exp_decay_start",
    ),
    "random_subset": ("timestep_fraction", "skip_last_step"),
    "single": ("max_index",),
}  # fmt: skip
OBJECTIVES = ("grpo", "grpo_guard")
RECIPES = ("flow_rl", "flow_pref", "flow_pretrain", "vlm_rl", "vlm_sft")
PREF_LOSSES = ("dpo", "sft")
BRANCHES = ("independent", "shared_prefix")
KL_FORMS = ("upstream", "gaussian")
CFG_GRADS = ("conditional", "both")
ADV_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
STD_ESTIMATORS = ("population", "unbiased")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise UserError(message)


def _one_of(value: str, valid: tuple[str, ...], key: str) -> None:
    _require(value in valid, f"{key}={value!r} is not valid; choose one of {', '.join(valid)}")


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
    init: str = "gaussian"
    """peft ``init_lora_weights``: ``gaussian`` (upstream) or ``true`` (zero-init B, Kaiming A)."""

    def __post_init__(self) -> None:
        _require(self.rank > 0, f"model.lora.rank must be positive, got {self.rank}")
        _one_of(self.init, ("gaussian", "true"), "model.lora.init")


@dataclass
class ModelConfig:
    family: str = "sd3"
    """Adapter name in the model registry (``rlgen ls`` lists them)."""
    path: str | None = None
    """Hub id or local directory of the diffusers pipeline; ignored when ``tiny`` is set."""
    tiny: bool = False
    """Build the family's tiny variant in-process (random weights, offline tokenizers) instead of loading."""
    tiny_seed: int = 0
    """Seed of the tiny variant's random weights (so a checkpoint's base can be rebuilt exactly)."""
    local_files_only: bool = False
    """Never touch the network when loading ``path``."""
    revision: str | None = None
    """Hub revision of ``path``."""
    dtype: str = "float32"
    """Dtype of the frozen weights and of the transformer's forward (trainable weights stay fp32)."""
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
    lora: LoraConfig = field(default_factory=LoraConfig)
    vlm: VLMOptions = field(default_factory=VLMOptions)
    """Multimodal-LLM families only (processor pixel bounds, context)."""

    def __post_init__(self) -> None:
        _one_of(self.dtype, DTYPES, "model.dtype")
        _require(
            self.tiny or bool(self.path),
            "model.path is empty: set model.path=HUB_ID_OR_DIR or model.tiny=true",
        )
        _require(self.resolution > 0, f"model.resolution must be positive, got {self.resolution}")
        _require(
            self.prompt_cache_mb >= 0,
            f"model.prompt_cache_mb must be ≥ 0 (0 = off), got {self.prompt_cache_mb}",
        )
        _require(
            self.guidance_scale >= 1.0,
            f"model.guidance_scale must be ≥ 1 (1 = no CFG), got {self.guidance_scale}",
        )
        _require(
            self.num_steps >= 1 and self.eval_num_steps >= 1,
            "model.num_steps and model.eval_num_steps must be ≥ 1",
        )


@dataclass
class SamplerConfig:
    kind: str = "flow_sde"
    """Stochastic step of rollouts: ``flow_sde`` (Flow-GRPO), ``dance`` (constant η), ``cps``, ``ode``."""
    noise_level: float | None = None
    """SDE noise level a (η for ``dance``); null takes the model family's default ``model.noise_level``."""
    logprob_reduce: str = "mean"
    """Reduce per-element log-densities over non-batch dims: ``mean`` (upstream) or ``sum`` (true density)."""
    logprob_form: str = "gaussian"
    """``gaussian`` (exact) or ``upstream`` (CPS's unnormalised −(x'−μ)², only with kind=cps)."""

    def __post_init__(self) -> None:
        _one_of(self.kind, STEP_KINDS, "sampler.kind")
        _one_of(self.logprob_reduce, ("mean", "sum"), "sampler.logprob_reduce")
        _one_of(self.logprob_form, ("gaussian", "upstream"), "sampler.logprob_form")
        _require(
            self.logprob_form == "gaussian" or self.kind == "cps",
            "sampler.logprob_form=upstream only exists for sampler.kind=cps; drop it or set sampler.kind=cps",
        )
        _require(self.noise_level is None or self.noise_level >= 0, "sampler.noise_level must be ≥ 0")


@dataclass
class WindowConfig:
    kind: str = "all"
    """Which steps are stochastic and trained: ``all`` (Flow-GRPO), ``random_window`` (Fast),
    ``sliding`` (MixGRPO), ``random_subset`` (DanceGRPO), ``single`` (R3)."""
    timestep_fraction: float = 0.99
    """``all``: train the first int(T·fraction) (0.99 skips the near-zero-σ last step);
    ``random_subset``: train a random int(n·fraction) of the n candidate steps per sample."""
    skip_last_step: bool = True
    """``random_subset``: the candidates are the first T − 1 steps, never the step onto σ′ = 0
    (DanceGRPO); false = all T steps."""
    size: int = 0
    """``random_window`` / ``sliding``: window length (Fast: 0 = all steps but the last)."""
    range: list[int] | None = None
    """``random_window``: [lo, hi) where the window may lie (null = [0, T−1))."""
    stride: int = 1
    """``sliding``: steps the window moves per shift (0: it stays at the first steps)."""
    shift_every: int = 25
    """``sliding``: epochs between shifts (τ); the ``exp_decay`` base interval."""
    strategy: str = "progressive"
    """``sliding``: progressive | random | decay | exp_decay (docs/maths.md §5.4)."""
    roll_back: bool = False
    """``sliding``: restart at step 0 after the last position."""
    end_offset: int = 0
    """``sliding``: the window lies before step T − end_offset (MixGRPO: 2)."""
    shrink_at_end: bool = False
    """``sliding``: keep moving past T − end_offset − size, dropping the steps past the end (MixGRPO);
    false: the last move lands on T − end_offset − size, every window full."""
    min_shift_every: int | None = None
    """``decay``: the shortest stay (null = max(1, shift_every // 4))."""
    max_shift_every: int | None = None
    """``decay``: the stay at the first position (null = shift_every)."""
    exp_decay_rate: float = 0.1
    """``exp_decay``: k in ceil(shift_every·exp(−k·max(0, start − exp_decay_start)))."""
    exp_decay_start: int = 13
    """``exp_decay``: the window start from which the stays shrink."""
    max_index: int | None = None
    """``single``: the SDE step is drawn from the first max_index steps (null = any)."""

    def __post_init__(self) -> None:
        _one_of(self.kind, WINDOW_KINDS, "algo.window.kind")
        _require(0 < self.timestep_fraction <= 1, "algo.window.timestep_fraction must be in (0, 1]")
        _require(self.range is None or len(self.range) == 2, "algo.window.range must be [lo, hi]")

    def options(self) -> dict[str, Any]:
        """The keyword options ``sde.window.plan_window`` takes for this kind."""
        values = {name: getattr(self, name) for name in WINDOW_OPTIONS[self.kind]}
        if values.get("range") is not None:
            values["range"] = tuple(values["range"])
        return values


def _check_window(window: WindowConfig, num_steps: int) -> None:
    """Plan the window once at validation, so a bad option (or one that does not fit model.num_steps)
    stops the run before it starts, with the option's name; the window module holds the valid ranges."""
    import torch  # the schema stays importable without torch; validation of a training run needs it anyway

    from rlgen_cli.sde.window import plan_window

    generator = torch.Generator().manual_seed(0)
    try:
        plan_window(window.kind, num_steps, generator=generator, batch_size=1, **window.options())
    except ValueError as err:
        raise UserError(f"algo.window with model.num_steps={num_steps}: {err}") from None


@dataclass
class FlashConfig:
    enabled: bool = False
    """MixGRPO-Flash: after the last SDE step, finish on a compressed schedule with DPM-Solver++ 2M."""
    ratio: float = 0.4
    """Fraction of the remaining steps kept by the compressed schedule."""

    def __post_init__(self) -> None:
        _require(0 < self.ratio <= 1, f"algo.flash.ratio must be in (0, 1], got {self.ratio}")


@dataclass
class PrefConfig:
    loss: str = "dpo"
    """``dpo`` (Flow-DPO on best-vs-worst pairs) or ``sft`` (reward-filtered flow matching)."""
    beta: float = 100.0
    """DPO: β of the implicit reward; SFT: weight of β·‖v_θ − v_base‖² (0 = plain filtered SFT)."""
    ref_update_step: int = 0
    """DPO: copy the policy into the reference every N optimizer steps (0 = offline: fixed base)."""
    top_k: int = 1
    """SFT: samples kept per group (the best ones)."""
    timesteps_per_sample: int = 1
    """Training σ drawn per kept sample (or pair) per epoch."""

    def __post_init__(self) -> None:
        _one_of(self.loss, PREF_LOSSES, "algo.pref.loss")
        _require(
            self.top_k >= 1 and self.timesteps_per_sample >= 1,
            "algo.pref.top_k and timesteps_per_sample must be ≥ 1",
        )


@dataclass
class PretrainConfig:
    """Flow-matching pretraining on ground-truth images (``algo.recipe=flow_pretrain``)."""

    steps_per_epoch: int = 50
    """Optimizer steps per epoch (an epoch is the unit of eval, logging and checkpoints)."""
    batch_size: int = 128
    """Images per optimizer step."""
    source: str = "shapes"
    """Where the images come from: ``shapes`` renders the ShapesEval metadata of each train row."""
    cond_dropout: float = 0.1
    """Share of prompts replaced by the empty prompt, so the model also learns the unconditional
    velocity that classifier-free guidance needs."""
    sigma_sampling: str = "logit_normal"
    """Training σ distribution: ``logit_normal`` (SD3, mean 0, std 1) or ``uniform``."""
    warmup_steps: int = 200
    """Linear learning-rate warm-up; then a cosine decay to ``min_lr_ratio``·lr at the last step."""
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        _one_of(self.source, ("shapes",), "algo.pretrain.source")
        _one_of(self.sigma_sampling, ("logit_normal", "uniform"), "algo.pretrain.sigma_sampling")
        _require(
            self.steps_per_epoch >= 1 and self.batch_size >= 1,
            "algo.pretrain.steps_per_epoch and algo.pretrain.batch_size must be ≥ 1",
        )
        _require(
            0 <= self.cond_dropout < 1,
            f"algo.pretrain.cond_dropout must be in [0, 1), got {self.cond_dropout}",
        )


@dataclass
class EMAConfig:
    enabled: bool = False
    """Keep an exponential moving average of the trainable weights, used for eval and saving."""
    decay: float = 0.9
    update_every: int = 8
    """Optimizer steps between EMA updates."""
    warmup: bool = False
    """Ramp the decay up as ``min(decay, (1 + step) / (10 + step))`` so the average forgets the
    starting weights quickly (training from scratch); off keeps the decay constant (fine-tuning)."""


@dataclass
class AlgoConfig:
    name: str = "grpo"
    """Algorithm name, for logs (``rlgen ls`` lists the options)."""
    recipe: str = "flow_rl"
    """Training loop: ``flow_rl`` (policy gradient on SDE rollouts) or ``flow_pref`` (DPO / SFT)."""
    group_size: int = 8
    """Samples per prompt (K); advantages are normalised within each prompt's group."""
    prompts_per_epoch: int = 2
    """Distinct prompts sampled per epoch; an epoch has prompts_per_epoch × group_size samples."""
    sample_batch_size: int = 8
    """Samples per rollout forward pass."""
    train_batch_size: int = 8
    """Samples per training forward pass; equal to sample_batch_size keeps the ratio exactly 1."""
    gradient_accumulation_steps: int = 1
    """Training micro-batches per optimizer step."""
    num_inner_epochs: int = 1
    """Passes over each epoch's samples."""
    lr: float = 3e-4
    lr_schedule: str = "constant"
    """``constant``, or ``cosine`` / ``linear``: ``lr`` for the ``lr_decay_start`` share of ``epochs``, then a
    decay to ``lr_min_ratio``·lr at the last epoch (a time limit that stops the run first cuts it short)."""
    lr_decay_start: float = 0.0
    lr_min_ratio: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    """Gradient-norm clip; ≤ 0 disables it."""
    clip_range: float = 1e-4
    """PPO clip ε on the importance ratio."""
    adv_clip_max: float = 5.0
    """Advantages are clamped to ±adv_clip_max."""
    global_std: bool = True
    """Normalise advantages by the whole batch's reward std instead of each group's."""
    std_estimator: str = "population"
    """Advantage std: ``population`` (/ n, Flow-GRPO) or ``unbiased`` (/ (n − 1), MixGRPO, DanceGRPO)."""
    adv_eps: float = 1e-4
    """Added to the advantage std before dividing (Flow-GRPO 1e-4, MixGRPO / DanceGRPO 1e-8)."""
    beta: float = 0.04
    """KL weight towards the reference (LoRA disabled); 0 skips the reference forward."""
    kl_form: str = "gaussian"
    """``gaussian`` = mean((μθ−μref)²)/(2s²), the KL of the two step Gaussians; ``upstream`` = Flow-GRPO's
    code, /(2σ_t²) with σ_t = s/sqrt(−dt) for flow_sde/dance (|dt| times weaker per step), s for cps."""
    cfg_grad: str = "both"
    """With CFG, the training forward back-propagates through ``both`` branches of u + g·(c − u), or only
    the ``conditional`` one (the unconditional prediction detached; same forward values)."""
    drop_zero_advantage: bool = False
    """Train only samples whose advantage is non-zero (Flow-GRPO's SD3 / Kontext / Wan scripts): the
    micro-batches per epoch stay the same and shrink, so each kept sample weighs more (docs/maths.md §4.5)."""
    objective: str = "grpo"
    """Per-step loss: ``grpo`` (clipped ratio) or ``grpo_guard`` (ratio normalisation, reweighting)."""
    window: WindowConfig = field(default_factory=WindowConfig)
    branch: str = "independent"
    """``shared_prefix``: one ODE prefix per prompt up to the window, then the group branches (Fast)."""
    flash: FlashConfig = field(default_factory=FlashConfig)
    shared_initial_noise: bool = False
    """Every sample of a group starts from the same noise (DanceGRPO)."""
    best_of_n: int = 0
    """Train only the k best and k worst samples of each group (DanceGRPO's best-of-N); 0 = all."""
    ema: EMAConfig = field(default_factory=EMAConfig)
    pref: PrefConfig = field(default_factory=PrefConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    token: TokenGRPOOptions = field(default_factory=TokenGRPOOptions)
    """Token-level GRPO (VLM recipes only)."""

    def __post_init__(self) -> None:
        _one_of(self.recipe, RECIPES, "algo.recipe")
        _one_of(self.kl_form, KL_FORMS, "algo.kl_form")
        _one_of(self.std_estimator, STD_ESTIMATORS, "algo.std_estimator")
        _require(self.adv_eps >= 0, f"algo.adv_eps must be ≥ 0, got {self.adv_eps}")
        _one_of(self.cfg_grad, CFG_GRADS, "algo.cfg_grad")
        _one_of(self.lr_schedule, LR_SCHEDULES, "algo.lr_schedule")
        in_range = 0 <= self.lr_decay_start < 1 and 0 <= self.lr_min_ratio <= 1
        got = f"got {self.lr_decay_start} and {self.lr_min_ratio}"
        _require(in_range, f"algo.lr_decay_start must be in [0, 1) and algo.lr_min_ratio in [0, 1], {got}")
        _one_of(self.objective, OBJECTIVES, "algo.objective")
        _one_of(self.branch, BRANCHES, "algo.branch")
        _require(
            self.branch == "independent" or self.window.kind in ("random_window", "sliding", "single"),
            "algo.branch=shared_prefix needs a window that starts after step 0 (random_window, sliding, single)",
        )
        _require(
            0 <= 2 * self.best_of_n <= self.group_size,
            f"algo.best_of_n={self.best_of_n}: 2·k must be ≤ algo.group_size ({self.group_size})",
        )
        _require(
            self.group_size >= 2, f"algo.group_size must be ≥ 2 to form advantages, got {self.group_size}"
        )
        total = self.prompts_per_epoch * self.group_size
        for key in ("sample_batch_size", "train_batch_size"):
            size = getattr(self, key)
            _require(
                size > 0 and total % size == 0,
                f"algo.prompts_per_epoch × algo.group_size = {total} must be divisible by algo.{key} ({size}); "
                f"set algo.{key} to a divisor of {total}",
            )
        micro = total // self.train_batch_size
        _require(
            micro % self.gradient_accumulation_steps == 0,
            f"{micro} training micro-batches per epoch are not divisible by "
            f"algo.gradient_accumulation_steps ({self.gradient_accumulation_steps})",
        )
        _require(self.clip_range > 0, f"algo.clip_range must be positive, got {self.clip_range}")
        _require(self.beta >= 0, f"algo.beta must be ≥ 0, got {self.beta}")


@dataclass
class RewardConfig:
    weights: dict[str, float] = field(default_factory=dict)
    """Reward mix {name: weight}; the final reward is Σ weight·score. Empty here on purpose: dicts merge,
    so a default entry would leak into every ``reward=`` option; the reward group fills it."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Per-reward constructor arguments: {name: {arg: value}}."""
    aggregation: str = "sum_then_normalize"
    """``sum_then_normalize`` (Flow-GRPO) or ``normalize_then_sum`` (MixGRPO's per-reward advantages)."""

    def __post_init__(self) -> None:
        _one_of(self.aggregation, ADV_AGGREGATIONS, "reward.aggregation")
        unknown = sorted(set(self.kwargs) - set(self.weights))
        _require(not unknown, f"reward.kwargs names rewards not in reward.weights: {unknown}")


def require_rewards(reward: RewardConfig) -> None:
    """Checked by the configs that score (the schema default is empty so groups do not merge into it)."""
    _require(
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


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "rlgen"
    mode: str = "offline"
    """online | offline (no network; ``wandb sync`` later) | disabled."""
    name: str | None = None

    def __post_init__(self) -> None:
        _one_of(self.mode, ("online", "offline", "disabled"), "logging.wandb.mode")


@dataclass
class LoggingConfig:
    tensorboard: bool = False
    """Also write TensorBoard scalars and image grids under run_dir/tensorboard."""
    wandb: WandbConfig = field(default_factory=WandbConfig)


LAUNCHERS = ("local", "accelerate", "deepspeed_zero2", "deepspeed_zero3", "fsdp", "multinode")
MIXED_PRECISION = ("no", "fp16", "bf16")


@dataclass
class LauncherConfig:
    name: str = "local"
    """How ONE run spreads over devices: ``local`` (this process), ``accelerate`` (DDP over N processes,
    gloo on CPU), ``deepspeed_zero2`` / ``deepspeed_zero3`` (DeepSpeed ZeRO through accelerate), ``fsdp``
    (PyTorch FSDP2 through accelerate), ``multinode`` (several machines). Not Hydra's hydra/launcher,
    which places sweep jobs."""
    num_processes: int = 1
    """Processes per machine (one per GPU)."""
    num_machines: int = 1
    machine_rank: int | None = None
    """This machine's rank; null reads MACHINE_RANK / NODE_RANK / SLURM_NODEID (else 0)."""
    main_process_ip: str | None = None
    """Rank-0 address; null reads MASTER_ADDR (else 127.0.0.1)."""
    main_process_port: int | None = None
    """Rank-0 port; null reads MASTER_PORT (else 29500)."""
    mixed_precision: str = "no"
    """accelerate's mixed precision for the launched workers."""
    config_file: str | None = None
    """Your own accelerate config (YAML) or DeepSpeed config (JSON), passed to ``accelerate launch`` as
    with ``accelerate launch --config_file``; with launcher=accelerate or multinode. The launcher.* values
    stay in charge: a process count (or machine, address, port, precision) the file sets differently
    stops the run with exit code 2, naming both."""

    def __post_init__(self) -> None:
        _one_of(self.name, LAUNCHERS, "launcher.name")
        _require(
            self.config_file is None or self.name in ("accelerate", "multinode"),
            f"launcher.config_file is passed to accelerate launch by launcher=accelerate or multinode, not "
            f"launcher={self.name}: add launcher=accelerate (and launcher.num_processes=N)",
        )
        _one_of(self.mixed_precision, MIXED_PRECISION, "launcher.mixed_precision")
        _require(
            self.num_processes >= 1 and self.num_machines >= 1,
            "launcher.num_processes and num_machines must be ≥ 1",
        )
        _require(
            self.name != "local" or self.num_processes * self.num_machines == 1,
            "launcher=local runs one process; use launcher=accelerate launcher.num_processes=N",
        )

    @property
    def world_size(self) -> int:
        return self.num_processes * self.num_machines


@dataclass
class TrainConfig:
    seed: int = 42
    epochs: int = 100
    """Sampling rounds; each is rollout → reward → advantages → update."""
    eval_every: int = 10
    """Epochs between evaluations (ODE sampling on the test prompts); 0 = never."""
    time_limit_minutes: float = 0.0
    """Stop after the first epoch that ends past this many minutes of training (then evaluate and save
    as after the last epoch); 0 = no limit."""
    eval_before: bool = False
    """Also evaluate before the first epoch (logged at step −1): the run ends with a before → after
    table per prompt tag (``before_after.txt``) and sample grid when the reward reports tags."""
    save_every: int = 10
    """Epochs between checkpoints; 0 = only at the end."""
    keep_last: int = 3
    """Checkpoints kept on disk (older ones are deleted)."""
    images_every: int = 5
    """Epochs between saving a grid of rollout images; 0 = never."""
    resume: str | None = None
    """``auto`` (latest checkpoint of run_dir) or a checkpoint directory."""
    device: str = "auto"
    """``auto`` (cuda if available), ``cpu``, ``cuda``, ``cuda:N``."""
    run_dir: str | None = "${hydra:runtime.output_dir}"
    """Where resolved.yaml, metrics.jsonl, images, plots and checkpoints go (Hydra's output directory; it
    is null only in ``--cfg job --resolve`` output, which prints the config without starting a run)."""
    progress: bool = True
    """Show rich progress bars."""
    model: ModelConfig = field(default_factory=lambda: ModelConfig(tiny=True))
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """metrics.jsonl is always written; TensorBoard and W&B on request."""
    fidelity: FidelityConfig | None = None
    """Experiments named after an upstream recipe: its source and every knob that matches or differs."""

    def __post_init__(self) -> None:
        require_rewards(self.reward)
        _require(self.epochs >= 1, f"epochs must be ≥ 1, got {self.epochs}")
        _require(min(self.eval_every, self.save_every, self.images_every) >= 0, "*_every must be ≥ 0")
        _require(self.keep_last >= 1, f"keep_last must be ≥ 1, got {self.keep_last}")
        _require(
            self.time_limit_minutes >= 0, f"time_limit_minutes must be ≥ 0, got {self.time_limit_minutes}"
        )
        _check_window(self.algo.window, self.model.num_steps)
        _require(
            self.sampler.kind != "ode",
            "sampler.kind=ode has no log-probability to train; use flow_sde, dance or cps",
        )
        world, algo = self.launcher.world_size, self.algo
        total = algo.prompts_per_epoch * algo.group_size
        _require(
            total % world == 0
            and (total // world) % algo.sample_batch_size == 0
            and (total // world) % algo.train_batch_size == 0,
            f"{total} samples per epoch over {world} processes must give every process a whole number of "
            f"sample/train batches (algo.sample_batch_size={algo.sample_batch_size}, "
            f"algo.train_batch_size={algo.train_batch_size} are per process)",
        )


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
        _require(
            self.images_per_prompt >= 1 and self.batch_size >= 1,
            "images_per_prompt and batch_size must be ≥ 1",
        )


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
    algo: AlgoConfig | None = None
    """Unused by eval: where a model's own training algorithm lands (the VLMs pick theirs)."""
    fidelity: FidelityConfig | None = None
    """Carried by experiments named after an upstream recipe (see ``TrainConfig.fidelity``)."""

    def __post_init__(self) -> None:
        require_rewards(self.reward)
        _require(
            not (self.ckpt and self.checkpoint and self.ckpt != self.checkpoint),
            f"ckpt={self.ckpt} and checkpoint={self.checkpoint} disagree; pass one of them",
        )
        self.checkpoint = self.checkpoint or self.ckpt
