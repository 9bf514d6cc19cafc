"""The Qwen-Image-Edit adapter: the source image conditions through the VL encoder and as latent tokens,
velocity is the target slice of one joint call, real loading + LoRA format, and a CLI training run."""

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
from rlgen_cli.models._qwen_common import LORA_WEIGHTS_NAME, true_cfg
from rlgen_cli.models.qwen_image_edit import (
    QwenImageEditPolicy,
    load_qwen_image_edit_pipeline,
    to_pil,
)
from rlgen_cli.models.tiny import tiny_qwen_image_edit_pipeline
from tests.conftest import TINY_RUN
from tests.models.helpers import CPU, model_cfg, perturb_lora

PROMPTS = ["add a red circle", "remove the two blue squares"]


@pytest.fixture(scope="module")
def edit_cfg():
    return model_cfg("tiny_qwen_image_edit")


def _sources(seed: int) -> torch.Tensor:
    """Two 32 px sources with 8-bit values, as read from PNG files."""
    return torch.randint(0, 256, (2, 3, 32, 32), generator=torch.Generator().manual_seed(seed)) / 255.0


@pytest.fixture(scope="module")
def shared(edit_cfg):
    policy = QwenImageEditPolicy(tiny_qwen_image_edit_pipeline(0), edit_cfg, CPU)
    perturb_lora(policy, 0.3, generator=torch.Generator().manual_seed(7))
    return policy, policy.noise(2, torch.Generator().manual_seed(0)), policy.encode(PROMPTS, _sources(0))


def test_the_source_image_changes_the_velocity_through_both_paths(shared):
    policy, x, cond = shared
    other = policy.encode(PROMPTS, _sources(1))
    sigma = torch.tensor(0.7)
    with torch.no_grad():
        v = policy.velocity(x, sigma, cond)
        assert v.shape == x.shape and v.dtype == torch.float32  # only the target tokens come back
        assert not torch.allclose(v, policy.velocity(x, sigma, other))
        for key in ("prompt_embeds", "source_latents"):  # the VL encoder and the VAE both see the image
            assert not torch.allclose(cond.tensors[key], other.tensors[key]), key
            mixed = replace(cond, tensors={**cond.tensors, key: other.tensors[key]})
            assert not torch.allclose(v, policy.velocity(x, sigma, mixed)), key


def test_velocity_is_the_target_slice_of_one_joint_call_with_true_cfg(shared):
    policy, x, cond = shared
    t = cond.tensors
    hidden = torch.cat([x, t["source_latents"]], dim=1)
    shapes = [[(1, 4, 4), (1, 4, 4)]] * 2  # target, then source (RoPE frame index 1)

    def raw(embeds, mask):
        keep = int(mask.sum(1).max())
        return policy.transformer(
            hidden_states=hidden,
            timestep=torch.full((2,), 0.4),
            encoder_hidden_states=embeds[:, :keep],
            encoder_hidden_states_mask=mask[:, :keep],
            img_shapes=shapes,
            return_dict=False,
        )[0][:, : x.shape[1]]

    with torch.no_grad():
        expected = true_cfg(
            raw(t["prompt_embeds"], t["prompt_mask"]), raw(t["neg_prompt_embeds"], t["neg_prompt_mask"]), 4.0
        )
        torch.testing.assert_close(
            policy.velocity(x, torch.tensor(0.4), cond), expected, atol=1e-5, rtol=1e-5
        )


def test_conditioning_equals_the_pipelines_own_encoders(shared):
    policy, _, cond = shared
    pipe, images = policy.pipeline, _sources(0)
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(PROMPTS, image=to_pil(images), device=CPU)
        latents = pipe._encode_vae_image((images * 2 - 1).unsqueeze(2), generator=None)
        packed = pipe._pack_latents(latents, 2, 4, 8, 8)
    torch.testing.assert_close(cond.tensors["prompt_embeds"][:, : embeds.shape[1]], embeds)
    torch.testing.assert_close(cond.tensors["source_latents"], packed)
    assert cond.tensors["source_shape"].tolist() == [[1, 4, 4]] * 2


