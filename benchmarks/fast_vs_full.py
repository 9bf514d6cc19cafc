"""Flow-GRPO-Fast against full Flow-GRPO: is the saving what the model-call count predicts?

One epoch of ``grpo`` (every step but the last trained) and one of ``grpo_fast`` (a 2-step window) on
the same tiny model, prompts and batch, in one process. Predicted ratio = model-call cost of full /
fast, counting a training step (forward + backward) as 3 forwards; measured = epoch seconds full / fast.
Also times ``shared_prefix`` sampling (one ODE prefix per prompt, then the group branches) against
``independent`` sampling. Prints JSON; target: measured_ratio ≥ 0.9 × predicted_ratio.

    python benchmarks/fast_vs_full.py
"""

from __future__ import annotations

import json
import time

from _common import build_recipe

from rlgen_cli.recipes import flow_grpo
from rlgen_cli.recipes.flow_run import FlowRun
from rlgen_cli.training.reporting.progress import Progress

GEOMETRY = ["algo.group_size=8", "algo.prompts_per_epoch=2", "model.num_steps=8"]
BACKWARD_COST = 2.0  # a backward pass ≈ two forwards


def epoch_seconds(run: FlowRun, repeats: int = 2) -> float:
    with Progress(enabled=False) as progress:
        flow_grpo.grpo_epoch(run, 0, progress)  # warm-up
        start = time.perf_counter()
        for epoch in range(1, repeats + 1):
            flow_grpo.grpo_epoch(run, epoch, progress)
    return (time.perf_counter() - start) / repeats


def sampling_seconds(run: FlowRun, repeats: int = 2) -> float:
    with Progress(enabled=False) as progress:
        flow_grpo.sample_rollouts(run, 0, progress)
        start = time.perf_counter()
        for epoch in range(1, repeats + 1):
            flow_grpo.sample_rollouts(run, epoch, progress)
    return (time.perf_counter() - start) / repeats


def model_cost(run: FlowRun) -> float:
    """Forward-equivalents of one epoch per sample: T rollout forwards + 3 per trained step."""
    plan = flow_grpo.plan_for(run, 0, run.cfg.algo.group_size * run.cfg.algo.prompts_per_epoch)
    return plan.num_steps + (1 + BACKWARD_COST) * len(plan.train_steps)


def main() -> dict[str, float]:
    full = build_recipe([*GEOMETRY, "algo=grpo", "algo.kl_weight=0"])
    fast = build_recipe([*GEOMETRY, "algo=grpo_fast", "algo.window.size=2", "algo.window.range=[1,5]"])
    prefix = build_recipe(
        [
            *GEOMETRY,
            "algo=grpo_fast",
            "algo.window.size=2",
            "algo.window.range=[3,7]",
            "algo.branch=shared_prefix",
        ]
    )
    branch = build_recipe([*GEOMETRY, "algo=grpo_fast", "algo.window.size=2", "algo.window.range=[3,7]"])
    full_s, fast_s = epoch_seconds(full), epoch_seconds(fast)
    predicted = model_cost(full) / model_cost(fast)
    measured = full_s / fast_s
    independent_s, shared_s = sampling_seconds(branch), sampling_seconds(prefix)
    return {
        "full_epoch_s": round(full_s, 3),
        "fast_epoch_s": round(fast_s, 3),
        "independent_sampling_s": round(independent_s, 3),
        "shared_prefix_sampling_s": round(shared_s, 3),
        "sampling_ratio": round(independent_s / shared_s, 3),
        "predicted_ratio": round(predicted, 3),
        "measured_ratio": round(measured, 3),
        "measured_over_predicted": round(measured / predicted, 3),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
