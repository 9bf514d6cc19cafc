"""Flow-GRPO: online reinforcement learning of a flow-matching image model.

Liu et al., 2025, "Flow-GRPO: Training Flow Matching Models via Online RL". Each epoch:

1. **rollout** — K samples per prompt with an SDE sampler; the stochastic steps' transitions and
   log-probabilities are stored (fp32) as a :class:`~rlgen_cli.sde.rollout.Trajectory`;
2. **score** — the reward mix scores the decoded images (every component logged);
3. **advantages** — rewards normalised within each prompt's group, groups keyed by dataset index;
4. **update** — ``num_inner_epochs`` passes of the clipped objective over the trained steps, with
   gradient accumulation, grad-norm clipping and an optional KL to the reference (LoRA disabled);
5. **log / eval / checkpoint** — metrics.jsonl, periodic ODE evaluation, full-state checkpoints.

Deliberate choices: samples keep their rollout batches in training (no shuffle), so with
``train_batch_size == sample_batch_size`` the first update is exactly on-policy (ratio == 1, checked by
``rlgen check-onpolicy``); all randomness of an epoch derives from (seed, epoch), so a resumed run
draws the same noise as an uninterrupted one.

    rlgen train                                     # tiny SD3 + JPEG compressibility on the CPU
    rlgen train model=sd3 reward=jpeg_compressibility algo.lr=1e-4
"""

from __future__ import annotations

import logging
import math
import resource
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from rlgen_cli.algos import combine_rewards, grpo_loss
from rlgen_cli.data import GroupSampler, PromptDataset
from rlgen_cli.data.paths import load_prompts
from rlgen_cli.models import Cond, FlowPolicy, build_policy, resolve_device
from rlgen_cli.rewards import RewardBatch, build_mix
from rlgen_cli.schema.flow import TrainConfig
from rlgen_cli.sde import step_kl
from rlgen_cli.sde.rollout import StepSpec, Trajectory, recompute_step, rollout
from rlgen_cli.sde.window import plan_window
from rlgen_cli.training.checkpoint import (
    COUNTERS_KEY,
    OPTIMIZER_KEY,
    SAMPLER_KEY,
    resolve_resume,
    save_checkpoint,
    set_rng_state,
)
from rlgen_cli.training.images import save_grid
from rlgen_cli.training.metrics import JsonlLogger
from rlgen_cli.training.plots import plot_runs
from rlgen_cli.training.progress import Progress

log = logging.getLogger(__name__)
REWARD_CURVE = "reward_curve.png"


@dataclass
class Rollouts:
    """One epoch's samples, in rollout order. N = prompts_per_epoch × group_size."""

    indices: Tensor  # (N,) dataset indices: the group keys
    prompts: list[str]
    metadata: list[dict]
    cond: Cond  # (N, ...)
    traj: Trajectory  # (N, S, ...)
    images: Tensor  # (N, 3, H, W) in [0, 1]


