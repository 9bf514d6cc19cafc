"""Where one Flow-GRPO epoch spends its time, phase by phase, under ``torch.profiler``.

Profiles one post-warm-up epoch of each geometry (``_geometry.py``: the tiny-SD3 CFG geometry loaded
through the real loader, and the ShapesEval default) and prints JSON per geometry: seconds and share of
the epoch in each phase — transformer forward, backward, optimizer, text encoders, VAE, SDE step maths,
objective, advantages, reward, data, logging — and ``rest`` (whatever no phase covers), plus the
operators that make up the rest. Phases are ``record_function`` labels the script wraps around the
recipe's own calls; each phase counts its own time only (a transformer call inside a rollout is
transformer time, not SDE time). Scoring (``algo.reward_scoring``) runs in line on a CPU with local
rewards, where ``reward`` is its time; on a worker thread while the next batch samples (an accelerator, a
served reward, or ``thread``), ``reward`` is the main thread's wait for it. ``scoring_s`` is the wall
clock spent scoring, on whichever thread.

    python benchmarks/profile_epoch.py [--geometry sd3_cfg|shapes|all] [--warmup 2] [key=value …]

Absolute times need an idle machine; the shares are what this script is for.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from _common import compose_recipe
from _geometry import GRPO_GEOMETRIES, default_warmup, overrides_for, run_epoch
from torch.profiler import ProfilerActivity, profile, record_function

from rlgen_cli.recipes import common, flow_grpo, flow_run, reward_scoring
from rlgen_cli.recipes.flow_run import FlowRun
from rlgen_cli.training.reporting.progress import Progress

PREFIX = "phase:"
EPOCH = "epoch"
PHASES = (
    "transformer_forward", "backward", "optimizer", "text_encoders", "vae", "sde_step", "objective",
    "advantages", "reward", "data", "logging",
)  # fmt: skip


MODULE_PHASES = {
    flow_grpo: {"rollout": "sde_step", "recompute_step": "sde_step", "recompute_steps": "sde_step", "euler": "sde_step",
                "sample_generators": "data", "plan_for": "data", "combine_rewards": "advantages",
                "best_and_worst": "advantages", "nonzero_advantage_rows": "advantages",
                "grpo_loss": "objective", "guard_loss": "objective",
                "summarise": "logging", "console_line": "logging"},
    flow_run: {"optimizer_step": "optimizer", "sources_of": "data", "log_epoch": "logging", "save_grid": "logging"},
    common: {"reduce_over_ranks": "logging"},
}  # fmt: skip
"""The recipe functions each phase label wraps, by the module the recipe looks them up in."""
CLASS_PHASES = {
    reward_scoring.RewardScoring: {"submit": "reward", "results": "reward"},
    flow_grpo.Rollouts: {"select": "data"},
}


def labelled(label: str, fn: Callable) -> Callable:
    """``fn`` inside a ``record_function`` range named ``phase:<label>``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(PREFIX + label):
            return fn(*args, **kwargs)

    return wrapper


