"""``README.txt`` of a checkpoint: which of its folders holds the weights and how to load them elsewhere.

A checkpoint folder (``checkpoints/epoch_000010``) is what ``resume=`` and ``rlgen sample checkpoint=``
take; the weights themselves live in its ``weights/`` (diffusers' ``load_lora_weights`` pointed at the
checkpoint folder finds no LoRA file and says so in misleading terms). The note says so where a person
browsing the run directory looks.
"""

from __future__ import annotations

from pathlib import Path

README_FILE = "README.txt"
LORA_FILE = "pytorch_lora_weights.safetensors"
PEFT_ADAPTER = "adapter_config.json"
FULL_TRANSFORMER = "transformer"
# families whose LoRA file diffusers' pipelines load as it is
DIFFUSERS_FAMILIES = ("sd3", "flux", "flux_kontext", "qwen_image", "qwen_image_edit", "wan2_1")


def load_hint(weights: Path, family: str | None, shown: str) -> str:
    """How to load the ``weights`` folder (named ``shown`` in the note) outside rlgen, from what it holds."""
    if (weights / LORA_FILE).is_file() and family in DIFFUSERS_FAMILIES:
        return f'diffusers: pipe.load_lora_weights("{shown}") on the base model\'s pipeline'
    if (weights / PEFT_ADAPTER).is_file():
        return f'peft: PeftModel.from_pretrained(base_model, "{shown}")'
    if (weights / FULL_TRANSFORMER).is_dir() and family in DIFFUSERS_FAMILIES:
        return f'diffusers: the transformer class\'s from_pretrained("{shown}/{FULL_TRANSFORMER}")'
    return "rlgen: rlgen sample checkpoint=<this folder> (rebuilds the model from config.yaml)"


def checkpoint_readme(name: str, weights: Path, family: str | None, epochs: int | None = None) -> str:
    """The note of checkpoint ``name`` (``epoch_000010``) whose weights folder is ``weights``; ``epochs``
    for a name that does not say it (``best_heldout``)."""
    shown = f"RUN_DIR/checkpoints/{name}/weights"
    epochs = int(name.split("_")[-1]) if epochs is None else epochs
    return (
        f"rlgen checkpoint {name}: the state after {epochs} epochs.\n\n"
        f"weights/          the trained weights; load THIS folder, not the checkpoint folder:\n"
        f"                  {load_hint(weights, family, shown)}\n"
        "trainer_state.pt  optimizer, counters, RNG and sampler states (rlgen train resume=auto)\n"
        "config.yaml       the resolved config (rlgen sample checkpoint=<this folder> rebuilds the model)\n"
        "manifest.json     size and SHA-256 of every file, checked before resuming\n"
    )


def write_checkpoint_readme(
    directory: Path, name: str, family: str | None, epochs: int | None = None
) -> Path:
    """Write :func:`checkpoint_readme` into the checkpoint ``directory`` (before its manifest)."""
    path = directory / README_FILE
    path.write_text(checkpoint_readme(name, directory / "weights", family, epochs), encoding="utf-8")
    return path
