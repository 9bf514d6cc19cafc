"""The sampler's log-probs recorded step by step (vlm/sampler_logprobs.py, what every real-size rollout
uses) equal those of ``generate``'s own ``output_logits`` for every tiny Qwen-VL family, LoRA and full
fine-tuning, and recording changes no draw; a model whose logits bypass its output head is an error, not
a shifted record."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.models.helpers import CPU, model_cfg

FAMILIES = {"qwen2_vl": "tiny_qwen2_vl", "qwen2_5_vl": "tiny_qwen2_vl", "qwen3_vl": "tiny_qwen3_vl"}


@pytest.fixture(autouse=True)
def streamed(monkeypatch):
    """The tiny models' records fit ``RECORD_ALL_BYTES``: make every rollout here take the streamed path."""
    from rlgen_cli.vlm import rollout

    monkeypatch.setattr(rollout, "RECORD_ALL_BYTES", 0)


@pytest.fixture(scope="module")
def built() -> dict[tuple[str, bool], object]:
    return {}


def _policy(built: dict, family: str, lora: bool):
    if (family, lora) not in built:
        from rlgen_cli.vlm.policy import build_vlm

        cfg = model_cfg(FAMILIES[family])
        cfg = dataclasses.replace(cfg, family=family, lora=dataclasses.replace(cfg.lora, enabled=lora))
        built[(family, lora)] = build_vlm(cfg, CPU)
    return built[(family, lora)]


def _encoded(policy):
    from rlgen_cli.vlm.data import load_vlm_examples, prompt_text
    from rlgen_cli.vlm.rollout import encode_prompts, load_images

    examples = [load_vlm_examples("builtin:tiny_r1vl.json")[k] for k in (0, 0, 1, 2)]
    vlm = policy.cfg.vlm
    texts = [prompt_text(policy.processor, ex, vlm.prompt_format, vlm.system_prompt) for ex in examples]
    return encode_prompts(policy, texts, load_images([ex.image for ex in examples]))


def _with_output_logits(policy, encoded, options, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The generated ids and their masked log-probs from ``generate``'s own stacked raw logits."""
    from rlgen_cli.vlm.rollout import generation_config, masked_log_softmax_gather

    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed)
        out = policy.model.generate(
            **encoded, generation_config=generation_config(policy, options, record=True)
        )
    ids = out.sequences[:, encoded["input_ids"].shape[1] :]
    return ids, masked_log_softmax_gather(torch.stack(out.logits, dim=1), ids, policy.suppressed_ids)


@pytest.mark.parametrize("lora", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_steps_equal_generates_own_raw_logits(built, family: str, lora: bool):
    from rlgen_cli.vlm.rollout import SamplingOptions, generate

    policy = _policy(built, family, lora)
    encoded = _encoded(policy)
    options = SamplingOptions(temperature=1.3, top_p=0.9, top_k=20, max_new_tokens=10)
    done = generate(policy, encoded, options, seed=7)
    ids, expected = _with_output_logits(policy, encoded, options, seed=7)
    # float32 log-softmax of the same float32 logits, reduced over (B, V) rows here and (B, L, V) there
    tolerance = 16 * torch.finfo(torch.float32).eps * max(1.0, float(expected.abs().max()))
    for row, (tokens, logprobs) in enumerate(zip(done.ids, done.logprobs, strict=True)):
        assert torch.equal(tokens, ids[row, : len(tokens)])  # recording changes no draw
        assert torch.allclose(logprobs, expected[row, : len(tokens)], rtol=0, atol=tolerance), row


def test_a_model_whose_logits_bypass_the_output_head_is_refused(built):
    from rlgen_cli.vlm.rollout import SamplingOptions, generate

    policy = _policy(built, "qwen2_vl", True)
    vocabulary = policy.model.get_output_embeddings().weight.shape[0]
    bypass = torch.nn.Linear(1, vocabulary)  # a head of the right size that generate never calls
    policy.model.get_output_embeddings = lambda: bypass
    try:
        with pytest.raises(RuntimeError, match="without an output-head call"):
            generate(policy, _encoded(policy), SamplingOptions(1.0, 1.0, 0, 4), seed=0)
    finally:
        del policy.model.get_output_embeddings
    assert not bypass._forward_hooks  # the hook is removed after generate, error or not
    done = generate(policy, _encoded(policy), SamplingOptions(1.0, 1.0, 0, 4), seed=0)  # the real head again
    assert done.logprobs is not None and all(torch.isfinite(lp).all() for lp in done.logprobs)


def test_real_size_rollouts_are_streamed_and_tiny_ones_read_whole(built, monkeypatch):
    from rlgen_cli.vlm import rollout

    monkeypatch.undo()  # the real threshold
    policy = _policy(built, "qwen2_vl", True)
    vocabulary = policy.model.get_output_embeddings().weight.shape[0]
    assert rollout.whole_record_fits(policy, 16, 32)  # the tiny rollouts: a few MB
    largest = rollout.RECORD_ALL_BYTES // (vocabulary * 4)
    assert rollout.whole_record_fits(policy, 1, largest) and not rollout.whole_record_fits(
        policy, 1, largest + 1
    )
