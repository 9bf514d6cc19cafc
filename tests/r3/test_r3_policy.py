"""The composite unified policy: protocol, stage routing, the shared text encoder, checkpoint round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlgen_cli.errors import UserError
from rlgen_cli.r3.policy import EDIT, GENERATE, IMAGE, TEXT, UnifiedPolicy
from rlgen_cli.vlm.rollout import SamplingOptions
from tests.r3.conftest import compose_r3

CPU = torch.device("cpu")
OPTIONS = SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=6)


def _policy_cfg(*overrides: str):
    return compose_r3("train", ["model=tiny_r3", *overrides])[0].r3.policy


@pytest.fixture(scope="module")
def policy():
    from rlgen_cli.r3.composite import build_composite

    torch.manual_seed(0)
    return build_composite(_policy_cfg(), CPU)


@pytest.fixture(scope="module")
def shared():
    from rlgen_cli.r3.composite import build_composite

    torch.manual_seed(0)
    return build_composite(_policy_cfg("r3.policy.share_text_encoder=true"), CPU)


def _perturb(params) -> None:
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.5)


def test_composite_is_a_unified_policy(policy):
    assert isinstance(policy, UnifiedPolicy)
    thoughts = policy.think(["a photo of a cat", "a dog"], OPTIONS, seed=0)
    assert len(thoughts) == 2 and all(c.numel() <= 6 for c in thoughts.completions)
    images = torch.rand(2, 3, 32, 32)
    reflections = policy.reflect(images, ["a photo of a cat", "a dog"], OPTIONS, seed=1)
    assert all(image is not None for image in reflections.images)
    batch = policy.token_batch(reflections, slice(0, 2))
    logp = policy.token_logprobs(batch)
    assert logp.shape == batch.completion_ids.shape and torch.equal(logp, policy.token_logprobs(batch))


def test_velocity_follows_the_stage_of_the_conditioning(policy):
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    gen_cond = policy.encode_generate(["a cat", "a dog"], ["<think>x</think>", ""])
    edit_cond = policy.encode_edit(torch.rand(2, 3, 32, 32), ["make it red", "add a dog"])
    for stage, cond in ((GENERATE, gen_cond), (EDIT, edit_cond)):
        x = policy.noise(2, gens, stage)
        v = policy.velocity(x, policy.schedule(3, x, stage)[0], cond)
        assert torch.equal(v, policy.parts[stage].velocity(x, policy.schedule(3, x, stage)[0], cond))
    with pytest.raises(ValueError, match="R3 stage"):
        gen_cond.extras.clear()
        policy.velocity(x, torch.tensor(0.5), gen_cond)


def test_image_reference_switches_both_image_adapters_off(policy):
    x = policy.noise(1, [torch.Generator().manual_seed(0)], GENERATE)
    cond = policy.encode_generate(["a cat"], [""])
    sigma = torch.tensor(0.7)
    with policy.image_reference():
        before = policy.velocity(x, sigma, cond)
    _perturb(policy.trainable_parameters(IMAGE))
    with policy.image_reference():
        assert torch.equal(before, policy.velocity(x, sigma, cond))
    assert not torch.equal(before, policy.velocity(x, sigma, cond))


def test_shared_encoder_is_the_text_policy_with_its_adapter_off(shared):
    encoder = shared.parts[GENERATE].pipeline.text_encoder
    assert shared.text.model.get_base_model() is encoder  # one set of weights
    thoughts = shared.think(["a cat"], OPTIONS, seed=0)
    batch = shared.token_batch(thoughts, slice(0, 1))
    cond_before, logp_before = shared.encode_generate(["a cat"], ["red"]), shared.token_logprobs(batch)
    _perturb(shared.trainable_parameters(TEXT))
    cond_after, logp_after = shared.encode_generate(["a cat"], ["red"]), shared.token_logprobs(batch)
    assert not torch.equal(logp_before, logp_after)  # the text policy moved …
    for key, value in cond_before.tensors.items():  # … the generator still sees its pretrained encoder
        assert torch.equal(value, cond_after.tensors[key]), key
    assert torch.equal(logp_before, shared.token_logprobs(batch, reference=True))


def test_sharing_needs_a_lora_text_policy():
    from rlgen_cli.r3.composite import build_composite

    with pytest.raises(UserError, match="lora.enabled=true"):
        build_composite(
            _policy_cfg("r3.policy.share_text_encoder=true", "r3.policy.text.lora.enabled=false"), CPU
        )


def test_parts_must_fit_their_roles():
    from rlgen_cli.r3.composite import build_composite

    with pytest.raises(UserError, match="the editor must edit"):
        build_composite(_policy_cfg("model_schema@r3.policy.editor=qwen_image"), CPU)  # a family's keys


def test_save_and_load_round_trip(policy, tmp_path: Path):
    policy.save_trainable(tmp_path)
    saved = [p.detach().clone() for track in (TEXT, IMAGE) for p in policy.trainable_parameters(track)]
    _perturb([p for track in (TEXT, IMAGE) for p in policy.trainable_parameters(track)])
    policy.load_trainable(tmp_path)
    loaded = [p for track in (TEXT, IMAGE) for p in policy.trainable_parameters(track)]
    assert all(torch.equal(a, b) for a, b in zip(saved, loaded, strict=True))
