#!/usr/bin/env python
"""Reproduce the ShapesQA base shipped in rlgen_cli/assets/models/shapesqa_base.

1. Build the random Qwen2-VL of ``rlgen_cli.vlm.shapesqa_base`` (processor, BPE and chat template included)
   and save it to RUN_DIR/random.
2. Write the pretraining set: a caption ("Describe the image." → "2 red squares, 1 blue circle.") and the
   short answer ("### The final answer is: 2") of each of --scenes scenes of ShapesQA's ``pretrain``
   stream (never a train, test or held-out scene), as ShareGPT jsonl.
3. Pretrain it with ``rlgen train algo=vlm_sft`` (masked cross-entropy on the replies, full fine-tuning,
   cosine schedule) for --epochs passes.
4. Run R1-VL's SFT warm-up on it (experiment=shapesqa_sft: the train questions' reasoning chains).
5. Copy both results' weights and processors into the package, as builtin:shapesqa_base and
   builtin:shapesqa_sft (--no-export to skip).

    nice -n 10 python scripts/pretrain_shapesqa_base.py [--run-dir outputs/shapesqa_pretrain]

Chains in R1-VL's format are not pretrained: they are what the warm-up teaches.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from rlgen_cli.vlm.assets import MODEL_ASSETS
from rlgen_cli.vlm.shapesqa_base import pretraining_rows, save_random_base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, default=Path("outputs/shapesqa_pretrain"))
    parser.add_argument("--scenes", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-export", action="store_true", help="keep the shipped weights as they are")
    args = parser.parse_args()

    run_dir = args.run_dir.resolve()
    random_dir = save_random_base(run_dir / "random", seed=args.seed)
    rows = pretraining_rows(args.scenes, run_dir / "images")
    data = run_dir / "pretrain.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    pretrain = [
        "model=shapesqa_base", f"model.path={random_dir}", "algo=vlm_sft", f"data.train={data}",
        f"epochs={args.epochs}", f"algo.lr={args.lr}", f"algo.train_batch_size={args.batch}",
        "algo.token.warmup_ratio=0.03", f"seed={args.seed}", "eval_every=0", f"save_every={args.epochs}",
    ]  # fmt: skip
    base = rlgen_train(pretrain, run_dir / "pretrain")
    sft = rlgen_train(["experiment=shapesqa_sft", f"model.path={base}", f"seed={args.seed}"], run_dir / "sft")
    if args.no_export:
        print(f"pretrained: {base}\nwarmed up: {sft}")
        return
    for weights, name in ((base, "shapesqa_base"), (sft, "shapesqa_sft")):
        shutil.rmtree(MODEL_ASSETS / name, ignore_errors=True)
        shutil.copytree(weights, MODEL_ASSETS / name)
        print(f"exported {weights} -> {MODEL_ASSETS / name}")


def rlgen_train(overrides: list[str], run: Path) -> Path:
    """``rlgen train OVERRIDES`` into ``run``; the weights directory of its last checkpoint."""
    command = [
        sys.executable,
        "-m",
        "rlgen_cli.cli",
        "train",
        *overrides,
        "progress=false",
        f"hydra.run.dir={run}",
    ]
    # one thread: on a 2-core machine two torch threads per process measured 14× slower per step under load
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(command, check=True, env=env)
    return sorted((run / "checkpoints").glob("epoch_*"))[-1] / "weights"


if __name__ == "__main__":
    main()
