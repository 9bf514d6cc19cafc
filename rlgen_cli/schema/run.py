"""Typed schemas of the flow-model configs: every field is declared, typed and documented here.

YAML files under ``conf/`` extend these schemas (Hydra ConfigStore, see ``schema/store.py``), so a
misspelt key or a wrong type fails at compose time with the key's full name. Checks that involve several
fields live in ``__post_init__``; ``OmegaConf.to_object`` runs them at task start.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, get_args

import yaml

from rlgen_cli.errors import UserError, require
from rlgen_cli.schema.algo import SamplerConfig
from rlgen_cli.schema.choices import (
    ENGINE_LAUNCHERS,
    AdvAggregation,
    Launcher,
    MixedPrecision,
    Recipe,
    SdeKind,
    WandbMode,
)
from rlgen_cli.schema.families import family_spec
from rlgen_cli.schema.fidelity import FidelityConfig
from rlgen_cli.schema.model import REAL_SIZE_VARIANTS as REAL_SIZE_VARIANTS
from rlgen_cli.schema.model import ExpertsConfig as ExpertsConfig
from rlgen_cli.schema.model import FlowModelConfig, ModelSection, require_family_schema
from rlgen_cli.schema.model import LoraConfig as LoraConfig
from rlgen_cli.schema.model import ModelConfig as ModelConfig
from rlgen_cli.schema.ranges import ANY, COUNT, DEVICE, NON_NEGATIVE, PORT
from rlgen_cli.schema.unread import require_defaults, shown


def tiny_flow_model() -> Any:
    """The model section a flow schema starts from; the model option's family schema replaces it."""
    return FlowModelConfig(tiny=True)


@dataclass
class RewardConfig:
    weights: Annotated[dict[str, float], ANY] = field(default_factory=dict)
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
    eval_num_prompts: Annotated[int, NON_NEGATIVE] = 8
    """Test prompts used by ``rlgen train``'s periodic evaluation (0 = all); ``rlgen eval`` reads
    ``max_prompts`` instead."""
    eval_images_per_prompt: Annotated[int, COUNT] = 1
    """Images drawn per test prompt at each of ``rlgen train``'s evaluations; ``rlgen eval`` and
    ``rlgen sample`` read ``images_per_prompt`` instead."""


@dataclass
class FlowDataConfig(DataConfig):
    """The flow recipes' prompts: what every run's data section holds, and how training samples them."""

    tag_repeats: Annotated[dict[str, int], NON_NEGATIVE] = field(default_factory=dict)
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


def read_launch_settings(spec: str) -> tuple[Path, str, dict[str, Any]]:
    """``launcher.config_file`` as read: its resolved path, its kind (JSON with ``distributed_type`` /
    ``compute_environment`` or YAML: ``accelerate``; any other JSON: ``deepspeed``) and its settings.

    Raises:
        UserError: The file is missing, unparsable or not a mapping.
    """
    path = Path(spec).expanduser()
    if not path.is_file():
        raise UserError(f"launcher.config_file={spec}: no such file")
    is_json = path.suffix.lower() == ".json"
    try:
        text = path.read_text(encoding="utf-8")
        settings = json.loads(text) if is_json else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise UserError(
            f"launcher.config_file={spec} is not readable {'JSON' if is_json else 'YAML'}: {err}"
        ) from err
    if not isinstance(settings, dict):
        raise UserError(
            f"launcher.config_file={spec} must hold a mapping of settings, not {type(settings).__name__}"
        )
    accelerate = not is_json or {"distributed_type", "compute_environment"} & settings.keys()
    return path.resolve(), "accelerate" if accelerate else "deepspeed", settings


def launch_file_engine(kind: str, settings: dict[str, Any]) -> str | None:
    """The engine a launch file turns on: ``deepspeed`` (a DeepSpeed config, or an accelerate config with
    ``distributed_type: DEEPSPEED``), ``fsdp`` (``distributed_type: FSDP``), else None (DDP, CPU)."""
    if kind == "deepspeed":
        return "deepspeed"
    return {"DEEPSPEED": "deepspeed", "FSDP": "fsdp"}.get(str(settings.get("distributed_type", "")).upper())


