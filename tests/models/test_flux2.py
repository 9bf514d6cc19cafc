"""The FLUX.2-dev and FLUX.2-klein adapters: the real loaders (and their refusal of step-distilled
checkpoints), the token layout, RoPE ids and schedule against the pipelines, guidance (embedded for dev,
true CFG for klein), the diffusers LoRA format, and the CLI (training moves every LoRA tensor,
``check-onpolicy`` passes). Sampling parity with the pipelines' own ``__call__`` is in
``test_pipeline_parity.py``."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.errors import UserError
from rlgen_cli.models._flux2_common import FLUX2_LORA_TARGETS, flux2_sigmas, image_ids, text_ids
from rlgen_cli.models.flux2 import Flux2Policy, load_flux2_pipeline
from rlgen_cli.models.flux2_klein import Flux2KleinPolicy, load_flux2_klein_pipeline
from rlgen_cli.models.tiny import tiny_flux2_klein_pipeline, tiny_flux2_pipeline
from rlgen_cli.models.trainable import LORA_WEIGHTS_NAME
from rlgen_cli.schema.run import ModelConfig
from tests.conftest import TINY_RUN, run_cli
from tests.models.helpers import CPU, assert_reference_disables_the_adapter, model_cfg, perturb_lora

PROMPTS = ["a red circle", "a blue square"]


@pytest.fixture(scope="module")
def dev_cfg() -> ModelConfig:
    return model_cfg("tiny_flux2")


@pytest.fixture(scope="module")
def klein_cfg() -> ModelConfig:
    return model_cfg("tiny_flux2_klein")


@pytest.fixture(scope="module")
def dev(dev_cfg) -> Flux2Policy:
    return Flux2Policy(tiny_flux2_pipeline(0), dev_cfg, CPU)


@pytest.fixture(scope="module")
def klein(klein_cfg) -> Flux2KleinPolicy:
    return Flux2KleinPolicy(tiny_flux2_klein_pipeline(0), klein_cfg, CPU)


def test_yaml_targets_match_the_constant(dev_cfg, klein_cfg):
    for name in ("flux2", "flux2_klein"):
        assert model_cfg(name).lora.target_modules == FLUX2_LORA_TARGETS
    assert dev_cfg.lora.target_modules == klein_cfg.lora.target_modules == FLUX2_LORA_TARGETS
    assert model_cfg("flux2_klein").path == "black-forest-labs/FLUX.2-klein-base-4B"


def test_lora_reaches_both_block_kinds(dev):
    names = [n for n, p in dev.transformer.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert any("single_transformer_blocks.0.attn.to_qkv_mlp_proj" in n for n in names)
    assert any("transformer_blocks.0.ff_context.linear_out" in n for n in names)


def test_noise_ids_and_schedule_follow_the_pipeline(dev):
    from diffusers import Flux2Pipeline
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps

    gens = lambda: [torch.Generator().manual_seed(s) for s in (3, 4)]  # noqa: E731
    x = dev.noise(2, gens())
    latents, ids = dev.pipeline.prepare_latents(2, 2, 32, 32, torch.float32, CPU, gens())
    assert x.shape == (2, 64, 8) and x.dtype == torch.float32
    torch.testing.assert_close(x, latents)
    torch.testing.assert_close(image_ids(8, 8, CPU), ids[0].float())
    torch.testing.assert_close(x[1:], dev.noise(1, gens()[1:]))  # a sample's noise ignores its batch
    embeds = torch.zeros(2, 5, 48)
    torch.testing.assert_close(text_ids(5, CPU), Flux2Pipeline._prepare_text_ids(embeds)[0].float())
    assert text_ids(3, CPU).tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2]]

    sigmas = dev.schedule(6, x)
    mu = compute_empirical_mu(image_seq_len=64, num_steps=6)
    scheduler = dev.pipeline.scheduler
    timesteps, _ = retrieve_timesteps(scheduler, 6, CPU, sigmas=torch.linspace(1, 1 / 6, 6).numpy(), mu=mu)
    assert sigmas.shape == (7,) and sigmas[0] == 1 and sigmas[-1] == 0
    torch.testing.assert_close(sigmas[:-1], timesteps.float() / 1000)
    # μ depends on the step count: the 6-step grid is not the 12-step grid's every other point
    assert not torch.allclose(dev.schedule(12, x)[::2], sigmas)
    static = flux2_sigmas(4, 64, scheduler.config, shift=3.0)
    torch.testing.assert_close(static, torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]))


def test_dev_embeds_guidance_without_a_cfg_branch(dev_cfg, dev):
    x = dev.noise(2, torch.Generator().manual_seed(0))
    cond = dev.encode(PROMPTS)
    assert set(cond.tensors) == {"prompt_embeds"} and cond.tensors["prompt_embeds"].shape[-1] == 48
    assert not dev.capabilities.has_cfg
    low = Flux2Policy(tiny_flux2_pipeline(0), replace(dev_cfg, guidance_scale=1.0), CPU)
    sigma = torch.tensor([0.6, 0.3])
    assert not torch.allclose(low.velocity(x, sigma, cond), dev.velocity(x, sigma, cond))
    with pytest.raises(UserError, match="model=flux2_klein"):
        Flux2Policy(tiny_flux2_klein_pipeline(0), dev_cfg, CPU)


def test_klein_true_cfg_is_the_combination_of_two_passes(klein):
    x = klein.noise(2, torch.Generator().manual_seed(1))
    cond = klein.encode(PROMPTS)
    assert klein.capabilities.has_cfg and set(cond.tensors) == {"prompt_embeds", "neg_prompt_embeds"}
    sigma = torch.tensor(0.5)
    with torch.no_grad():
        c = klein.flux2.forward(x, sigma, cond.tensors["prompt_embeds"], guidance=None)
        u = klein.flux2.forward(x, sigma, cond.tensors["neg_prompt_embeds"], guidance=None)
        v = klein.velocity(x, sigma, cond)
    torch.testing.assert_close(v, u + 4.0 * (c - u))
    assert (c - u).abs().max() > 1e-3  # the negative prompt gives another prediction


@pytest.mark.parametrize("family", ["flux2", "flux2_klein"])
def test_save_pretrained_round_trip_through_the_real_loader(tmp_path: Path, family, dev, klein):
    policy, build = (dev, tiny_flux2_pipeline) if family == "flux2" else (klein, tiny_flux2_klein_pipeline)
    build(0).save_pretrained(tmp_path / family)
    load = load_flux2_pipeline if family == "flux2" else load_flux2_klein_pipeline
    cls = type(policy)
    real = replace(policy.cfg, tiny=False, path=str(tmp_path / family), local_files_only=True)
    loaded = cls(load(real), real, CPU)
    x = policy.noise(2, torch.Generator().manual_seed(0))
    sigma = torch.tensor(0.7)
    with torch.no_grad():
        expected = policy.velocity(x, sigma, policy.encode(PROMPTS))
        torch.testing.assert_close(loaded.velocity(x, sigma, loaded.encode(PROMPTS)), expected)
    with pytest.raises(UserError, match="model.path"):
        load(replace(real, path=str(tmp_path / "nothing")))


def test_a_step_distilled_klein_is_refused_before_its_weights_load(tmp_path: Path, klein_cfg, caplog):
    tiny_flux2_klein_pipeline(0).save_pretrained(tmp_path / "klein")
    index = tmp_path / "klein" / "model_index.json"
    config = json.loads(index.read_text())
    config["is_distilled"] = True
    index.write_text(json.dumps(config))
    (tmp_path / "klein" / "transformer" / "diffusion_pytorch_model.safetensors").unlink()  # never read
    real = replace(klein_cfg, tiny=False, path=str(tmp_path / "klein"), local_files_only=True)
    with pytest.raises(UserError, match="step-distilled.*FLUX.2-klein-base-4B"):
        load_flux2_klein_pipeline(real)
    with pytest.raises(UserError, match="step-distilled"):  # a pipeline built as distilled, too
        Flux2KleinPolicy(tiny_flux2_klein_pipeline(0, is_distilled=True), klein_cfg, CPU)
    with pytest.raises(UserError):  # the name looks distilled: a warning, then the missing files fail
        load_flux2_pipeline(replace(real, path=str(tmp_path / "FLUX.2-dev-Turbo")))
    assert "looks like a step-distilled model" in caplog.text


def test_lora_saved_in_diffusers_format_loads_with_load_lora_weights(tmp_path: Path, klein_cfg):
    policy = Flux2KleinPolicy(tiny_flux2_klein_pipeline(0), klein_cfg, CPU)
    perturb_lora(policy, 0.3)
    policy.trainable.save(tmp_path)
    x, cond = policy.noise(2, torch.Generator().manual_seed(2)), policy.encode(PROMPTS)
    sigma = torch.tensor(0.5)
    expected = policy.velocity(x, sigma, cond).detach()

    plain = tiny_flux2_klein_pipeline(0)
    plain.load_lora_weights(tmp_path, weight_name=LORA_WEIGHTS_NAME)
    frozen = Flux2KleinPolicy(plain, replace(klein_cfg, lora=replace(klein_cfg.lora, enabled=False)), CPU)
    torch.testing.assert_close(frozen.velocity(x, sigma, cond).detach(), expected, atol=1e-5, rtol=1e-5)

    fresh = Flux2KleinPolicy(tiny_flux2_klein_pipeline(0), klein_cfg, CPU)
    fresh.trainable.load(tmp_path)
    torch.testing.assert_close(fresh.velocity(x, sigma, cond).detach(), expected)


def test_reference_disables_the_adapter_and_decode_is_in_unit_range(dev_cfg):
    policy = Flux2Policy(tiny_flux2_pipeline(0), dev_cfg, CPU)
    x = policy.noise(2, torch.Generator().manual_seed(0))
    assert_reference_disables_the_adapter(policy, x, policy.encode(PROMPTS))
    images = policy.decode(x)
    assert images.shape == (2, 3, 32, 32) and images.min() >= 0 and images.max() <= 1
    with pytest.raises(UserError, match="multiple of 4"):
        Flux2Policy(tiny_flux2_pipeline(0), replace(dev_cfg, resolution=30), CPU)


def _initial_lora(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(42)  # the recipe seeds torch with cfg.seed before building the adapter
    policy = Flux2KleinPolicy(tiny_flux2_klein_pipeline(0), cfg, CPU)
    return {f"transformer.{k}": v for k, v in get_peft_model_state_dict(policy.transformer).items()}


@pytest.mark.slow
def test_cli_training_changes_every_lora_tensor(tmp_path: Path, klein_cfg):
    run = tmp_path / "run"
    code, out = run_cli(
        "train",
        "model=tiny_flux2_klein",
        *TINY_RUN,
        "algo.lr=1e-2",
        "epochs=2",
        "save_every=2",
        "eval_every=0",
        "images_every=0",
        f"hydra.run.dir={run}",
    )
    assert code == 0, out
    trained = load_file(run / "checkpoints" / "epoch_000002" / "weights" / LORA_WEIGHTS_NAME)
    initial = _initial_lora(klein_cfg)
    assert trained.keys() == initial.keys() and len(trained) > 0
    assert [k for k in trained if torch.equal(trained[k], initial[k])] == []


@pytest.mark.parametrize("model", [pytest.param("tiny_flux2", marks=pytest.mark.slow), "tiny_flux2_klein"])
def test_cli_check_onpolicy_passes(tmp_path: Path, model):
    code, out = run_cli("check-onpolicy", f"model={model}", *TINY_RUN, f"hydra.run.dir={tmp_path}")
    assert code == 0, out
