"""``README.txt`` of a checkpoint: which of its folders holds the weights and how to load them elsewhere.

A checkpoint folder (``checkpoints/epoch_000010``) is what ``resume=`` and ``rlgen sample checkpoint=``
take; the weights themselves live in its ``weights/`` (diffusers' ``load_lora_weights`` pointed at the
checkpoint folder finds no LoRA file and says so in misleading terms). The note says so where a person
browsing the run directory looks.
"""

from __future__ import annotations

from pathlib import Path

from rlgen_cli.schema.families import FAMILY_TABLE

README_FILE = "README.txt"
LORA_FILE = "pytorch_lora_weights.safetensors"
PEFT_ADAPTER = "adapter_config.json"
FULL_TRANSFORMER = "transformer"
# The diffusers pipeline whose LoRA loader (``load_lora_weights``) reads each family's checkpoint: the
# pipeline class the family's ``DiffusersCheckpoint`` saves through (tests/training/test_checkpoint_readme.py
# checks both against every family of models/registry.py); the ``diffusers_pipeline`` column of
# schema/families.py. A family not here loads through rlgen only.
DIFFUSERS_PIPELINES: dict[str, str] = {
    row.name: row.diffusers_pipeline for row in FAMILY_TABLE.values() if row.diffusers_pipeline
}
DIFFUSERS_FAMILIES = tuple(DIFFUSERS_PIPELINES)
# Pipelines whose guidance_scale is not rlgen's g of u + g·(c − u) (docs/maths.md §4.6).
PIPELINE_GUIDANCE = {"z_image": "sample with guidance_scale = model.guidance_scale - 1 (config.yaml)"}
# Two-expert families (Wan2.2) save one folder per expert; diffusers loads the low-noise one into
# ``transformer_2``.
EXPERT_LOAD_ARGS = {"high_noise": "", "low_noise": ", load_into_transformer_2=True"}


def _diffusers_hint(weights: Path, family: str, shown: str) -> str | None:
    """The diffusers lines that load ``weights`` of ``family``; None when the folder holds no diffusers
    format (a LoRA file, per-expert LoRA files, or a full ``transformer/``)."""
    pipeline = DIFFUSERS_PIPELINES[family]
    on_base = f"pipe = diffusers.{pipeline}.from_pretrained(<base model>)"
    if (weights / LORA_FILE).is_file():
        guidance = f"; {PIPELINE_GUIDANCE[family]}" if family in PIPELINE_GUIDANCE else ""
        return f'diffusers: {on_base}; pipe.load_lora_weights("{shown}"){guidance}'
    experts = [name for name in EXPERT_LOAD_ARGS if (weights / name / LORA_FILE).is_file()]
    if experts:
        loads = [f'pipe.load_lora_weights("{shown}/{name}"{EXPERT_LOAD_ARGS[name]})' for name in experts]
        return f"diffusers: {on_base}; " + "; ".join(loads)
    if (weights / FULL_TRANSFORMER).is_dir():
        return f'diffusers: the transformer class\'s from_pretrained("{shown}/{FULL_TRANSFORMER}")'
    return None


def load_hint(weights: Path, family: str | None, shown: str) -> str:
    """How to load the ``weights`` folder (named ``shown`` in the note) outside rlgen, from what it holds."""
    hint = _diffusers_hint(weights, family, shown) if family in DIFFUSERS_PIPELINES else None
    if hint:
        return hint
    if (weights / PEFT_ADAPTER).is_file():
        return f'peft: PeftModel.from_pretrained(base_model, "{shown}")'
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
