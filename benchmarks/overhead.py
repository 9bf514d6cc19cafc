"""How much of a Flow-GRPO epoch is spent outside the model calls it has to make.

Runs epochs of a geometry (``_geometry.py``; default the tiny-SD3 CFG geometry loaded through the real
loader) and, right after each, replays exactly the transformer calls that epoch made, recorded from the
epoch itself: the same inputs (latents, σ, conditioning — so the same shapes and CFG doubling), grad
mode, CFG-gradient mode, LoRA state (reference passes with the adapter off) and a backward wherever the
epoch ran one — with nothing around them. After a warm-up (by default one pass over the training
prompts, so the prompt cache is warm as in a long run) epochs and replays alternate; the JSON holds
medians and ends with ``overhead_ratio`` = epoch ÷ replay. The epoch contains every replayed call, so a
ratio below 1 is a measurement error: it is flagged (``valid: false``) and the script exits 1.

On a CPU the epoch's own calls are clocked too (``model_calls_in_epoch_s``), which splits the overhead in
two: ``outside_calls_share``, the epoch's time between its model calls (Python, SDE maths, VAE, reward),
and ``calls_in_epoch_vs_replay``, how much slower the same calls ran inside the epoch than bare (what runs
beside them: another thread's work competing for the cores, caches). On a GPU a clock around each call
would have to synchronise the device, which changes what is measured, so they are left out.

``--baseline KEY=VALUE`` (repeatable) runs a second recipe with those overrides side by side, epochs
interleaved A/B/A/B, and reports ``epoch_vs_baseline`` (median of the per-repeat ratios). The old path
of the prompt conditioning is ``model.prompt_cache_mb=0``; the old cost of ``algo.cfg_grad=conditional``
(one CFG batch differentiated through both halves, the unconditional one detached afterwards) is what
``algo.cfg_grad=both`` computes; the old update (a transformer call and a backward per trained step) is
``algo.timesteps_per_pass=1``, so an arm that folds steps names it in its baseline.

    python benchmarks/overhead.py [--geometry sd3_cfg|shapes|shapes_nft] [--repeats 5] [--baseline K=V …] [K=V …]
    python benchmarks/overhead.py algo.timesteps_per_pass=8 --baseline algo.cfg_grad=both \
        --baseline model.prompt_cache_mb=0 --baseline algo.timesteps_per_pass=1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _common import compose_recipe
from _geometry import GEOMETRIES, default_warmup, overrides_for, run_epoch
from torch import Tensor

from rlgen_cli.models import Cond, cfg_gradient
from rlgen_cli.models.base import uncond_takes_grad
from rlgen_cli.recipes.flow_run import FlowRun
from rlgen_cli.training.reporting.progress import Progress

BACKWARD = "backward"
RATIOS = {
    True: ("overhead_ratio", "overhead_ratio_cpu"),
    False: ("overhead_ratio",),
}  # checked, by "on a CPU"


@dataclass
class Call:
    """One ``policy.velocity`` call of an epoch, with the state it ran in."""

    x: Tensor
    sigma: Tensor
    cond: Cond
    grad: bool
    cfg_grad: str
    reference: bool


Calls = list[Call | str]  # velocity calls and BACKWARD markers, in the epoch's order


@contextmanager
def clocked(seconds: list[float]) -> Iterator[None]:
    """Add the block's wall-clock seconds to ``seconds[0]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[0] += time.perf_counter() - start


