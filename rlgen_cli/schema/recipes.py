"""One schema per training recipe: the shared :class:`RunConfig` plus exactly the sections that recipe reads.

``recipe`` is not a key anyone sets: the ``algo`` option (or a unified ``model``) overrides the ``recipe``
config group (``- override /recipe@_global_: flow_pref``), which puts that recipe's schema at the root
(``schema/store.py``). So ``algo=dpo`` composes no ``algo.window`` and ``model=tiny_r3`` no ``algo`` or
``sampler``; an override of a key the recipe never reads stops at compose time with exit code 2.
Every reader dispatches on ``cfg.recipe``. ``tests/schema/test_composed_keys.py`` checks both ways:
every composed key is declared here, and every key declared here is read by its recipe's code.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any

from rlgen_cli.errors import require
from rlgen_cli.schema.algo import (
    FlowForwardAlgoConfig,
    FlowGrpoAlgoConfig,
    FlowPrefAlgoConfig,
    FlowPretrainAlgoConfig,
    SamplerConfig,
    TokenAlgoConfig,
    VlmSftAlgoConfig,
    require_whole_rollout_pieces,
)
from rlgen_cli.schema.check import CheckSection
from rlgen_cli.schema.choices import EvalReportKind, LrScheduleClock, TimeLimitCounts
from rlgen_cli.schema.hacking_guard import GuardConfig, check_guard
from rlgen_cli.schema.model import FlowModelConfig, VlmModelConfig, model_schema
from rlgen_cli.schema.r3 import R3Config, R3TrainConfig, typed_policy
from rlgen_cli.schema.ranges import NON_NEGATIVE
from rlgen_cli.schema.run import (
    AdvantageRewardConfig,
    EvalConfig,
    FlowDataConfig,
    RunConfig,
    check_noise_level,
    require_sde_sampler,
    require_step_noise,
    require_whole_batches,
    tiny_flow_model,
)
from rlgen_cli.schema.variants import section_variants
from rlgen_cli.schema.vlm import refuse_unread_settings

__all__ = [
    "CHECK_SCHEMAS",
    "EVAL_SCHEMAS",
    "FREE_FORM",
    "TRAIN_SCHEMAS",
    "FlowRunConfig",
    "declared_paths",
    "declares",
    "recipes_declaring",
]


@dataclass
class FlowRunConfig(RunConfig):
    """What the shared flow loop (``recipes/flow_run.py``) reads on top of every run's keys."""

    model: FlowModelConfig = field(default_factory=tiny_flow_model)
    """A flow model, its keys those of its family (``schema/model.py``): the model option picks them."""
    data: FlowDataConfig = field(default_factory=FlowDataConfig)

    time_limit_minutes: Annotated[float, NON_NEGATIVE] = 0.0
    """Stop after the first epoch that ends past this many minutes (``time_limit_counts`` says which
    seconds count; then evaluate and save as after the last epoch); 0 = no limit. The minutes count from
    the first epoch of a fresh run and carry over a resume (the clock travels in the checkpoint's
    counters)."""
    time_limit_counts: Annotated[str, TimeLimitCounts] = "wall"
    """What ``time_limit_minutes`` counts: ``wall`` (every second from the first epoch on, evaluations and
    checkpoints included: what a user waits) or ``training`` (the epochs' seconds alone: equal training
    budgets for runs that evaluate differently, as benchmarks compare them)."""
    lr_schedule_clock: Annotated[str, LrScheduleClock] = "epochs"
    """Where the run is in ``algo.lr_schedule``: ``epochs`` (the epoch count alone: bit-reproducible, but
    a time limit that stops the run early cuts the decay short) or ``time_or_epochs`` (the further along
    of the epoch count and the share of ``time_limit_minutes`` used, so the decay ends where the limit
    stops the run; not reproducible across machines once the time share takes over)."""
    eval_before: bool = False
    """Also evaluate before the first epoch (logged at step 0): the run ends with a before → after table
    (``before_after.txt``: the reward, each reward of the mix and its details; per prompt tag when the
    reward reports tags) and the sample grid before / after (``images/before_after.png``); needs
    ``eval_every`` > 0. A resumed run reads its evaluation before training back from ``metrics.jsonl``
    (the table, without the grid)."""
    eval_heldout: str | None = None
    """A second test split (e.g. ``builtin:shapes_heldout.jsonl``: combinations never trained on),
    evaluated like ``data.test`` but only after the last epoch (``eval_heldout/…`` metrics) and, with
    ``eval_before``, before the first, then reported as the ``unseen`` row of the before → after table;
    needs ``eval_every`` > 0; null = off."""
    eval_report: Annotated[str, EvalReportKind] = "none"
    """What the run writes from its evaluations at the end besides ``eval_before``'s table and grid:
    ``none``, or ``shapes`` (ShapesEval's ``shapes_curves.png``, a per-tag table, captioned grids)."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """The reward-hacking guard: held-out rewards scored at every evaluation, and what to do when the
    trained reward rises while they fall (docs/guard.md); no ``guard.monitors`` = off."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_guard(self)
        require_evaluations(self)


