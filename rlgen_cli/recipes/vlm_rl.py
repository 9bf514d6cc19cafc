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
    accumulation_per_process,
    reduce_over_ranks,
)
from rlgen_cli.recipes.registry import Perturb
from rlgen_cli.recipes.session import epoch_session
from rlgen_cli.recipes.trainer_run import open_vlm_run, opened, vlm_engine_options
from rlgen_cli.rewards import RewardBatch, build_mix
from rlgen_cli.rewards.r1vl import TEXT_REWARDS
from rlgen_cli.schema.recipes import VlmRlTrainConfig
from rlgen_cli.sde.noise import Stream, stream_seed
from rlgen_cli.training.checkpoints.checkpoint import (
    SAMPLER_KEY,
    NonFiniteRewards,
)
from rlgen_cli.training.reporting.progress import Progress
from rlgen_cli.vlm.data import load_vlm_examples, prompt_text
from rlgen_cli.vlm.engines import build_engine
from rlgen_cli.vlm.evaluate import answer_examples, evaluate, summarise
from rlgen_cli.vlm.rollout import (
    SamplingOptions,
    TokenBatch,
    collate,
    completion_logprobs,
    load_images,
    pad_stack,
)
from rlgen_cli.vlm.training import (
    batches,
    completion_budget,
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
        per_step,
        unit,
        world_size,
    )
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
        require_text_rewards(cfg)
        self.run = open_vlm_run(cfg, self.raw_cfg, algo.token.engine)
        self.dist, self.device, self.policy = self.run.dist, self.run.device, self.run.policy
        self.reward = build_mix(
            dict(cfg.reward.weights), **{k: dict(v) for k, v in cfg.reward.kwargs.items()}
        )
        self.train_set = load_vlm_examples(cfg.data.train)
        self.test_set = load_vlm_examples(cfg.data.test) if cfg.eval_every else []
        self.sampler = GroupSampler(
            len(self.train_set),
            algo.prompts_per_epoch,
            algo.group_size,
            seed=cfg.seed,
            num_replicas=self.dist.world_size,
            rank=self.dist.rank,
        )
        self.unit = assignment_unit(algo, self.dist.world_size)  # samples dealt round-robin as one piece
        micro = self.sampler.samples_per_rank // algo.train_batch_size  # per rank: the steps are shared
        accum = accumulation_per_process(algo, self.dist.world_size)  # the global count ÷ processes
        self.run.schedule(cfg.epochs * algo.token.num_iterations * micro // accum)
        self.max_completion_tokens = completion_budget(
            algo.token.max_completion_tokens, cfg.model.vlm.completion_cap
        )
        if algo.kl_weight > 0:  # full fine-tuning: the reference is the weights before a resume loads any
            self.policy.keep_reference()
        self.run.resume_and_prepare(
            vlm_engine_options(cfg), lambda state: self.sampler.load_state_dict(state[SAMPLER_KEY])
        )
        self.run.evaluation, self.run.draws_curve = lambda epoch, progress: self.evaluate(progress), True
        self.engine = build_engine(self.policy, algo.token, cfg.seed)  # after resume: it syncs on first use

    # -- the loop -------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """The epochs in the shared session (``recipes/session.py``): evaluation when due, log line,
        checkpoint (with the sampler's position), epochs bar."""
        with epoch_session(self.run) as s:
            for epoch in s.epochs():
                metrics = self.train_epoch(epoch, s.progress) | self.dist.loss_scale_metrics()
                entries = {SAMPLER_KEY: self.sampler.state_dict()}
                headline = f"reward {metrics['reward/mean']:+.4g}"
                if s.end_epoch(epoch, metrics, console_line, headline, extra_state=entries):
                    break
        return s.metrics

    def train_epoch(self, epoch: int, progress: Progress) -> dict[str, float]:
        timings: dict[str, float] = {}
        start = time.perf_counter()
        rollouts = self.rollout(epoch, progress)
        timings["time/rollout"] = time.perf_counter() - start
        local, local_total = self.score(rollouts)
        # every rank sees the whole batch's rewards with their dataset indices, put back in global order
        # (the group statistics then sum in the same order on any process count), so a group that spans
        # ranks is normalised as one; each rank then keeps the advantages of its own rows
        places = self.dist.gather(rollouts.positions).cpu()
        order = places.argsort()  # gathered rank by rank → global
        components = {k: self._in_global_order(v, order) for k, v in local.items()}
        total = self._in_global_order(local_total, order)
        group_ids = self.sampler.group_keys(places[order], self._in_global_order(rollouts.indices, order))
        algo = self.cfg.algo
        advantages, adv_stats = combine_rewards(
            components,
            dict(self.cfg.reward.weights),
            group_ids,
            mode=self.cfg.reward.aggregation,
            **advantage_options(algo.token.scale_rewards, algo.token.std_estimator, algo.adv_eps),
            clip_max=algo.adv_clip_max,
        )
        advantages = advantages[rollouts.positions]
        start = time.perf_counter()
        micro_batches = self.prepare(rollouts)
        update_stats = self.update(micro_batches, advantages, rollouts.truncated, progress)
        timings["time/update"] = time.perf_counter() - start
        local_stats = reduce_over_ranks(
            self.dist, {**update_stats, "sampler/logp_gap_max": self._sampler_gap(rollouts, micro_batches)}
        )
        return {
            "reward/mean": total.mean().item(),
            "reward/std": total.std().item(),
            **{f"reward/{k}/mean": v.mean().item() for k, v in components.items()},
            **{f"reward/{k}/std": v.std().item() for k, v in components.items()},
            "zero_std_ratio": adv_stats.zero_std_ratio,
            "num_groups": adv_stats.num_groups,
            **self._completion_stats(rollouts, order),
            **local_stats,
            **timings,
            "lr": self.run.scheduler.get_last_lr()[0],
            "global_step": self.run.global_step,
        }

    def _in_global_order(self, local: Tensor, order: Tensor) -> Tensor:
        """Every rank's values of this epoch, (prompts_per_epoch × group_size,), in global batch order
        (``order``: the argsort of the gathered positions)."""
        return self.dist.gather(local).cpu()[order]

    def _completion_stats(self, rollouts: Rollouts, order: Tensor) -> dict[str, float]:
        """Completion lengths and the truncated fraction over every rank's rows (in global order)."""
        lengths = self._in_global_order(torch.tensor([float(c.numel()) for c in rollouts.completions]), order)
        truncated = self._in_global_order(torch.tensor([float(t) for t in rollouts.truncated]), order)
        return {
            "completions/mean_length": lengths.mean().item(),
            "completions/max_length": lengths.max().item(),
            "completions/min_length": lengths.min().item(),
            "completions/clipped_ratio": truncated.mean().item(),
        }

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
        images = load_images([ex.image for ex in examples])
        options = self.sampling_options()
        ids, truncated, logprobs = [], [], []
        task = progress.task("rollout", total=len(indices))
        for part in batches(len(indices), cfg.algo.sample_batch_size):
            done = self.engine.generate(
                prompts[part],
                images[part],
                options,
                seed=stream_seed(cfg.seed, epoch, positions[part.start], Stream.VLM_ROLLOUT),
                labels=[f"#{i}" for i in indices[part]],
            )
            ids += done.ids
            truncated += done.truncated
            logprobs += done.logprobs or []
            progress.advance(task, part.stop - part.start)
        progress.remove(task)
        texts = self.policy.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return Rollouts(
            torch.tensor(indices),
            torch.tensor(positions),
            prompts,
            images,
            ids,
            truncated,
            texts,
            [dict(ex.metadata) for ex in examples],
            logprobs,
        )

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
            logp,
            mb.old,
            adv,
            self._loss_mask(mb, truncated),
            loss_type=algo.token.loss_type,
            importance_level=algo.token.importance_level,
            epsilon=algo.clip_range,
            epsilon_high=algo.token.epsilon_high,
            kl_weight=algo.kl_weight,
            ref_logp=mb.ref,
            max_completion_length=self.max_completion_tokens,
            num_items=num_items,
            bias_correction_kl=algo.token.use_bias_correction_kl,
        )

    def optimizer_step(self) -> float:
        grad_norm = self.run.optimizer_step()  # the pre-clip global norm
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

    def cleanup(self) -> None:
        self.run.close()
        self.engine.close()


def require_text_rewards(cfg: VlmRlTrainConfig) -> None:
    """The VLM recipes score texts: a reward that scores images is refused before anything loads."""
    unknown = sorted(set(cfg.reward.weights) - set(TEXT_REWARDS))
    if unknown:
        raise UserError(
            f"reward(s) {unknown} score images; VLM recipes score texts: {', '.join(TEXT_REWARDS)}"
        )


def console_line(m: dict[str, float]) -> str:
    """The epoch's reward, KL, clip fraction, completion length and seconds."""
    seconds = m["time/rollout"] + m["time/update"]
    return (
        f"reward {m['reward/mean']:+.4g}±{m['reward/std']:.3g}  kl {m['kl_loss']:.2e}  clipfrac {m['clipfrac']:.3f}  "
        f"len {m['completions/mean_length']:.1f}  {seconds:.1f}s"
    )


def splits_read(cfg: VlmRlTrainConfig) -> tuple[str, ...]:
    """The prompt files the run reads: the test set only when it evaluates."""
    return ("train", "test") if cfg.eval_every else ("train",)


ONPOLICY_SPLITS = ("train",)
"""The prompt files ``rlgen check-onpolicy`` reads."""


def check_onpolicy(typed: VlmRlTrainConfig, cfg: DictConfig, perturb: Perturb) -> tuple[float, bool]:
    """``rlgen check-onpolicy``: per-token log-probs of the rollout engine vs the training forward on the
    same completions (``vlm/onpolicy.py``); the worst error and whether it is within ``check.text_tolerance``."""
    from rlgen_cli.vlm.onpolicy import check_rollout, print_report

    with opened(VLMRLRecipe(typed, cfg)) as recipe:
        batch_size = typed.check.train_batch_size or typed.algo.train_batch_size
        rows = check_rollout(recipe, batch_size, perturb)
    worst = print_report(rows, typed.check.text_tolerance, recipe.engine.name)
    return worst, worst <= typed.check.text_tolerance


def run(cfg: VlmRlTrainConfig, raw_cfg: DictConfig) -> dict[str, Any]:
    """Entry point of ``rlgen train recipe=vlm_rl``."""
    with opened(VLMRLRecipe(cfg, raw_cfg)) as recipe:
        return recipe.train()
