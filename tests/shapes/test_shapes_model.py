"""The ShapesEval text-to-image model behind the flow-policy protocol, and its pretraining recipe."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from rlgen_cli._hydra import conf_dir
from rlgen_cli.errors import UserError
from rlgen_cli.models import build_policy
from rlgen_cli.models.shapes import BOS_ID, PAD_ID, UNK_ID, WORDS, WordTokenizer, resolve_model_dir
from rlgen_cli.models.shapes_unet import ShapesUNet
from rlgen_cli.recipes.flow_pretrain import learning_rate
from rlgen_cli.schema.model import option_section
from rlgen_cli.schema.run import ModelConfig

CPU = torch.device("cpu")


def _model_cfg(name: str, **overrides) -> ModelConfig:
    merged = option_section(OmegaConf.load(conf_dir() / "model" / f"{name}.yaml"))
    return OmegaConf.to_object(OmegaConf.merge(merged, overrides))


@pytest.fixture(scope="module")
def policy():
    return build_policy(_model_cfg("shapes_unet"), CPU)


def test_tokenizer_maps_words_and_marks_padding():
    ids, mask = WordTokenizer(8)(["a photo of two red circles", "", "a zebra"])
    assert ids[0, :7].tolist() == [BOS_ID] + [
        WORDS.index(w) for w in ["a", "photo", "of", "two", "red", "circles"]
    ]
    assert ids[0, 7] == PAD_ID and mask[0].tolist() == [True] * 7 + [False]
    assert ids[1, 0] == BOS_ID and mask[1].sum() == 1  # the empty prompt still has a key to attend to
    assert ids[2, 2] == UNK_ID
    with pytest.raises(UserError, match="at most 7"):
        WordTokenizer(8)(["a photo of a red circle left of a blue square"])


def test_protocol_shapes_and_pixel_round_trip(policy):
    cond = policy.encode(["a photo of a circle", "a photo of two squares"])
    x = policy.noise(2, torch.Generator().manual_seed(0))
    assert x.shape == (2, 3, 32, 32)
    sigmas = policy.schedule(10, x)
    assert sigmas.shape == (11,) and sigmas[0] == 1 and sigmas[-1] == 0
    assert policy.velocity(x, sigmas[3], cond).shape == x.shape
    images = torch.rand(2, 3, 32, 32)
    assert torch.allclose(policy.decode(policy.encode_images(images)), images, atol=1e-6)


def test_guidance_combines_the_empty_prompt_branch():
    guided = build_policy(_model_cfg("shapes_unet", guidance_scale=3.0), CPU)
    with torch.no_grad():  # a non-zero output layer so the two branches differ
        guided.unet.conv_out.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    x = guided.noise(1, torch.Generator().manual_seed(1))
    sigma = torch.tensor(0.5)
    cond = guided.encode(["a photo of a red circle"])
    assert set(cond.tensors) == {"input_ids", "attention_mask", "neg_input_ids", "neg_attention_mask"}
    with torch.no_grad():
        v = guided.velocity(x, sigma, cond)
        guided.guidance_scale = 1.0
        v_cond = guided.velocity(x, sigma, guided.encode(["a photo of a red circle"]))
        v_uncond = guided.velocity(x, sigma, guided.encode([""]))
    # the guided call runs both branches as one batch of 2, the plain ones as batches of 1: the convolutions
    # round differently (measured 1.7e-5, at the old atol=1e-5 + rtol=1e-4 on some kernels), and
    # u + g·(c − u) scales a branch's rounding by up to 1 + 2g: 32 float32 eps of the branches' scale each
    expected = v_uncond + 3.0 * (v_cond - v_uncond)
    scale = max(v_cond.abs().max(), v_uncond.abs().max())
    assert (v - expected).abs().max() <= (1 + 2 * 3.0) * 32 * torch.finfo(torch.float32).eps * scale


@pytest.mark.parametrize("lora", [False, True])
def test_save_and_load_trainable_round_trip(tmp_path: Path, lora: bool):
    cfg = _model_cfg("shapes_unet", lora={"enabled": lora})
    first = build_policy(cfg, CPU)
    with torch.no_grad():
        for param in first.trainable.parameters():
            param.add_(0.01)
    first.trainable.save(tmp_path)
    second = build_policy(cfg, CPU)
    second.trainable.load(tmp_path)
    for (name, a), (_, b) in zip(first.trainable.named(), second.trainable.named(), strict=True):
        assert torch.equal(a, b), name


def test_reference_is_the_frozen_start(policy):
    cond = policy.encode(["a photo of a blue triangle"])
    x = policy.noise(1, torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = policy.velocity(x, torch.tensor(0.7), cond)
        policy.unet.conv_out.bias.add_(1.0)
        with policy.trainable.reference():
            ref = policy.velocity(x, torch.tensor(0.7), cond)
        policy.unet.conv_out.bias.sub_(1.0)
    assert torch.equal(ref, before)


def test_a_missing_model_directory_is_a_clear_error(tmp_path: Path):
    with pytest.raises(UserError, match="config.json missing"):
        build_policy(_model_cfg("shapes_base", path=str(tmp_path)), CPU)


def test_the_shipped_base_loads_and_draws_shapes():
    base = build_policy(_model_cfg("shapes_base"), CPU)
    from rlgen_cli.sde.sampling import sample_images
    from rlgen_cli.shapes import score_images

    prompts = ["a photo of a red circle", "a photo of two blue squares"]
    images = sample_images(base, prompts, 10, 2, 0)
    assert images.shape == (2, 3, 32, 32) and images.min() >= 0 and images.max() <= 1
    results = score_images(images, [{"tag": "x", "include": [{"class": "circle", "count": 1}]}] * 2)
    assert all(r.n_objects >= 1 for r in results)  # it draws objects, not noise or a blank canvas


def test_the_channels_last_policy_computes_the_saved_models_velocity():
    """The policy keeps the UNet channels-last (the fast convolution layout); it must be the same
    function as the saved model in the default layout, to float rounding."""
    base = build_policy(_model_cfg("shapes_base"), CPU)
    assert base.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    saved = ShapesUNet.from_pretrained(resolve_model_dir("builtin:shapes_base"))
    assert saved.conv_in.weight.is_contiguous()
    cond = base.encode(["a photo of a red circle", "a photo of two blue squares", "a photo of a cat"])
    x = base.noise(3, torch.Generator().manual_seed(0))
    got = base.velocity(x, torch.tensor(0.6), cond)
    with torch.no_grad():
        want = saved(x, torch.full((3,), 600.0), cond.tensors["input_ids"], cond.tensors["attention_mask"])
    assert want.abs().mean() > 0.1  # a trained velocity, not the zero-initialised output layer's
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_learning_rate_warms_up_then_decays_on_a_cosine():
    assert learning_rate(0, 1.0, warmup=10, total=110, min_ratio=0.1) == pytest.approx(0.1)
    assert learning_rate(9, 1.0, warmup=10, total=110, min_ratio=0.1) == pytest.approx(1.0)
    assert learning_rate(60, 1.0, warmup=10, total=110, min_ratio=0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert learning_rate(110, 1.0, warmup=10, total=110, min_ratio=0.1) == pytest.approx(0.1)
    assert learning_rate(35, 2.0, 10, 110, 0.0) == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi / 4)))


def test_pretraining_through_the_cli_changes_the_weights(cli, tmp_path: Path):
    run = tmp_path / "pretrain"
    code, out = cli(
        "train",
        "experiment=shapes_pretrain",
        "epochs=2",
        "algo.pretrain.steps_per_epoch=2",
        "algo.pretrain.batch_size=8",
        "algo.pretrain.warmup_steps=1",
        "data.eval_num_prompts=6",
        "eval_every=1",
        "algo.sample_batch_size=8",
        "model.eval_num_steps=2",
        "progress=false",
        f"hydra.run.dir={run}",
    )
    assert code == 0, out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 for r in rows)
    assert "eval/reward/shapes_geneval/strict/mean" in rows[-1]
    assert "eval/reward/shapes_geneval/strict/tag/counting" in rows[-1]
    saved = load_file(
        run
        / "checkpoints"
        / "epoch_000002"
        / "weights"
        / "transformer"
        / "diffusion_pytorch_model.safetensors"
    )
    fresh = build_policy(_model_cfg("shapes_unet"), CPU).unet.state_dict()
    assert any(not torch.equal(saved[k], fresh[k]) for k in saved)
