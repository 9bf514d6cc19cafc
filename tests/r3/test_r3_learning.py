"""R3's image track learns: trained for brightness, the tiny composite's generated images get brighter;
trained with the reward negated (the negative control), they do not.

Task: ``reward=brightness`` through ``r3.reward_fn=mix`` (the offline stand-in is off: its reward has a
fixed weight). Geometry: tiny_r3 (4 branches, 3 generation and 3 editing steps, one SDE step per image),
the text track frozen (``tune_text_cot=false``: it is the image track under test), no CFG, lr 0.1 without
warm-up, 10 steps (5 reason steps training the generator, 5 refine steps training the editor). With the
tiny generator's CFG (4.0, rescaled to the conditional norm) five reason steps moved the brightness
neither way consistently (±0.008, sign changing with lr), so CFG is off here. Measure: round 0 of the
multi-round evaluation (greedy plan, ODE image, fixed noise) on 4 prompts after the last step, minus the
same evaluation of the untrained composite.

Measured (same on every rerun on CPU): trained +0.0123, negated −0.0073; margin 0.005.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_cli
from tests.r3.conftest import TINY_R3

STEPS, MARGIN = 10, 0.005
TINY_DATA = "builtin:r3_geneval_tiny.jsonl"
LEARNING_RUN = [
    *TINY_R3, "save_every=0", "r3.offline.enabled=false", "r3.reward_fn=mix", "reward=brightness",
    f"r3.train_data_path={TINY_DATA}", f"r3.val_data_path={TINY_DATA}", "r3.tune_text_cot=false",
    "r3.tune_image_cot=true", "r3.group_size=4", "r3.warmup_steps=0", "r3.kl_weight_image=0.0",
    "r3.kl_weight_text=0.0", "r3.mse_weight=2.0", "r3.clip_range=0.2", "r3.scale_by_std=false",
    "r3.sde_kind=dance", "r3.noise_level_gen=0.7", "r3.noise_level_edit=1.0", "r3.temperature=1.0",
    "r3.top_p=1.0", "r3.weight_decay=0.0", "r3.max_grad_norm=1.0", "r3.policy.generator.guidance_scale=1.0",
    "r3.policy.editor.guidance_scale=1.0", "r3.eval_rounds=0", "r3.eval_max_prompts=4",
]  # fmt: skip
FROZEN_LR = 1e-12  # the schema wants lr > 0; 1e-12 moves no fp32 weight


def evaluated_brightness(run: Path, weight: float, lr: float, steps: int) -> float:
    """Train ``steps`` steps with ``reward.weights.brightness=weight``; round 0's brightness after them."""
    schedule = [f"epochs={steps}", f"eval_every={steps}", f"r3.lr={lr}"]
    code, out = run_cli(
        "train", *LEARNING_RUN, *schedule, f"reward.weights.brightness={weight}", f"hydra.run.dir={run}"
    )
    assert code == 0, out
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    return last["eval/round_0/overall"] / weight  # the evaluation scores with the weighted mix


def test_image_track_raises_the_reward_and_the_negated_reward_lowers_it(tmp_path: Path):
    untrained = evaluated_brightness(tmp_path / "untrained", 1.0, FROZEN_LR, steps=1)
    trained = evaluated_brightness(tmp_path / "trained", 1.0, 0.1, STEPS) - untrained
    negated = evaluated_brightness(tmp_path / "negated", -1.0, 0.1, STEPS) - untrained
    assert trained >= MARGIN, f"brightness rose by {trained:+.4f}, expected ≥ {MARGIN}"
    assert negated <= 0.0, f"trained to lower brightness, it rose by {negated:+.4f}"