def require_guard_logprobs(objective: str, sampler: SamplerConfig) -> None:
    """GRPO-Guard's normalised ratio is exp(mean(z·Δμ)), which only the per-element mean of the Gaussian
    log-probability gives; a sum (about N× off in log space) or CPS's upstream form would clip wrongly."""
    if objective != "grpo_guard":
        return
    require(
        sampler.logprob_reduce == "mean" and sampler.logprob_form == "gaussian",
        f"algo.objective=grpo_guard normalises its ratio from the per-element mean of the Gaussian "
        f"log-probability, and sampler.logprob_reduce={sampler.logprob_reduce} "
        f"sampler.logprob_form={sampler.logprob_form} gives another: set sampler.logprob_reduce=mean and "
        "sampler.logprob_form=gaussian",
    )


def require_evaluations(cfg: FlowRunConfig) -> None:
    """``eval_before`` and ``eval_heldout`` ask for evaluations, which ``eval_every=0`` turns off.

    Raises:
        UserError: Naming the settings that would do nothing, and both fixes.
    """
    if cfg.eval_every:
        return
    asked = [
        key for key, value in (("eval_before", cfg.eval_before), ("eval_heldout", cfg.eval_heldout)) if value
    ]
    require(
        not asked,
        f"eval_every=0 never evaluates, so {' and '.join(f'{k}={getattr(cfg, k)}' for k in asked)} would do "
        f"nothing: set eval_every=N, or {' '.join(f'{k}={NOTHING[k]}' for k in asked)}",
    )


NOTHING = {"eval_before": "false", "eval_heldout": "null"}
"""Each evaluation setting's value that asks for nothing."""


@dataclass
class FlowRolloutRunConfig(FlowRunConfig):
    """A flow run that samples every epoch (GRPO, preference, forward): it can save what it sampled."""

    images_every: Annotated[int, NON_NEGATIVE] = 10
    """Epochs between saving a grid of the epoch's samples (DPO: the reference's); 0 = never."""