def epoch_generator(seed: int, epoch: int, device: torch.device) -> torch.Generator:
    """The RNG of one epoch: a pure function of (seed, epoch), so resume redraws the same noise."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + epoch)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def batches(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


class FlowRLRecipe:
    """setup → train (rollout → score → advantages → update → log → eval → checkpoint) → cleanup."""

    def __init__(self, cfg: TrainConfig, raw_cfg: DictConfig) -> None:
        self.cfg = cfg
        self.raw_cfg = raw_cfg
        self.run_dir = Path(cfg.run_dir)

    # -- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        self.device = resolve_device(cfg.device)
        self.policy: FlowPolicy = build_policy(cfg.model, self.device)
        self.reward = build_mix(dict(cfg.reward.weights), **{k: dict(v) for k, v in cfg.reward.kwargs.items()})
        self.train_set: PromptDataset = load_prompts(cfg.data.train)
        self.test_set: PromptDataset = load_prompts(cfg.data.test)
        self.sampler = GroupSampler(
            len(self.train_set), cfg.algo.prompts_per_epoch, cfg.algo.group_size, seed=cfg.seed
        )
        noise_level = cfg.sampler.noise_level if cfg.sampler.noise_level is not None else cfg.model.noise_level
        self.spec = StepSpec(cfg.sampler.kind, noise_level, cfg.sampler.logprob_reduce, cfg.sampler.logprob_form)
        self.plan = plan_window(
            cfg.algo.window.kind, cfg.model.num_steps, timestep_fraction=cfg.algo.window.timestep_fraction
        )
        self.optimizer = torch.optim.AdamW(
            self.policy.trainable_parameters(), lr=cfg.algo.lr, betas=(cfg.algo.adam_beta1, cfg.algo.adam_beta2),
            eps=cfg.algo.adam_eps, weight_decay=cfg.algo.weight_decay,
        )  # fmt: skip
        self.start_epoch, self.global_step = 0, 0
        self._maybe_resume()
        self.logger = JsonlLogger(self.run_dir)
        n_params = sum(p.numel() for p in self.policy.trainable_parameters())
        log.info(
            "%s on %s: %d trainable parameters, %d prompts × %d samples per epoch, %d trained of %d steps",
            cfg.model.family, self.device, n_params, cfg.algo.prompts_per_epoch, cfg.algo.group_size,
            len(self.plan.train_steps), self.plan.num_steps,
        )  # fmt: skip

    def _maybe_resume(self) -> None:
        ckpt = resolve_resume(self.cfg.resume, self.run_dir)
        if ckpt is None:
            return
        state = ckpt.state()
        self.policy.load_trainable(ckpt.weights)
        self.optimizer.load_state_dict(state[OPTIMIZER_KEY])
        self.sampler.load_state_dict(state[SAMPLER_KEY])
        set_rng_state(state["rng"])
        self.start_epoch = state[COUNTERS_KEY]["epoch"]
        self.global_step = state[COUNTERS_KEY]["global_step"]
        log.info("resumed from %s at epoch %d", ckpt.path, self.start_epoch)

    # -- the loop -------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        cfg = self.cfg
        metrics: dict[str, float] = {}
        with Progress(enabled=cfg.progress) as progress:
            epochs = progress.task("epochs", total=cfg.epochs, completed=self.start_epoch)
            for epoch in range(self.start_epoch, cfg.epochs):
                metrics = self.train_epoch(epoch, progress)
                if cfg.eval_every and (epoch == 0 or _due(epoch, cfg.eval_every, cfg.epochs)):
                    metrics |= self.evaluate(epoch, progress)
                self.logger.log(metrics, step=epoch)
                self._log_console(epoch, metrics)
                if _due(epoch, cfg.save_every, cfg.epochs):
                    self.save(epoch + 1)
                progress.advance(epochs, description=f"epoch {epoch + 1}: reward {metrics['reward/mean']:+.4g}")
        plot_runs([self.run_dir], self.run_dir / REWARD_CURVE)
        return metrics

    def train_epoch(self, epoch: int, progress: Progress) -> dict[str, float]:
        timings: dict[str, float] = {}
        with _timed(timings, "time/rollout"):
            rollouts = self.sample_epoch(epoch, progress)
        with _timed(timings, "time/reward"):
            components, reward_details = self.score(rollouts.images, rollouts.prompts, rollouts.metadata)
        advantages, adv_stats = combine_rewards(
            components, dict(self.cfg.reward.weights), rollouts.indices, mode=self.cfg.reward.aggregation,
            global_std=self.cfg.algo.global_std, clip_max=self.cfg.algo.adv_clip_max,
        )  # fmt: skip
        with _timed(timings, "time/update"):
            update_stats = self.update(rollouts, advantages, progress)
        if self.cfg.images_every and epoch % self.cfg.images_every == 0:
            save_grid(rollouts.images, self.run_dir / "images" / f"train_epoch_{epoch:05d}.png", upscale=2)
        total = sum(self.cfg.reward.weights[k] * v for k, v in components.items())
        return {
            "reward/mean": total.mean().item(), "reward/std": total.std().item(),
            **{f"reward/{k}/mean": v.mean().item() for k, v in components.items()},
            **reward_details, "zero_std_ratio": adv_stats.zero_std_ratio,
            "num_groups": adv_stats.num_groups, **update_stats, **timings,
            "peak_memory_mb": peak_memory_mb(self.device), "global_step": self.global_step,
        }  # fmt: skip

    # -- phases ---------------------------------------------------------------------------------
    def sample_epoch(self, epoch: int, progress: Progress) -> Rollouts:
        """Roll out this epoch's prompts in batches of ``sample_batch_size``."""
        indices = self.sampler.indices_for_epoch(epoch)
        examples = [self.train_set[i] for i in indices]
        prompts = [ex.prompt for ex in examples]
        generator = epoch_generator(self.cfg.seed, epoch, self.device)
        conds, trajs, images = [], [], []
        task = progress.task("rollout", total=len(indices))
        for part in batches(len(indices), self.cfg.algo.sample_batch_size):
            cond = self.policy.encode(prompts[part])
            traj = self.rollout_batch(cond, part.stop - part.start, generator)
            conds.append(cond)
            trajs.append(traj)
            images.append(self.policy.decode(traj.final))
            progress.advance(task, part.stop - part.start)
        progress.remove(task)
        return Rollouts(
            indices=torch.tensor(indices), prompts=prompts, metadata=[dict(ex.metadata) for ex in examples],
            cond=Cond.cat(conds), traj=Trajectory.cat(trajs), images=torch.cat(images).cpu(),
        )  # fmt: skip

    def rollout_batch(self, cond: Cond, n: int, generator: torch.Generator) -> Trajectory:
        x = self.policy.noise(n, generator)
        sigmas = self.policy.schedule(self.plan.num_steps, x)
        return rollout(lambda x_, s_: self.policy.velocity(x_, s_, cond), x, sigmas, self.plan, self.spec, generator)

    @torch.no_grad()
    def score(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> tuple[dict[str, Tensor], dict]:
        """Per-component rewards (N,) and scalar summaries of the mix's details."""
        result = self.reward.score(RewardBatch(prompts=prompts, images=images, metadata=metadata))
        components = {name: torch.as_tensor(result.details[name], dtype=torch.float32) for name in self.reward.rewards}
        bad = {k: int((~torch.isfinite(v)).sum()) for k, v in components.items() if not torch.isfinite(v).all()}
        if bad:
            raise RuntimeError(f"rewards failed for some samples {bad}; a failed score is never replaced by 0")
        summaries = {
            f"reward/{key}/mean": float(torch.as_tensor(value, dtype=torch.float32).mean())
            for key, value in result.details.items()
            if "/" in key and isinstance(value, Tensor) and value.is_floating_point()
        }
        return components, summaries

    def step_logprob(self, traj: Trajectory, cond: Cond, j: int, spec: StepSpec) -> tuple[Tensor, Tensor | None]:
        """New log-prob (B,) of stored step ``j`` — and its KL to the reference when β > 0."""
        out = recompute_step(lambda x, s: self.policy.velocity(x, s, cond), traj, j, spec)
        if self.cfg.algo.beta <= 0:
            return out.logprob, None
        with torch.no_grad(), self.policy.reference():
            ref = recompute_step(lambda x, s: self.policy.velocity(x, s, cond), traj, j, spec)
        dt = traj.sigmas_next[j] - traj.sigmas[j]
        return out.logprob, step_kl(out.mean, ref.mean, out.std, dt, form=self.cfg.algo.kl_form)

    def update(self, rollouts: Rollouts, advantages: Tensor, progress: Progress) -> dict[str, float]:
        """``num_inner_epochs`` passes of clipped policy-gradient steps over every trained step."""
        algo = self.cfg.algo
        n, steps = len(rollouts.indices), rollouts.traj.num_steps
        micro_batches = list(batches(n, algo.train_batch_size))
        stats: dict[str, list[float]] = defaultdict(list)
        task = progress.task("update", total=algo.num_inner_epochs * len(micro_batches))
        for _ in range(algo.num_inner_epochs):
            for k, part in enumerate(micro_batches):
                traj, cond = rollouts.traj.index(part), rollouts.cond.index(part)
                adv = advantages[part].to(self.device)
                for j in range(steps):
                    new_logp, kl = self.step_logprob(traj, cond, j, self.spec)
                    out = grpo_loss(new_logp, traj.logprobs[:, j], adv, clip_range=algo.clip_range, kl=kl, beta=algo.beta)
                    (out.loss / (steps * algo.gradient_accumulation_steps)).backward()
                    for key, value in {**out.stats, "policy_loss": out.policy_loss.item(), "kl_loss": out.kl_loss.item()}.items():
                        stats[key].append(value)
                if (k + 1) % algo.gradient_accumulation_steps == 0:
                    stats["grad_norm"].append(self.optimizer_step())
                progress.advance(task)
        progress.remove(task)
        return _summarise(stats)

    def optimizer_step(self) -> float:
        params = self.policy.trainable_parameters()
        max_norm = self.cfg.algo.max_grad_norm if self.cfg.algo.max_grad_norm > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return grad_norm

    @torch.no_grad()
    def evaluate(self, epoch: int, progress: Progress) -> dict[str, float]:
        """ODE sampling on the first test prompts with a fixed seed, scored by the reward mix."""
        n_prompts = self.cfg.data.eval_num_prompts or len(self.test_set)
        examples = [self.test_set[i] for i in range(min(n_prompts, len(self.test_set)))]
        examples = [ex for ex in examples for _ in range(self.cfg.data.eval_images_per_prompt)]
        images = self.sample_images([ex.prompt for ex in examples], self.cfg.model.eval_num_steps, progress)
        components, _ = self.score(images, [ex.prompt for ex in examples], [dict(ex.metadata) for ex in examples])
        save_grid(images, self.run_dir / "images" / f"eval_epoch_{epoch:05d}.png", upscale=2)
        total = sum(self.cfg.reward.weights[k] * v for k, v in components.items())
        return {"eval/reward/mean": total.mean().item(), **{f"eval/reward/{k}/mean": v.mean().item() for k, v in components.items()}}

    def sample_images(self, prompts: list[str], num_steps: int, progress: Progress) -> Tensor:
        """Deterministic ODE samples (B, 3, H, W) in [0, 1], the same noise at every evaluation."""
        return sample_images(self.policy, prompts, num_steps, self.cfg.algo.sample_batch_size, self.cfg.seed, progress)

    def save(self, epochs_done: int) -> None:
        state = {
            OPTIMIZER_KEY: self.optimizer.state_dict(), SAMPLER_KEY: self.sampler.state_dict(),
            COUNTERS_KEY: {"epoch": epochs_done, "global_step": self.global_step},
        }  # fmt: skip
        ckpt = save_checkpoint(self.run_dir, epochs_done, self.policy, state, self.raw_cfg, self.cfg.keep_last)
        log.info("saved %s", ckpt.path)

    def _log_console(self, epoch: int, m: dict[str, float]) -> None:
        extra = f" eval {m['eval/reward/mean']:+.4g}" if "eval/reward/mean" in m else ""
        log.info(
            "epoch %d  reward %+.4g±%.3g%s  kl %.2e  clipfrac %.3f  |ratio-1|max %.2e  %.1fs",
            epoch, m["reward/mean"], m["reward/std"], extra, m.get("kl_loss", 0.0), m.get("clipfrac", 0.0),
            max(abs(m.get("ratio_max", 1) - 1), abs(1 - m.get("ratio_min", 1))),
            m["time/rollout"] + m["time/reward"] + m["time/update"],
        )  # fmt: skip

    def cleanup(self) -> None:
        self.logger.close()


@torch.no_grad()
def sample_images(
    policy: FlowPolicy, prompts: list[str], num_steps: int, batch_size: int, seed: int, progress: Progress,
    spec: StepSpec | None = None,
) -> Tensor:
    """Sample images for ``prompts`` (ODE unless ``spec`` says otherwise), batch by batch; (B, 3, H, W)."""
    spec = spec or StepSpec("ode", 0.0)
    plan = plan_window("all", num_steps, timestep_fraction=1.0)
    generator = torch.Generator(device=policy.device).manual_seed(seed)
    images = []
    task = progress.task("sampling", total=len(prompts))
    for part in batches(len(prompts), batch_size):
        cond = policy.encode(prompts[part])
        x = policy.noise(part.stop - part.start, generator)
        traj = rollout(lambda x_, s_: policy.velocity(x_, s_, cond), x, policy.schedule(num_steps, x), plan, spec, generator)
        images.append(policy.decode(traj.final).cpu())
        progress.advance(task, part.stop - part.start)
    progress.remove(task)
    return torch.cat(images)


def _due(epoch: int, every: int, total: int) -> bool:
    """Periodic work after ``epoch`` (0-based): every ``every`` epochs and always after the last."""
    return epoch + 1 == total or (every > 0 and (epoch + 1) % every == 0)


@contextmanager
def _timed(timings: dict[str, float], key: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[key] = time.perf_counter() - start


def _summarise(stats: dict[str, list[float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, values in stats.items():
        if key == "ratio_min":
            out[key] = min(values)
        elif key == "ratio_max":
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def run(cfg: TrainConfig, raw_cfg: DictConfig) -> dict[str, Any]:
    """Entry point: the recipe, start to finish."""
    recipe = FlowRLRecipe(cfg, raw_cfg)
    recipe.setup()
    try:
        return recipe.train()
    finally:
        recipe.cleanup()
