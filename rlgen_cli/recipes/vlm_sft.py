"""Supervised warm-up of a Qwen-VL policy on ShareGPT conversations (R1-VL's SFT stage).

R1-VL (Zhang et al. 2025) warms Qwen2-VL up on Mulberry-260K without its reflective samples (full
fine-tuning, 2 epochs, cosine schedule with 3 % warm-up, global batch 128, lr 2e-5 for 2B / 5e-6 for 7B;
upstream runs LLaMA-Factory). Here:

* data — ShareGPT jsonl (``messages``, ``images``), conversations whose assistant turns contain a
  reflection marker (``algo.token.sft_drop_markers``) are dropped and counted;
* loss — next-token cross-entropy on assistant turns only (the tokens after ``<|im_start|>assistant\\n``
  up to and including ``<|im_end|>``), averaged over those tokens per micro-batch; prompts, images and
  system turns are masked; sequences are never truncated (too long → a clear error);
* loop — ``epochs`` passes in a seeded shuffled order, gradient accumulation, grad-norm clip, warm-up +
  cosine / linear / constant schedule, metrics.jsonl (and TensorBoard / W&B as ``logging.*`` asks),
  full-state checkpoints (resume), optional accuracy on ``data.test`` every ``eval_every`` epochs;
* not read — the RL recipes' ``algo.group_size``, ``algo.prompts_per_epoch`` and ``algo.sample_batch_size``
  and ``data.eval_images_per_prompt`` (refused unless at their defaults: ``schema/vlm.py``), and the
  ``reward`` section: SFT scores nothing and its evaluation reports accuracy alone, yet every run schema
  still asks for a non-empty ``reward.weights`` (``schema/run.py: require_rewards``), so the examples below
  pass a text reward (``reward=length``), which scores nothing here;
* several processes (``launcher=accelerate`` / ``deepspeed_zero2``, ``training/distributed/dist.py``) — the flow
  recipe's contract (docs/distributed.md, "process-count invariance"): the epoch's shuffled order is cut
  into global micro-batches of ``train_batch_size`` and micro-batch b goes to rank b mod N
  (:func:`rank_micro_batches`), so optimizer step s covers global micro-batches s·A … s·A + A − 1 on any
  process count (A = ``algo.gradient_accumulation_steps``, counted over all processes); gradients are
  summed in float64 once per step (``launcher.exact_reduction``; averaged by DeepSpeed's engine under
  ZeRO-2); rank 0 evaluates, logs and saves. One and two processes give bit-identical weights when the
  epoch's micro-batches split evenly over the processes; otherwise the order wraps to whole rounds of
  full micro-batches (every rank runs the same number), as ``DistributedSampler`` pads
  (``tests/distributed/test_vlm_process_invariance.py``).

    rlgen train model=tiny_qwen2_vl algo=vlm_sft data=tiny_vlm data.train=builtin:tiny_sft.jsonl reward=length
    rlgen train model=qwen2_vl algo=vlm_sft epochs=2 data.train=mulberry_sft.jsonl reward=r1vl
    rlgen train model=tiny_qwen2_vl algo=vlm_sft data.train=builtin:tiny_sft.jsonl reward=length \
        launcher=accelerate launcher.num_processes=2
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from rlgen_cli.errors import UserError
from rlgen_cli.recipes.common import (
    accumulation_per_process,
    reduce_over_ranks,
)
from rlgen_cli.recipes.session import epoch_session
from rlgen_cli.recipes.trainer_run import open_vlm_run, opened, vlm_engine_options
from rlgen_cli.schema.recipes import VlmSftTrainConfig
from rlgen_cli.training.reporting.progress import Progress
from rlgen_cli.vlm.data import SFTExample, drop_reflective, load_sft, load_vlm_examples
from rlgen_cli.vlm.evaluate import answer_examples, summarise
from rlgen_cli.vlm.policy import VLMPolicy
from rlgen_cli.vlm.rollout import load_image

__all__ = ["VLMSFTRecipe", "assistant_mask", "encode_conversations", "rank_micro_batches", "run"]

log = logging.getLogger(__name__)
IGNORE = -100


def assistant_mask(ids: Tensor, tokenizer: Any) -> Tensor:
    """(T,) bool: the tokens of assistant turns, from after ``<|im_start|>assistant\\n`` through ``<|im_end|>``."""
    start, end = (
        tokenizer.convert_tokens_to_ids("<|im_start|>"),
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    mask = torch.zeros_like(ids, dtype=torch.bool)
    tokens = ids.tolist()
    i = 0
    while i < len(tokens):
        if tokens[i] != start:
            i += 1
            continue
        header_end = i + 1  # the role header runs to the first token that ends with a newline
        while header_end < len(tokens) and not tokenizer.decode(tokens[i + 1 : header_end + 1]).endswith(
            "\n"
        ):
            header_end += 1
        role = tokenizer.decode(tokens[i + 1 : header_end + 1]).strip()
        close = next((j for j in range(header_end + 1, len(tokens)) if tokens[j] == end), len(tokens) - 1)
        if role == "assistant":
            mask[header_end + 1 : close + 1] = True
        i = close + 1
    return mask


def encode_conversations(policy: VLMPolicy, examples: list[SFTExample]) -> dict[str, Tensor]:
    """Right-padded model inputs plus ``labels`` (−100 outside assistant turns) for ``examples``.

    Raises:
        UserError: When a conversation (with its image tokens) exceeds ``model.vlm.max_context``.
    """
    processor, tokenizer = policy.processor, policy.tokenizer
    texts = [processor.apply_chat_template(ex.messages, tokenize=False) for ex in examples]
    images = [load_image(path) for ex in examples for path in ex.images]
    tokenizer.padding_side = "right"
    enc = processor(text=texts, images=images or None, return_tensors="pt", padding=True)
    limit = min(policy.cfg.vlm.max_context, policy.max_positions)
    for ex, length in zip(examples, enc["attention_mask"].sum(-1).tolist(), strict=True):
        if length > limit:
            raise UserError(
                f"SFT sample #{ex.index} is {length} tokens (with image tokens) > context {limit}; sequences are "
                "never truncated: raise model.vlm.max_context, lower model.vlm.max_pixels or drop the sample"
            )
    labels = enc["input_ids"].clone()
    for row in range(labels.shape[0]):
        keep = assistant_mask(enc["input_ids"][row], tokenizer) & enc["attention_mask"][row].bool()
        labels[row][~keep] = IGNORE
    enc["labels"] = labels
    return {key: value.to(policy.device) for key, value in enc.items()}


def sft_loss(policy: VLMPolicy, inputs: dict[str, Tensor]) -> tuple[Tensor, int]:
    """Mean next-token cross-entropy over the labelled (assistant) tokens, and their count."""
    labels = inputs["labels"][:, 1:]
    model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
    with policy.autocast():
        logits = policy.train_model(**model_inputs, use_cache=False).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=IGNORE)
    return loss, int((labels != IGNORE).sum())


def rank_micro_batches(size: int, seed: int, batch_size: int, rank: int, world_size: int) -> list[list[int]]:
    """This rank's micro-batches of one epoch (conversation indices): ``randperm(size)`` seeded by ``seed``
    cut into global micro-batches of ``batch_size`` (the last may be shorter), micro-batch b to rank
    b mod ``world_size``. When their count does not split evenly over the ranks, the order first wraps
    around to whole rounds of full micro-batches, so every rank runs the same number."""
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()
    count = math.ceil(size / batch_size)
    if count % world_size:
        padded = batch_size * world_size * math.ceil(count / world_size)
        order = [order[i % size] for i in range(padded)]
    everyone = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    return everyone[rank::world_size]


def require_whole_rounds(size: int, batch_size: int, launcher: Any) -> None:
    """Under ``launcher.exact_reduction`` (the same run on any process count) the epoch's micro-batches
    must split evenly over the processes: :func:`rank_micro_batches` would otherwise wrap the order
    around, and the padded epoch differs from one process's."""
    count, world = math.ceil(size / batch_size), launcher.world_size
    if world > 1 and launcher.reduces_exactly and count % world:
        raise UserError(
            f"{size} conversations make {count} micro-batches of algo.train_batch_size={batch_size}, which do "
            f"not split evenly over {world} processes: the epoch would wrap around (repeating conversations) "
            "and differ from one process's, and launcher.exact_reduction promises the same run. Pick "
            f"algo.train_batch_size so that the micro-batches are a multiple of {world}, or pass "
            "launcher.exact_reduction=false"
        )


