"""ShapesEval: strict and lenient test accuracy vs training wall-clock, per algorithm, from one base.

Every run starts from the shipped base (``model=shapes_base``) with the same seed and the same epoch
geometry as ``rlgen train`` (16 prompts × 8 samples, two optimizer steps of 64 samples per epoch, full
fine-tuning, a constant lr 3e-5 — the default run's decay is sized to its own epochs —, evaluated
through an EMA of the weights with decay 0.95), and trains for the same budget of training minutes
through the CLI (``time_limit_minutes`` with ``time_limit_counts=training``: evaluations do not eat into
it, so every run trains at least ``--minutes``):

* ``grpo``       Flow-GRPO: SDE at every step, every step trained;
* ``grpo_fast``  Flow-GRPO-Fast: SDE in a random 2-step window (``experiment=shapes_grpo_fast``);
* ``mix_grpo``   MixGRPO: a sliding 4-step SDE window;
* ``dance``      DanceGRPO-style: shared initial noise per group, a random 60 % subset of steps;
* ``dpo``        Flow-DPO on the best-vs-worst sample of each group;
* ``nft``        DiffusionNFT as the default ``rlgen train`` runs it (``algo=nft_shapes``): ODE rollouts
  (DPM-Solver++ 2M) from the old policy, positive / negative implicit policies on 2 forward-noised σ per
  sample (no log-probabilities);
* ``awm``        Advantage Weighted Matching: the flow-matching loss weighted by the advantage;
* ``dgpo``       DGPO: group-level DPO on 4 forward-noised σ per group (shared σ and ε), ODE rollouts;
* ``grpo_partial``  Flow-GRPO on plain GenEval partial credit (no per-object credit, no penalty): objects
  of other classes are free, but duplicates of a requested shape are not, so clutter only drifts in;
* ``grpo_lenient``  Flow-GRPO-Fast on GenEval's binary accuracy (``mode=lenient``), which ignores
  duplicates and other classes: reward hacking — lenient accuracy rises while strict accuracy falls and
  extra objects multiply (docs/guard.md measures it).

* ``gdpo`` / ``gdpo_sum``  DiffusionNFT (as ``nft``) on two rewards, strict accuracy and JPEG compressibility
  at weight 0.25, aggregated by GDPO (each reward normalised in its group) or summed then normalised; the
  summary adds the evaluation images' JPEG size (``jpeg_kb``);
* ``grpo_gardo``  ``grpo_fast`` with GARDO's uncertainty-gated KL (β 0.04; JPEG compressibility, at weight 0,
  the auxiliary reward) and a reference refreshed every 16 epochs (diversity shaping needs a CLIP).

The default ``--runs`` are the five the comparison needs plus the hacked run; the others run when named.

Each run is evaluated before training and every few epochs (ODE sampling of the test prompts, the same
noise every time). Time is the cumulative training seconds (``time/epoch``), evaluations excluded.
``--seeds N`` repeats every algorithm with seeds 0 … N−1, or S … S+N−1 with ``--first-seed S`` (the seed
draws the prompts, the noise and the evaluation noise, so the base itself reads differently per seed):
the plot draws each algorithm's change from its own base, the mean over seeds as a line and the spread
(min to max) as a band, and the summary gives the mean change with its min and max.

``--jobs N`` trains N runs side by side, each on cores / N threads (``OMP_NUM_THREADS``), for machines with
cores to spare; the budget is then per run on its share, and the plot says so. On a 2-core machine it
gains nothing: two one-thread runs took 12 s an epoch each against 5.3 s for one two-thread run.

``--merge A.json B.json …`` trains nothing: it draws the runs of several earlier results in one plot and
one JSON, for a comparison that does not fit one sitting (other arms, or other seeds of the same arms).
Their budget, threads per run and jobs must be equal and each arm's seed must come from one file; the
JSON lists its sources.

    python benchmarks/shapes.py [--minutes 5] [--seeds 2] [--hack-minutes 5] [--jobs 1] [--runs grpo_fast,grpo_partial] [--out benchmarks/results]
    python benchmarks/shapes.py --runs awm --first-seed 1 --out later      # seed 1 only, another day
    python benchmarks/shapes.py --merge docs/images/shapes_benchmark.json later/shapes.json --out merged

Writes ``shapes.json`` and ``shapes.png`` under ``--out`` and prints the JSON summary on one line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

CLI = "import sys; from rlgen_cli.cli import main; sys.exit(main())"
COMMON = [  # the held-out split is not part of the comparison: keep each run's budget for training
    "experiment=shapes_grpo_fast", "progress=false", "images_every=0", "save_every=0", "eval_heldout=null",
]  # fmt: skip
GEOMETRY = [
    "algo.prompts_per_epoch=16", "algo.group_size=8", "algo.sample_batch_size=64", "algo.train_batch_size=64",
    "algo.gradient_accumulation_steps=1", "algo.lr=3e-5", "algo.kl_weight=0.0",
    "algo.ema.enabled=true", "algo.ema.decay=0.95", "algo.ema.update_every=1", "algo.lr_schedule=constant",
]  # fmt: skip
NFT = ["algo=nft_shapes", "algo.lr_schedule=constant"]  # the default run's algorithm
TWO_REWARDS = [  # docs/shapes.md "Two rewards": strict accuracy and JPEG compressibility at a quarter of its weight
    "reward.kwargs.shapes_geneval.mode=strict", "+reward.weights.jpeg_compressibility=0.25",
]  # fmt: skip
GARDO = [  # the KL on the samples the auxiliary reward disagrees on, the reference refreshed every 16 epochs;
    # diversity shaping needs a CLIP (algo.gardo.feature_model), which this machine cannot download
    "algo.kl_weight=0.04", "+reward.weights.jpeg_compressibility=0", "algo.gardo.kl_gate=true",
    "algo.gardo.proxy_reward=shapes_geneval", "algo.gardo.auxiliary_rewards=[jpeg_compressibility]",
    "algo.gardo.refresh_every=16",
]  # fmt: skip
RUNS: dict[str, list[str]] = {
    "grpo": ["algo=grpo", *GEOMETRY, "algo.clip_range=1e-3"],
    "grpo_fast": ["algo.lr_schedule=constant"],  # the default experiment, at a constant lr like the others
    "mix_grpo": ["algo=mix_grpo", *GEOMETRY, "algo.clip_range=1e-3", "algo.window.shift_every=5"],
    "dance": ["algo=dance", *GEOMETRY, "algo.clip_range=1e-3", "sampler=dance"],
    "dpo": ["algo=dpo", *(o for o in GEOMETRY if "gradient_accumulation" not in o)],  # a step per σ: refused
    "nft": NFT,
    "awm": ["algo=awm", *GEOMETRY],
    "dgpo": ["algo=dgpo", *GEOMETRY],
    "gdpo": [*NFT, *TWO_REWARDS, "reward.aggregation=gdpo"],
    "gdpo_sum": [*NFT, *TWO_REWARDS, "reward.aggregation=sum_then_normalize"],
    "grpo_gardo": ["algo.lr_schedule=constant", *GARDO],
    "grpo_partial": [
        "algo=grpo",
        *GEOMETRY,
        "algo.clip_range=1e-3",
        "reward.kwargs.shapes_geneval.mode=partial",
    ],
    "grpo_lenient": ["algo.lr_schedule=constant", "reward.kwargs.shapes_geneval.mode=lenient"],
}
DEFAULT_RUNS = ("grpo", "grpo_fast", "mix_grpo", "dpo", "grpo_partial", "grpo_lenient")
HACKABLE = ("grpo_partial", "grpo_lenient")
"""Runs on a reward a policy can game, drawn dashed."""
DEMO = "grpo_lenient"
"""The reward-hacking demonstration: it shows a direction (lenient up, strict down, extra objects up), not a
rank, so it runs once (seed 0), first, on its own ``--hack-minutes`` (it games the reward within 20–40
epochs, docs/guard.md); the comparison's seeds and minutes go to the others."""
METRICS = {
    "strict": "eval/reward/shapes_geneval/strict/mean",
    "lenient": "eval/reward/shapes_geneval/accuracy/mean",
    "extra_per_image": "eval/reward/shapes_geneval/n_extra/mean",
}
OPTIONAL_METRICS = {"jpeg_kb": "eval/reward/jpeg_compressibility/jpeg_kb/mean"}
"""Logged by the runs that score JPEG size (the two-reward arms, GARDO's auxiliary reward)."""


