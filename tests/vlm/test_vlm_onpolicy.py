"""``rlgen check-onpolicy`` on the VLM recipes: the sampler's own log-probs (recorded by ``generate``) against
the training forward — two computations, within ``check.text_tolerance`` on the tiny Qwen2-VL in fp32, and
failing as soon as the weights move between the rollout and the check."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlgen_cli.schema.check import TEXT_TOLERANCE
from rlgen_cli.vlm.data import load_vlm_examples, prompt_text
from rlgen_cli.vlm.onpolicy import sampler_gaps
from rlgen_cli.vlm.rollout import (
    SamplingOptions,
    collate,
    completion_logprobs,
    encode_prompts,
    generate,
    generation_config,
    load_image,
    pad_stack,
)
from tests.conftest import run_cli
from tests.vlm.conftest import TINY_VLM

REPORT_ROW = "│"  # rich table rows: one per sample


def _max_error(out: str) -> float:
    line = next(line for line in out.splitlines() if "sampler): max error" in line)
    return float(line.split("max error")[1].split()[0])


@pytest.mark.parametrize("algo", ["step_grpo", "token_grpo"])
def test_sampler_and_training_forward_agree_within_the_text_tolerance(tmp_path: Path, algo):
    code, out = run_cli(
        "check-onpolicy", *TINY_VLM, f"algo={algo}", "reward=length", f"hydra.run.dir={tmp_path}"
    )
    assert code == 0, out
    assert "PASS text (hf sampler): max error" in out
    assert sum(line.startswith(REPORT_ROW) for line in out.splitlines()) == 4  # 2 prompts × 2 completions
    assert 0.0 <= _max_error(out) <= TEXT_TOLERANCE  # measured ≤ 9.5e-7 in fp32 (KV cache vs full forward)


def test_check_fails_when_the_weights_move_after_the_rollout(tmp_path: Path):
    overrides = [*TINY_VLM, "algo=step_grpo", "reward=length", "check.perturb_weights=1e-3"]
    code, out = run_cli("check-onpolicy", *overrides, f"hydra.run.dir={tmp_path}")
    assert code == 1, out
    assert "FAIL text (hf sampler): max error" in out
    assert _max_error(out) > 100 * TEXT_TOLERANCE  # LoRA noise of std 1e-3 moves the log-probs by ~2e-3


def test_flow_only_settings_are_refused_for_a_vlm(tmp_path: Path):
    overrides = [*TINY_VLM, "algo=step_grpo", "reward=length", "check.train_noise_level=0.8"]
    code, out = run_cli("check-onpolicy", *overrides, f"hydra.run.dir={tmp_path}")
    assert code == 2 and "check.train_noise_level" in out and "perturb_weights" in out, out


def test_sampler_gaps_by_hand():
    trained = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    gaps = sampler_gaps(trained, mask, [torch.tensor([-1.0, -2.5]), torch.tensor([])])
    assert gaps[0] == pytest.approx((math.exp(0.5) - 1, 0.5))  # the token the trainer finds likelier
    assert gaps[1] == (0.0, 0.0)  # an empty completion
    assert sampler_gaps(trained[:1], mask[:1], [torch.tensor([-1.0, -1.5])])[0] == pytest.approx(
        (1 - math.exp(-0.5), 0.5)
    )
    with pytest.raises(RuntimeError, match="not finite"):  # vLLM without log-probs: NaN must not pass
        sampler_gaps(trained[:1], mask[:1], [torch.tensor([float("nan"), -2.0])])
    with pytest.raises(RuntimeError, match="1 log-probs for 2 tokens"):
        sampler_gaps(trained[:1], mask[:1], [torch.tensor([-1.0])])


def _prompts(policy, n: int = 2):
    examples = load_vlm_examples("builtin:tiny_r1vl.json")[:n]
    vlm = policy.cfg.vlm
    texts = [prompt_text(policy.processor, ex, vlm.prompt_format, vlm.system_prompt) for ex in examples]
    return texts, [load_image(ex.image) for ex in examples]


def test_recorded_logprobs_are_the_sampling_distribution_brought_back_to_temperature_one(tiny_vlm_policy):
    """``generate`` samples from the processed scores (logits / T, vision tokens at −inf); what it records
    must be log softmax(T · scores) — the same distribution at temperature 1 — not the scores themselves."""
    policy = tiny_vlm_policy
    texts, images = _prompts(policy)
    options = SamplingOptions(temperature=1.7, top_p=1.0, top_k=0, max_new_tokens=6)
    encoded = encode_prompts(policy, texts, images)
    done = generate(policy, encoded, options, seed=4)
    config = generation_config(policy, options, record=True)
    config.output_scores = True
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(4)
        out = policy.model.generate(**encoded, generation_config=config)
    scores = torch.stack(out.scores, dim=1)  # (B, L, V) what the sampler drew from
    for i, ids in enumerate(done.ids):
        assert torch.equal(out.sequences[i, encoded["input_ids"].shape[1] :][: len(ids)], ids)  # same draw
        rows = scores[i, : len(ids)]
        at_t1 = torch.log_softmax(rows * options.temperature, -1).gather(-1, ids[:, None]).squeeze(-1)
        at_t = torch.log_softmax(rows, -1).gather(-1, ids[:, None]).squeeze(-1)
        assert torch.allclose(done.logprobs[i], at_t1, atol=2e-6)
        assert (done.logprobs[i] - at_t).abs().max() > 1e-2  # the temperature is not left in


def test_full_vocabulary_logprobs_for_raw_engine_logprobs(tiny_vlm_policy):
    """``suppressed=()`` (vLLM's raw log-probs) normalises over the vision tokens too: every log-prob is
    lower by the same per-position amount, log(1 − p_vision) < 0."""
    policy = tiny_vlm_policy
    texts, images = _prompts(policy)
    done = generate(policy, encode_prompts(policy, texts, images), SamplingOptions(1.0, 1.0, 0, 6), seed=0)
    batch = collate(policy, texts, images, done.ids)
    with torch.no_grad():
        masked = completion_logprobs(policy, batch)
        full = completion_logprobs(policy, batch, suppressed=())
    mask = batch.completion_mask.bool()
    assert torch.allclose(masked[mask], pad_stack(done.logprobs, masked.shape[1])[mask], atol=TEXT_TOLERANCE)
    assert ((full - masked)[mask] < -1e-6).all()
