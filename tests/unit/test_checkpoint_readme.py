"""A checkpoint's README.txt says that its weights/ folder (not the checkpoint folder) is what loads
elsewhere, and how, from what the folder holds."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from rlgen_cli.training.checkpoint import save_checkpoint
from rlgen_cli.training.checkpoint_readme import README_FILE, checkpoint_readme


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
