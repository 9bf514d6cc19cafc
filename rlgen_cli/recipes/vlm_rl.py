"""Token-level GRPO and StepGRPO for multimodal LLMs (Qwen2-VL / Qwen2.5-VL).

GRPO: Shao et al. 2024 ("DeepSeekMath"); StepGRPO: Zhang et al. 2025 ("R1-VL: Learning to Reason with
Multimodal Large Language Models via Step-wise Group Relative Policy Optimization"); loss variants and
defaults as TRL's ``GRPOTrainer``. Each epoch:

1. **rollout** — ``group_size`` completions per prompt through the rollout engine
   (``algo.token.engine``: ``hf`` = batched ``generate`` with the KV cache, or a colocated vLLM synced to
   the training weights — ``vlm/engines.py``), explicit temperature / top-p / top-k, vision tokens
   suppressed, stop at ``<|im_end|>``; the prompt + image + completion budget is checked against the
   context first (never truncated);
2. **score** — the reward mix scores the decoded texts (StepGRPO: ``answer_accuracy + step_rar +
   step_rvr``, every component logged);
3. **advantages** — group z-scores keyed by dataset index (``algo.token.scale_rewards``: group / batch /
   none; ``algo.token.std_estimator``: unbiased / population; eps 1e-4);
4. **prepare** — π_old (training-path recompute, or the sampler's raw-logit log-probs) and π_ref (LoRA
   disabled, or a frozen copy) on the training micro-batches;
5. **update** — ``num_iterations`` passes of the clipped token loss (``algos/token_grpo.py``) + β·k3 KL,
   gradient accumulation, grad-norm clip, warm-up / decay schedule;
6. **log / eval / checkpoint** — metrics.jsonl, accuracy on ``data.test``, full-state checkpoints.

Deliberate choices: log-probs are taken at temperature 1 from raw logits (the sampling temperature only
shapes exploration); micro-batches are built once per epoch and reused, so the first update is exactly
on-policy; ``rlgen check-onpolicy model=tiny_qwen2_vl algo=step_grpo`` holds the training forward against
the sampler's own log-probs (``vlm/onpolicy.py``).

Several processes (``launcher=accelerate`` = DDP, ``launcher=deepspeed_zero2``) go through the same
``training/distributed/dist.py`` context as the flow recipe, with its contract (docs/distributed.md, "process-count
invariance"): the epoch's global batch is cut into pieces of lcm(``sample_batch_size``,
``train_batch_size``) samples and piece b goes to rank b mod N (:func:`assignment_unit`,
``GroupSampler.positions``), so every sample is rolled out and trained in the same batch and optimizer
step s covers global micro-batches s·A … s·A + A − 1 on any process count (A =
``algo.gradient_accumulation_steps``, counted over all processes); a rollout batch samples under a seed
keyed by the global position of its first row; rewards are gathered with their positions and put back in
global order before the group statistics (a group may span ranks); dapo's token normaliser counts the
tokens of the whole step; gradients are summed in float64 once per step (``launcher.exact_reduction``),
and rank 0 alone evaluates, logs and writes checkpoints. One and two processes then give bit-identical
weights (``tests/distributed/test_vlm_process_invariance.py``). A step too small for whole rollout
batches on every rank (e.g. R1-VL's 16 completions per step over 4 processes with rollout batches of 16)
is dealt in training micro-batches instead, each rank sampling its own rows: the same run to sampling
statistics, not bit for bit.

    rlgen train model=tiny_qwen2_vl algo=step_grpo data=tiny_vlm reward=length     # tiny CPU run
    rlgen train model=tiny_qwen2_vl algo=token_grpo launcher=accelerate launcher.num_processes=2
    rlgen train model=qwen2_vl model.path=/ckpt/qwen2vl-2b-sft algo=step_grpo data=r1vl reward=r1vl
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from PIL import Image
from torch import Tensor

from rlgen_cli.algos.advantages import combine_rewards
from rlgen_cli.algos.token_grpo import advantage_options, token_grpo_loss
from rlgen_cli.data.sampler import GroupSampler
from rlgen_cli.errors import UserError
from rlgen_cli.recipes.common import (
    REWARD_CURVE,
    accumulation_per_process,
    due,
    load_resume,
    reduce_over_ranks,
    save_trainer_checkpoint,
)
from rlgen_cli.recipes.registry import Perturb
from rlgen_cli.rewards import RewardBatch, build_mix
from rlgen_cli.rewards.r1vl import TEXT_REWARDS
from rlgen_cli.schema.recipes import VlmRlTrainConfig
from rlgen_cli.sde.noise import Stream, stream_seed
from rlgen_cli.training.checkpoints.checkpoint import (
    COUNTERS_KEY,
    OPTIMIZER_KEY,
    SAMPLER_KEY,
    Checkpoint,
    NonFiniteRewards,
    set_rng_state,
)
from rlgen_cli.training.checkpoints.interrupt import on_interrupt
from rlgen_cli.training.distributed.dist import Dist, make_dist
from rlgen_cli.training.reporting.metrics import JsonlLogger, NullLogger, step_after
from rlgen_cli.training.reporting.plots import plot_runs
from rlgen_cli.training.reporting.progress import Progress
from rlgen_cli.vlm.data import load_vlm_examples, prompt_text
from rlgen_cli.vlm.engines import build_engine
from rlgen_cli.vlm.evaluate import answer_examples, evaluate, summarise
from rlgen_cli.vlm.policy import build_vlm
from rlgen_cli.vlm.rollout import (
    SamplingOptions,
    TokenBatch,
    collate,
    completion_logprobs,
    load_image,
    pad_stack,
)
from rlgen_cli.vlm.training import (
    SCHEDULER_KEY,
    batches,
    completion_budget,
    make_scheduler,
    require_whole_weights,
)

__all__ = ["VLMRLRecipe", "assignment_unit", "evaluate", "run"]

log = logging.getLogger(__name__)


def assignment_unit(algo: Any, world_size: int) -> int:
    """Samples dealt to a process as one piece: lcm(``sample_batch_size``, ``train_batch_size``) — whole
    rollout and training batches, so each sample is generated and trained in the same batch on any process
    count — when an optimizer step's samples split into such pieces over ``world_size`` processes; else
    one training micro-batch (whole steps still, the rollout batches then differ from one process's)."""
    unit = math.lcm(algo.sample_batch_size, algo.train_batch_size)
    per_step = algo.micro_batches_per_step(world_size) * algo.train_batch_size
    if per_step % (unit * world_size) == 0:
        return unit
    log.info(
        "an optimizer step's %d samples do not split into whole rollout batches of lcm(algo.sample_batch_size,"
        " algo.train_batch_size) = %d over %d processes: each process takes training micro-batches and "
        "samples them in its own batches (the same run to sampling statistics, not bit for bit)",
        per_step, unit, world_size,
    )  # fmt: skip
    return algo.train_batch_size


@dataclass
class Rollouts:
    """This rank's samples of one epoch in rollout order; N = prompts_per_epoch × group_size / processes."""

    indices: Tensor  # (N,) dataset indices: the group keys
    positions: Tensor  # (N,) places in the epoch's global batch (GroupSampler.positions)
    prompts: list[str]  # chat-templated prompt strings
    images: list[Image.Image | None]
    completions: list[Tensor]  # N × (L_i,) token ids
    truncated: list[bool]
    texts: list[str]
    metadata: list[dict]
    sampler_logprobs: list[Tensor]  # N × (L_i,) raw-logit log-probs recorded by generate


@dataclass
class MicroBatch:
    """A training micro-batch: its rows, layout, and the fixed log-probs of π_old / π_ref, (B, L) each."""

    rows: slice
    batch: TokenBatch
    old: Tensor
    ref: Tensor | None


class VLMRLRecipe:
    """setup → train (rollout → score → advantages → prepare → update → log → eval → save) → cleanup."""

    def __init__(self, cfg: VlmRlTrainConfig, raw_cfg: DictConfig) -> None:
        self.cfg, self.raw_cfg, self.run_dir = cfg, raw_cfg, Path(cfg.run_dir)

    # -- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, algo = self.cfg, self.cfg.algo
        unknown = sorted(set(cfg.reward.weights) - set(TEXT_REWARDS))
        if unknown:
            raise UserError(
                f"reward(s) {unknown} score images; VLM recipes score texts: {', '.join(TEXT_REWARDS)}"
            )
        torch.manual_seed(cfg.seed)
        self.dist: Dist = make_dist(cfg.device)
        require_whole_weights(self.dist, algo.token.engine)
        self.device = self.dist.device
        self.policy = build_vlm(cfg.model, self.device)
        self.reward = build_mix(
            dict(cfg.reward.weights), **{k: dict(v) for k, v in cfg.reward.kwargs.items()}
        )
        self.train_set = load_vlm_examples(cfg.data.train)
        self.test_set = load_vlm_examples(cfg.data.test) if cfg.eval_every else []
        self.sampler = GroupSampler(
            len(self.train_set), algo.prompts_per_epoch, algo.group_size, seed=cfg.seed,
            num_replicas=self.dist.world_size, rank=self.dist.rank,
        )  # fmt: skip
        self.unit = assignment_unit(algo, self.dist.world_size)  # samples dealt round-robin as one piece
        self.optimizer = torch.optim.AdamW(
            self.policy.trainable_parameters(), lr=algo.lr, betas=(algo.adam_beta1, algo.adam_beta2),
            eps=algo.adam_eps, weight_decay=algo.weight_decay,
        )  # fmt: skip
        micro = self.sampler.samples_per_rank // algo.train_batch_size  # per rank: the steps are shared
        accum = accumulation_per_process(algo, self.dist.world_size)  # the global count ÷ processes
        total = cfg.epochs * algo.token.num_iterations * micro // accum
        # on the torch optimizer: DeepSpeed's ZeRO optimizer steps with its param_groups' learning rates
        self.scheduler = make_scheduler(
            self.optimizer, total, algo.token.warmup_ratio, algo.token.lr_schedule
        )
        self.max_completion_tokens = completion_budget(
            algo.token.max_completion_tokens, cfg.model.vlm.completion_cap
        )
        self.start_epoch, self.global_step = 0, 0
        resumed = self._maybe_resume()  # into the bare model, before DDP / the engine wraps it
        self.optimizer = self.dist.prepare(
            self.policy, self.optimizer, max_grad_norm=algo.max_grad_norm, micro_batch_size=algo.train_batch_size,
            compute_dtype=cfg.model.dtype, exact_reduction=cfg.launcher.reduces_exactly,  # float64 gradient sums
        )  # fmt: skip
        if resumed is not None:  # DeepSpeed reads its optimizer shards from the checkpoint's engine/
            ckpt, state = resumed
            self.dist.load_optimizer_state(self.optimizer, state[OPTIMIZER_KEY], ckpt.engine)
        self.engine = build_engine(self.policy, algo.token, cfg.seed)  # after resume: it syncs on first use
        self.logger = JsonlLogger(self.run_dir) if self.dist.is_main else NullLogger()

    def _maybe_resume(self) -> tuple[Checkpoint, dict[str, Any]] | None:
        """Weights, scheduler, sampler, RNG and counters of the checkpoint to resume (if any); returns it and
        its state, whose optimizer entry ``setup`` restores once the optimizer is prepared."""
        resumed = load_resume(
            self.cfg.resume, self.run_dir, self.policy.load_trainable, self.cfg.resume_unverified
        )
        if resumed is None:
            return None
        state = resumed[1]
        self.scheduler.load_state_dict(state[SCHEDULER_KEY])
        self.sampler.load_state_dict(state[SAMPLER_KEY])
        set_rng_state(state["rng"])
        self.start_epoch = state[COUNTERS_KEY]["epoch"]
        self.global_step = state[COUNTERS_KEY]["global_step"]
        return resumed

    # -- the loop -------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        cfg, metrics, main = self.cfg, {}, self.dist.is_main
        completed = self.start_epoch
        with (
            on_interrupt(self.run_dir, main, lambda: completed, self.draw_curve),
            Progress(enabled=cfg.progress and main) as progress,
        ):
            epochs = progress.task("epochs", total=cfg.epochs, completed=self.start_epoch)
            for epoch in range(self.start_epoch, cfg.epochs):
                metrics = self.train_epoch(epoch, progress) | self.dist.loss_scale_metrics()
                # whole weights on every rank (require_whole_weights): rank 0 evaluates alone
                if main and cfg.eval_every and due(epoch, cfg.eval_every, cfg.epochs):
                    metrics |= self.evaluate(progress)
                self.logger.log(metrics, step=step_after(epoch))
                completed = epoch + 1  # logged: what a Ctrl-C from here on counts as done
                log.info(
                    "epoch %d  reward %+.4g±%.3g  kl %.2e  clipfrac %.3f  len %.1f  %.1fs", step_after(epoch),
                    metrics["reward/mean"], metrics["reward/std"], metrics["kl_loss"], metrics["clipfrac"],
                    metrics["completions/mean_length"], metrics["time/rollout"] + metrics["time/update"],
                )  # fmt: skip
                if due(epoch, cfg.save_every, cfg.epochs):
                    self.save(epoch + 1)
                self.dist.barrier()
                progress.advance(
                    epochs, description=f"epoch {epoch + 1}: reward {metrics['reward/mean']:+.4g}"
                )
        if main:
            self.draw_curve()
        return metrics

    def draw_curve(self) -> None:
        plot_runs([self.run_dir], self.run_dir / REWARD_CURVE)

    def train_epoch(self, epoch: int, progress: Progress) -> dict[str, float]:
        timings: dict[str, float] = {}
        start = time.perf_counter()
        rollouts = self.rollout(epoch, progress)
        timings["time/rollout"] = time.perf_counter() - start
        local, local_total = self.score(rollouts)
        # every rank sees the whole batch's rewards with their dataset indices, put back in global order
        # (the group statistics then sum in the same order on any process count), so a group that spans
        # ranks is normalised as one; each rank then keeps the advantages of its own rows
        order = self.dist.gather(rollouts.positions).cpu().argsort()  # gathered rank by rank → global
        components = {k: self._in_global_order(v, order) for k, v in local.items()}
        total = self._in_global_order(local_total, order)
        group_ids = self._in_global_order(rollouts.indices, order)
        algo = self.cfg.algo
        advantages, adv_stats = combine_rewards(
            components, dict(self.cfg.reward.weights), group_ids, mode=self.cfg.reward.aggregation,
            **advantage_options(algo.token.scale_rewards, algo.token.std_estimator, algo.adv_eps), clip_max=algo.adv_clip_max,
        )  # fmt: skip
        advantages = advantages[rollouts.positions]
        start = time.perf_counter()
        micro_batches = self.prepare(rollouts)
        update_stats = self.update(micro_batches, advantages, rollouts.truncated, progress)
        timings["time/update"] = time.perf_counter() - start
        local_stats = reduce_over_ranks(
            self.dist, {**update_stats, "sampler/logp_gap_max": self._sampler_gap(rollouts, micro_batches)}
        )
        return {
            "reward/mean": total.mean().item(), "reward/std": total.std().item(),
            **{f"reward/{k}/mean": v.mean().item() for k, v in components.items()},
            **{f"reward/{k}/std": v.std().item() for k, v in components.items()},
            "zero_std_ratio": adv_stats.zero_std_ratio, "num_groups": adv_stats.num_groups,
            **self._completion_stats(rollouts, order), **local_stats, **timings,
            "lr": self.scheduler.get_last_lr()[0], "global_step": self.global_step,
        }  # fmt: skip

    def _in_global_order(self, local: Tensor, order: Tensor) -> Tensor:
        """Every rank's values of this epoch, (prompts_per_epoch × group_size,), in global batch order
        (``order``: the argsort of the gathered positions)."""
        return self.dist.gather(local).cpu()[order]

    def _completion_stats(self, rollouts: Rollouts, order: Tensor) -> dict[str, float]:
        """Completion lengths and the truncated fraction over every rank's rows (in global order)."""
        lengths = self._in_global_order(torch.tensor([float(c.numel()) for c in rollouts.completions]), order)
        truncated = self._in_global_order(torch.tensor([float(t) for t in rollouts.truncated]), order)
        return {
            "completions/mean_length": lengths.mean().item(), "completions/max_length": lengths.max().item(),
            "completions/min_length": lengths.min().item(), "completions/clipped_ratio": truncated.mean().item(),
        }  # fmt: skip

    # -- phases ---------------------------------------------------------------------------------
    def sampling_options(self) -> SamplingOptions:
        token = self.cfg.algo.token
        return SamplingOptions(token.temperature, token.top_p, token.top_k, self.max_completion_tokens)

    def rollout(self, epoch: int, progress: Progress) -> Rollouts:
        """Generate this rank's completions of the epoch (whole pieces of :attr:`unit` samples, dealt
        round-robin) in batches of ``sample_batch_size``; a batch's seed is keyed by the global position of
        its first row, so the samples do not depend on the number of processes."""
        cfg, vlm = self.cfg, self.cfg.model.vlm
        indices = self.sampler.indices_for_epoch(epoch, self.unit)
        positions = self.sampler.positions(self.unit)  # places in the epoch's global batch
        examples = [self.train_set[i] for i in indices]
        prompts = [
            prompt_text(self.policy.processor, ex, vlm.prompt_format, vlm.system_prompt) for ex in examples
        ]
        images = [load_image(ex.image) for ex in examples]
        options = self.sampling_options()
        ids, truncated, logprobs = [], [], []
        task = progress.task("rollout", total=len(indices))
        for part in batches(len(indices), cfg.algo.sample_batch_size):
            done = self.engine.generate(
                prompts[part], images[part], options,
                seed=stream_seed(cfg.seed, epoch, positions[part.start], Stream.VLM_ROLLOUT),
                labels=[f"#{i}" for i in indices[part]],
            )  # fmt: skip
            ids += done.ids
            truncated += done.truncated
            logprobs += done.logprobs or []
            progress.advance(task, part.stop - part.start)
        progress.remove(task)
        texts = self.policy.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return Rollouts(
            torch.tensor(indices), torch.tensor(positions), prompts, images, ids, truncated, texts,
            [dict(ex.metadata) for ex in examples], logprobs,
        )  # fmt: skip

    @torch.no_grad()
    def score(self, rollouts: Rollouts) -> tuple[dict[str, Tensor], Tensor]:
        """Per-component rewards (N,) and their weighted total; a failed (NaN) score is an error."""
        batch = RewardBatch(prompts=rollouts.prompts, texts=rollouts.texts, metadata=rollouts.metadata)
        result = self.reward.score(batch)
        components = {
            name: torch.as_tensor(result.details[name], dtype=torch.float32) for name in self.reward.rewards
        }
        if not torch.isfinite(result.scores).all():
            raise NonFiniteRewards(
                "rewards failed for some samples (NaN); a failed score is never replaced by 0"
            )
        return components, result.scores

    @torch.no_grad()
    def prepare(self, rollouts: Rollouts) -> list[MicroBatch]:
        """Training micro-batches with π_old (recompute or sampler) and π_ref (when β > 0) log-probs."""
        algo, policy = self.cfg.algo, self.policy
        out = []
        for rows in batches(len(rollouts.texts), algo.train_batch_size):
            batch = collate(policy, rollouts.prompts[rows], rollouts.images[rows], rollouts.completions[rows])
            length = batch.completion_ids.shape[1]
            if algo.token.old_logprobs == "recompute":
                old = completion_logprobs(policy, batch)
            else:
                old = pad_stack(rollouts.sampler_logprobs[rows], length).to(self.device)
            ref = None
            if algo.kl_weight > 0:
                with policy.reference() as reference:
                    ref = completion_logprobs(policy, batch, reference)
            out.append(MicroBatch(rows, batch, old, ref))
        return out

    def update(
        self, micro_batches: list[MicroBatch], advantages: Tensor, truncated: list[bool], progress: Progress
    ) -> dict[str, list[float]]:
        """``num_iterations`` passes of the token loss over the micro-batches, stepping every accumulation;
        each backward carries 1/accum of its micro-batch's loss (the engine averages over ranks). Returns
        each statistic per micro-batch (``reduce_over_ranks`` pools them over ranks)."""
        algo, token = self.cfg.algo, self.cfg.algo.token
        accum = accumulation_per_process(algo, self.dist.world_size)  # the global count ÷ processes
        num_items = self.token_normalisers(micro_batches, truncated)
        stats: dict[str, list[float]] = defaultdict(list)
        task = progress.task("update", total=token.num_iterations * len(micro_batches))
        for _ in range(token.num_iterations):
            for k, mb in enumerate(micro_batches):
                out = self.micro_batch_loss(mb, advantages[mb.rows].to(self.device), truncated, num_items[k])
                steps_after = (k + 1) % accum == 0
                self.dist.backward(out.loss / accum, sync=steps_after)
                for key, value in {**out.stats, "policy_loss": out.policy_loss, "kl_loss": out.kl}.items():
                    stats[key].append(float(value))
                if steps_after:
                    stats["grad_norm"].append(self.optimizer_step())
                progress.advance(task)
        progress.remove(task)
        return stats

    def token_normalisers(self, micro_batches: list[MicroBatch], truncated: list[bool]) -> list[float]:
        """Per micro-batch, dapo's ``num_items``: the loss tokens of its accumulation group on every rank,
        divided by the micro-batches they fill (accum × ranks). Averaging the backwards (1/accum each) and
        the ranks' gradients then gives Σ loss / all tokens of the optimizer step, as TRL normalises;
        the other loss types ignore it. Local micro-batch k of every rank belongs to the same optimizer
        step (the round-robin deal gives each rank accum consecutive micro-batches of each step), and
        the integer counts sum exactly: the normaliser is the same on any process count."""
        ranks = self.dist.world_size
        accum = accumulation_per_process(self.cfg.algo, ranks)
        local = torch.tensor(
            [[float(self._loss_mask(mb, truncated).sum()) for mb in micro_batches]]
        )  # (1, M)
        counts = self.dist.gather(local).sum(0).cpu()  # (M,) over ranks
        starts = [k - k % accum for k in range(len(micro_batches))]
        return [counts[s : s + accum].sum().item() / (accum * ranks) for s in starts]

    def _loss_mask(self, mb: MicroBatch, truncated: list[bool]) -> Tensor:
        mask = mb.batch.completion_mask
        if self.cfg.algo.token.mask_truncated_completions:
            keep = torch.tensor([not t for t in truncated[mb.rows]], device=mask.device)
            mask = mask * keep.unsqueeze(-1)
        return mask

    def micro_batch_loss(self, mb: MicroBatch, adv: Tensor, truncated: list[bool], num_items: float) -> Any:
        """The training path: π_θ log-probs (with gradients) → token GRPO loss."""
        algo = self.cfg.algo
        logp = completion_logprobs(self.policy, mb.batch)
        return token_grpo_loss(
            logp, mb.old, adv, self._loss_mask(mb, truncated), loss_type=algo.token.loss_type,
            importance_level=algo.token.importance_level, epsilon=algo.clip_range, epsilon_high=algo.token.epsilon_high,
            kl_weight=algo.kl_weight, ref_logp=mb.ref, max_completion_length=self.max_completion_tokens, num_items=num_items,
            bias_correction_kl=algo.token.use_bias_correction_kl,
        )  # fmt: skip

    def optimizer_step(self) -> float:
        params = self.policy.trainable_parameters()
        max_norm = self.cfg.algo.max_grad_norm if self.cfg.algo.max_grad_norm > 0 else math.inf
        grad_norm = self.dist.clip_and_step(self.optimizer, params, max_norm)  # the pre-clip global norm
        self.scheduler.step()
        self.global_step += 1
        self.engine.weights_updated()  # vLLM: push the new weights before the next rollout
        return grad_norm

    def _sampler_gap(self, rollouts: Rollouts, micro_batches: list[MicroBatch]) -> float:
        """max |log π_old − log π_sampler| over tokens: the KV-cache vs full-forward numerics gap."""
        gap = 0.0
        for mb in micro_batches:
            sampled = pad_stack(rollouts.sampler_logprobs[mb.rows], mb.old.shape[1]).to(mb.old.device)
            diff = (mb.old - sampled).abs() * mb.batch.completion_mask
            gap = max(gap, diff.max().item())
        return gap

    @torch.no_grad()
    def evaluate(self, progress: Progress) -> dict[str, float]:
        """Accuracy on the first ``data.eval_num_prompts`` test questions (near-greedy decoding)."""
        n = self.cfg.data.eval_num_prompts or len(self.test_set)
        answers = answer_examples(
            self.policy, self.test_set[:n], self.cfg.algo.sample_batch_size, self.cfg.seed, progress
        )
        summary = summarise(answers)
        per_category = {f"eval/accuracy/{k}": v["accuracy"] for k, v in summary["categories"].items()}
        return {"eval/accuracy": summary["accuracy"], **per_category}

    def save(self, epochs_done: int) -> None:
        """A full-state checkpoint (every rank calls; rank 0 writes)."""
        entries = {SAMPLER_KEY: self.sampler.state_dict(), SCHEDULER_KEY: self.scheduler.state_dict()}
        save_trainer_checkpoint(
            self.dist, self.run_dir, epochs_done, self.global_step, self.optimizer, self.policy.save_trainable,
            entries, self.raw_cfg, self.cfg.keep_last,
        )  # fmt: skip

    def cleanup(self) -> None:
        self.logger.close()
        self.engine.close()


def splits_read(cfg: VlmRlTrainConfig) -> tuple[str, ...]:
    """The prompt files the run reads: the test set only when it evaluates."""
    return ("train", "test") if cfg.eval_every else ("train",)


ONPOLICY_SPLITS = ("train",)
"""The prompt files ``rlgen check-onpolicy`` reads."""


def check_onpolicy(typed: VlmRlTrainConfig, cfg: DictConfig, perturb: Perturb) -> tuple[float, bool]:
    """``rlgen check-onpolicy``: per-token log-probs of the rollout engine vs the training forward on the
    same completions (``vlm/onpolicy.py``); the worst error and whether it is within ``check.text_tolerance``."""
    from rlgen_cli.vlm.onpolicy import check_rollout, print_report

    recipe = VLMRLRecipe(typed, cfg)
    recipe.setup()
    try:
        batch_size = typed.check.train_batch_size or typed.algo.train_batch_size
        rows = check_rollout(recipe, batch_size, perturb)
    finally:
        recipe.cleanup()
    worst = print_report(rows, typed.check.text_tolerance, recipe.engine.name)
    return worst, worst <= typed.check.text_tolerance


def run(cfg: VlmRlTrainConfig, raw_cfg: DictConfig) -> dict[str, Any]:
    """Entry point of ``rlgen train recipe=vlm_rl``."""
    recipe = VLMRLRecipe(cfg, raw_cfg)
    recipe.setup()
    try:
        return recipe.train()
    finally:
        recipe.cleanup()
