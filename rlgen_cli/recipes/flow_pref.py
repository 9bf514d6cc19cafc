"""Flow-DPO and reward-filtered SFT: preference and imitation objectives on online samples.

* **Flow-DPO** (Diffusion-DPO, Wallace et al. 2023, in its flow-matching form, Liu et al. 2025): each
  epoch the *reference* samples K images per prompt; the best and worst by reward form a pair; both are
  noised with the same σ (logit-normal over the 1000-step training schedule) and ε, and the policy is
  pushed to lower its flow-matching error on the winner relative to the reference more than on the
  loser. ``ref_update_step = 0`` keeps the base model as reference (offline); N > 0 copies the policy
  into the reference every N optimizer steps (online DPO).
* **SFT**: the policy samples; the ``top_k`` best of each group are regressed on with the flow-matching
  loss, weighted by their (non-negative) advantage — honoured whatever β is (upstream drops it at β = 0)
  — plus β·‖v_θ − v_base‖² to stay near the base model.

The loop around the epoch (eval, logs, checkpoints, resume) is ``FlowRLRecipe``'s; this module only
supplies the epoch.

    rlgen train algo=dpo
    rlgen train algo=sft algo.pref.top_k=2
"""

from __future__ import annotations

import functools
from collections import defaultdict
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from rlgen_cli.algos import (
    dpo_loss,
    flow_matching_error,
    group_advantages,
    preference_pairs,
    sample_dpo_sigmas,
    select_best,
    sft_loss,
)
from rlgen_cli.models import Cond
from rlgen_cli.recipes.flow_rl import FlowRLRecipe
from rlgen_cli.recipes.loop import summarise
from rlgen_cli.recipes.sampling import batches, conditioned, sample_latents
from rlgen_cli.schema.flow import TrainConfig
from rlgen_cli.sde.noise import stream_seed
from rlgen_cli.training.ema import EMA
from rlgen_cli.training.progress import Progress

TRAIN_SCHEDULE_STEPS = 1000
SIGMA_STREAM = 3  # salt of the training-σ / ε stream


