"""ShapesQA: R1-VL's claim on two CPU cores — StepGRPO vs outcome-only GRPO vs more SFT, at equal training minutes.

Every arm starts from the same SFT'd base (``builtin:shapesqa_sft``, experiment=shapesqa_sft's result) with
the same seeds, and trains through the CLI until its cumulative training seconds (``time/rollout`` +
``time/update`` of the RL recipe, ``time/epoch`` of SFT; evaluations excluded) pass ``--minutes``:

* ``stepgrpo``  experiment=shapesqa_stepgrpo: R1-VL's reward, accuracy + 0.1·StepRAR + StepRVR;
* ``grpo``      experiment=shapesqa_grpo: the same run on answer accuracy alone (outcome reward);
* ``sft``       experiment=shapesqa_sft continued from the SFT'd base: more supervised epochs on the chains.

The learning rate is constant in every arm, without warm-up (a run stopped by the clock has no epoch count to decay
over). Each run saves a checkpoint every epoch (the last two kept) and is stopped at the budget; the last
checkpoint is then evaluated with ``rlgen eval`` (near-greedy decoding) on the test split and the held-out
split, as is the base once per seed: accuracy overall and per question type (count, colour, relation), the
format rate (the share of responses StepRVR accepts: all four headers, steps in order, the answer after the
last step) and the mean completion length in characters.

    nice -n 10 python benchmarks/shapesqa.py [--minutes 15] [--seeds 2] [--arms stepgrpo,grpo,sft] [--questions 0] [--out benchmarks/results]

Writes ``shapesqa.json`` and ``shapesqa.png`` under ``--out`` and prints the JSON summary on one line. The
claim (docs/vlm.md) needs ``--minutes 15 --seeds 2`` on idle cores: 3 arms × 2 seeds × 15 training minutes
plus the evaluations, about 2 hours on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

CLI = "import sys; from rlgen_cli.cli import main; sys.exit(main())"
ARMS = {
    "stepgrpo": ["experiment=shapesqa_stepgrpo"],
    "grpo": ["experiment=shapesqa_grpo"],
    "sft": ["experiment=shapesqa_sft", "model.path=builtin:shapesqa_sft"],
}
SPLITS = {"test": "builtin:shapesqa/test.jsonl", "heldout": "builtin:shapesqa/heldout.jsonl"}
TYPES = ("count", "colour", "relation")
POLL_S = 2.0


def _interruptible() -> None:
    """In the child: Ctrl-C's default handling back, which a shell's ``cmd &`` or nohup switches off."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _rlgen(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [sys.executable, "-c", CLI, *args]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, preexec_fn=_interruptible)


def training_seconds(run: Path, epochs: int | None = None) -> float:
    """Cumulative training seconds logged so far, or over the first ``epochs`` (evaluations excluded)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return 0.0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:epochs]
    return sum(_epoch_seconds(row) for row in rows)


def _epoch_seconds(row: dict) -> float:
    """An epoch's training seconds: ``time/epoch`` where the recipe logs it, else rollout + update."""
    if "time/epoch" in row:
        return row["time/epoch"]
    return row.get("time/rollout", 0.0) + row.get("time/update", 0.0)


def train(arm: str, seed: int, minutes: float, run: Path) -> tuple[Path, float, int]:
    """Train ``arm`` until its training seconds pass the budget (the epoch that crosses it completes, as
    the flow recipes' time limit); its last checkpoint, the training seconds up to it, its epochs."""
    overrides = [*ARMS[arm], f"seed={seed}", "epochs=100000", "eval_every=0", "save_every=1", "keep_last=2",
                 "algo.token.lr_schedule=constant", "algo.token.warmup_ratio=0.0"]  # fmt: skip
    process = _rlgen("train", *overrides, "progress=false", f"hydra.run.dir={run}")
    while process.poll() is None and training_seconds(run) < 60 * minutes:
        time.sleep(POLL_S)
    if process.poll() is None:
        process.send_signal(signal.SIGINT)  # the recipe finishes the epoch's bookkeeping and exits
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
    checkpoints = sorted((run / "checkpoints").glob("epoch_*"))
    if not checkpoints:
        raise RuntimeError(f"{arm} seed {seed}: no checkpoint under {run}; see its log")
    epochs = int(checkpoints[-1].name.split("_")[1])
    return checkpoints[-1], training_seconds(run, epochs), epochs


def evaluate(checkpoint: Path | None, split: str, run: Path, questions: int) -> dict[str, float]:
    """Accuracy overall and per type, format rate and mean length of ``rlgen eval`` on ``split``."""
    from rlgen_cli.rewards.r1vl import step_rvr

    args = ["experiment=shapesqa_eval", f"data.test={SPLITS[split]}", f"max_prompts={questions}", "progress=false",
            f"hydra.run.dir={run}"]  # fmt: skip
    if checkpoint is not None:
        args.append(f"checkpoint={checkpoint}")
    if _rlgen("eval", *args).wait() != 0:
        raise RuntimeError(f"rlgen eval {' '.join(args)} failed")
    results = json.loads((run / "results.json").read_text())
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    return {
        "accuracy": results["accuracy"],
        **{t: results["categories"].get(t, {}).get("accuracy", 0.0) for t in TYPES},
        "format_rate": mean(step_rvr(s["response"], mode="strict") for s in samples),
        "length_chars": mean(len(s["response"]) for s in samples),
    }


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(result["arms"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, split in zip(axes, SPLITS, strict=True):
        labels = ["overall", *TYPES]
        width = 0.8 / (len(arms) + 1)
        for k, name in enumerate(["base", *arms]):
            runs = result["base"] if name == "base" else result["arms"][name]
            values = [[r[split][key] for r in runs] for key in ("accuracy", *TYPES)]
            centres = [i + k * width for i in range(len(labels))]
            ax.bar(centres, [mean(v) for v in values], width, label=name)
            for x, v in zip(centres, values, strict=True):
                ax.plot([x, x], [min(v), max(v)], color="black", linewidth=1)
        ax.set_xticks([i + width * len(arms) / 2 for i in range(len(labels))], labels)
        ax.set_title(f"ShapesQA {split} ({result['minutes']} training min, {result['seeds']} seeds)")
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("accuracy (mean; bar: min–max over seeds)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=15.0, help="training minutes per arm and seed")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per arm (0 … N−1)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--questions", type=int, default=0, help="first N questions of each split (0 = all)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    arms = args.arms.split(",")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    result: dict = {"minutes": args.minutes, "seeds": args.seeds, "base": [], "arms": {a: [] for a in arms}}
    with tempfile.TemporaryDirectory(prefix="shapesqa_") as tmp:
        root = Path(tmp)
        for seed in range(args.seeds):
            base = {s: evaluate(None, s, root / f"base{seed}_{s}", args.questions) for s in SPLITS}
            result["base"].append(base)
            for arm in arms:
                checkpoint, seconds, epochs = train(arm, seed, args.minutes, root / f"{arm}{seed}")
                row = {s: evaluate(checkpoint, s, root / f"{arm}{seed}_{s}", args.questions) for s in SPLITS}
                result["arms"][arm].append({**row, "seed": seed, "train_seconds": seconds, "epochs": epochs})
    result["gain_over_base"] = {
        arm: [
            r["test"]["accuracy"] - b["test"]["accuracy"] for r, b in zip(rows, result["base"], strict=True)
        ]
        for arm, rows in result["arms"].items()
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "shapesqa.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    plot(result, args.out / "shapesqa.png")
    print(json.dumps(result["gain_over_base"]))
    return result


if __name__ == "__main__":
    main()
