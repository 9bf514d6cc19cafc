"""Every tiny flow family side by side: seconds per GRPO epoch and the overhead ratio.

For each tiny family, one warm-up epoch, then one timed epoch through the recipe, and in the same run
only the transformer calls that epoch must make (see ``overhead.py``). Prints one JSON object: a row
per family with ``epoch_s``, ``model_calls_s`` and ``overhead_ratio``.

    python benchmarks/families.py
"""

from __future__ import annotations

import json
import time

import torch
from _common import build_recipe
from overhead import model_calls_only

from rlgen_cli.training.progress import Progress

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
    torch.manual_seed(0)
    recipe = build_recipe([*GEOMETRY, *overrides])
    with Progress(enabled=False) as progress:
        recipe.train_epoch(0, progress)
        start = time.perf_counter()
        recipe.train_epoch(1, progress)
        epoch_s = time.perf_counter() - start
    size = recipe.cfg.algo.sample_batch_size
    cond = recipe.policy.encode(["a benchmark prompt"] * size)
    x = recipe.policy.noise(size, torch.Generator(device=recipe.device).manual_seed(0))
    model_s = model_calls_only(recipe, cond, x)
    recipe.cleanup()
    return {
        "epoch_s": round(epoch_s, 3),
        "model_calls_s": round(model_s, 3),
        "overhead_ratio": round(epoch_s / model_s, 3),
    }


if __name__ == "__main__":
    print(json.dumps({name: measure(overrides) for name, overrides in FAMILIES.items()}))
