"""A checkpoint's README.txt says that its weights/ folder (not the checkpoint folder) is what loads
elsewhere, and how, from what the folder holds."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import OmegaConf

from rlgen_cli.training.checkpoints.checkpoint import save_checkpoint
from rlgen_cli.training.checkpoints.checkpoint_readme import (
    DIFFUSERS_FAMILIES,
    DIFFUSERS_PIPELINES,
    LORA_FILE,
    README_FILE,
    checkpoint_readme,
)


def _weights(tmp_path: Path, *files: str) -> Path:
    weights = tmp_path / "weights"
    for name in files:
        (weights / name).parent.mkdir(parents=True, exist_ok=True)
        (weights / name).write_bytes(b"x")
    return weights


def test_a_diffusers_lora_points_load_lora_weights_at_weights(tmp_path: Path):
    note = checkpoint_readme("epoch_000010", _weights(tmp_path, "pytorch_lora_weights.safetensors"), "sd3")
    assert note.startswith("rlgen checkpoint epoch_000010: the state after 10 epochs.")
    assert 'pipe.load_lora_weights("RUN_DIR/checkpoints/epoch_000010/weights")' in note
    assert "load THIS folder, not the checkpoint folder" in note


def test_other_weights_get_their_own_loader(tmp_path: Path):
    peft = checkpoint_readme("epoch_000002", _weights(tmp_path / "a", "adapter_config.json"), "qwen2_vl")
    assert 'PeftModel.from_pretrained(base_model, "RUN_DIR/checkpoints/epoch_000002/weights")' in peft
    shapes = checkpoint_readme(
        "epoch_000002", _weights(tmp_path / "b", "pytorch_lora_weights.safetensors"), "shapes"
    )
    assert "rlgen sample checkpoint=<this folder>" in shapes and "load_lora_weights" not in shapes


def _write_lora(directory: Path) -> None:
    """What a diffusers-format LoRA policy's ``trainable.save`` writes."""
    directory.mkdir(parents=True)
    (directory / "pytorch_lora_weights.safetensors").write_bytes(b"lora")


def test_every_checkpoint_carries_the_note(tmp_path: Path):
    config = OmegaConf.create({"model": {"family": "flux"}})
    ckpt = save_checkpoint(tmp_path, 3, _write_lora, {}, config, keep_last=2)
    note = (ckpt.path / README_FILE).read_text()
    assert 'pipe.load_lora_weights("RUN_DIR/checkpoints/epoch_000003/weights")' in note
    assert README_FILE in ckpt.manifest()  # covered by the integrity check like every other file


# -- which families the note sends to diffusers ----------------------------------------------------------
def _saving_pipelines(family: str) -> set[str | None]:
    """The diffusers pipeline classes through which ``family``'s tiny policy saves its LoRA (None for a
    format that no diffusers pipeline reads)."""
    from rlgen_cli.models import build_policy
    from tests.models.helpers import CPU, model_cfg
    from tests.models.test_protocol import TINY_CONFIGS

    trainable = build_policy(model_cfg(TINY_CONFIGS[family]), CPU).trainable
    parts = trainable.trained.values() if hasattr(trainable, "trained") else [trainable]  # Wan2.2's experts
    return {getattr(part.checkpoint, "pipeline_class", None) for part in parts}


def test_the_diffusers_families_are_those_whose_checkpoints_a_lora_loader_reads():
    import diffusers
    from diffusers.loaders.lora_base import LoraBaseMixin

    from rlgen_cli.models.registry import FAMILIES

    assert set(DIFFUSERS_PIPELINES) <= set(FAMILIES)
    saved_through = {family: _saving_pipelines(family) for family in FAMILIES}
    loadable = {
        family
        for family, pipelines in saved_through.items()
        if None not in pipelines and all(issubclass(getattr(diffusers, p), LoraBaseMixin) for p in pipelines)
    }
    assert set(DIFFUSERS_FAMILIES) == loadable
    assert {"flux2", "flux2_klein", "z_image"} <= loadable and "shapes" not in loadable
    for family in DIFFUSERS_FAMILIES:
        assert saved_through[family] == {DIFFUSERS_PIPELINES[family]}, family


def test_the_readme_lists_the_diffusers_families():
    from rlgen_cli.models.registry import FAMILIES

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    row = next(line for line in readme.splitlines() if line.startswith("| `checkpoints/epoch_N/`"))
    loads, rlgen_only = row.split("load_lora_weights", 1)[1].split("rlgen only", 1)[0].split(";", 1)
    named = lambda text: {w for w in re.findall(r"`(\w+)`", text) if w in FAMILIES}  # noqa: E731
    assert named(loads) == set(DIFFUSERS_FAMILIES)
    assert named(rlgen_only) == set(FAMILIES) - set(DIFFUSERS_FAMILIES)


def test_a_two_expert_lora_loads_each_expert_into_its_transformer(tmp_path: Path):
    note = checkpoint_readme(
        "epoch_000004", _weights(tmp_path, f"high_noise/{LORA_FILE}", f"low_noise/{LORA_FILE}"), "wan2_2"
    )
    assert "diffusers.WanPipeline.from_pretrained(<base model>)" in note
    assert 'pipe.load_lora_weights("RUN_DIR/checkpoints/epoch_000004/weights/high_noise")' in note
    low = 'pipe.load_lora_weights("RUN_DIR/checkpoints/epoch_000004/weights/low_noise", load_into_transformer_2=True)'
    assert low in note


def test_flux2_and_z_image_loras_point_at_their_pipelines(tmp_path: Path):
    for family, pipeline in (("flux2", "Flux2Pipeline"), ("z_image", "ZImagePipeline")):
        note = checkpoint_readme("epoch_000001", _weights(tmp_path / family, LORA_FILE), family)
        assert f"diffusers.{pipeline}.from_pretrained(<base model>)" in note
        assert 'load_lora_weights("RUN_DIR/checkpoints/epoch_000001/weights")' in note


def test_a_z_image_note_says_the_pipelines_guidance_is_rlgens_minus_one(tmp_path: Path):
    note = checkpoint_readme("epoch_000001", _weights(tmp_path, LORA_FILE), "z_image")
    assert "guidance_scale = model.guidance_scale - 1" in note
    flux2 = checkpoint_readme("epoch_000001", _weights(tmp_path / "f", LORA_FILE), "flux2")
    assert "guidance_scale" not in flux2  # FLUX.2 embeds rlgen's own value
