"""R3: reason → reflect → refine, trained with Tree-RL and the Mix-GRPO loss (docs/maths.md §9).

A unified policy (``r3/policy.py``; here the composite of a VLM, a generator and an editor) plans in text
and draws (reason), looks at its image and writes an edit instruction or "no further edit needed"
(reflect), then edits (refine). Text tokens train with token GRPO, image denoising with Flow-GRPO,
jointly. Each step of the loop:

1. **rollout** — even steps: the reason stage. The step takes ``prompts_per_step`` prompts (global); each
   prompt's ``group_size`` branches each sample a plan and draw an image conditioned on prompt + plan.
   Odd steps: the refine stage. Each group draws one stage-1 image from the buffer every rank holds
   (``perfect_ratio`` of the draws perfect), and its branches each reflect and edit it. Every image takes
   exactly one SDE step (any step when generating, one of the first ``max_sde_timestep_idx_for_edit`` when
   editing), at the same index and from the same initial noise across the group; ``enable_sde_gen/edit``
   = false samples ODE only (that stage then trains its text alone).
2. **score** — the reward of ``reward_fn`` (``r3/scoring.py``); reason stage images enter the buffer.
3. **advantages** — ``r3/rewards.py``: text f·(r + w_f) / f·(w_f + Δ), image r / r_new (masked where no
   edit happened); reward minus the group mean, per track, over the whole group wherever its branches ran
   (rewards are gathered with their group ids first).
4. **update** — one on-policy step of ``ce_weight·(L_text + kl_weight_text·KL_text) + mse_weight·L_img +
   kl_weight_image·KL_img`` (``r3/loss.py``; ``tune_text_cot`` / ``tune_image_cot`` switch the tracks):
   text log-probs at temperature 1 on the rollout's own micro-batches, the image step recomputed through
   the same ``velocity`` (CFG recombined exactly as in the rollout, in both stages), so both importance
   ratios are exactly 1.
5. **log / eval / checkpoint** — metrics.jsonl, each branch in ``samples/rank_<r>.jsonl``, periodic
   multi-round evaluation, full-state checkpoints (the buffer included).

Several processes (``launcher=accelerate``; docs/distributed.md): the step's prompts_per_step ×
group_size branches are dealt in equal consecutive shares (``schema/r3.py`` ``R3Geometry``): a process
holds whole groups, or a group spans consecutive processes (upstream's policy group) that share its
prompt, initial noise and SDE step. Everything a branch draws is keyed by its global position or group,
a text micro-batch samples under the seed of its first branch's position, rewards are gathered in rank
order (= global order) before the group statistics, each micro-batch's loss is weighted by its share of
the step's branches over all processes, and gradients are summed in float64 once per step
(``launcher.exact_reduction``). With the same ``micro_batch_size`` the run is then the same, bit for bit,
on 1, 2 or 4 processes (``tests/distributed/test_r3_process_invariance.py``).

Deliberate choices: the reason stage trains on the CFG-combined velocity it sampled with (upstream trains
on the unguided one); every branch of a refine group runs the editor, even those that keep their image
(their image track is masked), so every rank runs the same forwards — what DDP needs.

    rlgen train model=tiny_r3                                   # tiny composite on the CPU, offline
    rlgen train experiment=r3_geneval r3.reward_server_urls=[HOST] r3.reward_server_port=[1001,1002]
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from rlgen_cli.data.sampler import GroupSampler
from rlgen_cli.errors import UserError
from rlgen_cli.r3.buffer import StageOneBuffer
from rlgen_cli.r3.data import R3Sample, load_r3_dataset
from rlgen_cli.r3.evaluate import build_unified, evaluate_rounds, save_strips
from rlgen_cli.r3.loss import image_kl, image_track_loss, text_track_loss
from rlgen_cli.r3.policy import EDIT, GENERATE, IMAGE, TEXT, Thoughts, UnifiedPolicy
from rlgen_cli.r3.rewards import (
    NO_EDIT,
    StageRewards,
    extract_instruction,
    extract_plan,
    is_no_edit,
    reason_rewards,
    refine_rewards,
    track_advantages,
)
from rlgen_cli.r3.rollout import ImageRollout, image_rollout, micro_batches, shifted, stage_plan, text_rollout
from rlgen_cli.r3.scoring import R3Scorer
from rlgen_cli.recipes.common import reduce_over_ranks
from rlgen_cli.recipes.registry import Perturb
from rlgen_cli.recipes.session import epoch_session
from rlgen_cli.recipes.trainer_run import TrainerRun, opened
from rlgen_cli.schema.r3 import R3Config, R3Geometry, R3TrainConfig, r3_geometry, track_models
from rlgen_cli.sde.rollout import StepSpec, Trajectory, recompute_step
from rlgen_cli.sde.sampling import conditioned
from rlgen_cli.training.distributed.dist import Dist, launched_engine, make_dist
from rlgen_cli.training.reporting.images import grid_name
from rlgen_cli.training.reporting.metrics import build_loggers, step_after
from rlgen_cli.vlm.rollout import SamplingOptions, TokenBatch

log = logging.getLogger(__name__)

__all__ = ["R3Recipe", "StageBatch", "run"]

REASON, REFINE = "reason", "refine"
BUFFER_KEY = "stage_one_buffer"
SAMPLES_DIR = "samples"


@dataclass
class TextMicroBatch:
    """A text micro-batch: its rows, its layout and π_old / π_ref recorded right after the rollout."""

    rows: slice
    batch: TokenBatch
    old: Tensor  # (B, L)
    ref: Tensor | None  # (B, L)


@dataclass(frozen=True)
class LocalGroup:
    """One group's branches on this process: the group, its rows here and their global positions."""

    group: int
    rows: slice
    positions: list[int]


