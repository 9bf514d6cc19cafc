"""The native BAGEL: release-layout loading (single file, sharded, EMA or not), the FLUX autoencoder's
names, the MoT routing (each token through its own expert, one attention), the generation mask, the
fixed position tables, the schedule and CFG conventions of the reference inference, LoRA on the
generation expert or both, input errors, and the CLI (check-onpolicy exact; 2 training epochs).

Parity with the reference implementation itself (its modules run on the side, fp32) is reported in
docs/bagel.md; these tests pin the conventions with hand-computed values."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlgen_cli.errors import UserError
from rlgen_cli.models.bagel import vae as bagel_vae
from rlgen_cli.models.bagel.config import TINY_BAGEL, from_directory
from rlgen_cli.models.bagel.loading import load_checkpoint, save_checkpoint
from rlgen_cli.models.bagel.modeling import generation_mask, sincos_2d
from rlgen_cli.models.bagel.policy import BagelPolicy, patchify_latents, unpatchify_latents
from rlgen_cli.models.bagel.tiny import tiny_bagel
from rlgen_cli.models.trainable import LORA_WEIGHTS_NAME
from tests.conftest import TINY_RUN
from tests.models.helpers import CPU, assert_reference_disables_the_adapter, model_cfg, perturb_lora

PROMPTS = ["a red circle", "two blue squares on a wooden table"]
BOTH_EXPERTS = [
    "q_proj_moe_gen", "k_proj_moe_gen", "v_proj_moe_gen", "o_proj_moe_gen", "mlp_moe_gen.gate_proj",
    "mlp_moe_gen.up_proj", "mlp_moe_gen.down_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
    "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
]  # fmt: skip


@pytest.fixture(scope="module")
def bagel_cfg():
    return model_cfg("tiny_bagel")


def _policy(cfg, parts=None, **changes) -> BagelPolicy:
    network, vae, tokenizer, markers = parts or tiny_bagel(cfg.tiny_seed)
    return BagelPolicy(network, vae, tokenizer, markers, replace(cfg, **changes), CPU)


@pytest.fixture(scope="module")
def shared(bagel_cfg):
    policy = _policy(bagel_cfg)
    return policy, policy.noise(2, torch.Generator().manual_seed(0)), policy.encode(PROMPTS)


# -- the release layout ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("shards", "ema"), [(1, True), (3, False)])
def test_release_layout_round_trip_through_the_real_loader(tmp_path: Path, shards: int, ema: bool):
    network, vae, tokenizer, markers = tiny_bagel(0)
    save_checkpoint(network, vae, tokenizer, tmp_path, shards=shards, ema=ema)
    stem = "ema" if ema else "model"
    expected_weights = {f"{stem}.safetensors"} if shards == 1 else {f"{stem}.safetensors.index.json"}
    assert expected_weights <= {p.name for p in tmp_path.iterdir()}
    assert (
        json.loads((tmp_path / "vit_config.json").read_text())["num_hidden_layers"] == 2
    )  # the file counts 2
    assert from_directory(tmp_path, TINY_BAGEL) == TINY_BAGEL  # … and BAGEL runs 1
    loaded, loaded_vae, loaded_tok, loaded_markers = load_checkpoint(tmp_path, torch.float32, base=TINY_BAGEL)
    assert loaded_markers == markers and loaded_tok.encode("a cat") == tokenizer.encode("a cat")
    for (name, a), (_, b) in zip(network.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    z = torch.randn(1, 4, 8, 8)
    assert torch.equal(bagel_vae.decode(loaded_vae, z), bagel_vae.decode(vae, z))


def test_the_loader_accepts_the_convolution_patch_embedding_and_rebuilds_missing_tables(tmp_path: Path):
    network, vae, tokenizer, _ = tiny_bagel(0)
    save_checkpoint(network, vae, tokenizer, tmp_path)
    state = load_file(tmp_path / "ema.safetensors")
    key = "vit_model.vision_model.embeddings.patch_embedding.weight"
    linear = state[key]  # (D, p·p·3) in the (p, p, channel) order
    p = TINY_BAGEL.vit.patch_size
    state[key] = linear.reshape(linear.shape[0], p, p, 3).permute(0, 3, 1, 2).contiguous()  # SigLIP's conv
    del state["latent_pos_embed.pos_embed"], state["vit_pos_embed.pos_embed"]
    save_file(state, tmp_path / "ema.safetensors")
    loaded = load_checkpoint(tmp_path, torch.float32, base=TINY_BAGEL)[0]
    assert torch.equal(loaded.state_dict()[key], linear)
    assert torch.equal(loaded.latent_pos_embed.pos_embed, network.latent_pos_embed.pos_embed)
    assert not any("pos_embed" in name for name, _ in loaded.named_parameters())  # never trained


def test_the_loader_refuses_what_does_not_fit(tmp_path: Path):
    with pytest.raises(UserError, match="not a directory"):
        load_checkpoint(tmp_path / "nowhere", torch.float32)
    network, vae, tokenizer, _ = tiny_bagel(0)
    save_checkpoint(network, vae, tokenizer, tmp_path)
    state = load_file(tmp_path / "ema.safetensors")
    del state["llm2vae.bias"]
    save_file(state | {"extra.weight": torch.zeros(1)}, tmp_path / "ema.safetensors")
    with pytest.raises(UserError, match="1 missing .*llm2vae.bias.*1 unexpected"):
        load_checkpoint(tmp_path, torch.float32, base=TINY_BAGEL)
    (tmp_path / "ema.safetensors").unlink()
    with pytest.raises(UserError, match="holds none of ema.safetensors"):
        load_checkpoint(tmp_path, torch.float32, base=TINY_BAGEL)
    llm = json.loads((tmp_path / "llm_config.json").read_text())
    (tmp_path / "llm_config.json").write_text(json.dumps(llm | {"rope_scaling": {"type": "yarn"}}))
    with pytest.raises(UserError, match="rope_scaling"):
        load_checkpoint(tmp_path, torch.float32, base=TINY_BAGEL)


def test_autoencoder_names_are_the_flux_release_names():
    vae = bagel_vae.build_vae(TINY_BAGEL.vae)
    state = bagel_vae.flux_layout_state_dict(vae)
    # ch_mult (1, 2, 2): level 1 widens 4 → 8 (a shortcut); the decoder's up.2 is diffusers' up_blocks.0
    for name in (
        "encoder.down.1.block.0.nin_shortcut.weight",
        "encoder.down.0.downsample.conv.weight",
        "encoder.mid.block_2.conv1.weight",
        "decoder.up.2.block.1.norm2.bias",
        "decoder.up.1.upsample.conv.weight",
        "decoder.norm_out.weight",
        "encoder.conv_out.weight",
    ):
        assert name in state, name
    assert state["encoder.mid.attn_1.q.weight"].shape == (8, 8, 1, 1)  # 1×1 convolutions
    assert torch.equal(
        state["decoder.up.2.block.0.conv1.weight"], vae.decoder.up_blocks[0].resnets[0].conv1.weight
    )
    copy = bagel_vae.build_vae(TINY_BAGEL.vae)
    bagel_vae.load_flux_layout(copy, state)
    assert all(
        torch.equal(a, b) for a, b in zip(vae.state_dict().values(), copy.state_dict().values(), strict=True)
    )
    with pytest.raises(ValueError, match="does not fit"):
        bagel_vae.load_flux_layout(copy, {k: v for k, v in state.items() if "mid.attn_1.k" not in k})


# -- the network ----------------------------------------------------------------------------------------
def _perturbed(network, fragment: str):
    with torch.no_grad():
        for name, param in network.named_parameters():
            if fragment in name:
                param.add_(0.5)


def test_each_token_goes_through_its_own_expert():
    """The generation expert's MLP moves the image velocity but not a text-only pass; the understanding
    expert's MLP moves both (text through it directly, the image through the prompt it attends to); with an
    empty prompt the image block still feels it through its two marker tokens."""
    network = tiny_bagel(0)[0]
    ids = torch.tensor([[261, 72, 73, 262]])
    text_mask = torch.ones(1, 4, dtype=torch.bool)
    latents, t, markers = torch.randn(1, 4, 16), torch.tensor([0.7]), (260, 259)

    def outputs():
        with torch.no_grad():
            return (
                network.text_logits(ids),
                network.generation_velocity(ids, text_mask, markers, latents, t, (2, 2)),
                network.generation_velocity(ids, ~text_mask, markers, latents, t, (2, 2)),
            )

    base = outputs()
    _perturbed(network, "mlp_moe_gen.down_proj")
    gen = outputs()
    assert torch.equal(gen[0], base[0]) and not torch.allclose(gen[1], base[1])
    _perturbed(network, "mlp.down_proj")
    und = outputs()
    assert not torch.allclose(und[0], gen[0]) and not torch.allclose(und[1], gen[1])
    assert not torch.allclose(und[2], gen[2])


def test_generation_mask_by_hand():
    mask = generation_mask(torch.tensor([[True, True, False]]), block=2)[0].int()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],  # prompt token 0: itself
            [1, 1, 0, 0, 0],  # prompt token 1: causal
            [0, 0, 1, 0, 0],  # padding: only itself
            [1, 1, 0, 1, 1],  # image block: the valid prompt and the whole block
            [1, 1, 0, 1, 1],
        ]
    )
    assert torch.equal(mask, expected)


def test_position_table_by_hand():
    # dim 4, side 2: [sin col, cos col, sin row, cos row] (ω = 1 on each half); id = row·2 + col
    table = sincos_2d(4, 2)
    s1, c1 = math.sin(1.0), math.cos(1.0)
    torch.testing.assert_close(table[1], torch.tensor([s1, c1, 0.0, 1.0]))  # row 0, col 1
    torch.testing.assert_close(table[2], torch.tensor([0.0, 1.0, s1, c1]))  # row 1, col 0


def test_latent_patches_flatten_p_p_channel():
    x = torch.arange(2 * 2 * 4, dtype=torch.float32).reshape(1, 2, 2, 4)  # C=2, h=2, w=4
    tokens = patchify_latents(x, 2)
    # token 0 = the top-left 2×2 patch, (p, q, c) order: x[c, p, q] for p, q, c
    assert tokens[0, 0].tolist() == [0.0, 8.0, 1.0, 9.0, 4.0, 12.0, 5.0, 13.0]
    assert tokens.shape == (1, 2, 8)
    assert torch.equal(unpatchify_latents(tokens, 2, 2, 4, 2), x)


# -- the policy -----------------------------------------------------------------------------------------
def test_schedule_is_the_reference_shifted_linspace(shared):
    policy = shared[0]
    sigmas = policy.schedule(4, shared[1])  # linspace 1, .75, .5, .25, 0 through 3t / (1 + 2t)
    torch.testing.assert_close(sigmas.float(), torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]))


def test_guidance_acts_only_inside_the_interval_and_is_renormed(bagel_cfg, shared):
    policy, x, cond = shared
    parts = (policy.transformer, policy.vae, policy.tokenizer, policy.markers)
    plain = _policy(bagel_cfg, parts, guidance_scale=1.0, lora=replace(bagel_cfg.lora, enabled=False))
    with torch.no_grad():
        assert torch.equal(
            policy.velocity(x, torch.tensor(0.4), cond), plain.velocity(x, torch.tensor(0.4), cond)
        )
        guided = policy.velocity(x, torch.tensor(0.9), cond)
        c = plain.velocity(x, torch.tensor(0.9), cond)
        empty = {"text_ids": cond.tensors["neg_text_ids"], "text_mask": cond.tensors["neg_text_mask"]}
        u = plain.velocity(x, torch.tensor(0.9), type(cond)(empty))
    assert not cond.tensors["neg_text_mask"].any()  # the empty context
    raw = u + 4.0 * (c - u)
    scale = (c.flatten(1).norm(dim=1) / raw.flatten(1).norm(dim=1)).clamp(max=1.0)
    assert (scale < 1).any()  # the renorm acts here, so the check can fail
    torch.testing.assert_close(guided, raw * scale[:, None, None, None], rtol=1e-5, atol=1e-5)


def test_lora_sits_on_the_generation_expert_and_reference_disables_it(bagel_cfg):
    policy = _policy(bagel_cfg)
    names = [n for n, _ in policy.trainable.named()]
    assert names and all("moe_gen" in n and "lora_" in n for n in names)
    x, cond = policy.noise(2, torch.Generator().manual_seed(1)), policy.encode(PROMPTS)
    assert_reference_disables_the_adapter(policy, x, cond)


def test_lora_on_both_experts_never_touches_the_vit(bagel_cfg):
    policy = _policy(bagel_cfg, lora=replace(bagel_cfg.lora, target_modules=BOTH_EXPERTS))
    names = [n for n, _ in policy.trainable.named()]
    assert any("moe_gen" in n for n in names) and any(".mlp.gate_proj" in n for n in names)
    assert not any("vit_model" in n for n in names)


def test_lora_checkpoint_round_trip(tmp_path: Path, bagel_cfg):
    policy = _policy(bagel_cfg)
    perturb_lora(policy, generator=torch.Generator().manual_seed(3))
    tuned = {n: p.detach().clone() for n, p in policy.trainable.named()}
    policy.trainable.save(tmp_path)
    assert (tmp_path / LORA_WEIGHTS_NAME).is_file()
    fresh = _policy(bagel_cfg)
    fresh.trainable.load(tmp_path)
    for name, param in fresh.trainable.named():
        assert torch.equal(param, tuned[name]), name


def test_input_errors(bagel_cfg, shared):
    policy = shared[0]
    assert "source_latents" in policy.encode(PROMPTS, torch.zeros(2, 3, 32, 32)).tensors  # edits on request
    with pytest.raises(UserError, match="multiple of 8"):
        _policy(bagel_cfg, resolution=36)
    with pytest.raises(UserError, match="at most 128 px"):
        _policy(bagel_cfg, resolution=136)
    with pytest.raises(UserError, match="model.max_sequence_length"):
        policy.encode(["x" * 200])


# -- the CLI ----------------------------------------------------------------------------------------------
def test_check_onpolicy_passes(tmp_path: Path, cli):
    code, out = cli("check-onpolicy", "model=tiny_bagel", *TINY_RUN, f"hydra.run.dir={tmp_path}")
    assert code == 0, out


@pytest.mark.slow  # a 2-epoch CLI run
def test_training_changes_every_lora_tensor(tmp_path: Path, cli, bagel_cfg):
    from peft.utils import get_peft_model_state_dict

    code, out = cli(
        "train", "model=tiny_bagel", *TINY_RUN, "epochs=2", "save_every=1", f"hydra.run.dir={tmp_path}"
    )
    assert code == 0, out
    torch.manual_seed(42)  # the recipe seeds torch with cfg.seed before building the adapter
    initial = get_peft_model_state_dict(_policy(bagel_cfg).transformer)
    trained = load_file(tmp_path / "checkpoints" / "epoch_000002" / "weights" / LORA_WEIGHTS_NAME)
    assert trained.keys() == initial.keys() and len(trained) > 0
    assert [k for k in trained if torch.equal(trained[k], initial[k])] == []


def test_gradient_checkpointing_leaves_loss_and_lora_gradients_unchanged(bagel_cfg):
    policy = _policy(bagel_cfg, gradient_checkpointing=True)
    assert policy.transformer.gradient_checkpointing  # switched on by the config
    perturb_lora(policy, std=0.3, generator=torch.Generator().manual_seed(2))
    x, cond = policy.noise(2, torch.Generator().manual_seed(4)), policy.encode(PROMPTS)
    layer = policy.transformer.language_model.model.layers[0]
    calls = []
    layer.register_forward_pre_hook(lambda *_: calls.append(1))  # recompute stops early: no post-hook

    def loss_and_grads():
        for param in policy.trainable.parameters():
            param.grad = None
        loss = policy.velocity(x, torch.tensor(0.8), cond).square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in policy.trainable.parameters()]

    loss, grads = loss_and_grads()
    checkpointed_calls = len(calls)
    policy.transformer.gradient_checkpointing = False
    calls.clear()
    plain_loss, plain_grads = loss_and_grads()
    assert checkpointed_calls == 2 * len(calls) > 0  # the layer ran again in the backward
    assert all(g.abs().max() > 0 for g in plain_grads)
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
    for g, p in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(g, p, rtol=1e-6, atol=1e-9)