@contextmanager
def recording(recipe: FlowRun, calls: Calls, passes: Counter, in_calls: list[float]) -> Iterator[None]:
    """Append every velocity call and backward of the block to ``calls``; count the transformer's passes
    by batch size and grad mode in ``passes``; add the wall-clock seconds spent inside those calls to
    ``in_calls[0]`` (meaningful on a CPU only: nothing here waits for a GPU)."""
    policy, dist = recipe.policy, recipe.dist
    velocity, reference, backward = policy.velocity, policy.trainable.reference, dist.backward
    depth = [0]

    def recorded_velocity(x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        mode = "both" if uncond_takes_grad() else "conditional"
        calls.append(
            Call(
                x.detach().clone(), sigma.detach().clone(), cond, torch.is_grad_enabled(), mode, depth[0] > 0
            )
        )
        with clocked(in_calls):
            return velocity(x, sigma, cond)

    @contextmanager
    def recorded_reference() -> Iterator[None]:
        depth[0] += 1
        try:
            with reference():
                yield
        finally:
            depth[0] -= 1

    def recorded_backward(loss: Tensor, sync: bool = True) -> None:
        calls.append(BACKWARD)
        with clocked(in_calls):
            backward(loss, sync)

    def recorded_pass(_: Any, args: tuple, kwargs: dict) -> None:
        first = kwargs.get("hidden_states", args[0] if args else None)
        passes[f"batch {first.shape[0]}, {'grad' if torch.is_grad_enabled() else 'no grad'}"] += 1

    policy.velocity, policy.trainable.reference, dist.backward = (
        recorded_velocity,
        recorded_reference,
        recorded_backward,
    )
    hook = policy.trainable.module.register_forward_pre_hook(recorded_pass, with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()
        del policy.velocity, policy.trainable.reference, dist.backward


def replay(recipe: FlowRun, calls: Calls, lora: bool = True) -> None:
    """Make ``calls`` again, bare: each velocity in its recorded state, a backward where the epoch had one
    (through every differentiated output since the last). ``lora=False``: no-grad calls only, adapter off."""
    policy = recipe.policy
    pending: list[Tensor] = []
    for call in calls:
        if isinstance(call, str):
            if lora and pending:
                torch.stack([v.square().mean() for v in pending]).sum().backward()
            pending.clear()
            continue
        if not lora and call.grad:
            continue
        off = call.reference or not lora
        with (
            torch.set_grad_enabled(call.grad),
            cfg_gradient(call.cfg_grad),
            policy.trainable.reference() if off else nullcontext(),
        ):
            v = policy.velocity(call.x, call.sigma, call.cond)
        if v.requires_grad:
            pending.append(v)
    recipe.optimizer.zero_grad(set_to_none=True)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, float]:
    """Wall-clock and process CPU seconds ``fn`` takes (the device synchronised on both sides). On a CPU,
    CPU time is what other processes' load inflates least: on a shared machine compare the ``*_cpu``
    figures (on a GPU they only count the host's work)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, time.process_time() - cpu


class Arm:
    """One recipe under measurement: its epochs, each followed later by the replay of its calls."""

    def __init__(self, name: str, overrides: list[str]) -> None:
        self.name, self.overrides = name, overrides
        self.recipe = compose_recipe(overrides)
        self.epoch = 0
        self.calls: Calls = []
        self.passes: Counter = Counter()
        self.epoch_s: list[tuple[float, float]] = []  # (wall, cpu) per measured epoch
        self.calls_s: list[tuple[float, float]] = []
        self.in_epoch_calls_s: list[float] = []  # wall seconds inside the epoch's own model calls

    def run_epoch(self, progress: Progress, measured: bool) -> None:
        self.calls, self.passes, in_calls = [], Counter(), [0.0]
        with recording(self.recipe, self.calls, self.passes, in_calls):
            seconds = timed(lambda: run_epoch(self.recipe, self.epoch, progress), self.recipe.device)
        self.epoch += 1
        if measured:
            self.epoch_s.append(seconds)
            self.in_epoch_calls_s.append(in_calls[0])

    def replay(self, measured: bool) -> None:
        seconds = timed(lambda: replay(self.recipe, self.calls), self.recipe.device)
        if measured:
            self.calls_s.append(seconds)

    def lora_share(self, repeats: int = 3) -> float | None:
        """Share of the epoch's no-grad forwards (rollout, reference) that the LoRA adapter costs (CPU time
        on a CPU, wall clock on a GPU)."""
        if not self.recipe.cfg.model.lora.enabled:
            return None
        nograd = [c for c in self.calls if isinstance(c, Call) and not c.grad]
        device = self.recipe.device
        clock = 1 if device.type == "cpu" else 0
        with_lora, without = [], []
        for _ in range(repeats):
            with_lora.append(timed(lambda: replay(self.recipe, nograd), device)[clock])
            without.append(timed(lambda: replay(self.recipe, nograd, lora=False), device)[clock])
        return round(1 - statistics.median(without) / statistics.median(with_lora), 4)

    def summary(self) -> dict[str, Any]:
        velocity = [c for c in self.calls if isinstance(c, Call)]
        cache = getattr(self.recipe.policy.encode, "cache", None)
        epoch_s, calls_s = (statistics.median(s for s, _ in t) for t in (self.epoch_s, self.calls_s))
        epoch_cpu, calls_cpu = (statistics.median(c for _, c in t) for t in (self.epoch_s, self.calls_s))
        in_epoch = {}
        if self.recipe.device.type == "cpu":
            in_epoch_s = statistics.median(self.in_epoch_calls_s)
            in_epoch = {
                "model_calls_in_epoch_s": round(in_epoch_s, 4),
                "outside_calls_share": round(1 - in_epoch_s / epoch_s, 4),
                "calls_in_epoch_vs_replay": round(in_epoch_s / calls_s, 4),
            }
        return {
            "overrides": self.overrides,
            "epoch_s": round(epoch_s, 4),
            "model_calls_s": round(calls_s, 4),
            "overhead_ratio": round(epoch_s / calls_s, 4),
            "epoch_cpu_s": round(epoch_cpu, 4),
            "model_calls_cpu_s": round(calls_cpu, 4),
            "overhead_ratio_cpu": round(epoch_cpu / calls_cpu, 4),
            **in_epoch,
            "epoch_s_all": [round(s, 4) for s, _ in self.epoch_s],
            "model_calls_s_all": [round(s, 4) for s, _ in self.calls_s],
            "calls_per_epoch": {
                "no_grad_forwards": sum(not c.grad for c in velocity),
                "grad_forwards": sum(c.grad for c in velocity),
                "reference_forwards": sum(c.reference for c in velocity),
                "backwards": self.calls.count(BACKWARD),
                "transformer_passes": dict(self.passes),
            },
            "lora_share_of_no_grad_forwards": self.lora_share(),
            "prompt_cache": None if cache is None else {"hits": cache.hits, "misses": cache.misses},
        }


def measure(
    geometry: str, overrides: list[str], baseline: list[str] | None, repeats: int, warmup: int | None
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rlgen-overhead-") as workdir:
        common = [*overrides_for(geometry, Path(workdir)), *overrides]
        arms = [Arm("recipe", common)]
        if baseline is not None:
            arms.append(Arm("baseline", [*common, *baseline]))
        warmup = default_warmup(arms[0].recipe) if warmup is None else warmup
        with Progress(enabled=False) as progress:
            for arm in arms:  # first calls allocate and pick kernels; the prompt cache fills
                for _ in range(max(warmup, 1)):
                    arm.run_epoch(progress, measured=False)
                arm.replay(measured=False)
            for _ in range(repeats):  # A/B/A/B: drifts in machine load hit both alike
                for arm in arms:
                    arm.run_epoch(progress, measured=True)
                for arm in arms:
                    arm.replay(measured=True)
        result: dict[str, Any] = {"geometry": geometry, "repeats": repeats, "warmup_epochs": warmup}
        result |= {arm.name: arm.summary() for arm in arms}
        for arm in arms:
            arm.recipe.logger.close()
    problems = [
        f"{arm.name}: {key} {result[arm.name][key]} < 1 — the epoch contains every replayed call, so the "
        "machine's load changed between them; re-run on an idle machine"
        for arm in arms
        for key in RATIOS[arm.recipe.device.type == "cpu"]
        if result[arm.name][key] < 1
    ]
    if baseline is not None:
        a, b = arms
        pairs = list(zip(a.epoch_s, b.epoch_s))
        result["epoch_vs_baseline"] = round(statistics.median(x[0] / y[0] for x, y in pairs), 4)
        result["epoch_vs_baseline_cpu"] = round(statistics.median(x[1] / y[1] for x, y in pairs), 4)
    result["valid"] = not problems
    result["problems"] = problems
    result["overhead_ratio"] = result["recipe"]["overhead_ratio"]
    return result


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", choices=GEOMETRIES, default="sd3_cfg")
    parser.add_argument("--repeats", type=int, default=5, help="measured epoch/replay pairs per recipe")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured epochs first (default: a pass)")
    parser.add_argument(
        "--baseline",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="overrides of a baseline recipe measured side by side (repeatable)",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of both recipes")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    return measure(args.geometry, args.overrides, args.baseline, args.repeats, args.warmup)


if __name__ == "__main__":
    result = main(sys.argv[1:])
    print(json.dumps(result))
    sys.exit(0 if result["valid"] else 1)