@dataclass
class StageBatch:
    """One stage's rollout on this process, ready for the update; N = the process's branches of the step
    (``R3Geometry.per_process``), one image rollout per group it holds (a group's SDE step is its own)."""

    stage: str
    samples: list[R3Sample]
    thoughts: Thoughts
    images: list[ImageRollout]  # one per local group
    rewards: StageRewards
    text_adv: Tensor  # (N,)
    image_adv: Tensor  # (N,), 0 where masked
    groups: list[LocalGroup]
    text_micro: list[TextMicroBatch] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def positions(self) -> list[int]:
        """Global branch positions of this process's rows."""
        return [p for local in self.groups for p in local.positions]

    def group_rollouts(self) -> list[tuple[LocalGroup, ImageRollout]]:
        return list(zip(self.groups, self.images, strict=True))


class R3Recipe:
    """setup → train (rollout → score → advantages → update → log → eval → checkpoint) → cleanup."""

    def __init__(self, cfg: R3TrainConfig, raw_cfg: DictConfig) -> None:
        self.cfg, self.raw_cfg, self.run_dir = cfg, raw_cfg, Path(cfg.run_dir)

    # -- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, r3 = self.cfg, self.cfg.r3
        torch.manual_seed(cfg.seed)
        if launched_engine() is not None:
            raise UserError(
                "R3 trains three models and runs on launcher=local or launcher=accelerate (DDP); "
                "DeepSpeed / FSDP launchers shard one model"
            )
        self.dist: Dist = make_dist(cfg.device)
        self.device = self.dist.device
        self.policy: UnifiedPolicy = build_unified(cfg.model.family, r3.policy, self.device)
        train_path, val_path = r3.data_paths()
        self.train_set = load_r3_dataset(train_path, r3.dataset_name)
        self.val_set = load_r3_dataset(val_path, r3.dataset_name) if cfg.eval_every else []
        self.scorer = R3Scorer(r3, cfg.reward)
        self.geometry: R3Geometry = r3_geometry(r3, self.dist.world_size)
        self.groups = local_groups(self.geometry, self.dist.rank)
        self.sampler = GroupSampler(
            len(self.train_set), r3.prompts_per_step, r3.group_size, seed=cfg.seed,
            num_replicas=self.dist.world_size, rank=self.dist.rank,
        )  # fmt: skip  # this rank's consecutive share of the step's prompts × branches
        self.buffer = StageOneBuffer(r3.buffer_size)
        self.tracks = [t for t, on in ((TEXT, r3.tune_text_cot), (IMAGE, r3.tune_image_cot)) if on]
        self.params = [p for track in self.tracks for p in self.policy.trainable_parameters(track)]
        optimizer = torch.optim.AdamW(
            self.params, lr=r3.lr, betas=(r3.adam_beta1, r3.adam_beta2), weight_decay=r3.weight_decay
        )
        self.run = TrainerRun(
            cfg, self.raw_cfg, self.run_dir, self.dist, self.policy, optimizer, draws_curve=True, unit="step"
        )
        warmup = max(r3.warmup_steps, 0)
        self.run.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        if (
            r3.kl_weight_text > 0
        ):  # a full fine-tuned text track: its reference is the weights before a resume
            self.policy.keep_reference()
        self.run.resume_and_prepare(  # into the bare modules, before DDP wraps them
            {
                "max_grad_norm": r3.max_grad_norm,
                "micro_batch_size": self.geometry.micro_batch,
                "compute_dtype": compute_dtype(
                    r3, self.tracks, cfg.model.family
                ),  # fp16: the Dist scales the loss
                "exact_reduction": cfg.launcher.reduces_exactly,  # float64 gradient sums: same bits on any count
            },
            lambda state: self.buffer.load_state_dict(state[BUFFER_KEY]),
            lambda: build_loggers(self.run_dir, cfg.logging, self.raw_cfg),
        )
        self.run.evaluation = lambda step, progress: self.evaluate(step)
        (self.run_dir / SAMPLES_DIR).mkdir(parents=True, exist_ok=True)
        self.sample_log = (self.run_dir / SAMPLES_DIR / f"rank_{self.dist.rank}.jsonl").open(
            "a", encoding="utf-8"
        )
        geometry = self.geometry
        log.info(
            "R3 on %s: %d prompts × %d branches per step over %d processes (%d per process, each group on "
            "%d), %d per forward, tracks %s",
            self.device,
            r3.prompts_per_step,
            r3.group_size,
            self.dist.world_size,
            geometry.per_process,
            geometry.ranks_per_group,
            geometry.micro_batch,
            self.tracks,
        )

    # -- the loop -------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """The steps in the shared session (``recipes/session.py``): evaluation when due, log line,
        checkpoint (with the stage-one buffer), steps bar."""
        with epoch_session(self.run) as s:
            for step in s.epochs():
                metrics = self.train_step(step)
                entries = {BUFFER_KEY: self.buffer.state_dict()}
                headline = f"reward {metrics['reward/mean']:+.4g}"
                if s.end_epoch(step, metrics, console_line, headline, extra_state=entries):
                    break
        return s.metrics

    def train_step(self, step: int) -> dict[str, float]:
        """Even steps the reason stage, odd steps reflect + refine; one optimizer step each."""
        start = time.perf_counter()
        batch = self.rollout_reason(step) if step % 2 == 0 else self.rollout_refine(step)
        rollout_time = time.perf_counter() - start
        update_stats = self.update(batch)
        self._log_samples(step, batch)
        return {
            **batch.stats,
            **update_stats,
            "stage": float(STAGE_NAMES.index(batch.stage)),
            "time/rollout": rollout_time,
            "time/step": time.perf_counter() - start,
            "lr": self.run.scheduler.get_last_lr()[0],
            "global_step": self.run.global_step,
            **self.dist.loss_scale_metrics(),
        }

    # -- rollouts -------------------------------------------------------------------------------
    @property
    def first_position(self) -> int:
        """Global position of this rank's first branch (its text micro-batches seed from there)."""
        return self.geometry.first_position(self.dist.rank)

    def _images(
        self, stage: str, encode: Any, num_steps: int, sde: bool, max_index: int | None, step: int
    ) -> list[ImageRollout]:
        """One image rollout per local group: its own SDE step and shared initial noise; ``encode(rows)``
        conditions rows of this process."""
        seed, out = self.cfg.seed, []
        for local in self.groups:
            out.append(
                image_rollout(
                    self.policy,
                    functools.partial(_encode_shifted, encode, local.rows.start),
                    stage,
                    stage_plan(num_steps, sde, max_index, seed, step, local.group),
                    self._spec(stage),
                    local.positions,
                    [local.group] * len(local.positions),
                    seed,
                    step,
                    self.geometry.micro_batch,
                    self.cfg.r3.eta_schedule,
                )
            )
        return out

    def _spec(self, stage: str) -> StepSpec:
        r3 = self.cfg.r3
        return StepSpec(r3.sde_kind, r3.noise_level_gen if stage == GENERATE else r3.noise_level_edit)

    def rollout_reason(self, step: int) -> StageBatch:
        """Plans and images of this rank's branches of its group's prompt."""
        r3, seed = self.cfg.r3, self.cfg.seed
        samples = [self.train_set[i] for i in self.sampler.indices_for_epoch(step // 2)]
        prompts = [s.prompt for s in samples]
        options = SamplingOptions(r3.temperature, r3.top_p, 0, r3.max_output_token_n_gen)
        thoughts = text_rollout(
            lambda rows, s: self.policy.think(prompts[rows], options, s),
            len(samples),
            self.geometry.micro_batch,
            seed,
            step,
            self.first_position,
        )
        plans = [extract_plan(text) for text in thoughts.texts]
        images = self._images(
            GENERATE,
            lambda rows: self.policy.encode_generate(prompts[rows], plans[rows]),
            r3.steps_gen,
            r3.enable_sde_gen,
            None,
            step,
        )
        pixels = torch.cat([rollout.images for rollout in images])
        scores = self.scorer.score(pixels, samples)
        self._fill_buffer(torch.tensor([s.index for s in samples]), pixels, scores)
        rewards = reason_rewards(thoughts.texts, scores, r3.format_weight)
        return self._stage_batch(REASON, samples, thoughts, images, rewards)

    def _fill_buffer(self, indices: Tensor, images: Tensor, scores: Tensor) -> None:
        """Every rank adds every rank's stage-1 images: the buffer is the same everywhere."""
        gather = self.dist.gather
        all_scores = gather(scores.to(self.device)).cpu()
        perfect = all_scores >= self.cfg.r3.perfect_threshold
        self.buffer.add(
            gather(indices.to(self.device)).cpu(), gather(images.to(self.device)).cpu(), all_scores, perfect
        )

    def rollout_refine(self, step: int) -> StageBatch:
        """Reflections on, and edits of, the stage-1 image each local group draws from the buffer."""
        r3, seed = self.cfg.r3, self.cfg.seed
        draws = [self.buffer.draw(seed, step, local.group, r3.perfect_ratio) for local in self.groups]
        share = self.geometry.group_share
        samples = [self.train_set[draw.index] for draw in draws for _ in range(share)]
        n = len(samples)
        prompts = [s.prompt for s in samples]
        sources = torch.cat([draw.image.expand(share, -1, -1, -1) for draw in draws])  # (n, 3, H, W)
        options = SamplingOptions(r3.temperature, r3.top_p, 0, r3.max_output_token_n_edit)
        thoughts = text_rollout(
            lambda rows, s: self.policy.reflect(sources[rows], prompts[rows], options, s),
            n,
            self.geometry.micro_batch,
            seed,
            step,
            self.first_position,
        )
        instructions = [extract_instruction(t) or NO_EDIT for t in thoughts.texts]
        kept = torch.tensor([is_no_edit(t) for t in thoughts.texts])
        images = self._images(
            EDIT,
            lambda rows: self.policy.encode_edit(sources[rows], instructions[rows]),
            r3.steps_edit,
            r3.enable_sde_edit,
            r3.max_sde_timestep_idx_for_edit,
            step,
        )
        prev = torch.tensor([draw.score for draw in draws]).repeat_interleave(share)
        perfect = torch.tensor([draw.perfect for draw in draws]).repeat_interleave(share)
        new = prev.clone()
        edited = (~kept).nonzero().squeeze(1)
        pixels = torch.cat([rollout.images for rollout in images])
        new[edited] = self.scorer.score(pixels[edited], [samples[i] for i in edited.tolist()])
        rewards = refine_rewards(thoughts.texts, prev, new, perfect, r3.format_weight)
        batch = self._stage_batch(REFINE, samples, thoughts, images, rewards)
        batch.stats |= reduce_over_ranks(  # per branch: a draw counts for each branch of its group
            self.dist,
            {
                "no_edit_rate": kept.float().tolist(),
                "delta/mean": rewards.delta.tolist(),
                "refine/drew_perfect": perfect.float().tolist(),
                "refine/missed_kind": [float(d.missed) for d in draws for _ in range(share)],
            },
        )
        return batch

    # -- advantages and π_old -------------------------------------------------------------------
    def _stage_batch(
        self,
        stage: str,
        samples: list[R3Sample],
        thoughts: Thoughts,
        images: list[ImageRollout],
        rewards: StageRewards,
    ) -> StageBatch:
        """Group advantages over every rank's branches in global order (a rank holds consecutive
        positions, so rank order is global order: the group sums run in the same order on any process
        count), this rank's rows kept."""
        r3, n = self.cfg.r3, len(samples)
        gather = functools.partial(_gather, self.dist)
        ids = torch.arange(self.geometry.branches_per_step) // r3.group_size  # group of each global position
        text, image = gather(rewards.text), gather(rewards.image)
        mask = gather(rewards.image_mask.float()) > 0.5
        mine = slice(self.first_position, self.first_position + n)
        text_adv = track_advantages(text, ids, scale_by_std=r3.scale_by_std)
        image_adv = track_advantages(image, ids, mask, scale_by_std=r3.scale_by_std)
        batch = StageBatch(
            stage, samples, thoughts, images, rewards, text_adv[mine], image_adv[mine], self.groups
        )
        if TEXT in self.tracks:
            batch.text_micro = self.prepare_text(thoughts)
        lengths = torch.tensor([float(c.numel()) for c in thoughts.completions])
        batch.stats = {
            "reward/mean": image.mean().item(), "reward/std": image.std().item(),
            "reward/text/mean": text.mean().item(), "reward/text/std": text.std().item(),
            "advantage/text/abs_mean": text_adv.abs().mean().item(),  # over the step's branches
            "advantage/image/abs_mean": image_adv.abs().mean().item(),
            "buffer/size": float(len(self.buffer)), "buffer/perfect_fraction": self.buffer.perfect.float().mean().item(),
            **reduce_over_ranks(self.dist, {  # per branch, pooled over ranks
                "format_rate": rewards.format.tolist(),
                "sde_step": [float(r.sde_step) for r in images for _ in range(len(r.images))],
                "completions/mean_length": lengths.tolist(),
                "completions/clipped_ratio": [float(t) for t in thoughts.truncated],
            }),
        }  # fmt: skip
        return batch

    @torch.no_grad()
    def prepare_text(self, thoughts: Thoughts) -> list[TextMicroBatch]:
        """π_old (the training path, right after the rollout) and π_ref on the rollout's micro-batches."""
        out = []
        for rows in micro_batches(len(thoughts), self.geometry.micro_batch):
            batch = self.policy.token_batch(thoughts, rows)
            old = self.policy.token_logprobs(batch)
            ref = (
                self.policy.token_logprobs(batch, reference=True) if self.cfg.r3.kl_weight_text > 0 else None
            )
            out.append(TextMicroBatch(rows, batch, old, ref))
        return out

    # -- the update -----------------------------------------------------------------------------
    def image_step(self, traj: Trajectory, cond: Any, spec: StepSpec) -> tuple[Any, Tensor | None]:
        """The trained step recomputed on the training path (gradients), and R3's KL to the reference."""
        velocity = functools.partial(conditioned, self.policy, cond)
        out = recompute_step(velocity, traj, 0, spec)
        if self.cfg.r3.kl_weight_image <= 0:
            return out, None
        with torch.no_grad(), self.policy.image_reference():
            ref = recompute_step(velocity, traj, 0, spec)
        return out, image_kl(out, ref.mean)

    def step_share(self, rows: slice) -> float:
        """What a micro-batch's row-mean loss is multiplied by before its backward: its rows' share of the
        step's branches over all processes, times the process count (the Dist averages over processes).
        Summed over every process's micro-batches that is the mean over the step's branches, whichever
        process holds which branch; the factors of two process counts differ by a power of two when the
        counts do, so the scaled gradients differ by exact powers of two."""
        return (rows.stop - rows.start) * self.dist.world_size / self.geometry.branches_per_step

    def update(self, batch: StageBatch) -> dict[str, float]:
        """One optimizer step on both tracks (the tracks that are tuned and have something to train)."""
        r3, dev = self.cfg.r3, self.device
        stats: dict[str, list[float]] = defaultdict(list)
        for mb in batch.text_micro:
            logp = self.policy.token_logprobs(mb.batch)
            loss = text_track_loss(
                logp,
                mb.old,
                batch.text_adv[mb.rows].to(dev),
                mb.batch.completion_mask,
                mb.ref,
                clip_range=r3.clip_range,
                ce_weight=r3.ce_weight,
                kl_weight=r3.kl_weight_text,
            )
            self.dist.backward(loss.loss * self.step_share(mb.rows))
            _collect(stats, loss.stats)
        for local, rollout in batch.group_rollouts():
            if IMAGE not in self.tracks or not rollout.traj.num_steps:
                continue
            for rows in micro_batches(len(local.positions), self.geometry.micro_batch):
                traj, mine = rollout.traj.index(rows), shifted(rows, local.rows.start)
                out, kl = self.image_step(traj, rollout.cond.index(rows), rollout.spec)
                loss = image_track_loss(
                    out,
                    traj.logprobs[:, 0],
                    batch.image_adv[mine].to(dev),
                    batch.rewards.image_mask[mine].to(dev),
                    kl,
                    clip_range=r3.clip_range,
                    mse_weight=r3.mse_weight,
                    kl_weight=r3.kl_weight_image,
                )
                self.dist.backward(loss.loss * self.step_share(rows))
                _collect(stats, loss.stats)
        max_norm = r3.max_grad_norm if r3.max_grad_norm > 0 else math.inf
        stats["grad_norm"].append(self.dist.clip_and_step(self.run.optimizer, self.params, max_norm))
        self.run.scheduler.step()
        self.run.global_step += 1
        summary = reduce_over_ranks(self.dist, stats)  # per micro-batch values pooled over ranks
        extremes = [
            abs(summary.get(f"{t}/ratio_{e}", 1.0) - 1) for t in (TEXT, IMAGE) for e in ("min", "max")
        ]
        return summary | {"ratio_error_max": max(extremes)}

    # -- logging, evaluation, checkpoints -------------------------------------------------------
    def _log_samples(self, step: int, batch: StageBatch) -> None:
        """Each branch of this rank: what it wrote, where its image was stochastic, what it earned; under
        the ``step`` its metrics are logged at (steps completed, :func:`step_after`)."""
        for local, rollout in batch.group_rollouts():
            for i, position in zip(range(local.rows.start, local.rows.stop), local.positions, strict=True):
                row = {
                    "step": step_after(step), "stage": batch.stage, "rank": self.dist.rank, "group": local.group,
                    "position": position, "index": batch.samples[i].index, "prompt": batch.samples[i].prompt,
                    "text": batch.thoughts.texts[i], "sde_step": rollout.sde_step,
                    "noise_sum": rollout.noise_sum, "reward_image": float(batch.rewards.image[i]),
                    "reward_text": float(batch.rewards.text[i]), "format": float(batch.rewards.format[i]),
                }  # fmt: skip
                self.sample_log.write(json.dumps(row) + "\n")
        self.sample_log.flush()

    def evaluate(self, step: int) -> dict[str, float]:
        """Multi-round evaluation (ODE, greedy text) on the first ``r3.eval_max_prompts`` prompts."""
        r3 = self.cfg.r3
        samples = self.val_set[: r3.eval_max_prompts or len(self.val_set)]
        result = evaluate_rounds(self.policy, samples, self.scorer, r3, self.cfg.seed)
        save_strips(result, self.run_dir / "images" / grid_name("eval", step_after(step)))
        return {f"eval/{k}": float(v) for k, v in result.metrics.to_dict().items()}

    def cleanup(self) -> None:
        self.sample_log.close()
        self.run.close()


STAGE_NAMES = (REASON, REFINE)


def console_line(m: dict[str, float]) -> str:
    """The step's stage, reward (the text track's too), format rate, worst |ratio − 1| and seconds."""
    return (
        f"{STAGE_NAMES[int(m['stage'])]:<6} reward {m['reward/mean']:+.4g}  text {m['reward/text/mean']:+.4g}  "
        f"format {m['format_rate']:.2f}  |ratio-1| {m['ratio_error_max']:.1e}  {m['time/step']:.1f}s"
    )


def compute_dtype(r3: R3Config, tracks: list[str], family: str = "r3_composite") -> str:
    """The lowest precision a trained track computes in: ``float16`` when any model the tuned tracks run
    (text: the text policy; image: generator and editor; BAGEL: its one network) is fp16, so the Dist
    scales the one joint loss (scaling by a power of two is exact, so the bf16 / fp32 parts lose nothing)."""
    models = track_models(family, r3.policy)
    dtypes = {model.dtype for track in tracks for model in models[track]}
    return next((d for d in ("float16", "bfloat16") if d in dtypes), "float32")


def local_groups(geometry: R3Geometry, rank: int) -> list[LocalGroup]:
    """The groups process ``rank`` holds, in order: its consecutive positions cut at group boundaries."""
    first, share = geometry.first_position(rank), geometry.group_share
    return [
        LocalGroup(
            start // geometry.group_size,
            slice(start - first, start - first + share),
            list(range(start, start + share)),
        )
        for start in range(first, first + geometry.per_process, share)
    ]


def _encode_shifted(encode: Any, offset: int, rows: slice) -> Any:
    """``encode`` of a group's ``rows``, which sit at ``offset`` among this process's rows."""
    return encode(shifted(rows, offset))


def _gather(dist: Dist, values: Tensor) -> Tensor:
    """Every rank's (n,) values in rank order, on the CPU."""
    return dist.gather(values.to(dist.device)).cpu()


def _collect(stats: dict[str, list[float]], values: dict[str, float]) -> None:
    for key, value in values.items():
        stats[key].append(float(value))


def splits_read(cfg: R3TrainConfig) -> tuple[str, ...]:
    """None of ``data.*``: R3 reads ``r3.train_data_path`` / ``val_data_path`` (or its offline stand-in)."""
    return ()


ONPOLICY_SPLITS: tuple[str, ...] = ()
"""The ``data.*`` prompt files ``rlgen check-onpolicy`` reads: none (as :func:`splits_read`)."""


def check_onpolicy(typed: R3TrainConfig, cfg: DictConfig, perturb: Perturb) -> tuple[float, bool]:
    """``rlgen check-onpolicy``: both tracks of a unified policy, in the reason (step 0) and the refine
    (step 1) stage (``r3/onpolicy.py``); the worst error and whether every row passed."""
    from rlgen_cli.r3.onpolicy import check_stage, print_report

    tolerances = typed.check.tolerance, typed.check.text_tolerance
    with opened(R3Recipe(typed, cfg)) as recipe:
        rows = check_stage(recipe, 0, perturb, *tolerances) + check_stage(recipe, 1, perturb, *tolerances)
    passed = print_report(rows)
    return max(row.error for row in rows), passed


def run(cfg: R3TrainConfig, raw_cfg: DictConfig) -> dict[str, Any]:
    """Entry point of ``rlgen train`` for unified policies (``model.family`` in ``schema.r3.R3_FAMILIES``)."""
    with opened(R3Recipe(cfg, raw_cfg)) as recipe:
        return recipe.train()
