"""BAGEL image editing: the source image in the context (it changes the velocity), the three CFG branches
combined by hand (text_channel renorm, image scale 1 = text guidance alone), the editing interval, the
ViT resize rule and mask by hand, batching through ``Cond``, input errors, and the CLI (check-onpolicy
exact and failing under perturbed weights; a Flow-GRPO run on the generated editing set).

Parity with the reference implementation (its modules run on the side, fp32) is reported in docs/bagel.md.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlgen_cli.errors import UserError
from rlgen_cli.models.bagel import editing
from rlgen_cli.models.bagel.config import BAGEL_7B_MOT, TINY_BAGEL
from rlgen_cli.models.bagel.policy import BagelPolicy, patchify_latents
from rlgen_cli.models.bagel.tiny import tiny_bagel
from rlgen_cli.models.base import Cond
from rlgen_cli.models.trainable import LORA_WEIGHTS_NAME
from rlgen_cli.schema.model import require_family_schema
from tests.conftest import TINY_RUN
from tests.models.helpers import CPU, model_cfg

PROMPTS = ["make the square red", "add two blue circles next to the big square"]


@pytest.fixture(scope="module")
def edit_cfg():
    return model_cfg("tiny_bagel_edit")


def _policy(cfg, parts=None, **changes) -> BagelPolicy:
    network, vae, tokenizer, markers = parts or tiny_bagel(cfg.tiny_seed)
    return BagelPolicy(network, vae, tokenizer, markers, replace(cfg, **changes), CPU)


def _sources(seed: int, n: int = 2) -> torch.Tensor:
    return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def shared(edit_cfg):
    """The guided policy (text 4, image 2), an unguided one on the same network, noise and conditioning."""
    policy = _policy(edit_cfg)
    parts = (policy.transformer, policy.vae, policy.tokenizer, policy.markers)
    off = replace(edit_cfg.lora, enabled=False)  # the network already holds the adapter (B = 0 at init)
    plain = _policy(edit_cfg, parts, guidance_scale=1.0, image_guidance_scale=1.0, lora=off)
    x = policy.noise(2, torch.Generator().manual_seed(0))
    return policy, plain, x, policy.encode(PROMPTS, _sources(1))


def test_the_source_image_and_the_instruction_change_the_velocity(shared):
    _, plain, x, _ = shared
    t = torch.tensor(0.9)
    cond = plain.encode(PROMPTS, _sources(1))
    without_image = Cond({k: cond.tensors[k] for k in ("text_ids", "text_mask")})  # the text-to-image context
    with torch.no_grad():
        base = plain.velocity(x, t, cond)
        other_image = plain.velocity(x, t, plain.encode(PROMPTS, _sources(2)))
        other_text = plain.velocity(x, t, plain.encode(PROMPTS[::-1], _sources(1)))
        text_only = plain.velocity(x, t, without_image)
    for changed in (other_image, other_text, text_only):
        assert (changed - base).abs().amax(dim=(1, 2, 3)).min() > 1e-3


def test_guidance_is_the_reference_editing_cfg_by_hand(shared):
    """v_t = (u_t + 4(c − u_t))·clamp(‖c‖/‖·‖ per token, 0, 1); v = u_i + 2(v_t − u_i), at t = 0.3 (outside
    the text-to-image interval, inside the editing one); image scale 1 gives v_t alone."""
    policy, plain, x, cond = shared
    parts = (policy.transformer, policy.vae, policy.tokenizer, policy.markers)
    off = replace(policy.cfg.lora, enabled=False)
    text_only = _policy(policy.cfg, parts, image_guidance_scale=1.0, lora=off)
    t = torch.tensor(0.3)
    without_text = Cond(
        cond.tensors | {"text_ids": cond.tensors["neg_text_ids"], "text_mask": cond.tensors["neg_text_mask"]},
        cond.extras,
    )
    without_image = Cond({"text_ids": cond.tensors["text_ids"], "text_mask": cond.tensors["text_mask"]})
    with torch.no_grad():
        guided, text_guided = policy.velocity(x, t, cond), text_only.velocity(x, t, cond)
        c, u_t, u_i = (
            patchify_latents(plain.velocity(x, t, k), 2) for k in (cond, without_text, without_image)
        )
    assert not cond.tensors["neg_text_mask"].any()  # the text-CFG context is the image alone
    raw = u_t + 4.0 * (c - u_t)
    scale = (c.norm(dim=-1, keepdim=True) / raw.norm(dim=-1, keepdim=True)).clamp(max=1.0)
    assert (scale < 0.95).all() and scale.max() - scale.min() > 0.05  # the renorm acts, per token
    expected_text = raw * scale
    torch.testing.assert_close(patchify_latents(text_guided, 2), expected_text, rtol=1e-5, atol=1e-5)
    expected = u_i + 2.0 * (expected_text - u_i)
    torch.testing.assert_close(patchify_latents(guided, 2), expected, rtol=1e-5, atol=1e-5)
    assert (expected - expected_text).abs().max() > 1e-2  # the image branch matters


def test_cond_cat_and_index_round_trip(shared):
    policy, _, x, cond = shared
    first, second = (policy.encode([p], s) for p, s in zip(PROMPTS, _sources(1).split(1)))
    joined = Cond.cat([first, second])
    assert joined.tensors.keys() == cond.tensors.keys() and joined.extras == cond.extras
    for key, value in cond.tensors.items():  # the VAE's batched convolutions may differ in the last bits
        torch.testing.assert_close(joined.tensors[key], value, rtol=0, atol=1e-6)
        torch.testing.assert_close(cond.index([1]).tensors[key], second.tensors[key], rtol=0, atol=1e-6)
    with torch.no_grad():
        whole = policy.velocity(x, torch.tensor(0.9), cond)
        alone = policy.velocity(x[1:], torch.tensor(0.9), cond.index([1]))
    torch.testing.assert_close(alone, whole[1:], rtol=1e-5, atol=1e-5)


def test_vit_resize_rule_by_hand():
    """The reference's rule (long side ≤ 980, short side ≥ 224, multiples of 14), e.g. 768 → 55·14 = 770
    and 512 → 37·14 = 518; the tiny model's 32 px stays 32 px (8 patches of 4)."""
    vit = BAGEL_7B_MOT.vit
    assert editing.vit_input_size(1024, 1024, vit) == (980, 980)
    assert editing.vit_input_size(512, 768, vit) == (518, 770)
    assert editing.vit_input_size(2048, 1024, vit) == (980, 490)
    assert editing.vit_input_size(128, 128, vit) == (224, 224)
    assert editing.vit_input_size(32, 32, TINY_BAGEL.vit) == (32, 32)
    patches, grid = editing.vit_patches(torch.ones(1, 3, 32, 32), TINY_BAGEL.vit)
    assert grid == (8, 8) and patches.shape == (1, 64, 48) and torch.equal(patches, torch.ones_like(patches))