def train(
    name: str, seed: int, overrides: list[str], minutes: float, eval_every: int, root: Path, threads: int
) -> list[dict]:
    """One CLI run on ``threads`` intra-op threads; returns its metrics rows."""
    run = root / f"{name}_seed{seed}"
    argv = [
        sys.executable, "-c", CLI, "train", *COMMON, *overrides, f"seed={seed}", f"time_limit_minutes={minutes}",
        "time_limit_counts=training", "epochs=100000", f"eval_every={eval_every}", f"hydra.run.dir={run}",
    ]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def curve(rows: list[dict]) -> dict[str, list[float]]:
    """Evaluation points against cumulative training minutes (the before-training one at 0)."""
    evaluations = [row for row in rows if METRICS["strict"] in row]
    logged = {k: key for k, key in OPTIONAL_METRICS.items() if evaluations and key in evaluations[0]}
    metrics = METRICS | logged
    points: dict[str, list[float]] = {"minutes": [], **{k: [] for k in metrics}}
    elapsed = 0.0
    for row in sorted(rows, key=lambda r: r["step"]):
        elapsed += row.get("time/epoch", 0.0)
        if METRICS["strict"] in row:
            points["minutes"].append(round(elapsed / 60, 3))
            for short, key in metrics.items():
                points[short].append(round(row[key], 4))
    return points


