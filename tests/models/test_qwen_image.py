"""The Qwen-Image adapter: real loading path, schedule and true CFG equal to diffusers' pipeline, LoRA
format and reference switch, full FT, and the CLI (training moves every LoRA tensor, ratio exactly 1)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.errors import UserError
from rlgen_cli.models._qwen_common import LORA_WEIGHTS_NAME, dead_text_outputs, true_cfg
from rlgen_cli.models.qwen_image import QwenImagePolicy, load_qwen_image_pipeline
from rlgen_cli.models.tiny import tiny_qwen_image_pipeline
from tests.conftest import TINY_RUN
from tests.models.helpers import CPU, model_cfg, perturb_lora, restoring_trainable

PROMPTS = ["a red circle", "two blue squares on a wooden table"]


@pytest.fixture(scope="module")
def qwen_cfg():
    return model_cfg("tiny_qwen_image")


def _policy(cfg, **changes) -> QwenImagePolicy:
    return QwenImagePolicy(tiny_qwen_image_pipeline(cfg.tiny_seed), replace(cfg, **changes), CPU)


@pytest.fixture(scope="module")
def shared(qwen_cfg):
    """One LoRA policy (CFG 4) and its probe batch for the tests that only read it."""
    policy = _policy(qwen_cfg)
    return policy, policy.noise(2, torch.Generator().manual_seed(0)), policy.encode(PROMPTS)


@pytest.fixture
def lora_policy(shared):
    """The shared policy; its LoRA weights are restored after the test."""
    for _ in restoring_trainable(shared[0]):
        yield shared


def _probe(policy: QwenImagePolicy):
    return policy.noise(2, torch.Generator().manual_seed(0)), policy.encode(PROMPTS)


def _raw(policy: QwenImagePolicy, x, sigma: float, embeds, mask):
    """One plain transformer call, its text trimmed to its own longest prompt (as diffusers pads)."""
    keep = int(mask.sum(1).max())
    h, w = policy.latent_hw
    return policy.transformer(
        hidden_states=x,
        timestep=torch.full((x.shape[0],), sigma),
        encoder_hidden_states=embeds[:, :keep],
        encoder_hidden_states_mask=mask[:, :keep],
        img_shapes=[[(1, h // 2, w // 2)]] * x.shape[0],
        return_dict=False,
    )[0]


def test_save_pretrained_round_trip_through_the_real_loader(tmp_path: Path, qwen_cfg, shared):
    tiny_qwen_image_pipeline(0).save_pretrained(tmp_path / "qwen")
    cfg = replace(qwen_cfg, tiny=False, path=str(tmp_path / "qwen"), local_files_only=True)
    loaded = QwenImagePolicy(load_qwen_image_pipeline(cfg), cfg, CPU)
    built, x, cond = shared
    sigma = torch.tensor(0.7)
    with torch.no_grad(), loaded.trainable.reference(), built.trainable.reference():
        torch.testing.assert_close(
            loaded.velocity(x, sigma, loaded.encode(PROMPTS)), built.velocity(x, sigma, cond)
        )
    with pytest.raises(UserError, match="model.path"):
        load_qwen_image_pipeline(replace(cfg, path=str(tmp_path / "nothing")))


def test_tiny_builder_is_deterministic_in_its_seed():
    a, b, c = tiny_qwen_image_pipeline(0), tiny_qwen_image_pipeline(0), tiny_qwen_image_pipeline(1)
    for part in ("transformer", "text_encoder"):
        pa, pb, pc = (dict(getattr(p, part).named_parameters()) for p in (a, b, c))
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
        assert not all(torch.equal(pa[k], pc[k]) for k in pa)


def test_sampling_equals_the_diffusers_pipeline(qwen_cfg):
    """Euler over the policy's schedule and velocity reproduces QwenImagePipeline.__call__ (true CFG 4,
    negative " ", dynamic shift + terminal stretch, t = σ, packing, VAE decode)."""
    policy = _policy(qwen_cfg, lora=replace(qwen_cfg.lora, enabled=False))
    x = policy.noise(1, torch.Generator().manual_seed(3))
    sigmas = policy.schedule(3, x)
    policy.pipeline.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 3, 3), mu=_mu(policy, x))
    torch.testing.assert_close(sigmas, policy.pipeline.scheduler.sigmas, atol=1e-6, rtol=0)
    cond, z = policy.encode(PROMPTS[:1]), x
    with torch.no_grad():
        for i in range(3):
            z = z + policy.velocity(z, sigmas[i], cond) * (sigmas[i + 1] - sigmas[i])
        expected = policy.pipeline(
            PROMPTS[:1],
            negative_prompt=" ",
            true_cfg_scale=4.0,
            height=32,
            width=32,
            num_inference_steps=3,
            latents=x,
            output_type="pt",
            max_sequence_length=qwen_cfg.max_sequence_length,
        ).images
    torch.testing.assert_close(policy.decode(z), expected, atol=1e-5, rtol=1e-5)


def _mu(policy: QwenImagePolicy, x) -> float:
    from rlgen_cli.sde.schedule import calculate_mu

    c = policy.pipeline.scheduler.config
    return calculate_mu(x.shape[1], c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)


def test_true_cfg_norm_rescale_matches_a_hand_computation(lora_policy):
    policy, x, cond = lora_policy
    perturb_lora(policy)
    t = cond.tensors
    with torch.no_grad():
        c = _raw(policy, x, 0.6, t["prompt_embeds"], t["prompt_mask"])
        u = _raw(policy, x, 0.6, t["neg_prompt_embeds"], t["neg_prompt_mask"])
        combined = u + 4.0 * (c - u)
        by_hand = (
            combined
            * (torch.linalg.vector_norm(c, dim=-1) / torch.linalg.vector_norm(combined, dim=-1))[..., None]
        )
        got = policy.velocity(x, torch.tensor(0.6), cond)
    torch.testing.assert_close(got, by_hand, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(true_cfg(c, u, 4.0), by_hand)
    assert not torch.allclose(got, combined, atol=1e-3)  # the rescale is not a no-op


def test_guidance_one_has_no_unconditional_branch(qwen_cfg):
    policy = _policy(qwen_cfg, guidance_scale=1.0)
    x, cond = _probe(policy)
    assert set(cond.tensors) == {"prompt_embeds", "prompt_mask"}
    with torch.no_grad():
        direct = _raw(policy, x, 0.5, cond.tensors["prompt_embeds"], cond.tensors["prompt_mask"])
        torch.testing.assert_close(policy.velocity(x, torch.tensor(0.5), cond), direct)


def test_lora_targets_upstream_modules_all_alive_and_only_lora_trains(lora_policy):
    policy, x, cond = lora_policy
    names = [n for n, p in policy.transformer.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names) and len(policy.trainable.parameters()) == len(names)
    assert any("img_mlp.net.2" in n for n in names) and any("attn.add_k_proj" in n for n in names)
    dead = dead_text_outputs(policy.transformer)
    assert not any(n.startswith(tuple(f"{d}." for d in dead)) for n in names)
    perturb_lora(policy)  # gaussian init has B = 0, which blocks A's gradient
    policy.velocity(x, torch.tensor(0.8), cond).square().mean().backward()
    silent = [
        n for n, p in policy.transformer.named_parameters() if p.requires_grad and not p.grad.abs().sum()
    ]
    assert silent == []


# diffusers targets the modules named in the file, so peft finds nothing left to exclude
@pytest.mark.filterwarnings("ignore:You have passed exclude_modules")
def test_lora_saved_in_diffusers_format_loads_with_load_lora_weights(tmp_path: Path, qwen_cfg, lora_policy):
    policy, x, cond = lora_policy
    perturb_lora(policy)
    policy.trainable.save(tmp_path)
    sigma = torch.tensor(0.5)
    expected = policy.velocity(x, sigma, cond).detach()

    plain = tiny_qwen_image_pipeline(0)
    plain.load_lora_weights(tmp_path, weight_name=LORA_WEIGHTS_NAME)  # α/r from the file's metadata
    reloaded = QwenImagePolicy(plain, replace(qwen_cfg, lora=replace(qwen_cfg.lora, enabled=False)), CPU)
    torch.testing.assert_close(reloaded.velocity(x, sigma, cond).detach(), expected, atol=1e-5, rtol=1e-5)

    fresh = _policy(qwen_cfg)
    fresh.trainable.load(tmp_path)
    torch.testing.assert_close(fresh.velocity(x, sigma, cond).detach(), expected)
    with pytest.raises(UserError, match="no LoRA weights"):
        fresh.trainable.load(tmp_path / "missing")


def test_reference_disables_the_adapter(lora_policy):
    policy, x, cond = lora_policy
    sigma = torch.tensor(0.6)
    with torch.no_grad():
        with policy.trainable.reference():
            base = policy.velocity(x, sigma, cond)
        perturb_lora(policy)
        tuned = policy.velocity(x, sigma, cond)
        with policy.trainable.reference():
            torch.testing.assert_close(policy.velocity(x, sigma, cond), base)
        assert not torch.allclose(tuned, base)
        torch.testing.assert_close(policy.velocity(x, sigma, cond), tuned)  # adapter back on


def test_full_finetune_keeps_a_frozen_reference_and_round_trips(tmp_path: Path, qwen_cfg):
    policy = _policy(qwen_cfg, lora=replace(qwen_cfg.lora, enabled=False))
    assert len(policy.trainable.parameters()) == len(list(policy.transformer.parameters()))
    x, cond = _probe(policy)
    sigma = torch.tensor(0.4)
    with torch.no_grad():
        base = policy.velocity(x, sigma, cond)
        for p in policy.trainable.parameters():
            p.add_(0.01)
        with policy.trainable.reference():
            torch.testing.assert_close(policy.velocity(x, sigma, cond), base)
        policy.trainable.save(tmp_path)
        fresh = _policy(qwen_cfg, lora=replace(qwen_cfg.lora, enabled=False))
        fresh.trainable.load(tmp_path)
        torch.testing.assert_close(fresh.velocity(x, sigma, cond), policy.velocity(x, sigma, cond))


def test_noise_is_per_sample_and_inputs_are_checked(qwen_cfg, shared):
    policy = shared[0]
    gens = [torch.Generator().manual_seed(s) for s in (5, 6)]
    both = policy.noise(2, gens)
    alone = policy.noise(1, [torch.Generator().manual_seed(6)])
    assert both.shape == (2, 16, 16) and both.dtype == torch.float32
    torch.testing.assert_close(both[1:], alone)
    images = policy.decode(both)
    assert images.shape == (2, 3, 32, 32) and images.min() >= 0 and images.max() <= 1
    with pytest.raises(UserError, match="multiple of 8"):
        _policy(qwen_cfg, resolution=36)
    assert policy.encode(PROMPTS).tensors["prompt_embeds"].shape[1] == qwen_cfg.max_sequence_length


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    from tests.conftest import run_cli

    run_dir = tmp_path_factory.mktemp("qwen_rl") / "run"
    code, out = run_cli(
        "train", "model=tiny_qwen_image", *TINY_RUN, "epochs=2", "save_every=1", f"hydra.run.dir={run_dir}"
    )
    assert code == 0, out
    return run_dir


def test_training_changes_every_lora_tensor(trained_run: Path, qwen_cfg):
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(42)  # the recipe seeds torch with cfg.seed before building the adapter
    initial = {
        f"transformer.{k}": v for k, v in get_peft_model_state_dict(_policy(qwen_cfg).transformer).items()
    }
    trained = load_file(trained_run / "checkpoints" / "epoch_000002" / "weights" / LORA_WEIGHTS_NAME)
    assert trained.keys() == initial.keys() and len(trained) > 0
    assert [k for k in trained if torch.equal(trained[k], initial[k])] == []


def test_check_onpolicy_passes(tmp_path: Path, cli):
    code, out = cli("check-onpolicy", "model=tiny_qwen_image", *TINY_RUN, f"hydra.run.dir={tmp_path}")
    assert code == 0, out