class PreferenceEpoch:
    """One DPO / SFT epoch, plugged into :class:`FlowRLRecipe` as its ``epoch_fn``."""

    def __init__(self) -> None:
        self._reference_copy: EMA | None = None
        self._sigma_table: Tensor | None = None

    def __call__(self, recipe: FlowRLRecipe, epoch: int, progress: Progress) -> dict[str, float]:
        pref = recipe.cfg.algo.pref
        if self._sigma_table is None:
            self._bind(recipe)
        prompts, indices, metadata = self._prompts(recipe, epoch)
        with self.reference(recipe) if pref.loss == "dpo" else nullcontext():
            x0 = sample_latents(
                recipe.policy, prompts, recipe.cfg.model.num_steps, recipe.cfg.algo.sample_batch_size,
                recipe.cfg.seed, progress, recipe.spec, epoch=epoch,
            )  # fmt: skip
        images = torch.cat(
            [recipe.policy.decode(x0[p]).cpu() for p in batches(len(x0), recipe.cfg.algo.sample_batch_size)]
        )
        components, details = recipe.score(images, prompts, metadata)
        total = sum(recipe.cfg.reward.weights[k] * v for k, v in components.items())
        cond = Cond.cat(
            [
                recipe.policy.encode(prompts[p])
                for p in batches(len(prompts), recipe.cfg.algo.sample_batch_size)
            ]
        )
        stats = (
            self._dpo(recipe, epoch, x0, cond, total, indices)
            if pref.loss == "dpo"
            else self._sft(recipe, epoch, x0, cond, total, indices)
        )
        return {
            "reward/mean": total.mean().item(), "reward/std": total.std().item(),
            **{f"reward/{k}/mean": v.mean().item() for k, v in components.items()}, **details, **stats,
            "time/rollout": 0.0, "time/reward": 0.0, "time/update": 0.0, "global_step": recipe.global_step,
        }  # fmt: skip

    def _bind(self, recipe: FlowRLRecipe) -> None:
        pref = recipe.cfg.algo.pref
        probe = recipe.policy.noise(1)
        self._sigma_table = recipe.policy.schedule(TRAIN_SCHEDULE_STEPS, probe)[:-1]
        if pref.loss == "dpo" and pref.ref_update_step > 0:  # an EMA with decay 0 is an exact periodic copy
            params = recipe.policy.trainable_parameters()
            self._reference_copy = EMA(
                params, decay=0.0, update_every=pref.ref_update_step, gather=recipe.dist.gathered
            )

    def reference(self, recipe: FlowRLRecipe) -> AbstractContextManager[Any]:
        """The DPO reference: the periodic copy of the policy (online) or the base model (offline)."""
        return self._reference_copy.swap() if self._reference_copy is not None else recipe.policy.reference()

    @staticmethod
    def _prompts(recipe: FlowRLRecipe, epoch: int) -> tuple[list[str], Tensor, list[dict]]:
        indices = recipe.sampler.indices_for_epoch(epoch)
        examples = [recipe.train_set[i] for i in indices]
        return [ex.prompt for ex in examples], torch.tensor(indices), [dict(ex.metadata) for ex in examples]

    def _noised(self, recipe: FlowRLRecipe, epoch: int, x0: Tensor, t: int) -> tuple[Tensor, Tensor, Tensor]:
        """σ (B,), ε (B, ...) and x_σ for every row of ``x0`` — rows passed together share nothing."""
        generator = torch.Generator(device=recipe.device).manual_seed(
            stream_seed(recipe.cfg.seed, epoch, t, SIGMA_STREAM)
        )
        sigma = sample_dpo_sigmas(x0.shape[0], self._sigma_table, generator)
        noise = torch.randn(x0.shape, generator=generator, device=recipe.device)
        s = sigma.view(-1, *([1] * (x0.dim() - 1)))
        return sigma, noise, (1 - s) * x0 + s * noise

    def _dpo(
        self, recipe: FlowRLRecipe, epoch: int, x0: Tensor, cond: Cond, rewards: Tensor, groups: Tensor
    ) -> dict[str, float]:
        pairs = preference_pairs(rewards, groups)
        chosen, rejected = pairs.chosen.to(x0.device), pairs.rejected.to(x0.device)
        stats: dict[str, list[float]] = defaultdict(list)
        for t in range(recipe.cfg.algo.pref.timesteps_per_sample):
            sigma, noise, _ = self._noised(recipe, epoch, x0[chosen], t)  # one σ, ε per pair
            errors = {}
            # reference first: the online reference swaps weights in place, which must not happen
            # between the policy's forward and its backward
            for owner in ("ref", "policy"):
                for name, rows in (("w", chosen), ("l", rejected)):
                    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
                    x_sigma = (1 - s) * x0[rows] + s * noise
                    velocity = functools.partial(conditioned, recipe.policy, cond.index(rows))
                    context = torch.no_grad() if owner == "ref" else nullcontext()
                    with context, self.reference(recipe) if owner == "ref" else nullcontext():
                        errors[f"{owner}_{name}"] = flow_matching_error(
                            velocity(x_sigma, sigma), x0[rows], noise
                        )
            out = dpo_loss(
                errors["policy_w"],
                errors["policy_l"],
                errors["ref_w"],
                errors["ref_l"],
                beta=recipe.cfg.algo.pref.beta,
            )
            recipe.dist.backward(out.loss)
            stats["grad_norm"].append(recipe.optimizer_step())
            if self._reference_copy is not None:
                self._reference_copy.step(recipe.global_step)
            for key, value in {**out.stats, "dpo_loss": out.loss.item()}.items():
                stats[key].append(float(value))
        stats["pairs"].append(float(len(chosen)))
        stats["skipped_groups"].append(float(pairs.num_skipped))
        return summarise(stats)

    def _sft(
        self, recipe: FlowRLRecipe, epoch: int, x0: Tensor, cond: Cond, rewards: Tensor, groups: Tensor
    ) -> dict[str, float]:
        pref = recipe.cfg.algo.pref
        keep = select_best(rewards, groups, top_k=pref.top_k)
        algo = recipe.cfg.algo
        advantages, _ = group_advantages(
            rewards, groups, global_std=algo.global_std, std_estimator=algo.std_estimator, eps=algo.adv_eps
        )
        weights = advantages[keep].clamp(min=0).to(x0.device)
        rows = keep.to(x0.device)
        stats: dict[str, list[float]] = defaultdict(list)
        for t in range(pref.timesteps_per_sample):
            sigma, noise, x_sigma = self._noised(recipe, epoch, x0[rows], t)
            velocity = functools.partial(conditioned, recipe.policy, cond.index(rows))
            v_base = None
            if pref.beta > 0:
                with torch.no_grad(), recipe.policy.reference():
                    v_base = velocity(x_sigma, sigma)
            out = sft_loss(
                velocity(x_sigma, sigma), x0[rows], noise, v_base=v_base, beta=pref.beta, weights=weights
            )
            recipe.dist.backward(out.loss)
            stats["grad_norm"].append(recipe.optimizer_step())
            for key, value in {**out.stats, "sft_loss": out.loss.item()}.items():
                stats[key].append(float(value))
        stats["trained_samples"].append(float(len(keep)))
        return summarise(stats)


def run(cfg: TrainConfig, raw_cfg: DictConfig) -> dict[str, Any]:
    """Entry point: the shared flow loop with the preference epoch plugged in."""
    recipe = FlowRLRecipe(cfg, raw_cfg, epoch_fn=PreferenceEpoch())
    recipe.setup()
    try:
        return recipe.train()
    finally:
        recipe.cleanup()