@dataclass
class LauncherConfig:
    name: Annotated[str, Launcher] = "local"
    """How ONE run spreads over devices: ``local`` (this process), ``accelerate`` (DDP over N processes,
    gloo on CPU), ``deepspeed_zero2`` / ``deepspeed_zero3`` (DeepSpeed ZeRO through accelerate), ``fsdp``
    (PyTorch FSDP2 through accelerate), ``multinode`` (several machines). Not Hydra's hydra/launcher,
    which places sweep jobs."""
    num_processes: Annotated[int, COUNT] = 1
    """Processes per machine (one per GPU)."""
    num_machines: Annotated[int, COUNT] = 1
    """Machines of one run (launcher=multinode); its processes: num_processes × num_machines."""
    machine_rank: Annotated[int | None, NON_NEGATIVE] = None
    """This machine's rank; null reads MACHINE_RANK / NODE_RANK / SLURM_NODEID (else 0)."""
    main_process_ip: str | None = None
    """Rank-0 address; null reads MASTER_ADDR (else 127.0.0.1)."""
    main_process_port: Annotated[int | None, PORT] = None
    """Rank-0 port; null reads MASTER_PORT (else 29500)."""
    mixed_precision: Annotated[str, MixedPrecision] = "fp32"
    """Mixed precision of the workers ``accelerate launch`` starts: ``fp32`` (none), ``fp16`` or ``bf16``:
    accelerate's autocast of the model it wraps (DDP over several processes, DeepSpeed, FSDP). Refused
    where it would do nothing: launcher=local, and one process without an engine (launcher=accelerate
    or multinode with one process in all trains unwrapped); fp16 also on CPUs, which have no fp16
    autocast. Under DDP rlgen scales the loss of fp16 itself. ``model.dtype`` sets the compute dtype of
    any launcher."""
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
        require(
            self.name != "local" or self.mixed_precision == "fp32",
            f"launcher.mixed_precision={self.mixed_precision} is accelerate's autocast of the workers it "
            "launches, and launcher=local trains in this process without accelerate launch, so it would do "
            "nothing. For 16-bit compute here set model.dtype (e.g. model.dtype=bfloat16: rlgen autocasts the "
            "transformer) and keep launcher.mixed_precision=fp32; or launch several processes through "
            f"accelerate (launcher=accelerate launcher.num_processes=2 launcher.mixed_precision="
            f"{self.mixed_precision})",
        )
        require(
            self.name == "local"
            or self.world_size > 1
            or self.mixed_precision == "fp32"
            or self._engine(strict=True) is not None,
            f"launcher.mixed_precision={self.mixed_precision} is accelerate's autocast of the model it wraps "
            "(DDP over several processes, or an engine: deepspeed_zero2, deepspeed_zero3, fsdp), and "
            f"launcher={self.name} with one process in all trains it unwrapped, so it would do nothing. For "
            "16-bit compute in one process set "
            "model.dtype (e.g. model.dtype=bfloat16: rlgen autocasts the transformer) and keep "
            "launcher.mixed_precision=fp32; or launch several processes (launcher.num_processes=2)",
        )

    @property
    def world_size(self) -> int:
        return self.num_processes * self.num_machines

    @property
    def engine(self) -> str | None:
        """What reduces the gradients inside itself: ``deepspeed`` or ``fsdp`` (those launchers, or a
        ``config_file`` naming one), else None (DDP or one process: rlgen's hands)."""
        return self._engine(strict=False)

    def _engine(self, strict: bool) -> str | None:
        """:attr:`engine`; a ``config_file`` that cannot be read raises with ``strict``, else counts as no
        engine (the launch reads it before any worker starts, and names what is wrong)."""
        if self.name in ENGINE_LAUNCHERS:
            return "fsdp" if self.name == "fsdp" else "deepspeed"
        if not self.config_file:
            return None
        try:
            _, kind, settings = read_launch_settings(self.config_file)
        except UserError:
            if strict:
                raise
            return None
        return launch_file_engine(kind, settings)

    @property
    def reduces_exactly(self) -> bool:
        """``exact_reduction``, with null resolved: on unless an engine reduces the gradients (an engine
        launcher, or a ``config_file`` naming DeepSpeed or FSDP)."""
        return self.engine is None if self.exact_reduction is None else self.exact_reduction

    @property
    def shards_weights(self) -> bool:
        """Each process holds a shard of the weights (ZeRO-3, FSDP; ZeRO-2 shards optimizer state only)."""
        return self.name in ("deepspeed_zero3", "fsdp")

    @property
    def accelerate_mixed_precision(self) -> str:
        """``mixed_precision`` in accelerate's words (``no`` | ``fp16`` | ``bf16``)."""
        return "no" if self.mixed_precision == "fp32" else self.mixed_precision


def noise_level(sampler: SamplerConfig, model: FlowModelConfig) -> float:
    """The SDE noise level a run samples with: ``sampler.noise_level``, else the family's default."""
    return model.noise_level if sampler.noise_level is None else sampler.noise_level


