"""Every tiny flow family side by side: seconds per GRPO epoch and the overhead ratio.

For each tiny family, one warm-up epoch, then one timed epoch through the recipe, and in the same run
only the transformer calls that epoch must make (see ``overhead.py``). Prints one JSON object: a row
per family with ``epoch_s``, ``model_calls_s`` and ``overhead_ratio``.

    python benchmarks/families.py
"""

from __future__ import annotations

import json

import torch
from overhead import Arm

from rlgen_cli.training.reporting.progress import Progress

FAMILIES = {
    "sd3": ["model=tiny_sd3"],
    "flux": ["model=tiny_flux"],
    "qwen_image": ["model=tiny_qwen_image"],
    "wan2_1": ["model=tiny_wan2_1", "eval_every=0", "images_every=0"],
}
GEOMETRY = [
    "algo.group_size=4",
    "algo.prompts_per_epoch=2",
    "algo.sample_batch_size=4",
    "algo.train_batch_size=4",
]


def measure(overrides: list[str]) -> dict[str, float]:
    """One warm-up epoch and replay, then one measured epoch and the bare replay of its model calls."""
    torch.manual_seed(0)
    arm = Arm("family", ["experiment=tiny_cpu", *GEOMETRY, *overrides])
    with Progress(enabled=False) as progress:
        for measured in (False, True):
            arm.run_epoch(progress, measured)
            arm.replay(measured)
    summary = arm.summary()
    arm.recipe.logger.close()
    return {key: summary[key] for key in ("epoch_s", "model_calls_s", "overhead_ratio")}


if __name__ == "__main__":
    print(json.dumps({name: measure(overrides) for name, overrides in FAMILIES.items()}))
