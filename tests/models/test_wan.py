"""The Wan2.1 adapter: real loading path, video geometry, Wan's sigma grid, CFG inside velocity, the LoRA
format WanPipeline reads, the reference switch, CLI training / on-policy check, and video files."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.errors import UserError
from rlgen_cli.models.tiny import tiny_wan_pipeline
from rlgen_cli.models.wan import (
    LORA_WEIGHTS_NAME,
    WanPolicy,
    load_wan_pipeline,
    wan_sigmas,
)
from rlgen_cli.training.reporting.video import save_video, video_encoder
from tests.conftest import TINY_RUN
from tests.models.helpers import CPU, assert_reference_disables_the_adapter, model_cfg, perturb_lora

PROMPTS = ["a red circle", "a blue square"]


@pytest.fixture(scope="module")
def wan_cfg():
    return model_cfg("tiny_wan2_1")


@pytest.fixture(scope="module")
def cfg_policy(wan_cfg) -> WanPolicy:
    """A tiny Wan with CFG on, LoRA B perturbed so the adapter matters."""
    policy = WanPolicy(tiny_wan_pipeline(0), replace(wan_cfg, guidance_scale=4.5), CPU)
    perturb_lora(policy)
    return policy


def _probe(policy: WanPolicy, n: int = 2):
    return policy.noise(n, torch.Generator().manual_seed(0)), policy.encode(PROMPTS[:n])


def test_video_geometry_noise_velocity_and_decode(cfg_policy: WanPolicy):
    x, cond = _probe(cfg_policy)
    assert x.shape == (2, 16, 2, 4, 6) and x.dtype == torch.float32  # (B, C, F', H', W'): 5 frames, 32×48
    v = cfg_policy.velocity(x, torch.tensor(0.5), cond)
    assert v.shape == x.shape and v.dtype == torch.float32
    videos = cfg_policy.decode(x)
    assert videos.shape == (2, 3, 5, 32, 48) and videos.min() >= 0 and videos.max() <= 1


def test_per_sample_noise_does_not_depend_on_batching(cfg_policy: WanPolicy):
    gens = lambda: [torch.Generator().manual_seed(s) for s in (3, 4)]  # noqa: E731
    both = cfg_policy.noise(2, gens())
    torch.testing.assert_close(cfg_policy.noise(1, gens()[1:]), both[1:])


def test_schedule_is_wans_unipc_flow_grid(cfg_policy: WanPolicy):
    from diffusers import UniPCMultistepScheduler

    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    unipc.set_timesteps(20)
    sigmas = cfg_policy.schedule(20, torch.zeros(1))
    assert sigmas.shape == (21,) and sigmas[0] == 1.0 and sigmas[-1] == 0.0
    torch.testing.assert_close(sigmas[1:], unipc.sigmas[1:].float())  # UniPC nudges σ₀ to 1 − 1e-6
    assert torch.all(sigmas[1:] < sigmas[:-1])
    assert not torch.allclose(wan_sigmas(20, 5.0), sigmas)  # the shift is the model's, not hard-coded


def test_save_pretrained_round_trip_through_the_real_loader(tmp_path: Path, wan_cfg):
    tiny_wan_pipeline(seed=0).save_pretrained(tmp_path / "wan")
    cfg = replace(wan_cfg, tiny=False, path=str(tmp_path / "wan"), local_files_only=True, guidance_scale=4.5)
    torch.manual_seed(0)
    loaded = WanPolicy(load_wan_pipeline(cfg), cfg, CPU)
    torch.manual_seed(0)
    built = WanPolicy(tiny_wan_pipeline(seed=0), replace(wan_cfg, guidance_scale=4.5), CPU)
    x, cond = _probe(built)
    sigma = torch.tensor(0.7)
    torch.testing.assert_close(
        loaded.velocity(x, sigma, loaded.encode(PROMPTS)), built.velocity(x, sigma, cond)
    )


def test_missing_local_path_is_a_user_error(tmp_path: Path, wan_cfg):
    cfg = replace(wan_cfg, tiny=False, path=str(tmp_path / "nothing"), local_files_only=True)
    with pytest.raises(UserError, match="model.path"):
        load_wan_pipeline(cfg)


@pytest.mark.parametrize(
    ("change", "message"), [({"num_frames": 4}, "4·k \\+ 1"), ({"height": 40}, "multiples of 16")]
)
def test_unrepresentable_geometry_is_refused(wan_cfg, change: dict, message: str):
    with pytest.raises(UserError, match=message):
        WanPolicy(tiny_wan_pipeline(0), replace(wan_cfg, **change), CPU)


def test_tiny_builder_is_deterministic_in_its_seed():
    a, b, c = tiny_wan_pipeline(0), tiny_wan_pipeline(0), tiny_wan_pipeline(1)
    pa, pb, pc = (dict(p.transformer.named_parameters()) for p in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not all(torch.equal(pa[k], pc[k]) for k in pa)


def test_lora_on_self_and_cross_attention_only(cfg_policy: WanPolicy, wan_cfg):
    names = [n for n, p in cfg_policy.transformer.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    for target in ("attn1.to_q", "attn1.to_out.0", "attn2.to_k", "attn2.to_v"):
        assert any(f"{target}.lora_A" in n for n in names), target
    assert len(cfg_policy.trainable.parameters()) == len(names) == 2 * 2 * 8  # A+B × 2 blocks × 8 layers
    sd3_targets = replace(wan_cfg.lora, target_modules=["attn.to_q", "attn.add_k_proj"])
    with pytest.raises(UserError, match="attn1.to_q"):
        WanPolicy(tiny_wan_pipeline(0), replace(wan_cfg, lora=sd3_targets), CPU)


def test_cfg_is_two_separate_forwards_inside_velocity(cfg_policy: WanPolicy):
    x, cond = _probe(cfg_policy)
    t = torch.full((2,), 700.0)

    def call(e: torch.Tensor) -> torch.Tensor:
        return cfg_policy.transformer(
            hidden_states=x, timestep=t, encoder_hidden_states=e, return_dict=False
        )[0]

    c, u = call(cond.tensors["prompt_embeds"]), call(cond.tensors["neg_prompt_embeds"])
    torch.testing.assert_close(cfg_policy.velocity(x, torch.tensor(0.7), cond), u + 4.5 * (c - u))


def test_lora_saved_in_wan_format_loads_with_load_lora_weights(tmp_path: Path, cfg_policy: WanPolicy):
    cfg_policy.trainable.save(tmp_path)
    assert (tmp_path / LORA_WEIGHTS_NAME).is_file()
    x, cond = _probe(cfg_policy)
    expected = cfg_policy.velocity(x, torch.tensor(0.5), cond).detach()

    plain = tiny_wan_pipeline(0)
    plain.load_lora_weights(tmp_path, weight_name=LORA_WEIGHTS_NAME)
    no_lora = replace(cfg_policy.cfg, lora=replace(cfg_policy.cfg.lora, enabled=False))
    reloaded = WanPolicy(plain, no_lora, CPU)  # loaded adapter stays active; nothing new is attached
    got = reloaded.velocity(x, torch.tensor(0.5), cond)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    fresh = WanPolicy(tiny_wan_pipeline(0), cfg_policy.cfg, CPU)
    fresh.trainable.load(tmp_path)
    torch.testing.assert_close(fresh.velocity(x, torch.tensor(0.5), cond).detach(), expected)


def test_reference_disables_the_adapter(wan_cfg):
    policy = WanPolicy(tiny_wan_pipeline(0), wan_cfg, CPU)
    x, cond = _probe(policy)
    assert_reference_disables_the_adapter(policy, x, cond)


def test_full_finetune_keeps_a_frozen_reference_and_round_trips(tmp_path: Path, wan_cfg):
    cfg = replace(wan_cfg, lora=replace(wan_cfg.lora, enabled=False))
    policy = WanPolicy(tiny_wan_pipeline(0), cfg, CPU)
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
    fresh = WanPolicy(tiny_wan_pipeline(0), cfg, CPU)
    fresh.trainable.load(tmp_path)
    torch.testing.assert_close(fresh.velocity(x, sigma, cond), policy.velocity(x, sigma, cond))


def test_cli_training_changes_every_lora_tensor(tmp_path: Path, wan_cfg, cli):
    from peft.utils import get_peft_model_state_dict

    run_dir = tmp_path / "run"
    code, out = cli(
        "train",
        "model=tiny_wan2_1",
        *TINY_RUN,
        "epochs=2",
        "save_every=1",
        "images_every=0",
        "eval_every=0",
        "algo.lr=1e-2",
        f"hydra.run.dir={run_dir}",
    )
    assert code == 0, out
    torch.manual_seed(42)  # the recipe seeds torch with cfg.seed before building the adapter
    initial = WanPolicy(tiny_wan_pipeline(0), wan_cfg, CPU)
    before = {f"transformer.{k}": v for k, v in get_peft_model_state_dict(initial.transformer).items()}
    after = load_file(run_dir / "checkpoints" / "epoch_000002" / "weights" / LORA_WEIGHTS_NAME)
    assert after.keys() == before.keys() and len(after) == 32
    assert [k for k in after if torch.equal(after[k], before[k])] == []


def test_check_onpolicy_passes_with_cfg(tmp_path: Path, cli):
    code, out = cli(
        "check-onpolicy",
        "model=tiny_wan2_1",
        "model.guidance_scale=4.5",
        *TINY_RUN,
        f"hydra.run.dir={tmp_path / 'check'}",
    )
    assert code == 0, out
    assert "PASS" in out


def _video(frames: int = 5) -> torch.Tensor:
    return torch.rand((3, frames, 31, 47), generator=torch.Generator().manual_seed(0))  # odd sides on purpose


def test_save_video_webp_reads_back_every_frame(tmp_path: Path):
    from PIL import Image

    video = _video()
    path = save_video(video, tmp_path / "clip.mp4", fps=8, format="webp")
    assert path == tmp_path / "clip.webp"
    with Image.open(path) as image:
        assert image.n_frames == 5 and image.size == (47, 31)
        image.seek(3)
        expected = (video[:, 3].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        np.testing.assert_array_equal(np.asarray(image.convert("RGB")), expected)  # lossless


def test_save_video_auto_uses_mp4_when_the_encoder_is_installed(tmp_path: Path):
    if video_encoder() != "mp4":
        with pytest.raises(UserError, match="imageio-ffmpeg"):
            save_video(_video(), tmp_path / "clip", format="mp4")
        assert save_video(_video(), tmp_path / "clip").suffix == ".webp"
        return
    import imageio_ffmpeg

    path = save_video(_video(), tmp_path / "clip", fps=8)
    assert path.suffix == ".mp4"
    frames = imageio_ffmpeg.read_frames(str(path))
    meta = next(frames)
    assert meta["size"] == (48, 32) and sum(1 for _ in frames) == 5  # padded to even sides


def test_video_grid_tiles_every_frame(tmp_path: Path):
    from rlgen_cli.training.reporting.video import save_video_grid, tile_videos

    videos = torch.rand((3, 3, 4, 8, 6))
    grid = tile_videos(videos, upscale=2)  # 2 columns × 2 rows, one white cell
    assert grid.shape == (3, 4, 32, 24)
    torch.testing.assert_close(grid[:, :, 16:32:2, 0:12:2], videos[2])
    assert torch.all(grid[:, :, 16:, 12:] == 1)
    path = save_video_grid(videos, tmp_path / "train_epoch_00000.png")
    assert path.stem == "train_epoch_00000" and path.suffix in (".mp4", ".webp") and path.is_file()