def check_noise_level(sampler: SamplerConfig, model: FlowModelConfig) -> None:
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
    seed: Annotated[int, NON_NEGATIVE] = 42
    """The run's random streams (torch's global seed, each sample's initial and step noise, every epoch's
    draws) derive from it."""
    epochs: Annotated[int, COUNT] = 100
    """Sampling rounds; each is rollout → reward → advantages → update."""
    eval_every: Annotated[int, NON_NEGATIVE] = 10
    """Epochs between evaluations (ODE sampling on the test prompts); 0 = never."""
    save_every: Annotated[int, NON_NEGATIVE] = 10
    """Epochs between checkpoints; 0 = only at the end."""
    keep_last: Annotated[int, COUNT] = 3
    """Checkpoints kept on disk (older ones are deleted)."""
    resume: str | None = None
    """``auto`` (latest intact checkpoint of run_dir) or a checkpoint directory."""
    resume_unverified: bool = False
    """Resume from a checkpoint without ``manifest.json`` (its files cannot be checked: damaged, or saved by
    an rlgen before manifests); ``resume=auto`` skips such checkpoints unless this is true."""
    resume_changes: list[str] = field(default_factory=list)
    """Settings (or sections) this resume changes on purpose, e.g. ``[reward.kwargs.remote]``. A resume is
    otherwise refused where its config differs from the checkpoint's in what training computes; the
    optimizer's rate and decay, the LoRA, the EMA, the recipe and the model family never change on resume."""
    device: Annotated[str, DEVICE] = "auto"
    """``auto`` (cuda if available), ``cpu``, ``cuda``, ``cuda:N``."""
    run_dir: str | None = "${hydra:runtime.output_dir}"
    """Where resolved.yaml, metrics.jsonl, images, plots and checkpoints go (Hydra's output directory; it
    is null only in ``--cfg job --resolve`` output, which prints the config without starting a run)."""
    progress: bool = True
    """Show rich progress bars."""
    model: ModelSection = field(default_factory=ModelSection)
    """The model, its keys those of its family (``schema/model.py``): the model option picks them."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """metrics.jsonl is always written; TensorBoard and W&B on request."""
    fidelity: FidelityConfig | None = None
    """Experiments named after an upstream recipe: its source and every knob that matches or differs."""

    def __post_init__(self) -> None:
        require_family_schema(self.model)
        require_rewards(self.reward)

    def text_policy_dtype(self) -> str:
        """``model.dtype`` of the policy whose tokens ``check.text_tolerance`` bounds (R3: its text policy's)."""
        model = self.model
        assert isinstance(model, ModelConfig), "a unified family's schema names its text policy's dtype"
        return model.dtype


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


def require_sde_sampler(sampler: SamplerConfig, model: FlowModelConfig) -> None:
    """A recipe that trains on rollout log-probabilities needs a stochastic step."""
    require(
        sampler.kind != "ode", "sampler.kind=ode has no log-probability to train; use flow_sde, dance or cps"
    )
    check_noise_level(sampler, model)


def require_step_noise(sampler: SamplerConfig, model: FlowModelConfig) -> None:
    """A policy gradient on the steps' log-probabilities needs steps that draw noise."""
    level = noise_level(sampler, model)
    require(
        level > 0,
        f"sampler.kind={sampler.kind} at noise level {level} (sampler.noise_level, else model.noise_level) draws "
        "every step deterministically: no log-probability to train and nothing trains; set a noise level > 0 "
        "(flow_sde 0.7, cps 0.8)",
    )


@dataclass
class SampleConfig:
    seed: Annotated[int, NON_NEGATIVE] = 0
    device: Annotated[str, DEVICE] = "auto"
    run_dir: str | None = "${hydra:runtime.output_dir}"
    prompts: list[str] = field(default_factory=list)
    """Prompts to draw (alternatively ``prompts_file``; with neither, ``data.test``)."""
    prompts_file: str | None = None
    edit_set: bool = False
    """Build an editing set from a GenEval-style prompts_file: sources from ``source_prompt`` (or
    ``prompt``), written with their metadata to edit_set.jsonl."""
    checkpoint: str | None = None
    """A checkpoint directory from ``rlgen train``; its config rebuilds the model unless overridden."""
    images_per_prompt: Annotated[int, COUNT] = 1
    batch_size: Annotated[int, COUNT] = 8
    num_steps: Annotated[int | None, COUNT] = None
    """Denoising steps; null = model.eval_num_steps."""
    sampler: SamplerConfig = field(default_factory=lambda: SamplerConfig(kind="ode"))
    progress: bool = True
    model: FlowModelConfig = field(default_factory=tiny_flow_model)
    data: DataConfig = field(default_factory=DataConfig)
    """``data.test`` is drawn when neither ``prompts`` nor ``prompts_file`` is given; a model picks its own
    (editing models: rows with source images)."""

    def __post_init__(self) -> None:
        require_family_schema(self.model)
        check_noise_level(self.sampler, self.model)
        require_one_prompt_source(self)
        require_read_sampler_settings(self.sampler)


def require_one_prompt_source(cfg: SampleConfig) -> None:
    """``prompts`` and ``prompts_file`` exclude each other, and ``edit_set`` builds its set from rows of a
    file: either would otherwise silently draw something else than what was given."""
    require(
        not (cfg.prompts and cfg.prompts_file),
        f"prompts=[…] and prompts_file={cfg.prompts_file} both name the prompts to draw: pass one of them",
    )
    require(
        not (cfg.edit_set and cfg.prompts),
        "edit_set=true builds an editing set from the rows of a GenEval-style prompts file (each row's "
        "source_prompt or prompt, and its metadata), and prompts=[…] has no rows: pass "
        "prompts_file=FILE.jsonl instead of prompts=",
    )


def require_read_sampler_settings(sampler: SamplerConfig) -> None:
    """``rlgen sample`` computes no log-probabilities, and its noise level acts only on a stochastic step."""
    require(
        sampler.noise_level is None or sampler.kind in get_args(SdeKind),
        f"sampler.noise_level={sampler.noise_level} sets the step noise of a stochastic sampler, and "
        f"sampler.kind={sampler.kind} draws without it: set sampler.kind=flow_sde (or dance, cps) to "
        "sample with noise, or drop sampler.noise_level",
    )
    require_defaults(
        sampler,
        SamplerConfig,
        ("logprob_reduce", "logprob_form"),
        lambda key, value, default: (
            f"sampler.{key}={shown(value)} shapes the log-probabilities training computes, and rlgen sample "
            f"computes none: drop sampler.{key} (back to its default, {shown(default)})"
        ),
    )


@dataclass
class EvalConfig:
    seed: Annotated[int, NON_NEGATIVE] = 0
    device: Annotated[str, DEVICE] = "auto"
    run_dir: str | None = "${hydra:runtime.output_dir}"
    checkpoint: str | None = None
    """Checkpoint to evaluate; null evaluates the base model."""
    ckpt: str | None = None
    """Short alias of ``checkpoint``."""
    images_per_prompt: Annotated[int, COUNT] = 1
    batch_size: Annotated[int, COUNT] = 8
    num_steps: Annotated[int | None, COUNT] = None
    """Denoising steps; null = model.eval_num_steps."""
    max_prompts: Annotated[int, NON_NEGATIVE] = 0
    """Evaluate only the first N test prompts (0 = all)."""
    save_images: bool = True
    progress: bool = True
    model: ModelSection = field(default_factory=tiny_flow_model)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algo: Any = None
    """Unused by eval: where a model's own training algorithm lands (the VLMs pick theirs); each recipe's
    eval schema types it (``schema/recipes.py``)."""
    fidelity: FidelityConfig | None = None
    """Carried by experiments named after an upstream recipe (see ``RunConfig.fidelity``)."""

    def __post_init__(self) -> None:
        require_family_schema(self.model)
        require_rewards(self.reward)
        require(
            not (self.ckpt and self.checkpoint and self.ckpt != self.checkpoint),
            f"ckpt={self.ckpt} and checkpoint={self.checkpoint} disagree; pass one of them",
        )
        self.checkpoint = self.checkpoint or self.ckpt
        kind = family_spec(self.model.family).kind
        if kind == "vlm":
            refuse_image_settings(self)
        elif kind == "unified":
            refuse_r3_sampling_settings(self)


def refuse_r3_sampling_settings(cfg: EvalConfig) -> None:
    """A unified policy's evaluation (R3) draws one image per prompt with its own step counts and
    batching: ``rlgen eval``'s flow sampling settings would do nothing."""
    refuse_eval_settings(
        cfg,
        ("images_per_prompt", "num_steps", "batch_size"),
        "R3's evaluation draws one image per prompt in r3.num_timesteps_gen − 1 denoising steps (edits: "
        "r3.num_timesteps_edit − 1), then r3.eval_rounds reflect → refine rounds",
    )


def refuse_image_settings(cfg: EvalConfig) -> None:
    """A VLM's evaluation answers each test question once and draws no images: the image settings of
    ``rlgen eval`` would do nothing."""
    refuse_eval_settings(
        cfg,
        ("images_per_prompt", "num_steps", "save_images"),
        "a VLM's evaluation answers each test question once with near-greedy decoding (model.vlm.eval_*) "
        "and draws no images",
    )


def refuse_eval_settings(cfg: EvalConfig, keys: tuple[str, ...], why: str) -> None:
    """``keys`` of ``rlgen eval`` held at their defaults for this model's kind, which ``why`` explains."""
    require_defaults(
        cfg,
        EvalConfig,
        keys,
        lambda key, value, default: (
            f"{key}={shown(value)} does nothing for model.family={cfg.model.family}: {why}. Drop {key} "
            f"(back to its default, {shown(default)})"
        ),
    )