class VLMSFTRecipe:
    """setup → train (shuffled epochs of masked cross-entropy → log → eval → checkpoint) → cleanup."""

    def __init__(self, cfg: VlmSftTrainConfig, raw_cfg: DictConfig) -> None:
        self.cfg, self.raw_cfg, self.run_dir = cfg, raw_cfg, Path(cfg.run_dir)

    def setup(self) -> None:
        cfg, algo = self.cfg, self.cfg.algo
        self.run = open_vlm_run(cfg, self.raw_cfg)  # rank 0 evaluates with generate on its whole model
        self.dist, self.device, self.policy = self.run.dist, self.run.device, self.run.policy
        self.train_set, dropped = drop_reflective(load_sft(cfg.data.train), algo.token.sft_drop_markers)
        if not self.train_set:
            raise UserError(
                f"every SFT sample of {cfg.data.train} was dropped by algo.token.sft_drop_markers"
            )
        log.info("SFT on %d conversations (%d reflective ones dropped)", len(self.train_set), dropped)
        require_whole_rounds(len(self.train_set), algo.train_batch_size, cfg.launcher)
        self.dropped = dropped
        self.test_set = load_vlm_examples(cfg.data.test) if cfg.eval_every else []
        micro_per_rank = len(  # the same every epoch and on every rank
            rank_micro_batches(len(self.train_set), cfg.seed, algo.train_batch_size, 0, self.dist.world_size)
        )
        steps_per_epoch = math.ceil(micro_per_rank / accumulation_per_process(algo, self.dist.world_size))
        self.run.schedule(cfg.epochs * steps_per_epoch)
        self.run.resume_and_prepare(vlm_engine_options(cfg))
        self.run.evaluation = lambda epoch, progress: self.evaluate(progress)

    def train(self) -> dict[str, float]:
        """The epochs in the shared session (``recipes/session.py``): evaluation when due, log line,
        checkpoint, epochs bar."""
        with epoch_session(self.run) as s:
            for epoch in s.epochs():
                metrics = self.train_epoch(epoch, s.progress) | self.dist.loss_scale_metrics()
                if s.end_epoch(epoch, metrics, console_line, headline=f"loss {metrics['loss']:.4g}"):
                    break
        return s.metrics

    def evaluate(self, progress: Progress) -> dict[str, float]:
        """Accuracy on the first ``data.eval_num_prompts`` test questions."""
        cfg = self.cfg
        n = cfg.data.eval_num_prompts or len(self.test_set)
        answers = answer_examples(
            self.policy, self.test_set[:n], cfg.algo.train_batch_size, cfg.seed, progress
        )
        return {"eval/accuracy": summarise(answers)["accuracy"]}

    def train_epoch(self, epoch: int, progress: Progress) -> dict[str, float]:
        """One shuffled pass (order seeded by (seed, epoch), so a resumed run sees the same order); this
        rank's micro-batches of it (:func:`rank_micro_batches`), the same number on every rank."""
        algo, start = self.cfg.algo, time.perf_counter()
        parts = rank_micro_batches(
            len(self.train_set),
            self.cfg.seed + epoch,
            algo.train_batch_size,
            self.dist.rank,
            self.dist.world_size,
        )
        accum = accumulation_per_process(algo, self.dist.world_size)  # the global count ÷ processes
        losses, tokens, norms = [], 0, []
        task = progress.task("sft", total=len(parts))
        for k, part in enumerate(parts):
            inputs = encode_conversations(self.policy, [self.train_set[i] for i in part])
            loss, count = sft_loss(self.policy, inputs)
            steps_after = (k + 1) % accum == 0 or k + 1 == len(parts)
            step_size = min(accum, len(parts) - k // accum * accum)  # the last step may hold fewer
            self.dist.backward(loss / step_size, sync=steps_after)
            losses.append(loss.item())
            tokens += count
            if steps_after:
                norms.append(self.run.optimizer_step())
            progress.advance(task)
        progress.remove(task)
        # per micro-batch losses pooled over ranks: the logged mean does not depend on the process count
        stats = reduce_over_ranks(self.dist, {"loss": losses, "tokens": float(tokens), "grad_norm": norms})
        return {
            **stats,
            "lr": self.run.scheduler.get_last_lr()[0],
            "dropped_reflective": float(self.dropped),
            "time/epoch": time.perf_counter() - start,
            "global_step": self.run.global_step,
        }

    def cleanup(self) -> None:
        self.run.close()


def console_line(m: dict[str, float]) -> str:
    """The epoch's loss, learning rate and seconds."""
    return f"loss {m['loss']:.4f}  lr {m['lr']:.2e}  {m['time/epoch']:.1f}s"


def splits_read(cfg: VlmSftTrainConfig) -> tuple[str, ...]:
    """The prompt files the run reads: the test set only when it evaluates."""
    return ("train", "test") if cfg.eval_every else ("train",)


def run(cfg: VlmSftTrainConfig, raw_cfg: DictConfig) -> dict[str, Any]:
    """Entry point of ``rlgen train algo=vlm_sft``; returns the last epoch's metrics."""
    with opened(VLMSFTRecipe(cfg, raw_cfg)) as recipe:
        return recipe.train()