def test_edit_mask_by_hand():
    """[VAE block 2][ViT block 2][instruction 3, last padded][generated block 2]."""
    mask = editing.edit_mask(2, 2, torch.tensor([[True, True, False]]), 2)[0].int()
    expected = torch.tensor(
        [
            [1, 1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 1, 0, 0],  # the padded position sees only itself
            [1, 1, 1, 1, 1, 1, 0, 1, 1],
            [1, 1, 1, 1, 1, 1, 0, 1, 1],
        ]
    )
    assert torch.equal(mask, expected)


def test_input_errors(edit_cfg, shared):
    policy = shared[0]
    with pytest.raises(UserError, match="source image"):
        policy.encode(PROMPTS)
    with pytest.raises(UserError, match="model's size"):
        policy.encode(PROMPTS, torch.rand(2, 3, 64, 64))
    with pytest.raises(UserError, match="one source image per prompt"):
        policy.encode(PROMPTS, torch.rand(2, 2, 3, 32, 32))
    with pytest.raises(UserError, match="model.guidance_scale"):
        replace(edit_cfg, guidance_scale=1.0).__post_init__()
    with pytest.raises(UserError, match="model.family=sd3 has keys of its own"):
        require_family_schema(replace(edit_cfg, family="sd3"))


def test_the_training_pass_gives_the_rollout_velocity_bit_for_bit(shared):
    """What check-onpolicy relies on: the velocity with gradients (three branches, the unconditional ones
    without a graph) equals the rollout's no-grad velocity exactly, and gradients reach the adapter."""
    policy, _, x, cond = shared
    t = torch.tensor([0.9, 0.3])
    with torch.no_grad():
        rollout = policy.velocity(x, t, cond)
    training = policy.velocity(x, t, cond)
    assert torch.equal(training, rollout)
    training.square().mean().backward()
    grads = [p.grad for p in policy.trainable.parameters()]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    for param in policy.trainable.parameters():
        param.grad = None


# -- the CLI ----------------------------------------------------------------------------------------------
@pytest.mark.slow  # ~20 s on 2 cores; the test above pins the same equality in-process
def test_check_onpolicy_is_exact_on_the_editing_set_it_picks(tmp_path: Path, cli):
    code, out = cli("check-onpolicy", "model=tiny_bagel_edit", *TINY_RUN, f"hydra.run.dir={tmp_path}")
    assert code == 0 and "PASS" in out, out
    assert (tmp_path / "tiny_edit" / "tiny_edit_train.jsonl").is_file()  # generated in the run directory


@pytest.mark.slow  # a second check-onpolicy run (~20 s on 2 cores)
def test_check_onpolicy_fails_with_perturbed_weights(tmp_path: Path, cli):
    code, out = cli(
        "check-onpolicy",
        "model=tiny_bagel_edit",
        *TINY_RUN,
        "check.perturb_weights=1e-2",
        f"hydra.run.dir={tmp_path}",
    )
    assert code != 0 and "FAIL max error" in out, out


@pytest.mark.slow  # a 2-epoch CLI run, three branches per step (~90 s on 2 cores)
def test_flow_grpo_editing_run_changes_every_lora_tensor(tmp_path: Path, cli, edit_cfg):
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    code, out = cli("train", "model=tiny_bagel_edit", *TINY_RUN, "epochs=2", f"hydra.run.dir={tmp_path}")
    assert code == 0, out
    torch.manual_seed(42)  # the recipe seeds torch with cfg.seed before building the adapter
    initial = get_peft_model_state_dict(_policy(edit_cfg).transformer)  # B = 0: A moves from epoch 2 on
    trained = load_file(tmp_path / "checkpoints" / "epoch_000002" / "weights" / LORA_WEIGHTS_NAME)
    assert trained.keys() == initial.keys() and len(trained) > 0
    assert [k for k in trained if torch.equal(trained[k], initial[k])] == []


def test_a_formatted_context_is_tokenized_as_it_is(shared):
    """``encode_formatted`` adds no markers: the markers written out give ``encode``'s context."""
    policy = shared[0]
    sources = _sources(1)
    formatted = policy.encode_formatted([f"<|im_start|>{p}<|im_end|>" for p in PROMPTS], sources)
    plain = policy.encode(PROMPTS, sources)
    for key in ("text_ids", "text_mask", "neg_text_ids", "neg_text_mask"):
        assert torch.equal(formatted.tensors[key], plain.tensors[key]), key
    bare = policy.encode_formatted(PROMPTS, sources)
    assert torch.equal(bare.tensors["text_mask"].sum(1), plain.tensors["text_mask"].sum(1) - 2)
