"""Flow-matching pretraining on ground-truth images: how the ShapesEval base model is made.

Each optimizer step draws ``algo.pretrain.batch_size`` rows of the train prompts, renders their
ground-truth images (``source=shapes``: the ShapesEval renderer, a fresh random scene per draw), and
regresses the velocity ``ε − x_0`` at ``x_σ = (1 − σ)·x_0 + σ·ε`` (rectified flow, the convention of
every family here). A share of prompts is replaced by the empty prompt so classifier-free guidance has an
unconditional branch. The learning rate warms up linearly, then decays on a cosine to
``min_lr_ratio``·lr at the run's last step — a function of the global step alone, so resume is exact.

:func:`pretrain_epoch` runs ``algo.pretrain.steps_per_epoch`` such steps; :func:`run` wraps the epochs in
the shared loop (``recipes/flow_run.py``: ODE eval scored by the reward, EMA, logs, checkpoints, resume), so
``weights/`` of the last checkpoint (the EMA weights when ``algo.ema`` is on) is the pretrained model:

    rlgen train experiment=shapes_pretrain
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from rlgen_cli.errors import UserError
from rlgen_cli.recipes import common, flow_run
from rlgen_cli.recipes.flow_run import FlowRun
from rlgen_cli.recipes.flow_run import splits_read as splits_read
from rlgen_cli.recipes.plan_shape import PlanShape
from rlgen_cli.recipes.plan_trace import EpochTracer, replaced
from rlgen_cli.recipes.session import session
from rlgen_cli.schema.recipes import FlowPretrainTrainConfig
from rlgen_cli.sde.noise import Stream, stream_seed
from rlgen_cli.training.control.schedule import decay_factor
from rlgen_cli.training.reporting.progress import Progress


def learning_rate(step: int, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio``·``base_lr`` at ``total``."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * decay_factor(progress, "cosine", min_ratio)


def sample_sigmas(n: int, kind: str, generator: torch.Generator) -> Tensor:
    """Training σ in (0, 1): logit-normal (SD3's default) or uniform."""
    if kind == "uniform":
        return torch.rand(n, generator=generator)
    return torch.sigmoid(torch.randn(n, generator=generator))


@contextlib.contextmanager
def unguided(policy: Any) -> Iterator[None]:
    """Train the conditional velocity itself: classifier-free guidance is a sampling-time combination."""
    scale = policy.guidance_scale
    policy.guidance_scale = 1.0
    try:
        yield
    finally:
        policy.guidance_scale = scale


def pretrain_epoch(run: FlowRun, epoch: int, progress: Progress) -> dict[str, float]:
    """``algo.pretrain.steps_per_epoch`` optimizer steps; the epoch's mean loss and last learning rate."""
    pre = run.cfg.algo.pretrain
    losses: list[float] = []
    task = progress.task("pretrain", total=pre.steps_per_epoch)
    for step in range(pre.steps_per_epoch):
        losses.append(pretrain_step(run, epoch, step))
        progress.advance(task, description=f"pretrain loss {losses[-1]:.4f}")
    progress.remove(task)
    loss = common.reduce_over_ranks(run.dist, {"loss": losses})["loss"]  # every process's steps, pooled
    return {
        "lr": run.optimizer.param_groups[0]["lr"],
        "loss": loss,
        "global_step": run.global_step,
        **run.dist.loss_scale_metrics(),
    }


def pretrain_step(run: FlowRun, epoch: int, step: int) -> float:
    """One optimizer step on this process's share of a fresh batch; returns its loss."""
    cfg, pre, policy, dist = run.cfg, run.cfg.algo.pretrain, run.policy, run.dist
    lr = learning_rate(
        run.global_step, cfg.algo.lr, pre.warmup_steps, cfg.epochs * pre.steps_per_epoch, pre.min_lr_ratio
    )
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    prompts, images = pretrain_batch(run, epoch, step)
    generator = torch.Generator().manual_seed(
        stream_seed(cfg.seed, epoch, step * dist.world_size + dist.rank, Stream.PRETRAIN_NOISE)
    )
    x0 = policy.encode_images(images)
    sigma = sample_sigmas(len(x0), pre.sigma_sampling, generator).to(run.device)
    noise = torch.randn(x0.shape, generator=generator).to(run.device)
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    with unguided(policy):
        v = policy.velocity((1 - s) * x0 + s * noise, sigma, policy.encode(prompts))
    loss = torch.nn.functional.mse_loss(v, noise - x0)
    dist.backward(loss, sync=True)
    flow_run.optimizer_step(run)
    return loss.item()


def pretrain_batch(run: FlowRun, epoch: int, step: int) -> tuple[list[str], Tensor]:
    """This process's rows of the step's global batch: prompts (some emptied) and rendered images."""
    from rlgen_cli.shapes.render import RenderConfig, render_batch

    cfg, pre, dist = run.cfg, run.cfg.algo.pretrain, run.dist
    generator = torch.Generator().manual_seed(stream_seed(cfg.seed, epoch, step, Stream.PRETRAIN_BATCH))
    rows = torch.randint(len(run.train_set), (pre.batch_size,), generator=generator).tolist()
    scenes = torch.randint(2**62, (pre.batch_size,), generator=generator).tolist()
    dropped = (torch.rand(pre.batch_size, generator=generator) < pre.cond_dropout).tolist()
    share = pre.batch_size // dist.world_size
    mine = slice(dist.rank * share, (dist.rank + 1) * share)
    examples, prompts, metadata = flow_run.examples_of(run.train_set, rows[mine])
    if any(not meta.get("include") for meta in metadata):
        raise UserError(
            f"{cfg.data.train}: algo.pretrain.source=shapes needs ShapesEval metadata (data=shapes)"
        )
    images = render_batch(metadata, scenes[mine], RenderConfig(size=cfg.model.resolution))
    return ["" if drop else prompt for prompt, drop in zip(prompts, dropped[mine])], images


def require_pretrainable(run: FlowRun) -> None:
    """A pixel-space family (``capabilities.encodes_images``) and a batch that splits over the processes."""
    cfg = run.cfg
    if not run.policy.capabilities.encodes_images:
        raise UserError(
            f"model.family={cfg.model.family} cannot be pretrained here: flow_pretrain needs a pixel-space "
            "family with encode_images (model=shapes_unet)"
        )
    if cfg.algo.pretrain.batch_size % run.dist.world_size:
        raise UserError(
            f"algo.pretrain.batch_size={cfg.algo.pretrain.batch_size} must be divisible by the "
            f"{run.dist.world_size} processes"
        )


class PretrainTracer(EpochTracer):
    """Flow-matching pretraining (``recipe=flow_pretrain``): no rollout — its sampling phase is the
    evaluation, one batch of ``algo.sample_batch_size`` sampled (ODE) and decoded; and
    ``pretrain_step`` for one optimizer step on this process's share of
    ``algo.pretrain.batch_size``: the batch's ground-truth images rendered and encoded, the unguided
    forward, the loss, the backward, the clip, the AdamW step and the EMA. Nothing is kept from one phase
    to the other."""

    phase = "evaluation"
    update_copies = 0

    def kept_per_sample(self) -> int:
        return 0

    def _rollout(self, batch: int) -> None:
        from rlgen_cli.sde.sampling import sample_latents

        cfg, run = self.cfg, self.run
        x0 = sample_latents(run.policy, [""] * batch, cfg.model.eval_num_steps, batch, cfg.seed)
        run.policy.decode(x0)  # the images go to host memory
        self._keep(batch, (), run.policy.last_cond)

    def _update_of(self, micro_batch: int) -> Callable[[], Any]:
        algo = replaced(self.cfg.algo, pretrain=replaced(self.cfg.algo.pretrain, batch_size=micro_batch))
        run = replaced(self.run, cfg=replaced(self.cfg, algo=algo), train_set=self._train_set())
        return lambda: pretrain_step(run, 0, 0)

    def _train_set(self) -> Any:
        from pathlib import Path

        from rlgen_cli.data.paths import load_prompts

        workdir = Path(self.cfg.run_dir) if self.cfg.run_dir else None
        return load_prompts(self.cfg.data.train, workdir, "data.train")


class PretrainShape(PlanShape):
    """Pretraining rolls nothing out; each process trains its share of ``algo.pretrain.batch_size`` in one
    micro-batch per step."""

    tracer = PretrainTracer

    def require_plannable(self, cfg: Any, policy: Any) -> None:
        dist = types.SimpleNamespace(world_size=cfg.launcher.world_size)
        require_pretrainable(types.SimpleNamespace(cfg=cfg, policy=policy, dist=dist))

    def samples_per_epoch(self, cfg: Any) -> int:
        return 0

    def micro_batch(self, cfg: Any) -> tuple[int, str | None]:
        return max(cfg.algo.pretrain.batch_size // cfg.launcher.world_size, 1), None

    def micro_batches_per_process(self, cfg: Any) -> int:
        return 1


PLAN = PretrainShape()
"""What ``rlgen plan`` reads of this recipe."""


def run(cfg: FlowPretrainTrainConfig, raw_cfg: DictConfig) -> dict[str, Any]:
    """Entry point: the shared session (``recipes/flow_run.py``) around :func:`pretrain_epoch`; the last epoch's metrics."""
    with session(cfg, raw_cfg) as s:
        require_pretrainable(s.run)
        for epoch in s.epochs():
            metrics = pretrain_epoch(s.run, epoch, s.progress)
            if s.end_epoch(epoch, metrics, console_line, headline=f"loss {metrics['loss']:.4g}"):
                break
    return s.metrics


def console_line(m: dict[str, float]) -> str:
    """The epoch's loss, and the evaluation when there was one."""
    return f"loss {m['loss']:.4g}{flow_run.eval_suffix(m)}"
