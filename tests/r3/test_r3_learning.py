"""R3's two tracks learn, each against a negative control run in the same test.

**Image track**: trained for brightness, the tiny composite's generated images get brighter; trained with
the reward negated, they do not. Task: ``reward=brightness`` through ``r3.reward_fn=mix`` (the offline
stand-in is off: its reward has a fixed weight). Geometry: tiny_r3 (4 branches, 3 generation and 3
editing steps, one SDE step per image), the text track frozen (``tune_text_cot=false``), no CFG, lr 0.1
without warm-up, 10 steps (5 reason steps training the generator, 5 refine steps training the editor).
With the tiny generator's CFG (4.0, rescaled to the conditional norm) five reason steps moved the
brightness neither way consistently (±0.008, sign changing with lr), so CFG is off here. Measure: round 0
of the multi-round evaluation (greedy plan, ODE image, fixed noise) on 4 prompts after the last step,
minus the same evaluation of the untrained composite. Measured (same on every rerun on CPU): trained
+0.0123, negated −0.0073; margin 0.005.

**Text track**: trained with R3's own reason reward f·(r + w_f), the share of well-formed plans f rises;
trained with the text reward negated (w_f = −1 and r's weight −1: −f·(r + 1)), it falls. A random text
policy never writes the format (no signal); one fine-tuned on a single plan writes it always for some
prompts and never for others, and where it is uncertain it sits on a sharp 16-token mode that every
update dulled, with the reward or against it (the share fell either way at lr 1e-3 to 1e-2). So the
text policy is warm-started on one prompt with two answers, ``<think>a cat</think>`` and the bare
``a cat`` (``_warm_start.py``): its first token picks the format about half the time, a choice GRPO can
move. Both answers give the plan "a cat", so the ODE images — and r — are the same in every branch: the
text advantage is (1 + r)·(f − mean f). Geometry: tiny_r3 with its text LoRA, one prompt, 16 branches,
the image track frozen and SDE off, lr 2e-3 without warm-up or KL, 10 steps. Reflections are never
well-formed (the warm start saw no reflect prompt), so refine steps have zero text advantages and the 5
reason steps train. Measure: the format rate of the reason steps after an update (steps 2–8, 64 plans)
minus that of a run with lr 1e-12 (same prompts and sampling seeds, no weight moves). Every tensor of
the text adapter changes (a single reason step moves only the B matrices, which start at 0).

Measured (same on every rerun on CPU, with 1 or 2 threads): frozen 0.453, trained +0.375, negated
−0.234; margin 0.2. With the text loss's advantages negated the test fails (−0.234 and +0.375).

Both tests run single-threaded: these 32-wide models gain nothing from a second intra-op thread, and on
a loaded 2-core machine its spin-waits made the text test take 8 minutes instead of 25 s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_cli
from tests.r3._warm_start import PROMPT
from tests.r3.conftest import TINY_R3, compose_r3, warm_text_overrides

STEPS, MARGIN = 10, 0.005
TINY_DATA = "builtin:r3_geneval_tiny.jsonl"
LEARNING_RUN = [
    *TINY_R3, "save_every=0", "r3.offline.enabled=false", "r3.reward_fn=mix", "reward=brightness",
    f"r3.train_data_path={TINY_DATA}", f"r3.val_data_path={TINY_DATA}", "r3.tune_text_cot=false",
    "r3.tune_image_cot=true", "r3.group_size=4", "r3.warmup_steps=0", "r3.kl_weight_image=0.0",
    "r3.mse_weight=2.0", "r3.clip_range=0.2", "r3.scale_by_std=false",
    "r3.sde_kind=dance", "r3.noise_level_gen=0.7", "r3.noise_level_edit=1.0", "r3.temperature=1.0",
    "r3.top_p=1.0", "r3.weight_decay=0.0", "r3.max_grad_norm=1.0", "r3.policy.generator.guidance_scale=1.0",
    "r3.policy.editor.guidance_scale=1.0", "r3.eval_rounds=0", "r3.eval_max_prompts=4",
]  # fmt: skip
FROZEN_LR = 1e-12  # the schema wants lr > 0; 1e-12 moves no fp32 weight


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for this module (see the module docstring), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


TEXT_STEPS, TEXT_LR, TEXT_MARGIN = 10, 2e-3, 0.2
TEXT_RUN = [
    "save_every=0", "r3.offline.enabled=false", "r3.reward_fn=mix", "reward=brightness", "r3.group_size=16",
    "r3.tune_text_cot=true", "r3.tune_image_cot=false", "r3.enable_sde_gen=false", "r3.enable_sde_edit=false",
    "r3.policy.generator.guidance_scale=1.0", "r3.policy.editor.guidance_scale=1.0", "r3.warmup_steps=0",
    "r3.kl_weight_text=0.0", "r3.ce_weight=1.0", "r3.clip_range=0.2",
    "r3.scale_by_std=false", "r3.temperature=1.0", "r3.top_p=1.0", "r3.weight_decay=0.0",
    "r3.max_grad_norm=1.0", f"epochs={TEXT_STEPS}",
]  # fmt: skip
ADAPTER = "text/adapter_model.safetensors"


@pytest.fixture(scope="module")
def half_formatted_text_dir(tmp_path_factory) -> Path:
    """The tiny Qwen2.5-VL warm-started on a well-formed and a bare plan (see the module docstring)."""
    from tests.r3._warm_start import PLAN, warm_started_text_policy

    return warm_started_text_policy(tmp_path_factory.mktemp("half_formatted"), plans=(PLAN, "a cat"))


def text_overrides(warm: Path, data: Path) -> list[str]:
    paths = [f"r3.train_data_path={data}", f"r3.val_data_path={data}"]
    return [*TINY_R3, *warm_text_overrides(warm), *TEXT_RUN, *paths]


def format_rate_after_updates(run: Path, overrides: list[str], sign: float, lr: float) -> float:
    """Train with the text reward times ``sign``; the share of well-formed plans at reason steps 2, 4, …"""
    signed = [f"r3.format_weight={sign}", f"reward.weights.brightness={sign}", f"r3.lr={lr}"]
    code, out = run_cli("train", *overrides, *signed, f"hydra.run.dir={run}")
    assert code == 0, out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [row["format_rate"] for row in rows if row["stage"] == 0.0][1:]  # step 0 precedes any update
    assert len(rates) == TEXT_STEPS // 2 - 1
    return sum(rates) / len(rates)


def initial_adapter(overrides: list[str], directory: Path) -> dict[str, torch.Tensor]:
    """The text adapter before training, built as the recipe builds the composite (same seed, same order)."""
    from rlgen_cli.r3.composite import build_composite

    typed, _ = compose_r3("train", overrides)
    torch.manual_seed(typed.seed)
    build_composite(typed.r3.policy, torch.device("cpu")).save_trainable(directory)
    return load_file(directory / ADAPTER)


def test_text_track_raises_the_format_rate_and_the_negated_reward_lowers_it(
    tmp_path: Path, half_formatted_text_dir: Path
):
    data = tmp_path / "cat.jsonl"
    cat = {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": PROMPT}
    data.write_text(json.dumps(cat) + "\n")  # the one prompt the warm start answered
    overrides = text_overrides(half_formatted_text_dir, data)
    frozen = format_rate_after_updates(tmp_path / "frozen", overrides, 1.0, FROZEN_LR)
    trained = format_rate_after_updates(tmp_path / "trained", overrides, 1.0, TEXT_LR) - frozen
    negated = format_rate_after_updates(tmp_path / "negated", overrides, -1.0, TEXT_LR) - frozen
    assert trained >= TEXT_MARGIN, f"the format rate rose by {trained:+.3f}, expected ≥ {TEXT_MARGIN}"
    assert negated <= 0.0, f"trained to lower the format rate, it rose by {negated:+.3f}"

    before = initial_adapter(overrides, tmp_path / "initial")
    after = load_file(tmp_path / "trained" / "checkpoints" / f"epoch_{TEXT_STEPS:06d}" / "weights" / ADAPTER)
    assert before.keys() == after.keys() and before
    unchanged = sorted(k for k in before if torch.equal(before[k], after[k]))
    assert not unchanged, f"{len(unchanged)} of {len(before)} text adapter tensors unchanged: {unchanged[:3]}"
