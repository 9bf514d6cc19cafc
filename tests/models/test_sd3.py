"""The SD3 adapter: real loading path, LoRA format, reference switch, CFG inside velocity, full FT."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlgen_cli.errors import UserError
from rlgen_cli.models.base import Cond
from rlgen_cli.models.sd3 import LORA_WEIGHTS_NAME, SD3Policy, load_sd3_pipeline
from rlgen_cli.models.tiny import tiny_sd3_pipeline
from tests.models.helpers import CPU, assert_reference_disables_the_adapter, perturb_lora


def _probe(policy, n: int = 2):
    cond = policy.encode(["a red circle", "a blue square"][:n])
    x = policy.noise(n, torch.Generator().manual_seed(0))
    return x, cond


def test_save_pretrained_round_trip_through_the_real_loader(tmp_path: Path, tiny_model_cfg):
    source = tiny_sd3_pipeline(seed=0)
    source.save_pretrained(tmp_path / "sd3")
    cfg = replace(tiny_model_cfg, tiny=False, path=str(tmp_path / "sd3"), local_files_only=True)
    loaded = SD3Policy(load_sd3_pipeline(cfg), cfg, CPU)
    built = SD3Policy(tiny_sd3_pipeline(seed=0), tiny_model_cfg, CPU)
    x, cond = _probe(built)
    sigma = torch.tensor(0.7)
    torch.testing.assert_close(
        loaded.velocity(x, sigma, loaded.encode(["a red circle", "a blue square"])),
        built.velocity(x, sigma, cond),
    )


def test_missing_local_path_is_a_user_error(tmp_path: Path, tiny_model_cfg):
    cfg = replace(tiny_model_cfg, tiny=False, path=str(tmp_path / "nothing"), local_files_only=True)
    with pytest.raises(UserError, match="model.path"):
        load_sd3_pipeline(cfg)


def test_tiny_builder_is_deterministic_in_its_seed():
    a, b, c = tiny_sd3_pipeline(0), tiny_sd3_pipeline(0), tiny_sd3_pipeline(1)
    pa, pb, pc = (dict(p.transformer.named_parameters()) for p in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not all(torch.equal(pa[k], pc[k]) for k in pa)


def test_lora_targets_upstream_attention_and_only_lora_trains(tiny_policy):
    names = [n for n, p in tiny_policy.transformer.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert any("attn.to_q" in n for n in names) and any("attn.add_k_proj" in n for n in names)
    assert len(tiny_policy.trainable.parameters()) == len(names)


def test_lora_saved_in_diffusers_format_loads_with_load_lora_weights(tmp_path: Path, tiny_model_cfg):
    tiny_model_cfg = replace(tiny_model_cfg, guidance_scale=4.5)
    policy = SD3Policy(tiny_sd3_pipeline(0), tiny_model_cfg, CPU)
    perturb_lora(policy)
    policy.trainable.save(tmp_path)
    assert (tmp_path / LORA_WEIGHTS_NAME).is_file()
    x, cond = _probe(policy)
    expected = policy.velocity(x, torch.tensor(0.5), cond)

    plain = tiny_sd3_pipeline(0)
    plain.load_lora_weights(tmp_path, weight_name=LORA_WEIGHTS_NAME)
    reloaded = SD3Policy(
        plain, replace(tiny_model_cfg, lora=replace(tiny_model_cfg.lora, enabled=False)), CPU
    )
    torch.testing.assert_close(reloaded.velocity(x, torch.tensor(0.5), cond), expected, atol=1e-5, rtol=1e-5)

    fresh = SD3Policy(tiny_sd3_pipeline(0), tiny_model_cfg, CPU)
    fresh.trainable.load(tmp_path)
    torch.testing.assert_close(fresh.velocity(x, torch.tensor(0.5), cond), expected)


def test_reference_disables_the_adapter(tiny_model_cfg):
    policy = SD3Policy(tiny_sd3_pipeline(0), tiny_model_cfg, CPU)
    x, cond = _probe(policy)
    assert_reference_disables_the_adapter(policy, x, cond)


def test_cfg_lives_in_velocity(tiny_model_cfg):
    cfg = replace(tiny_model_cfg, guidance_scale=4.5)
    policy = SD3Policy(tiny_sd3_pipeline(0), cfg, CPU)
    x, cond = _probe(policy)
    t = torch.full((2,), 700.0)

    def call(e: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return policy.transformer(
            hidden_states=x, timestep=t, encoder_hidden_states=e, pooled_projections=p, return_dict=False
        )[0]

    c = call(cond.tensors["prompt_embeds"], cond.tensors["pooled"])
    u = call(cond.tensors["neg_prompt_embeds"], cond.tensors["neg_pooled"])
    torch.testing.assert_close(
        policy.velocity(x, torch.tensor(0.7), cond), u + 4.5 * (c - u), atol=1e-5, rtol=1e-5
    )


def test_guidance_one_has_no_unconditional_branch(tiny_model_cfg):
    cfg = replace(tiny_model_cfg, guidance_scale=1.0)
    policy = SD3Policy(tiny_sd3_pipeline(0), cfg, CPU)
    x, cond = _probe(policy)
    assert set(cond.tensors) == {"prompt_embeds", "pooled"}
    direct = policy.transformer(
        hidden_states=x,
        timestep=torch.full((2,), 500.0),
        encoder_hidden_states=cond.tensors["prompt_embeds"],
        pooled_projections=cond.tensors["pooled"],
        return_dict=False,
    )[0]
    torch.testing.assert_close(policy.velocity(x, torch.tensor(0.5), cond), direct)


def test_full_finetune_trains_everything_and_keeps_a_frozen_reference(tmp_path: Path, tiny_model_cfg):
    cfg = replace(tiny_model_cfg, lora=replace(tiny_model_cfg.lora, enabled=False))
    policy = SD3Policy(tiny_sd3_pipeline(0), cfg, CPU)
    assert len(policy.trainable.parameters()) == len(list(policy.transformer.parameters()))
    x, cond = _probe(policy)
    sigma = torch.tensor(0.4)
    base = policy.velocity(x, sigma, cond).detach()
    with torch.no_grad():
        for p in policy.trainable.parameters():
            p.add_(0.01)
    with policy.trainable.reference():
        torch.testing.assert_close(policy.velocity(x, sigma, cond).detach(), base)
    policy.trainable.save(tmp_path)
    fresh = SD3Policy(tiny_sd3_pipeline(0), cfg, CPU)
    fresh.trainable.load(tmp_path)
    torch.testing.assert_close(fresh.velocity(x, sigma, cond), policy.velocity(x, sigma, cond))


def test_cond_slices_and_joins():
    cond = Cond({"a": torch.arange(6).reshape(3, 2), "b": torch.arange(3)}, {"g": 1})
    joined = Cond.cat([cond.index(slice(0, 1)), cond.index(slice(1, 3))])
    assert (
        len(joined) == 3 and torch.equal(joined.tensors["a"], cond.tensors["a"]) and joined.extras == {"g": 1}
    )


def test_decode_gives_images_in_unit_range(tiny_policy):
    images = tiny_policy.decode(tiny_policy.noise(2, torch.Generator().manual_seed(1)))
    assert images.shape == (2, 3, 32, 32) and images.min() >= 0 and images.max() <= 1
