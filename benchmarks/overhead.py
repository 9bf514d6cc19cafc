"""How much of a Flow-GRPO epoch is spent outside the transformer.

Runs one tiny-SD3 GRPO epoch through the recipe (rollout → reward → advantages → update), then, in the
same process, replays only the transformer forward/backward calls that epoch had to make (same shapes,
same batch sizes, same CFG and reference passes) and times them. Prints JSON whose last field is
``overhead_ratio`` = epoch time / model-call time (1.0 = no overhead at all).

    python benchmarks/overhead.py [key=value overrides…]
"""

from __future__ import annotations

import json
import sys
import time

import torch
from _common import build_recipe

from rlgen_cli.recipes.flow_rl import FlowRLRecipe
from rlgen_cli.training.progress import Progress


def model_calls_only(recipe: FlowRLRecipe, cond, x: torch.Tensor) -> float:
    """Seconds for exactly the transformer calls of one epoch, with nothing else around them."""
    algo, policy = recipe.cfg.algo, recipe.policy
    n = algo.prompts_per_epoch * algo.group_size
    plan = recipe.plan_for(0, n)
    steps, trained = plan.num_steps, len(plan.train_steps)
    sigma = torch.tensor(0.5)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(n // algo.sample_batch_size):
            for _ in range(steps):
                policy.velocity(
                    x[: algo.sample_batch_size], sigma, cond.index(slice(0, algo.sample_batch_size))
                )
    for _ in range(algo.num_inner_epochs * (n // algo.train_batch_size)):
        for _ in range(trained):
            batch = cond.index(slice(0, algo.train_batch_size))
            policy.velocity(x[: algo.train_batch_size], sigma, batch).square().mean().backward()
            if algo.beta > 0:
                with torch.no_grad(), policy.reference():
                    policy.velocity(x[: algo.train_batch_size], sigma, batch)
    recipe.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main(overrides: list[str]) -> dict[str, float]:
    torch.manual_seed(0)
    recipe = build_recipe(overrides)
    with Progress(enabled=False) as progress:
        recipe.train_epoch(0, progress)  # warm-up: first calls allocate and pick kernels
        start = time.perf_counter()
        recipe.train_epoch(1, progress)
        epoch_s = time.perf_counter() - start
    algo = recipe.cfg.algo
    size = max(algo.sample_batch_size, algo.train_batch_size)
    cond = recipe.policy.encode(["a benchmark prompt"] * size)
    x = recipe.policy.noise(size, torch.Generator(device=recipe.device).manual_seed(0))
    model_s = model_calls_only(recipe, cond, x)
    return {"epoch_s": round(epoch_s, 3), "model_calls_s": round(model_s, 3),
            "overhead_ratio": round(epoch_s / model_s, 3)}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