def clocked(clock: dict[str, float], key: str, fn: Callable) -> Callable:
    """``fn``, adding the seconds each call takes to ``clock[key]`` (for threads the profiler misses)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[key] = clock.get(key, 0.0) + time.perf_counter() - start

    return wrapper


@contextmanager
def phase_labels(run: FlowRun) -> Iterator[dict[str, float]]:
    """Wrap the recipe's calls in phase labels for the duration of the block (this process only); yields
    the seconds spent scoring on any thread (``scoring``)."""
    instance = {
        run.policy: {"encode": "text_encoders", "velocity": "transformer_forward", "decode": "vae",
                     "noise": "data"},
        run.dist: {"backward": "backward"},
        run.sampler: {"indices_for_epoch": "data"},
        run.logger: {"log": "logging", "log_images": "logging"},
    }  # fmt: skip
    classes = {**CLASS_PHASES, type(run.train_set): {"__getitem__": "data"}}
    saved: list[tuple[Any, str, Any, bool]] = []
    for owner, names in [*instance.items(), *MODULE_PHASES.items(), *classes.items()]:
        for name, label in names.items():
            had_own = name in vars(owner)
            original = getattr(owner, name)
            saved.append((owner, name, vars(owner).get(name) if had_own else None, had_own))
            setattr(owner, name, labelled(label, original))
    clock: dict[str, float] = {}
    score = flow_run.score  # maybe called on the scorer thread, which the profiler does not follow
    flow_run.score = clocked(clock, "scoring", score)
    try:
        yield clock
    finally:
        flow_run.score = score
        for owner, name, original, had_own in reversed(saved):
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def exclusive_times(events: Any) -> tuple[dict[int, dict[str, float]], dict[str, int], Counter]:
    """Per thread and phase label, the label's own microseconds (minus the phase ranges nested in it);
    call counts per label; the self time of the operators directly under ``epoch`` (no phase covers them)."""
    spans = defaultdict(list)  # thread -> [(start, end, name, self_us)]
    for e in events:
        spans[e.thread].append((e.time_range.start, e.time_range.end, e.name, e.self_cpu_time_total))
    own: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    calls: dict[str, int] = defaultdict(int)
    rest_ops: Counter = Counter()
    for thread, items in spans.items():
        items.sort(key=lambda s: (s[0], -s[1]))
        stack: list[list] = []  # open labels: [end, label, own_us]
        for start, end, name, self_us in items:
            while stack and stack[-1][0] <= start:
                _, label, us = stack.pop()
                own[thread][label] += us
            if name.startswith(PREFIX):
                if stack:
                    stack[-1][2] -= end - start
                stack.append([end, name[len(PREFIX) :], end - start])
                calls[name[len(PREFIX) :]] += 1
            elif stack and stack[-1][1] == EPOCH:
                rest_ops[name] += self_us
        while stack:
            _, label, us = stack.pop()
            own[thread][label] += us
    return own, calls, rest_ops


def profile_geometry(geometry: str, overrides: list[str], warmup: int | None, repeats: int) -> dict[str, Any]:
    """Warm up, time ``repeats`` plain epochs, then profile one more."""
    with tempfile.TemporaryDirectory(prefix="rlgen-profile-") as workdir:
        recipe = compose_recipe([*overrides_for(geometry, Path(workdir)), *overrides])
        try:
            return _measure(recipe, geometry, warmup, repeats)
        finally:
            recipe.logger.close()


def _measure(recipe: FlowRun, geometry: str, warmup: int | None, repeats: int) -> dict[str, Any]:
    warmup = default_warmup(recipe) if warmup is None else warmup
    epoch = 0
    plain = []
    with Progress(enabled=False) as progress:
        for _ in range(warmup):
            run_epoch(recipe, epoch, progress)
            epoch += 1
        for _ in range(repeats):
            start = time.perf_counter()
            run_epoch(recipe, epoch, progress)
            plain.append(time.perf_counter() - start)
            epoch += 1
        activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if recipe.device.type == "cuda" else []
        )
        cache = getattr(recipe.policy.encode, "cache", None)
        hits, misses = (cache.hits, cache.misses) if cache is not None else (0, 0)
        with phase_labels(recipe) as clock, profile(activities=activities) as prof:
            start = time.perf_counter()
            with record_function(PREFIX + EPOCH):
                run_epoch(recipe, epoch, progress)
            if recipe.device.type == "cuda":
                torch.cuda.synchronize(recipe.device)
            profiled_s = time.perf_counter() - start
    own, calls, rest_ops = exclusive_times(prof.events())
    main_thread = next(thread for thread, labels in own.items() if EPOCH in labels)
    main = own.pop(main_thread)
    total_s = sum(main.values()) / 1e6  # the epoch's range: its own time plus every phase's
    seconds = {phase: main.get(phase, 0.0) / 1e6 for phase in PHASES}  # reward: the wait for the scorer
    seconds["rest"] = main[EPOCH] / 1e6
    scoring_s = clock.get("scoring", 0.0)
    return {
        "geometry": geometry,
        "epoch_s_median": round(statistics.median(plain), 4) if plain else None,
        "profiled_epoch_s": round(profiled_s, 4),
        "share": {k: round(v / total_s, 4) for k, v in seconds.items()},
        "seconds": {k: round(v, 4) for k, v in seconds.items()},
        "calls": {k: v for k, v in sorted(calls.items()) if k != EPOCH},
        "scoring_s": round(scoring_s, 4),
        "prompt_cache": None
        if cache is None
        else {"hits": cache.hits - hits, "misses": cache.misses - misses},
        "warmup_epochs": warmup,
        "rest_top_ops_s": {k: round(v / 1e6, 4) for k, v in rest_ops.most_common(8)},
    }


def main(argv: list[str]) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", choices=[*GRPO_GEOMETRIES, "all"], default="all")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured epochs first (default: a pass)")
    parser.add_argument("--repeats", type=int, default=3, help="plain (unprofiled) epochs timed")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied after the geometry's")
    args = parser.parse_args(argv)
    geometries = GRPO_GEOMETRIES if args.geometry == "all" else (args.geometry,)
    torch.manual_seed(0)
    return [profile_geometry(g, args.overrides, args.warmup, args.repeats) for g in geometries]


if __name__ == "__main__":
    for result in main(sys.argv[1:]):
        print(json.dumps(result))