def test_sources_are_required_and_checked(shared):
    policy = shared[0]
    with pytest.raises(UserError, match="source image per prompt"):
        policy.encode(PROMPTS)
    with pytest.raises(UserError, match=r"\(B, 3, H, W\)"):
        policy.encode(PROMPTS, torch.zeros(1, 3, 32, 32))
    with pytest.raises(UserError, match="multiple of 8"):
        policy.encode(PROMPTS, torch.zeros(2, 3, 36, 36))


# diffusers targets the modules named in the file, so peft finds nothing left to exclude
@pytest.mark.filterwarnings("ignore:You have passed exclude_modules")
def test_real_loader_and_lora_file_reproduce_the_velocity(tmp_path: Path, edit_cfg, shared):
    policy, x, cond = shared
    tiny_qwen_image_edit_pipeline(0).save_pretrained(tmp_path / "edit")
    policy.trainable.save(tmp_path / "lora")
    cfg = replace(edit_cfg, tiny=False, path=str(tmp_path / "edit"), local_files_only=True)
    pipeline = load_qwen_image_edit_pipeline(cfg)
    pipeline.load_lora_weights(tmp_path / "lora", weight_name=LORA_WEIGHTS_NAME)
    loaded = QwenImageEditPolicy(pipeline, replace(cfg, lora=replace(cfg.lora, enabled=False)), CPU)
    sigma = torch.tensor(0.3)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.velocity(x, sigma, loaded.encode(PROMPTS, _sources(0))),
            policy.velocity(x, sigma, cond),
            atol=1e-5,
            rtol=1e-5,
        )
        with policy.trainable.reference():
            base = policy.velocity(x, sigma, cond)
        assert not torch.allclose(base, policy.velocity(x, sigma, cond))


@pytest.fixture(scope="module")
def edit_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("edit_data")
    (root / "src").mkdir()
    rows = []
    for i, prompt in enumerate(["Change the number of clocks to two.", "Add a red circle."]):
        pixels = np.random.default_rng(i).integers(0, 256, (40, 48, 3), dtype=np.uint8)  # resized to 32 px
        Image.fromarray(pixels).save(root / "src" / f"{i}.png")
        rows.append(json.dumps({"prompt": prompt, "image": f"src/{i}.png", "tag": "counting"}))
    (root / "edit.jsonl").write_text("\n".join(rows) + "\n")
    return root / "edit.jsonl"


def test_cli_training_on_an_edit_set_changes_every_lora_tensor(
    edit_data: Path, edit_cfg, tmp_path: Path, cli
):
    from peft.utils import get_peft_model_state_dict

    run = tmp_path / "run"
    code, out = cli(
        "train",
        "model=tiny_qwen_image_edit",
        *TINY_RUN,
        f"data.train={edit_data}",
        f"data.test={edit_data}",
        "epochs=1",
        f"hydra.run.dir={run}",
    )
    assert code == 0, out
    torch.manual_seed(42)  # the recipe seeds torch with cfg.seed before building the adapter
    fresh = QwenImageEditPolicy(tiny_qwen_image_edit_pipeline(0), edit_cfg, CPU)
    initial = {f"transformer.{k}": v for k, v in get_peft_model_state_dict(fresh.transformer).items()}
    trained = load_file(run / "checkpoints" / "epoch_000001" / "weights" / LORA_WEIGHTS_NAME)
    assert trained.keys() == initial.keys() and len(trained) > 0
    assert [k for k in trained if torch.equal(trained[k], initial[k])] == []


def test_check_onpolicy_on_the_editing_set_it_picks(tmp_path: Path, cli):
    run = tmp_path / "check"
    code, out = cli("check-onpolicy", "model=tiny_qwen_image_edit", *TINY_RUN, f"hydra.run.dir={run}")
    assert code == 0 and "PASS" in out, out
    assert (run / "tiny_edit" / "tiny_edit_train.jsonl").is_file()  # generated in the run directory