@dataclass
class FlowGrpoTrainConfig(FlowRolloutRunConfig):
    recipe: str = "flow_grpo"
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    reward: AdvantageRewardConfig = field(default_factory=AdvantageRewardConfig)
    algo: FlowGrpoAlgoConfig = field(default_factory=FlowGrpoAlgoConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.algo.window.check_fits(self.model.num_steps)
        require_sde_sampler(self.sampler, self.model)
        require_step_noise(self.sampler, self.model)
        require_guard_logprobs(self.algo.objective, self.sampler)
        require_whole_batches(self)
        self.algo.require_process_split(self.launcher.world_size)
        self.algo.require_rank_symmetric(self.launcher.world_size > 1 or self.launcher.shards_weights)
        self.algo.require_process_invariance(self.launcher.world_size, self.launcher.exact_reduction)
        self.algo.gardo.require_valid(self.algo.kl_weight, list(self.reward.weights))


@dataclass
class FlowPrefTrainConfig(FlowRolloutRunConfig):
    recipe: str = "flow_pref"
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    algo: FlowPrefAlgoConfig = field(default_factory=FlowPrefAlgoConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        require_sde_sampler(self.sampler, self.model)
        require_whole_batches(self)


@dataclass
class FlowPretrainTrainConfig(FlowRunConfig):
    recipe: str = "flow_pretrain"
    lr_schedule_clock: Annotated[str, LrScheduleClock] = "epochs"
    """Must stay ``epochs`` here: pretraining's learning rate (``algo.pretrain.warmup_steps``, then a cosine
    to ``algo.pretrain.min_lr_ratio``) follows the optimizer step over ``epochs`` ×
    ``algo.pretrain.steps_per_epoch``, never the time limit; ``time_or_epochs`` is refused."""
    algo: FlowPretrainAlgoConfig = field(default_factory=FlowPretrainAlgoConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.lr_schedule_clock == "epochs",
            f"lr_schedule_clock={self.lr_schedule_clock} is not read by recipe=flow_pretrain: its learning "
            "rate follows the optimizer step over epochs × algo.pretrain.steps_per_epoch (warm-up, then a "
            "cosine decay), never the time limit's share. Drop the override (lr_schedule_clock=epochs); to "
            "end the decay within a time budget, set epochs to what fits in it",
        )
        require_pretrain_split(self)


def require_pretrain_split(cfg: FlowPretrainTrainConfig) -> None:
    """What pretraining's process count must divide (instead of :func:`require_whole_batches`: it rolls
    out no epoch of samples): each optimizer step's images, split evenly; and the shared loop's prompt
    sampler, which deals its (fixed) algo.prompts_per_epoch × algo.group_size over the processes."""
    world, algo = cfg.launcher.world_size, cfg.algo
    require(
        algo.pretrain.batch_size % world == 0,
        f"algo.pretrain.batch_size={algo.pretrain.batch_size} must be divisible by the {world} processes "
        "(launcher.num_processes × launcher.num_machines): each trains an equal share of every step's images",
    )
    dealt = algo.prompts_per_epoch * algo.group_size
    require(
        dealt % world == 0,
        f"recipe=flow_pretrain runs on a process count that divides {dealt}, not {world}: the shared loop's "
        f"prompt sampler deals algo.prompts_per_epoch × algo.group_size = {dealt} (fixed for this recipe) "
        "over the processes. Use launcher.num_processes × launcher.num_machines dividing it",
    )


@dataclass
class FlowForwardTrainConfig(FlowRolloutRunConfig):
    recipe: str = "flow_forward"
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """The rollout step of ``algo.forward.solver=sde`` (its ``kind`` and ``noise_level``; no
    log-probabilities are trained, so ``logprob_*`` shape nothing). ``dpm2`` and ``euler`` solve the ODE and
    never take it: with them, a sampler other than ``sampler=flow_sde`` as composed is refused."""
    reward: AdvantageRewardConfig = field(default_factory=AdvantageRewardConfig)
    algo: FlowForwardAlgoConfig = field(default_factory=FlowForwardAlgoConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        require_whole_batches(self)
        require_forward_sampler(self)
        self.algo.require_process_split(self.launcher.world_size)
        self.algo.gardo.require_valid(self.algo.kl_weight, list(self.reward.weights), self.algo.forward.loss)


def require_forward_sampler(cfg: FlowForwardTrainConfig) -> None:
    """The ``sampler`` section does something in ``recipe=flow_forward`` only as the rollout step of
    ``algo.forward.solver=sde``: with the ODE solvers any setting of it is refused, and so is
    ``logprob_reduce=sum``, which shapes log-probabilities the recipe never computes."""
    solver, sampler, default = cfg.algo.forward.solver, cfg.sampler, SamplerConfig()
    require(
        sampler.logprob_reduce == default.logprob_reduce,
        f"sampler.logprob_reduce={sampler.logprob_reduce} reduces SDE log-probabilities, which "
        "recipe=flow_forward never computes (it trains on forward-noised clean samples): drop the override "
        f"(sampler.logprob_reduce={default.logprob_reduce})",
    )
    if solver == "sde":
        check_noise_level(sampler, cfg.model)
        return
    changed = [
        f"sampler.{f.name}={getattr(sampler, f.name)}"
        for f in dataclasses.fields(SamplerConfig)
        if getattr(sampler, f.name) != getattr(default, f.name)
    ]
    require(
        not changed,
        f"{', '.join(changed)}: algo.forward.solver={solver} rolls out the deterministic ODE and never takes "
        "the sampler's SDE step, so these settings do nothing. Pass algo.forward.solver=sde to roll out with "
        "that step, or drop them (sampler=flow_sde, no sampler.* overrides)",
    )


def tiny_vlm_model() -> VlmModelConfig:
    """The model section a VLM schema starts from; the model option's family schema replaces it."""
    return VlmModelConfig(family="qwen2_vl", tiny=True)


@dataclass
class VlmRlTrainConfig(RunConfig):
    recipe: str = "vlm_rl"
    model: VlmModelConfig = field(default_factory=tiny_vlm_model)
    """A vision-language model, its keys those of its family (``schema/model.py``)."""
    reward: AdvantageRewardConfig = field(default_factory=AdvantageRewardConfig)
    algo: TokenAlgoConfig = field(default_factory=TokenAlgoConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_unread_settings(self)
        require_whole_batches(self)
        self.algo.require_process_split(self.launcher.world_size)
        # without exact reduction a step too small for whole rollout batches is dealt in micro-batches
        if self.launcher.reduces_exactly:
            require_whole_rollout_pieces(
                self.algo,
                self.launcher.world_size,
                otherwise=", or pass launcher.exact_reduction=false (each process then samples its training "
                "micro-batches in its own rollout batches: the same run statistically, not bit for bit)",
            )


@dataclass
class VlmSftTrainConfig(RunConfig):
    recipe: str = "vlm_sft"
    model: VlmModelConfig = field(default_factory=tiny_vlm_model)
    """A vision-language model, its keys those of its family (``schema/model.py``)."""
    algo: VlmSftAlgoConfig = field(default_factory=VlmSftAlgoConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_unread_settings(self)
        self.algo.require_process_split(self.launcher.world_size)


TRAIN_SCHEMAS: dict[str, type] = {
    "flow_grpo": FlowGrpoTrainConfig,
    "flow_pref": FlowPrefTrainConfig,
    "flow_pretrain": FlowPretrainTrainConfig,
    "flow_forward": FlowForwardTrainConfig,
    "vlm_rl": VlmRlTrainConfig,
    "vlm_sft": VlmSftTrainConfig,
    "r3": R3TrainConfig,
}
"""``recipe`` → the schema of ``rlgen train`` with that recipe (the keys its run composes)."""


def _named(cls: type) -> type:
    cls.__module__ = __name__  # found where it is built (pickling, type hints, error messages)
    return cls


def _check_schema(recipe: str, train: type) -> type:
    """``rlgen check-onpolicy``: the recipe's training schema plus ``check``."""
    name = f"{train.__name__.removesuffix('TrainConfig')}CheckOnPolicyConfig"
    return _named(dataclasses.make_dataclass(name, [], bases=(CheckSection, train)))


def _eval_schema(recipe: str, train: type) -> type:
    """``rlgen eval``: its own keys, with the recipe's ``model`` and ``algo`` (or ``r3``) slots typed as
    training types them."""
    model = {f.name: f for f in dataclasses.fields(train)}["model"]
    fields: list[Any] = [
        ("recipe", str, field(default=recipe)),
        ("model", typing.get_type_hints(train)["model"], field(default_factory=model.default_factory)),
    ]
    slots = {f.name: f.type for f in dataclasses.fields(train)}
    if "algo" in slots:
        algo_type = {f.name: f for f in dataclasses.fields(train)}["algo"].default_factory
        assert isinstance(algo_type, type), f"{train.__name__}.algo's default_factory is its schema class"
        fields.append(("algo", algo_type | None, field(default=None)))
    if "r3" in slots:
        fields.append(("r3", R3Config, field(default_factory=R3Config)))
    name = f"{train.__name__.removesuffix('TrainConfig')}EvalConfig"
    return _named(dataclasses.make_dataclass(name, fields, bases=(EvalConfig,)))


CHECK_SCHEMAS = {recipe: _check_schema(recipe, cls) for recipe, cls in TRAIN_SCHEMAS.items()}
EVAL_SCHEMAS = {recipe: _eval_schema(recipe, cls) for recipe, cls in TRAIN_SCHEMAS.items()}


FREE_FORM = frozenset(
    {"reward.weights", "reward.kwargs", "guard.monitors", "guard.kwargs", "fidelity", "r3.offline.data"}
)
"""Maps whose keys are data (reward names, dataset names, provenance records), not settings."""


def structured_run(saved: Any) -> Any:
    """A saved run config (``resolved.yaml``) under its schemas: the recipe's, its ``model`` section under its
    family's and R3's ``r3.policy`` under its family's policy schema, as composition typed them (the
    recipe's own schema declares only what every family shares)."""
    from omegaconf import OmegaConf

    family = saved.model.family
    sections: dict[str, Any] = {"model": OmegaConf.structured(model_schema(family))}
    if "r3" in saved and "policy" in saved.r3:
        sections["r3"] = {"policy": typed_policy(family, saved.r3.policy)}
    return OmegaConf.merge(OmegaConf.structured(TRAIN_SCHEMAS[saved.recipe]), sections, saved)


def declared_paths(schema: type, prefix: str = "") -> set[str]:
    """Every leaf path ``schema`` declares (sections followed through their dataclass type, a section whose
    keys an option picks, the model's or R3's policy, through every schema it can take; the maps of
    :data:`FREE_FORM` count as leaves)."""
    hints = typing.get_type_hints(schema)
    out = set()
    for f in dataclasses.fields(schema):
        path = f"{prefix}{f.name}"
        inner = [t for t in (typing.get_args(hints[f.name]) or (hints[f.name],)) if t is not type(None)]
        section = inner[0] if len(inner) == 1 else None
        if path not in FREE_FORM and isinstance(section, type) and dataclasses.is_dataclass(section):
            for variant in section_variants(section):
                out |= declared_paths(variant, path + ".")
        else:
            out.add(path)
    return out


def declares(schema: type, key: str) -> bool:
    """Whether ``key`` (a leaf, a section, or an entry of a free-form map) is a setting of ``schema``."""
    return any(
        key == path or path.startswith(key + ".") or (path in FREE_FORM and key.startswith(path + "."))
        for path in declared_paths(schema)
    )


def recipes_declaring(key: str) -> list[str]:
    """The training recipes that have the setting ``key``."""
    return [recipe for recipe, schema in TRAIN_SCHEMAS.items() if declares(schema, key)]
