"""The FLUX.1-Kontext adapter: source-image tokens, pipeline parity, real loader, diffusers LoRA format,
reference switch, and the CLI on a tiny editing set (training moves every LoRA tensor, on-policy check)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from rlgen_cli.errors import UserError
from rlgen_cli.models.flux_kontext import (
    KONTEXT_LORA_TARGETS,
    LORA_WEIGHTS_NAME,
    FluxKontextPolicy,
    load_flux_kontext_pipeline,
)
from rlgen_cli.models.tiny import tiny_flux_kontext_pipeline
from rlgen_cli.schema.run import ModelConfig
from tests.conftest import TINY_RUN, run_cli
from tests.models.helpers import CPU, model_cfg, perturb_lora

PROMPTS = ["add two cats", "remove the dog"]


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return model_cfg("tiny_flux_kontext")


@pytest.fixture(scope="module")
def policy(cfg) -> FluxKontextPolicy:
    return FluxKontextPolicy(tiny_flux_kontext_pipeline(0), cfg, CPU)


@pytest.fixture(scope="module")
def sources() -> torch.Tensor:
    return torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def probe(policy, sources):
    return policy.noise(2, torch.Generator().manual_seed(0)), policy.encode(PROMPTS, sources)


def test_yaml_settings_and_targets(cfg):
    real = model_cfg("flux_kontext")
    assert cfg.lora.target_modules == KONTEXT_LORA_TARGETS == real.lora.target_modules
    assert "proj_mlp" in KONTEXT_LORA_TARGETS
    assert (real.family, real.guidance_scale, real.lora.rank, real.lora.alpha) == (
        "flux_kontext",
        2.5,
        64,
        128,
    )


def test_source_tokens_are_appended_with_their_own_ids(policy, probe):
    x, cond = probe
    assert policy.capabilities.takes_source_images
    assert cond.tensors["source_latents"].shape == x.shape  # same size source → as many tokens
    ids = cond.tensors["source_ids"]
    assert ids.shape == (2, 64, 3) and bool((ids[..., 0] == 1).all())
    assert policy.velocity(x, torch.tensor(0.5), cond).shape == x.shape  # target tokens only


def test_source_image_changes_the_velocity(policy, probe, sources):
    x, cond = probe
    other = policy.encode(PROMPTS, sources.flip(-1))
    sigma = torch.tensor([0.8, 0.4])
    assert not torch.allclose(policy.velocity(x, sigma, cond), policy.velocity(x, sigma, other))
    with pytest.raises(UserError, match="editing model"):
        policy.encode(PROMPTS)
    with pytest.raises(UserError, match="B = 2 prompts"):
        policy.encode(PROMPTS, sources[:1])


def test_euler_sampling_equals_flux_kontext_pipeline(policy, sources):
    x = policy.noise(2, torch.Generator().manual_seed(5))
    expected = policy.pipeline(
        image=sources,
        prompt=PROMPTS,
        height=32,
        width=32,
        max_area=32 * 32,
        _auto_resize=False,
        num_inference_steps=3,
        guidance_scale=2.5,
        latents=x.clone(),
        max_sequence_length=32,
        output_type="latent",
    ).images
    cond, sigmas = policy.encode(PROMPTS, sources), policy.schedule(3, x)
    with torch.no_grad():
        for i in range(3):
            x = x + policy.velocity(x, sigmas[i], cond) * (sigmas[i + 1] - sigmas[i])
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=1e-5)


def test_save_pretrained_round_trip_through_the_real_loader(tmp_path: Path, cfg, policy, probe, sources):
    tiny_flux_kontext_pipeline(0).save_pretrained(tmp_path / "kontext")
    real = replace(cfg, tiny=False, path=str(tmp_path / "kontext"), local_files_only=True)
    loaded = FluxKontextPolicy(load_flux_kontext_pipeline(real), real, CPU)
    x, cond = probe
    sigma = torch.tensor(0.7)
    torch.testing.assert_close(
        loaded.velocity(x, sigma, loaded.encode(PROMPTS, sources)), policy.velocity(x, sigma, cond)
    )


def test_guidance_embedding_changes_the_velocity(cfg, probe):
    x, cond = probe
    low = FluxKontextPolicy(tiny_flux_kontext_pipeline(0), replace(cfg, guidance_scale=1.0), CPU)
    high = FluxKontextPolicy(tiny_flux_kontext_pipeline(0), replace(cfg, guidance_scale=4.0), CPU)
    assert not torch.allclose(
        low.velocity(x, torch.tensor(0.5), cond), high.velocity(x, torch.tensor(0.5), cond)
    )


def test_lora_format_reference_and_reload(tmp_path: Path, cfg, probe):
    policy = FluxKontextPolicy(tiny_flux_kontext_pipeline(0), cfg, CPU)
    names = [n for n, p in policy.transformer.named_parameters() if p.requires_grad]
    assert any("proj_mlp.lora_" in n for n in names) and all("lora_" in n for n in names)
    x, cond = probe
    sigma = torch.tensor(0.5)
    base = policy.velocity(x, sigma, cond).detach()
    perturb_lora(policy, 0.3)
    tuned = policy.velocity(x, sigma, cond).detach()
    with policy.trainable.reference():
        torch.testing.assert_close(policy.velocity(x, sigma, cond).detach(), base)
    assert not torch.allclose(tuned, base)

    policy.trainable.save(tmp_path)
    plain = tiny_flux_kontext_pipeline(0)
    plain.load_lora_weights(tmp_path, weight_name=LORA_WEIGHTS_NAME)
    frozen = FluxKontextPolicy(plain, replace(cfg, lora=replace(cfg.lora, enabled=False)), CPU)
    torch.testing.assert_close(frozen.velocity(x, sigma, cond).detach(), tuned, atol=1e-5, rtol=1e-5)
    fresh = FluxKontextPolicy(tiny_flux_kontext_pipeline(0), cfg, CPU)
    fresh.trainable.load(tmp_path)
    torch.testing.assert_close(fresh.velocity(x, sigma, cond).detach(), tuned)


def _editing_set(root: Path, n: int = 4) -> Path:
    """A tiny counting-edit jsonl with PNG sources under ``root/src``."""
    (root / "src").mkdir(parents=True)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "src" / f"{i}.png")
        include = [{"class": "cat", "count": i + 1}]
        lines.append(
            {
                "prompt": f"make it {i + 1} cats",
                "image": f"src/{i}.png",
                "tag": "counting",
                "include": include,
            }
        )
    path = root / "edits.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


@pytest.fixture(scope="module")
def editing_data(tmp_path_factory) -> list[str]:
    path = _editing_set(tmp_path_factory.mktemp("edits"))
    return [f"data.train={path}", f"data.test={path}"]


def test_cli_training_changes_every_lora_tensor(tmp_path: Path, cfg, editing_data):
    from peft.utils import get_peft_model_state_dict

    run = tmp_path / "run"
    code, out = run_cli(
        "train",
        "model=tiny_flux_kontext",
        *TINY_RUN,
        *editing_data,
        "algo.lr=1e-2",
        "epochs=2",
        "save_every=2",
        "eval_every=2",
        "images_every=0",
        f"hydra.run.dir={run}",
    )
    assert code == 0, out
    trained = load_file(run / "checkpoints" / "epoch_000002" / "weights" / LORA_WEIGHTS_NAME)
    torch.manual_seed(42)  # the recipe seeds torch with cfg.seed before building the adapter
    initial = FluxKontextPolicy(tiny_flux_kontext_pipeline(0), cfg, CPU)
    initial = {f"transformer.{k}": v for k, v in get_peft_model_state_dict(initial.transformer).items()}
    assert trained.keys() == initial.keys() and len(trained) > 0
    assert [k for k in trained if torch.equal(trained[k], initial[k])] == []


def test_cli_check_onpolicy_passes_on_the_editing_set_it_picks(tmp_path: Path):
    code, out = run_cli("check-onpolicy", "model=tiny_flux_kontext", *TINY_RUN, f"hydra.run.dir={tmp_path}")
    assert code == 0 and "PASS" in out, out
    assert (tmp_path / "tiny_edit" / "tiny_edit_train.jsonl").is_file()  # generated in the run directory