def gain_band(seeds: dict[int, dict[str, list[float]]], metric: str) -> tuple[list[float], ...]:
    """Each seed's change from its own base, interpolated onto the union of their evaluation minutes
    (past a seed's last evaluation its last value holds): ``(minutes, mean, low, high)`` over seeds."""
    import numpy as np

    grid = sorted({m for points in seeds.values() for m in points["minutes"]})
    gains = np.array(
        [
            np.interp(grid, points["minutes"], np.array(points[metric]) - points[metric][0])
            for points in seeds.values()
        ]
    )
    return grid, gains.mean(0).tolist(), gains.min(0).tolist(), gains.max(0).tolist()


def plot(curves: dict[str, dict[int, dict[str, list[float]]]], out: Path, clock: str = "2 CPU cores") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"strict": "strict accuracy (headline)", "lenient": "lenient (GenEval) accuracy",
              "extra_per_image": "extra objects per image"}  # fmt: skip
    palette = plt.get_cmap("tab20").colors
    colours = dict(zip(curves, palette[::2] + palette[1::2], strict=False))  # the ten dark ones first
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5), gridspec_kw={"width_ratios": [3, 3, 3, 2]})
    for ax, (metric, title) in zip(axes, titles.items()):
        for name, seeds in curves.items():
            grid, mean, low, high = gain_band(seeds, metric)
            ax.plot(
                grid,
                mean,
                marker="o",
                ms=3,
                color=colours[name],
                label=f"{name} ({len(seeds)} seeds)",
                linestyle="--" if name in HACKABLE else "-",
            )
            ax.fill_between(grid, low, high, color=colours[name], alpha=0.15, linewidth=0)
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_title(f"{title}: change from the base")
        ax.set_xlabel(f"training minutes ({clock})")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    final_strict_panel(axes[3], curves, colours)
    fig.suptitle("ShapesEval test set: RL from the same base and budget — mean over seeds, band = min…max")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def final_strict_panel(ax, curves: dict[str, dict[int, dict[str, list[float]]]], colours: dict) -> None:
    """Each arm's strict change at the end of its budget, best on top: the mean as a bar, every seed as
    a dot (the spread the verdict has to beat)."""
    finals = {
        name: [100 * (p["strict"][-1] - p["strict"][0]) for p in seeds.values()]
        for name, seeds in curves.items()
    }
    order = sorted(finals, key=lambda name: sum(finals[name]) / len(finals[name]))
    for row, name in enumerate(order):
        ax.barh(row, sum(finals[name]) / len(finals[name]), color=colours[name], alpha=0.6)
        ax.plot(finals[name], [row] * len(finals[name]), "k.", ms=5)
    ax.set_yticks(range(len(order)), order, fontsize=8)
    ax.axvline(0.0, color="grey", linewidth=0.8)
    ax.set_xlabel("strict change at the budget (points)")
    ax.set_title("where each arm ends (dots: seeds)")
    ax.grid(alpha=0.3, axis="x")


def summary(seeds: dict[int, dict[str, list[float]]]) -> dict[str, float]:
    """Per metric: the mean over seeds of before, after and the change, with the change's min and max."""
    runs = list(seeds.values())
    out: dict[str, float] = {
        "seeds": len(runs),
        "minutes": round(sum(p["minutes"][-1] for p in runs) / len(runs), 3),
    }
    for metric in [*METRICS, *(m for m in OPTIONAL_METRICS if all(m in p for p in runs))]:
        deltas = [p[metric][-1] - p[metric][0] for p in runs]
        out |= {
            f"{metric}_before": round(sum(p[metric][0] for p in runs) / len(runs), 4),
            f"{metric}_after": round(sum(p[metric][-1] for p in runs) / len(runs), 4),
            f"{metric}_delta": round(sum(deltas) / len(deltas), 4),
            f"{metric}_delta_min": round(min(deltas), 4),
            f"{metric}_delta_max": round(max(deltas), 4),
        }
    return out


def clock(jobs: int, threads: int) -> str:
    """What a training minute means in this benchmark: the cores behind each run."""
    cores = f"{threads} CPU core{'s' if threads > 1 else ''}"
    return cores if jobs == 1 else f"{cores} per run, {jobs} runs side by side"


