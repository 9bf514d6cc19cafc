"""Flow-matching pretraining on ground-truth images: how the ShapesEval base model is made.

Each optimizer step draws ``algo.pretrain.batch_size`` rows of the train prompts, renders their
ground-truth images (``source=shapes``: the ShapesEval renderer, a fresh random scene per draw), and
regresses the velocity ``ε − x_0`` at ``x_σ = (1 − σ)·x_0 + σ·ε`` (rectified flow, the convention of
every family here). A share of prompts is replaced by the empty prompt so classifier-free guidance has an
unconditional branch. The learning rate warms up linearly, then decays on a cosine to
``min_lr_ratio``·lr at the run's last step — a function of the global step alone, so resume is exact.

The loop around the epoch (ODE eval scored by the reward, EMA, logs, checkpoints, resume) is
:class:`~rlgen_cli.recipes.flow_rl.FlowRLRecipe`'s, so ``weights/`` of the last checkpoint (the EMA
weights when ``algo.ema`` is on) is the pretrained model:

    rlgen train experiment=shapes_pretrain
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from rlgen_cli.recipes.flow_rl import FlowRLRecipe
from rlgen_cli.schema.errors import UserError
from rlgen_cli.schema.flow import TrainConfig
from rlgen_cli.sde.noise import stream_seed
from rlgen_cli.training.progress import Progress
from rlgen_cli.training.schedule import decay_factor

PRETRAIN_STREAM = 5  # salt of the pretraining draws (rows, scenes, dropout, σ, ε)


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


class PretrainEpoch:
    """``algo.pretrain.steps_per_epoch`` flow-matching steps, plugged into :class:`FlowRLRecipe`."""

    def __call__(self, recipe: FlowRLRecipe, epoch: int, progress: Progress) -> dict[str, float]:
        pre = recipe.cfg.algo.pretrain
        if not hasattr(recipe.policy, "encode_images"):
            raise UserError(
                f"model.family={recipe.cfg.model.family} cannot be pretrained here: flow_pretrain needs a "
                "pixel-space family with encode_images (model=shapes_unet)"
            )
        losses: list[float] = []
        task = progress.task("pretrain", total=pre.steps_per_epoch)
        for step in range(pre.steps_per_epoch):
            losses.append(self.step(recipe, epoch, step))
            progress.advance(task, description=f"pretrain loss {losses[-1]:.4f}")
        progress.remove(task)
        loss = sum(losses) / len(losses)
        return {
            "loss": loss, "lr": recipe.optimizer.param_groups[0]["lr"], "global_step": recipe.global_step,
            "time/rollout": 0.0, "time/reward": 0.0, "time/update": 0.0,
        }  # fmt: skip

    def step(self, recipe: FlowRLRecipe, epoch: int, step: int) -> float:
        """One optimizer step on this rank's share of a fresh batch; returns its loss."""
        cfg, pre, policy = recipe.cfg, recipe.cfg.algo.pretrain, recipe.policy
        total_steps = cfg.epochs * pre.steps_per_epoch
        lr = learning_rate(recipe.global_step, cfg.algo.lr, pre.warmup_steps, total_steps, pre.min_lr_ratio)
        for group in recipe.optimizer.param_groups:
            group["lr"] = lr
        prompts, images = self.batch(recipe, epoch, step)
        generator = torch.Generator().manual_seed(
            stream_seed(
                cfg.seed, epoch, step * recipe.dist.world_size + recipe.dist.rank, PRETRAIN_STREAM + 1
            )
        )
        x0 = policy.encode_images(images)
        sigma = sample_sigmas(len(x0), pre.sigma_sampling, generator).to(recipe.device)
        noise = torch.randn(x0.shape, generator=generator).to(recipe.device)
        s = sigma.view(-1, *([1] * (x0.dim() - 1)))
        with unguided(policy):
            cond = policy.encode(prompts)
            v = policy.velocity((1 - s) * x0 + s * noise, sigma, cond)
        loss = torch.nn.functional.mse_loss(v, noise - x0)
        recipe.dist.backward(loss, sync=True)
        recipe.optimizer_step()
        return loss.item()

    @staticmethod
    def batch(recipe: FlowRLRecipe, epoch: int, step: int) -> tuple[list[str], Tensor]:
        """This rank's rows of the step's global batch: prompts (some emptied) and rendered images."""
        from rlgen_cli.shapes.render import RenderConfig, render_batch

        cfg, pre, dist = recipe.cfg, recipe.cfg.algo.pretrain, recipe.dist
        if pre.batch_size % dist.world_size:
            raise UserError(
                f"algo.pretrain.batch_size={pre.batch_size} must be divisible by the {dist.world_size} processes"
            )
        generator = torch.Generator().manual_seed(stream_seed(cfg.seed, epoch, step, PRETRAIN_STREAM))
        rows = torch.randint(len(recipe.train_set), (pre.batch_size,), generator=generator).tolist()
        scenes = torch.randint(2**62, (pre.batch_size,), generator=generator).tolist()
        dropped = (torch.rand(pre.batch_size, generator=generator) < pre.cond_dropout).tolist()
        share = pre.batch_size // dist.world_size
        mine = slice(dist.rank * share, (dist.rank + 1) * share)
        examples = [recipe.train_set[i] for i in rows[mine]]
        metadata = [dict(ex.metadata) for ex in examples]
        if any(not meta.get("include") for meta in metadata):
            raise UserError(
                f"{cfg.data.train}: algo.pretrain.source=shapes needs ShapesEval metadata (data=shapes)"
            )
        images = render_batch(metadata, scenes[mine], RenderConfig(size=cfg.model.resolution))
        prompts = ["" if drop else ex.prompt for ex, drop in zip(examples, dropped[mine])]
        return prompts, images


def run(cfg: TrainConfig, raw_cfg: DictConfig) -> dict[str, Any]:
    """Entry point: the shared flow loop with the pretraining epoch plugged in."""
    recipe = FlowRLRecipe(cfg, raw_cfg, epoch_fn=PretrainEpoch())
    recipe.setup()
    try:
        return recipe.train()
    finally:
        recipe.cleanup()
