"""Token GRPO and StepGRPO learn: on the tiny Qwen2-VL, trained to write lowercase letters, the share of
them in the completions rises; trained with the reward negated (the negative control), it does not.

Task: ``reward=char_fraction`` with ``chars=a-z``, dense in every generated token (the untrained model's
completions are ≈ 62 % lowercase letters). Geometry: all 8 training prompts every epoch × 4 completions
of ≤ 12 tokens, one on-policy update per epoch, lr 0.2 (constant), 5 epochs, full fine-tuning: a LoRA on
the attention of a random model with tied 32-wide embeddings can barely move its next-token distribution
(logits stay within ±0.6), so LoRA runs changed the share by less than the sampling noise.

Measure: the share over the last 2 epochs minus the same share of a reference run with lr 1e-12 (no
weight moves; the same prompts and sampling seeds, epoch by epoch). Comparing epochs with each other
instead would measure the seeds: the reference's own share moves by ±0.03 from epoch to epoch.

Measured (same on every rerun on CPU): at seed 42, trained and negated; the worst trained gain over
seeds 0, 1, 2, 3, 42; the margin asserted, about half that worst gain:

    algorithm    trained   negated   worst     margin
    token_grpo   +0.1144   −0.5447   +0.1136   0.04
    step_grpo    +0.2838   −0.5841   +0.0874   0.04

Groups of 4, not 2: with 2 completions per prompt (advantages ±1 whatever the rewards) seed 42 gained
+0.2465 / +0.2337, but seed 0 gave step_grpo +0.0234 and seed 3 token_grpo +0.0228 and step_grpo
+0.0788, against a margin of 0.08.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

EPOCHS, LAST = 5, 2
LEARNING_RUN = [
    "model=tiny_qwen2_vl", "data=tiny_vlm", "reward=char_fraction", "reward.kwargs.char_fraction.chars=a-z",
    "model.lora.enabled=false", "progress=false", f"epochs={EPOCHS}", "eval_every=0", "save_every=0",
    "algo.prompts_per_epoch=8", "algo.group_size=4", "algo.sample_batch_size=32", "algo.train_batch_size=32",
    "algo.gradient_accumulation_steps=1", "algo.weight_decay=0.0", "algo.max_grad_norm=1.0", "algo.kl_weight=0.0",
    "algo.clip_range=0.2", "algo.adv_clip_max=5.0", "algo.token.max_completion_tokens=12",
    "algo.token.num_iterations=1", "algo.token.old_logprobs=recompute", "algo.token.importance_level=token",
    "algo.token.epsilon_high=null", "algo.token.scale_rewards=group", "algo.token.std_estimator=unbiased",
    "algo.token.top_p=1.0", "algo.token.top_k=0", "algo.token.lr_schedule=constant", "algo.token.warmup_ratio=0.0",
    "algo.token.mask_truncated_completions=false",
]  # fmt: skip
ALGORITHMS = {  # algorithm: (its own sampling and loss, margin)
    "token_grpo": (["algo=token_grpo", "algo.token.loss_type=dapo", "algo.token.temperature=1.0"], 0.04),
    "step_grpo": (["algo=step_grpo", "algo.token.loss_type=grpo", "algo.token.temperature=1.2"], 0.04),
}
LR, FROZEN_LR = 0.2, 1e-12  # the schema wants lr > 0; 1e-12 moves no fp32 weight


def lowercase_share(run: Path, overrides: list[str], weight: float, lr: float) -> float:
    """Train with ``reward.weights.char_fraction=weight``; the mean share of the last epochs."""
    weighted = [f"reward.weights.char_fraction={weight}", f"algo.lr={lr}", f"hydra.run.dir={run}"]
    code, out = run_cli("train", *overrides, *LEARNING_RUN, *weighted)
    assert code == 0, out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    shares = [row["reward/char_fraction/mean"] for row in rows]  # the raw score, whatever the weight
    assert len(shares) == EPOCHS
    return sum(shares[-LAST:]) / LAST


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_training_raises_the_reward_and_the_negated_reward_does_not(tmp_path: Path, algo: str):
    overrides, margin = ALGORITHMS[algo]
    reference = lowercase_share(tmp_path / "reference", overrides, 1.0, FROZEN_LR)
    trained = lowercase_share(tmp_path / "trained", overrides, 1.0, LR) - reference
    negated = lowercase_share(tmp_path / "negated", overrides, -1.0, LR) - reference
    assert trained >= margin, f"{algo}: the lowercase share rose by {trained:+.4f}, expected ≥ {margin}"
    assert negated <= 0.0, f"{algo}: trained to lower the lowercase share, it rose by {negated:+.4f}"