def write(curves: dict[str, dict[int, dict[str, list[float]]]], settings: dict, out: Path) -> dict:
    """Write ``shapes.json`` and ``shapes.png`` under ``out`` for the runs so far (``settings``: how they
    ran); returns the JSON."""
    done = {name: seeds for name, seeds in curves.items() if seeds}
    result = {"benchmark": "shapes", **settings, "summary": {name: summary(seeds) for name, seeds in done.items()},
              "curves": done}  # fmt: skip
    (out / "shapes.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    plot(done, out / "shapes.png", clock(settings["jobs"], settings["threads_per_run"]))
    return result


MERGE_MUST_AGREE = ("minutes_per_run", "threads_per_run", "jobs")
"""What makes two results' training minutes the same minutes."""


def merge(paths: list[Path]) -> tuple[dict[str, dict[int, dict[str, list[float]]]], dict]:
    """The curves of several results and the settings they share; raises SystemExit naming the file and
    the key when their budgets differ or an arm is in two files."""
    results = [(path, json.loads(path.read_text(encoding="utf-8"))) for path in paths]
    first_path, first = results[0]
    curves: dict[str, dict[int, dict[str, list[float]]]] = {}
    for path, result in results:
        for key in MERGE_MUST_AGREE:
            if result[key] != first[key]:
                raise SystemExit(
                    f"{path}: {key}={result[key]} but {first_path} has {first[key]}; merge equal budgets"
                )
        for name, seeds in result["curves"].items():
            for seed, points in seeds.items():
                if int(seed) in curves.setdefault(name, {}):
                    raise SystemExit(
                        f"{path}: {name} seed {seed} is in an earlier file too; give each run once"
                    )
                curves[name][int(seed)] = points
    hack = next((r["hack_run"] for _, r in results if DEMO in r["curves"]), first["hack_run"])
    settings = {key: first[key] for key in MERGE_MUST_AGREE} | {
        "seeds": max((len(seeds) for name, seeds in curves.items() if name != DEMO), default=1), "hack_run": hack,
        "wall_s": round(sum(r["wall_s"] for _, r in results), 1),
        "sources": [{"file": path.name, "arms": sorted(r["curves"]), "wall_s": r["wall_s"]} for path, r in results],
    }  # fmt: skip
    return curves, settings


def main() -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="training budget per algorithm")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per algorithm (S … S+N−1)")
    parser.add_argument("--first-seed", type=int, default=0, help="S, the first seed")
    parser.add_argument("--eval-every", type=int, default=10, help="epochs between evaluations")
    parser.add_argument(
        "--runs", default=",".join(DEFAULT_RUNS), help=f"comma-separated subset of {','.join(RUNS)}"
    )
    parser.add_argument(
        "--hack-minutes", type=float, default=None, help=f"{DEMO}'s budget (default: --minutes), seed 0 only"
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs trained side by side, sharing the cores")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--merge", type=Path, nargs="+", help="draw these results together; train nothing")
    args = parser.parse_args()
    if args.merge:
        args.out.mkdir(parents=True, exist_ok=True)
        return write(*merge(args.merge), args.out)
    names = [n for n in args.runs.split(",") if n]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"unknown runs {unknown}; choose from {list(RUNS)}")
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: give at least 1")
    if args.first_seed < 0:
        parser.error(f"--first-seed {args.first_seed}: give 0 or more")
    cores = os.cpu_count() or 1
    if not 1 <= args.jobs <= cores:
        parser.error(f"--jobs {args.jobs}: give 1 … {cores} (this machine's cores)")
    threads = cores // args.jobs
    started = time.perf_counter()
    curves: dict[str, dict[int, dict[str, list[float]]]] = {name: {} for name in names}
    args.out.mkdir(parents=True, exist_ok=True)
    if args.hack_minutes is None:
        args.hack_minutes = args.minutes
    # the demonstration first, then seed-major: a run cut short keeps whole seeds
    runs = [(DEMO, 0, args.hack_minutes)] if DEMO in names else []
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    runs += [(name, seed, args.minutes) for seed in seeds for name in names if name != DEMO]
    with tempfile.TemporaryDirectory(prefix="rlgen-shapes-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        pending = {
            pool.submit(train, name, seed, RUNS[name], minutes, args.eval_every, Path(tmp), threads): (
                name,
                seed,
            )
            for name, seed, minutes in runs
        }
        for future in as_completed(pending):  # written after every run: one cut short keeps the rest
            name, seed = pending[future]
            curves[name][seed] = curve(future.result())
            settings = {
                "minutes_per_run": args.minutes, "seeds": args.seeds, "jobs": args.jobs,
                "hack_run": {"name": DEMO, "seeds": 1, "minutes": args.hack_minutes},
                "threads_per_run": threads, "wall_s": round(time.perf_counter() - started, 1),
            }  # fmt: skip
            result = write(curves, settings, args.out)
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
