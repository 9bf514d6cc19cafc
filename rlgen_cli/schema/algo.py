"""Typed schemas of the ``sampler`` and ``algo`` sections of the flow and VLM training configs.

Single-field rules live in the annotations (choices, ``schema/choices.py``) and in ``schema/ranges.py``
(numbers); ``__post_init__`` holds only the checks that involve several fields.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Annotated, Any

from rlgen_cli.errors import require
from rlgen_cli.schema.choices import (
    Branch,
    CfgGrad,
    KlForm,
    LogprobForm,
    LogprobReduce,
    LrSchedule,
    Objective,
    PrefLoss,
    PretrainSource,
    RewardScoringMode,
    ShuffleSamples,
    SigmaSampling,
    SlidingStrategy,
    StdEstimator,
    StepKind,
    WindowKind,
)
from rlgen_cli.schema.forward import ForwardConfig
from rlgen_cli.schema.gardo import GardoConfig
from rlgen_cli.schema.ranges import (
    ANY,
    BELOW_ONE,
    COUNT,
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    at_least,
)
from rlgen_cli.schema.unread import require_defaults
from rlgen_cli.schema.vlm import TokenGRPOOptions, TokenSftOptions

log = logging.getLogger(__name__)

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
"""Which ``algo.window`` options each window kind reads: the keyword options of ``sde.window.plan_window``."""

SLIDING_STRATEGY_OPTIONS = {
    "progressive": ("stride", "shift_every", "roll_back", "shrink_at_end"),
    "random": (),
    "decay": ("stride", "shift_every", "roll_back", "shrink_at_end", "min_shift_every", "max_shift_every"),
    "exp_decay": ("stride", "shift_every", "roll_back", "shrink_at_end", "exp_decay_rate", "exp_decay_start"),
}  # fmt: skip
"""Which ``sliding`` options each ``algo.window.strategy`` reads (``sde.window._sliding``); every strategy
reads ``size`` and ``end_offset``. ``random`` draws each start afresh, so it neither moves nor stays."""


@dataclass
class SamplerConfig:
    kind: Annotated[str, StepKind] = "flow_sde"
    """Stochastic step of rollouts: ``flow_sde`` (Flow-GRPO), ``dance`` (constant η), ``cps``, ``ode``."""
    noise_level: Annotated[float | None, NON_NEGATIVE] = None
    """SDE noise level (a of ``flow_sde`` / ``cps``, η of ``dance``); null takes ``model.noise_level``."""
    logprob_reduce: Annotated[str, LogprobReduce] = "mean"
    """Reduce per-element log-densities over non-batch dims: ``mean`` (upstream) or ``sum`` (true density)."""
    logprob_form: Annotated[str, LogprobForm] = "gaussian"
    """``gaussian`` (exact) or ``upstream`` (CPS's unnormalised −(x'−μ)², only with kind=cps)."""

    def __post_init__(self) -> None:
        require(
            self.logprob_form == "gaussian" or self.kind == "cps",
            "sampler.logprob_form=upstream only exists for sampler.kind=cps; drop it or set sampler.kind=cps",
        )


@dataclass
class WindowConfig:
    kind: Annotated[str, WindowKind] = "all"
    """Which steps are stochastic and trained: ``all`` (Flow-GRPO), ``random_window`` (Fast),
    ``sliding`` (MixGRPO), ``random_subset`` (DanceGRPO), ``single`` (R3)."""
    timestep_fraction: Annotated[float, FRACTION] = 0.99
    """``all``: train the first int(T·fraction) (0.99 skips the near-zero-σ last step);
    ``random_subset``: train a random int(n·fraction) of the n candidate steps per sample."""
    skip_last_step: bool = True
    """``random_subset``: the candidates are the first T − 1 steps, never the step onto σ′ = 0
    (DanceGRPO); false = all T steps."""
    size: Annotated[int, NON_NEGATIVE] = 0
    """``random_window`` / ``sliding``: window length (Fast: 0 = all steps but the last)."""
    range: Annotated[list[int] | None, NON_NEGATIVE] = None
    """``random_window``: [lo, hi) where the window may lie (null = [0, T−1))."""
    stride: Annotated[int, NON_NEGATIVE] = 1
    """``sliding``: steps the window moves per shift (0: it stays at the first steps)."""
    shift_every: Annotated[int, COUNT] = 25
    """``sliding``: epochs between shifts (τ); the ``exp_decay`` base interval."""
    strategy: Annotated[str, SlidingStrategy] = "progressive"
    """``sliding``: progressive | random | decay | exp_decay (docs/maths.md §5.4)."""
    roll_back: bool = False
    """``sliding``: restart at step 0 after the last position."""
    end_offset: Annotated[int, NON_NEGATIVE] = 0
    """``sliding``: the window lies before step T − end_offset (MixGRPO: 2)."""
    shrink_at_end: bool = False
    """``sliding``: keep moving past T − end_offset − size, dropping the steps past the end (MixGRPO);
    false: the last move lands on T − end_offset − size, every window full."""
    min_shift_every: Annotated[int | None, COUNT] = None
    """``decay``: the shortest stay (null = max(1, shift_every // 4))."""
    max_shift_every: Annotated[int | None, COUNT] = None
    """``decay``: the stay at the first position (null = shift_every)."""
    exp_decay_rate: Annotated[float, NON_NEGATIVE] = 0.1
    """``exp_decay``: k in ceil(shift_every·exp(−k·max(0, start − exp_decay_start)))."""
    exp_decay_start: Annotated[int, NON_NEGATIVE] = 13
    """``exp_decay``: the window start from which the stays shrink."""
    max_index: Annotated[int | None, COUNT] = None
    """``single``: the SDE step is drawn from the first max_index steps (null = any)."""

    def __post_init__(self) -> None:
        require(self.range is None or len(self.range) == 2, "algo.window.range must be [lo, hi]")
        if self.kind == "sliding":
            longest = self.shift_every if self.max_shift_every is None else self.max_shift_every
            shortest = max(1, self.shift_every // 4) if self.min_shift_every is None else self.min_shift_every
            require(
                shortest <= longest,
                f"algo.window.min_shift_every ({shortest}; null = max(1, shift_every // 4)) must be ≤ "
                f"algo.window.max_shift_every ({longest}; null = shift_every)",
            )

    def leaves_ode_tail(self) -> bool:
        """Whether the window can leave steps after its last stochastic one, which MixGRPO-Flash's
        tail (``algo.flash``) integrates: ``all``, ``random_subset`` and a ``random_window`` of size 0
        make every step stochastic."""
        return self.kind in ("sliding", "single") or (self.kind == "random_window" and self.size > 0)

    def options(self) -> dict[str, Any]:
        """The keyword options ``sde.window.plan_window`` takes for this kind."""
        values = {name: getattr(self, name) for name in WINDOW_OPTIONS[self.kind]}
        if values.get("range") is not None:
            values["range"] = tuple(values["range"])
        return values

    def check_fits(self, num_steps: int) -> None:
        """The window fits a schedule of ``num_steps`` steps (``model.num_steps``).

        Raises:
            UserError: Naming the option, what it gives with ``num_steps`` and the fix.
        """
        fits = _WINDOW_FITS[self.kind](self, num_steps)
        require(fits is None, f"algo.window (kind={self.kind}) with model.num_steps={num_steps}: {fits}")


def _all_fits(w: WindowConfig, num_steps: int) -> str | None:
    if int(num_steps * w.timestep_fraction) < 1:
        return f"int({num_steps} × timestep_fraction {w.timestep_fraction}) = 0 trained steps; raise either"
    return None


def _random_window_fits(w: WindowConfig, num_steps: int) -> str | None:
    if w.size > num_steps:
        return f"size={w.size} is longer than the schedule; use at most {num_steps} (0 = all but the last)"
    if w.size == 0:
        return None
    lo, hi = (0, num_steps - 1) if w.range is None else w.range
    lo, hi = max(0, lo), min(num_steps, hi)
    if hi - lo < w.size:
        return f"range={w.range} clipped to the schedule is [{lo}, {hi}), too short for size={w.size}"
    return None


def _sliding_fits(w: WindowConfig, num_steps: int) -> str | None:
    if w.end_offset > num_steps - 1:
        return f"end_offset={w.end_offset} leaves no step; use at most {num_steps - 1}"
    longest = num_steps if w.shrink_at_end and w.strategy != "random" else num_steps - w.end_offset
    if not 1 <= w.size <= longest:
        return f"size={w.size} must be in [1, {longest}] (at most T − end_offset unless shrink_at_end)"
    return None


def _random_subset_fits(w: WindowConfig, num_steps: int) -> str | None:
    candidates = num_steps - 1 if w.skip_last_step else num_steps
    if int(candidates * w.timestep_fraction) < 1:
        skipped = " (skip_last_step leaves the last step out)" if w.skip_last_step else ""
        return (
            f"int({candidates} candidate steps × timestep_fraction {w.timestep_fraction}) = 0 trained "
            f"steps; raise timestep_fraction or model.num_steps{skipped}"
        )
    return None


def _single_fits(w: WindowConfig, num_steps: int) -> str | None:
    if w.max_index is not None and w.max_index > num_steps:
        return f"max_index={w.max_index} exceeds the {num_steps} steps"
    return None


_WINDOW_FITS = {
    "all": _all_fits,
    "random_window": _random_window_fits,
    "sliding": _sliding_fits,
    "random_subset": _random_subset_fits,
    "single": _single_fits,
}


@dataclass
class FlashConfig:
    enabled: bool = False
    """MixGRPO-Flash: after the last SDE step, finish on a compressed schedule with DPM-Solver++ 2M."""
    ratio: Annotated[float, FRACTION] = 0.4
    """Fraction of the remaining steps kept by the compressed schedule."""


@dataclass
class PrefConfig:
    loss: Annotated[str, PrefLoss] = "dpo"
    """``dpo`` (Flow-DPO on best-vs-worst pairs) or ``sft`` (reward-filtered flow matching)."""
    dpo_beta: Annotated[float, POSITIVE] = 100.0
    """DPO: β of the implicit reward (the temperature of the preference loss)."""
    anchor_weight: Annotated[float, NON_NEGATIVE] = 0.0
    """SFT: weight of ‖v_θ − v_base‖², which keeps the policy near the base (0 = plain filtered SFT)."""
    ref_update_step: Annotated[int, NON_NEGATIVE] = 0
    """DPO: copy the policy into the reference every N optimizer steps (0 = offline: fixed base)."""
    top_k: Annotated[int, COUNT] = 1
    """SFT: samples kept per group (the best ones)."""
    timesteps_per_sample: Annotated[int, COUNT] = 1
    """Training σ drawn per kept sample (or pair) per epoch."""

    def __post_init__(self) -> None:
        for loss, keys in PREF_LOSS_OPTIONS.items():
            if loss != self.loss:
                require_defaults(
                    self,
                    PrefConfig,
                    keys,
                    lambda key, value, default, loss=loss: (
                        f"algo.pref.{key}={value!r} is read by algo.pref.loss={loss} alone, and this run trains "
                        f"algo.pref.loss={self.loss}, which ignores it: drop the override (back to "
                        f"{default!r}), or set algo.pref.loss={loss} (algo={loss})"
                    ),
                )


PREF_LOSS_OPTIONS = {"dpo": ("dpo_beta", "ref_update_step"), "sft": ("anchor_weight", "top_k")}
"""The ``algo.pref`` options one loss alone reads (``recipes/flow_pref.py``): the other refuses them set."""


@dataclass
class PretrainConfig:
    """Flow-matching pretraining on ground-truth images (``recipe=flow_pretrain``)."""

    steps_per_epoch: Annotated[int, COUNT] = 50
    """Optimizer steps per epoch (an epoch is the unit of eval, logging and checkpoints)."""
    batch_size: Annotated[int, COUNT] = 128
    """Images per optimizer step."""
    source: Annotated[str, PretrainSource] = "shapes"
    """Where the images come from: ``shapes`` renders the ShapesEval metadata of each train row."""
    cond_dropout: Annotated[float, BELOW_ONE] = 0.1
    """Share of prompts replaced by the empty prompt, so the model also learns the unconditional
    velocity that classifier-free guidance needs."""
    sigma_sampling: Annotated[str, SigmaSampling] = "logit_normal"
    """Training σ distribution: ``logit_normal`` (SD3, mean 0, std 1) or ``uniform``."""
    warmup_steps: Annotated[int, NON_NEGATIVE] = 200
    """Linear learning-rate warm-up; then a cosine decay to ``min_lr_ratio``·lr at the last step."""
    min_lr_ratio: Annotated[float, PROBABILITY] = 0.1
    """Where the cosine decay ends: ``min_lr_ratio``·lr at the last step."""


@dataclass
class EMAConfig:
    enabled: bool = False
    """Keep an exponential moving average of the trainable weights, used for eval and saving."""
    decay: Annotated[float, PROBABILITY] = 0.9
    """Each update: shadow ← decay·shadow + (1 − decay)·weights."""
    update_every: Annotated[int, COUNT] = 8
    """Optimizer steps between EMA updates."""
    warmup: bool = False
    """Ramp the decay up as ``min(decay, (1 + step) / (10 + step))`` so the average forgets the
    starting weights quickly (training from scratch); off keeps the decay constant (fine-tuning)."""


@dataclass
class AlgoConfig:
    """What every trained recipe but R3 reads: batch geometry and the optimiser. Each recipe's ``algo``
    section extends it with exactly the keys that recipe reads (``schema/recipes.py``)."""

    name: str = "grpo"
    """Algorithm name, for logs (``rlgen ls`` lists the options)."""
    group_size: Annotated[int, at_least(2)] = 8
    """Samples per prompt (K); advantages are normalised within each prompt's group."""
    prompts_per_epoch: Annotated[int, COUNT] = 2
    """Distinct prompts sampled per epoch; an epoch has prompts_per_epoch × group_size samples."""
    sample_batch_size: Annotated[int, COUNT] = 8
    """Samples per rollout forward pass."""
    train_batch_size: Annotated[int, COUNT] = 8
    """Samples per training forward pass; equal to sample_batch_size keeps the ratio exactly 1."""
    gradient_accumulation_steps: Annotated[int | None, COUNT] = None
    """Training micro-batches per optimizer step over ALL processes (global, like the batch geometry):
    each process trains gradient_accumulation_steps ÷ launcher world size of them, so one optimizer step
    covers the same samples on any process count. null = one micro-batch per process (then a step's
    samples grow with the process count)."""
    lr: Annotated[float, POSITIVE] = 3e-4
    """AdamW's learning rate (the rate ``lr_schedule`` starts from)."""
    lr_schedule: Annotated[str, LrSchedule] = "constant"
    """``constant``, or ``cosine`` / ``linear``: ``lr`` for the ``lr_decay_start`` share of ``epochs``, then a
    decay to ``lr_min_ratio``·lr at the last epoch (a time limit that stops the run first cuts it short)."""
    lr_decay_start: Annotated[float, BELOW_ONE] = 0.0
    """Share of ``epochs`` trained at ``lr`` before the ``cosine`` / ``linear`` decay starts (0 = from the
    first epoch)."""
    lr_min_ratio: Annotated[float, PROBABILITY] = 0.0
    """Where the decay ends: ``lr_min_ratio``·lr at the last epoch."""
    lr_warmup_epochs: Annotated[int, NON_NEGATIVE] = 0
    """Ramp the learning rate linearly over the first epochs (epoch e of W runs at (e + 1)/W of the
    schedule's rate), whatever ``lr_schedule``; 0 = none (upstream)."""
    adam_beta1: Annotated[float, BELOW_ONE] = 0.9
    """AdamW's β₁ (decay of the gradient's running mean)."""
    adam_beta2: Annotated[float, BELOW_ONE] = 0.999
    """AdamW's β₂ (decay of the squared gradient's running mean)."""
    adam_eps: Annotated[float, POSITIVE] = 1e-8
    """AdamW's ε (added to the root of the second moment)."""
    weight_decay: Annotated[float, NON_NEGATIVE] = 1e-4
    """AdamW's decoupled weight decay."""
    max_grad_norm: Annotated[float, ANY] = 1.0
    """Gradient-norm clip; ≤ 0 disables it."""

    def __post_init__(self) -> None:
        self.require_whole_epoch_batches()

    def require_whole_epoch_batches(self) -> None:
        """An epoch of prompts_per_epoch × group_size samples splits into whole sampling and training
        micro-batches, and those into whole optimizer steps."""
        total = self.prompts_per_epoch * self.group_size
        for key in ("sample_batch_size", "train_batch_size"):
            size = getattr(self, key)
            require(
                total % size == 0,
                f"algo.prompts_per_epoch × algo.group_size = {total} must be divisible by algo.{key} ({size}); "
                f"set algo.{key} to a divisor of {total}",
            )
        micro = total // self.train_batch_size
        accumulation = self.gradient_accumulation_steps or 1
        require(
            micro % accumulation == 0,
            f"{micro} training micro-batches per epoch are not divisible by "
            f"algo.gradient_accumulation_steps ({accumulation})",
        )

    def micro_batches_per_step(self, world_size: int) -> int:
        """Training micro-batches per optimizer step over all ``world_size`` processes."""
        return world_size if self.gradient_accumulation_steps is None else self.gradient_accumulation_steps

    def require_process_split(self, world_size: int) -> None:
        """An optimizer step's micro-batches split evenly over ``world_size`` processes.

        Raises:
            UserError: Saying how many micro-batches cannot be split over how many processes, and the fix.
        """
        steps = self.micro_batches_per_step(world_size)
        require(
            steps % world_size == 0,
            f"algo.gradient_accumulation_steps={steps} micro-batches per optimizer step cannot be split over "
            f"{world_size} processes: each process trains whole micro-batches of algo.train_batch_size="
            f"{self.train_batch_size} and every process the same number per step. Set "
            f"algo.gradient_accumulation_steps to a multiple of {world_size} (it counts micro-batches over all "
            "processes), or run a process count that divides it",
        )


@dataclass
class AdvantageConfig(AlgoConfig):
    """Recipes that turn group rewards into advantages."""

    global_std: bool = True
    """Normalise advantages by the whole batch's reward std instead of each group's."""
    std_estimator: Annotated[str, StdEstimator] = "population"
    """Advantage std: ``population`` (/ n, Flow-GRPO) or ``unbiased`` (/ (n − 1), MixGRPO, DanceGRPO)."""
    adv_eps: Annotated[float, NON_NEGATIVE] = 1e-4
    """Added to the advantage std before dividing (Flow-GRPO 1e-4, MixGRPO / DanceGRPO 1e-8)."""
    kl_weight: Annotated[float, NON_NEGATIVE] = 0.04
    """Weight β of the KL towards the reference (LoRA disabled); 0 skips the reference forward."""


@dataclass
class PolicyGradientConfig(AdvantageConfig):
    """Recipes whose loss is advantage-weighted (GRPO on flows and tokens, DiffusionNFT / AWM)."""

    adv_clip_max: Annotated[float, NON_NEGATIVE] = 5.0
    """Advantages are clamped to ±adv_clip_max."""


@dataclass
class FlowGrpoAlgoConfig(PolicyGradientConfig):
    """``recipe=flow_grpo``: policy gradient on SDE rollouts (Flow-GRPO and its window variants)."""

    num_inner_epochs: Annotated[int, COUNT] = 1
    """Passes over each epoch's samples."""
    clip_range: Annotated[float, POSITIVE] = 1e-4
    """PPO clip ε on the importance ratio."""
    kl_form: Annotated[str, KlForm] = "gaussian"
    """``gaussian`` = mean((μθ−μref)²)/(2s²), the KL of the two step Gaussians; ``upstream`` = Flow-GRPO's
    code, /(2σ_t²) with σ_t = s/sqrt(−dt) for flow_sde/dance (|dt| times weaker per step), s for cps."""
    cfg_grad: Annotated[str, CfgGrad] = "both"
    """With CFG, the training forward back-propagates through ``both`` branches of u + g·(c − u), or only
    the ``conditional`` one (the unconditional prediction detached; same forward values)."""
    timesteps_per_pass: Annotated[int, COUNT] = 1
    """Trained steps of a micro-batch that share one transformer call and one backward in the update
    (rows = samples × steps, each its own x_t and σ): the same gradient in fewer, larger calls, activation
    memory × this. 1 = upstream (a call and a backward per step); ≥ the trained steps folds them all."""
    drop_zero_advantage: bool = False
    """Train only samples whose advantage is non-zero (Flow-GRPO's SD3 / Kontext / Wan scripts): the
    micro-batches per epoch stay the same and shrink, so each kept sample weighs more (docs/maths.md §4.5)."""
    shuffle_samples: Annotated[str, ShuffleSamples] = "none"
    """The order a process trains its samples in: ``none`` = rollout order; ``per_process`` =
    Flow-Factory's, each process permutes its own samples before every inner epoch (seeded by seed, epoch
    and inner epoch) and then cuts micro-batches, so which samples share a step depends on the process
    count (docs/maths.md §4.5)."""
    objective: Annotated[str, Objective] = "grpo"
    """Per-step loss: ``grpo`` (clipped ratio) or ``grpo_guard`` (ratio normalisation, reweighting)."""
    reward_scoring: Annotated[str, RewardScoringMode] = "auto"
    """Where each rollout batch is scored: ``thread`` = on a worker thread while the next batch samples;
    ``inline`` = between batches, in the sampling thread; ``auto`` = ``thread`` on an accelerator or with a
    served reward, ``inline`` on a CPU run whose rewards compute locally (a thread there competes with the
    sampler for the same cores). Same scores either way."""
    window: WindowConfig = field(default_factory=WindowConfig)
    branch: Annotated[str, Branch] = "independent"
    """``shared_prefix``: one ODE prefix per prompt up to the window, then the group branches (Fast)."""
    flash: FlashConfig = field(default_factory=FlashConfig)
    shared_initial_noise: bool = False
    """Every sample of a group starts from the same noise (DanceGRPO)."""
    best_of_n: Annotated[int, NON_NEGATIVE] = 0
    """Train only the k best and k worst samples of each group (DanceGRPO's best-of-N); 0 = all."""
    prompts_per_draw: Annotated[int | None, COUNT] = None
    """Which prompts an epoch trains: null = passes over the dataset without replacement (every prompt once
    per pass, every group K samples: rlgen's choice); N = Flow-GRPO's sampler, a fresh random set of N
    distinct prompts for each of the epoch's prompts_per_epoch / N sampling batches, so a prompt may come
    twice in an epoch (its groups then merge) while others wait (docs/maths.md §4.1, §13)."""
    ema: EMAConfig = field(default_factory=EMAConfig)
    gardo: GardoConfig = field(default_factory=GardoConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.prompts_per_draw is None
            or (self.prompts_per_draw >= 1 and self.prompts_per_epoch % self.prompts_per_draw == 0),
            f"algo.prompts_per_draw={self.prompts_per_draw} must be null or a positive divisor of "
            f"algo.prompts_per_epoch ({self.prompts_per_epoch})",
        )
        require(
            self.branch == "independent" or self.window.kind in ("random_window", "sliding", "single"),
            "algo.branch=shared_prefix needs a window that starts after step 0 (random_window, sliding, single)",
        )
        require(
            2 * self.best_of_n <= self.group_size,
            f"algo.best_of_n={self.best_of_n}: 2·k must be ≤ algo.group_size ({self.group_size})",
        )
        self.require_best_of_n_selects()
        self.require_best_of_n_steps()
        require(
            not self.flash.enabled or self.window.leaves_ode_tail(),
            f"algo.flash.enabled=true does nothing with algo.window.kind={self.window.kind}"
            f"{' and algo.window.size=0' if self.window.kind == 'random_window' else ''}: MixGRPO-Flash "
            "integrates the steps after the window's last stochastic step, and this window makes every step "
            "stochastic. Use a window that ends earlier (algo.window.kind=sliding, single, or random_window "
            "with algo.window.size > 0), or algo.flash.enabled=false",
        )

    def require_best_of_n_selects(self) -> None:
        """``best_of_n`` = group_size / 2 keeps the k best and k worst of a group of 2·k: every sample, as
        0 does. Groups of Flow-GRPO's fresh draws (``prompts_per_draw``) merge a prompt drawn twice, so
        there it may select."""
        k, size = self.best_of_n, self.group_size
        fewer = f", or at most {(size - 1) // 2} to train fewer" if size > 2 else ""
        require(
            not k or 2 * k < size or self.prompts_per_draw is not None,
            f"algo.best_of_n={k} keeps the {k} best and {k} worst samples of each group of "
            f"algo.group_size={size}: all of them, so it does nothing. Set algo.best_of_n=0 (the same "
            f"training){fewer}",
        )

    def require_best_of_n_steps(self) -> None:
        """The samples ``best_of_n`` keeps fill whole optimizer steps: otherwise the last micro-batches'
        gradients never step (and with fewer micro-batches than one step, nothing trains)."""
        accumulation = self.gradient_accumulation_steps
        if not self.best_of_n or 2 * self.best_of_n == self.group_size or not accumulation:
            return
        kept = 2 * self.best_of_n * self.prompts_per_epoch
        micro_batches = math.ceil(kept / self.train_batch_size)
        require(
            micro_batches % accumulation == 0,
            f"algo.best_of_n={self.best_of_n} keeps 2·k of each group: {kept} samples, {micro_batches} "
            f"micro-batches of algo.train_batch_size={self.train_batch_size}, which "
            f"algo.gradient_accumulation_steps={accumulation} does not divide: the last micro-batches' "
            "gradients would never reach an optimizer step (with fewer than one step, nothing trains). Set "
            f"algo.gradient_accumulation_steps to a divisor of {micro_batches}, or null",
        )

    @property
    def assignment_unit(self) -> int:
        """Samples dealt to a process as one piece: whole rollout and training batches, so every sample
        is rolled out and trained in the same batch on any process count (lcm of the two sizes)."""
        return math.lcm(self.sample_batch_size, self.train_batch_size)

    def require_process_split(self, world_size: int) -> None:
        """On top of :meth:`AlgoConfig.require_process_split`: every optimizer step's samples split into
        whole :attr:`assignment_unit` pieces, the same number on every process."""
        super().require_process_split(world_size)
        require_whole_rollout_pieces(self, world_size)

    def require_rank_symmetric(self, several_ranks: bool) -> None:
        """What several processes, or an engine that shards the weights, cannot run: per-sample step subsets
        and best-of-N would give the processes different numbers of backward passes."""
        require(
            not several_ranks or (self.window.kind != "random_subset" and self.best_of_n == 0),
            "algo.window.kind=random_subset and algo.best_of_n are single-process for now (processes would "
            "run different numbers of backward passes): use launcher=local, or another window and "
            "algo.best_of_n=0",
        )

    def require_process_invariance(self, world_size: int, exact: bool | None) -> None:
        """What makes the run depend on the process count: refused under ``launcher.exact_reduction=true``
        (the promise of the same run on any process count), a warning under null (on where it can be: the
        run is upstream's, per-process packing included)."""
        if world_size == 1:
            return
        for option, how, way_out in self.process_count_dependent_options():
            if exact is None:
                log.warning(
                    f"{option} {how}: this run differs from one on another process count (statistically "
                    f"the same, not bit for bit). launcher.exact_reduction=true refuses this; {way_out} "
                    "keeps the process-count invariance"
                )
            require(
                not exact,
                f"{option} {how}, so which samples share a micro-batch depends on the process count, and "
                f"launcher.exact_reduction promises a run that does not: pass {way_out}, or "
                "launcher.exact_reduction=false (the same run statistically, not bit for bit)",
            )

    def process_count_dependent_options(self) -> list[tuple[str, str, str]]:
        """(the option set, what it does per process, the setting that avoids it) for each option that
        makes a step's samples depend on the process count."""
        found = []
        if self.drop_zero_advantage:
            found.append(
                (
                    "algo.drop_zero_advantage=true",
                    "packs each process's kept samples into its own micro-batches",
                    "algo.drop_zero_advantage=false (every sample trains; zero-advantage ones add no policy gradient)",
                )
            )
        if self.shuffle_samples == "per_process":
            found.append(
                (
                    "algo.shuffle_samples=per_process",
                    "permutes each process's own samples before cutting micro-batches",
                    "algo.shuffle_samples=none (rollout order: a step covers the same samples on any process count)",
                )
            )
        return found


def require_whole_rollout_pieces(algo: AlgoConfig, world_size: int, otherwise: str = "") -> None:
    """A recipe that deals rollouts in pieces of lcm(sample, train batch) round-robin (flow GRPO,
    DiffusionNFT / AWM, token GRPO under exact reduction): every optimizer step's samples split into whole
    pieces, the same number on every process, so step s covers the same samples on any process count.
    ``otherwise``: a further way out, appended to the message."""
    per_step = algo.micro_batches_per_step(world_size) * algo.train_batch_size
    unit = math.lcm(algo.sample_batch_size, algo.train_batch_size)
    require(  # one process rolls out across optimizer steps freely: nothing to deal
        world_size == 1 or per_step % (unit * world_size) == 0,
        f"an optimizer step's {per_step} samples (algo.gradient_accumulation_steps × algo.train_batch_size) "
        f"cannot be split over {world_size} processes in whole rollout batches: a process takes "
        f"lcm(algo.sample_batch_size={algo.sample_batch_size}, algo.train_batch_size={algo.train_batch_size})"
        f" = {unit} samples at a time. Make algo.sample_batch_size divide algo.train_batch_size, or raise "
        f"algo.gradient_accumulation_steps to a multiple of {unit * world_size // math.gcd(unit * world_size, algo.train_batch_size)}"
        f"{otherwise}",
    )


@dataclass
class FlowPrefAlgoConfig(AdvantageConfig):
    """``recipe=flow_pref``: Flow-DPO / reward-filtered SFT on the reference's samples."""

    gradient_accumulation_steps: Annotated[int | None, COUNT] = None
    """Must stay null here: DPO / SFT take one optimizer step per training σ over ALL of an epoch's pairs
    (kept samples), cut into micro-batches of ``algo.train_batch_size`` (``algo.pref.timesteps_per_sample``
    steps per epoch); a number is refused."""
    kl_weight: Annotated[float, NON_NEGATIVE] = 0.0
    """Must stay 0 here: DPO and SFT train no KL term (DPO's reference enters its loss through
    ``algo.pref.dpo_beta``; SFT's pull towards the base is ``algo.pref.anchor_weight``); non-zero is refused."""
    cfg_grad: Annotated[str, CfgGrad] = "both"
    """Must stay ``both`` here: DPO's and SFT's training forwards back-propagate through both CFG branches;
    ``conditional`` (``FlowGrpoAlgoConfig.cfg_grad``) is refused."""
    pref: PrefConfig = field(default_factory=PrefConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.cfg_grad == "both",
            f"algo.cfg_grad={self.cfg_grad} is not read by recipe=flow_pref: DPO's and SFT's training forwards "
            "always back-propagate through both classifier-free-guidance branches. Drop the override "
            "(algo.cfg_grad=both); the conditional-only gradient exists for algo=grpo and the flow_forward "
            "algorithms (nft, awm, dgpo)",
        )
        require(
            self.kl_weight == 0,
            f"algo.kl_weight={self.kl_weight} is not read by recipe=flow_pref: DPO and SFT train no KL term. "
            "Set algo.kl_weight=0; to keep the policy near the base use algo.pref.dpo_beta (DPO's reference "
            "term) or algo.pref.anchor_weight (SFT's ‖v_θ − v_base‖²)",
        )
        require(
            self.gradient_accumulation_steps is None,
            f"algo.gradient_accumulation_steps={self.gradient_accumulation_steps} is not read by "
            "recipe=flow_pref: DPO / SFT take one optimizer step per training σ over all of an epoch's pairs "
            "(kept samples), in micro-batches of algo.train_batch_size. Set "
            "algo.gradient_accumulation_steps=null; a step's size is algo.prompts_per_epoch (× "
            "algo.pref.top_k for SFT), the steps per epoch algo.pref.timesteps_per_sample",
        )
        if self.pref.loss == "dpo":
            require_defaults(
                self,
                AdvantageConfig,
                ("global_std", "std_estimator", "adv_eps"),
                lambda key, value, default: (
                    f"algo.{key}={value!r} normalises SFT's advantages, and algo.pref.loss=dpo computes none "
                    f"(it pairs each group's best and worst sample by reward): drop the override (back to "
                    f"{default!r}), or train algo.pref.loss=sft (algo=sft)"
                ),
            )


EPOCH_SCHEDULE_KEYS = ("lr_schedule", "lr_decay_start", "lr_min_ratio", "lr_warmup_epochs")
"""The flow RL loop's per-epoch schedule keys of ``AlgoConfig`` (``training/control/schedule.py``); their
defaults are the off values."""
TOKEN_SCHEDULE = "algo.token.lr_schedule and algo.token.warmup_ratio (per step)"
"""Where the VLM recipes' own schedule is set."""


def refuse_epoch_schedule(algo: AlgoConfig, recipe: str, instead: str) -> None:
    """A recipe with its own per-step schedule refuses the per-epoch keys rather than ignore them."""
    require_defaults(
        algo,
        AlgoConfig,
        EPOCH_SCHEDULE_KEYS,
        lambda key, value, _: (
            f"algo.{key}={value!r} sets the flow RL loop's per-epoch schedule, which recipe={recipe} does not "
            f"read; its schedule is {instead}"
        ),
    )


@dataclass
class FlowPretrainAlgoConfig(AlgoConfig):
    """``recipe=flow_pretrain``: flow matching on ground-truth images."""

    group_size: Annotated[int, at_least(2)] = 2
    """Fixed here (``conf/algo/flow_pretrain.yaml``'s value): pretraining draws no groups, each optimizer
    step trains ``algo.pretrain.batch_size`` images; another value is refused."""
    prompts_per_epoch: Annotated[int, COUNT] = 32
    """Fixed here (``conf/algo/flow_pretrain.yaml``'s value): an epoch is ``algo.pretrain.steps_per_epoch``
    optimizer steps of ``algo.pretrain.batch_size`` images; another value is refused."""
    train_batch_size: Annotated[int, COUNT] = 16
    """Fixed here (``conf/algo/flow_pretrain.yaml``'s value): each process trains its share of
    ``algo.pretrain.batch_size`` in one forward; another value is refused."""
    gradient_accumulation_steps: Annotated[int | None, COUNT] = None
    """Must stay null here: each optimizer step is one backward on ``algo.pretrain.batch_size`` images; a
    number is refused."""
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_epoch_schedule(
            self, "flow_pretrain", "algo.pretrain.warmup_steps and algo.pretrain.min_lr_ratio (per step)"
        )
        require_defaults(
            self,
            FlowPretrainAlgoConfig,
            PRETRAIN_FIXED_KEYS,
            lambda key, value, default: (
                f"algo.{key}={value} has no effect with recipe=flow_pretrain: each optimizer step is one "
                "backward on algo.pretrain.batch_size ground-truth images (split over the processes), "
                f"algo.pretrain.steps_per_epoch steps an epoch. Leave algo.{key} at "
                f"{'null' if default is None else default} and size the training with "
                "algo.pretrain.batch_size and algo.pretrain.steps_per_epoch"
            ),
        )

    def require_whole_epoch_batches(self) -> None:
        """None to check here: pretraining rolls out no epoch of prompts_per_epoch × group_size samples;
        ``algo.sample_batch_size`` is the evaluation's batch, which may leave a smaller last one."""


PRETRAIN_FIXED_KEYS = ("group_size", "prompts_per_epoch", "train_batch_size", "gradient_accumulation_steps")
"""``AlgoConfig`` keys of the RL loop's batch geometry that pretraining never reads: fixed at their defaults."""


@dataclass
class FlowForwardAlgoConfig(PolicyGradientConfig):
    """``recipe=flow_forward``: DiffusionNFT / AWM on forward-process noising of the rollouts."""

    num_inner_epochs: Annotated[int, COUNT] = 1
    """Passes over each epoch's samples."""
    cfg_grad: Annotated[str, CfgGrad] = "both"
    """See ``FlowGrpoAlgoConfig.cfg_grad``."""
    forward: ForwardConfig = field(default_factory=ForwardConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    gardo: GardoConfig = field(default_factory=GardoConfig)

    @property
    def assignment_unit(self) -> int:
        """See :attr:`FlowGrpoAlgoConfig.assignment_unit`."""
        return math.lcm(self.sample_batch_size, self.train_batch_size)

    def require_process_split(self, world_size: int) -> None:
        """See :meth:`FlowGrpoAlgoConfig.require_process_split`."""
        super().require_process_split(world_size)
        require_whole_rollout_pieces(self, world_size)


@dataclass
class TokenAlgoConfig(PolicyGradientConfig):
    """``recipe=vlm_rl``: token-level GRPO of a multimodal LLM."""

    clip_range: Annotated[float, POSITIVE] = 0.2
    """PPO clip ε on the importance ratio."""
    token: TokenGRPOOptions = field(default_factory=TokenGRPOOptions)

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_epoch_schedule(self, "vlm_rl", TOKEN_SCHEDULE)


@dataclass
class VlmSftAlgoConfig(AlgoConfig):
    """``recipe=vlm_sft``: masked cross-entropy warm-up of a multimodal LLM."""

    token: TokenSftOptions = field(default_factory=TokenSftOptions)

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_epoch_schedule(self, "vlm_sft", TOKEN_SCHEDULE)

    def require_whole_epoch_batches(self) -> None:
        """None to check here: an SFT epoch is one pass over ``data.train`` (not prompts_per_epoch ×
        group_size samples), cut into micro-batches when the file is read; the last optimizer step of an
        epoch may hold fewer than ``gradient_accumulation_steps`` of them (``recipes/vlm_sft.py``)."""
