"""Scale-out: samples per second with 1 vs 2 processes, and checkpoint save/load seconds vs model size.

Throughput: the same tiny-SD3 GRPO run (same model, prompts, seeds and global batch of
``prompts × group`` samples per epoch) through the CLI — ``launcher=local`` with two accumulated
micro-batches, and ``launcher=accelerate launcher.num_processes=2`` (DDP over gloo on CPUs) with one
micro-batch per rank: the same arithmetic, split. Samples per second = global samples per epoch / the
epoch's rollout + reward + update seconds (``metrics.jsonl``), the median over the epochs after the
first (warm-up); process start-up is reported apart. The single process runs once with torch's default thread
count (every core) and once with one thread (one core, as each of the two workers gets). The two-process
run is repeated under DeepSpeed ZeRO-2 and FSDP2 (``--no-engines`` skips them).

Checkpoints: ``training/checkpoints/checkpoint.py``'s atomic ``save_checkpoint`` and its load (``Checkpoint.state()``
+ the weights) for the tiny SD3's LoRA and full transformer (the policy's own format), then for a
synthetic trainable state of growing size (fp32 weights in safetensors + AdamW moments in the trainer
state, as a real run writes).

    python benchmarks/scaling.py [--epochs 6] [--sizes 1,4,16,64] [--no-engines]   # sizes: millions of params

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

GEOMETRY = [
    "experiment=tiny_cpu", "algo.prompts_per_epoch=4", "algo.group_size=4", "algo.sample_batch_size=4", "algo.train_batch_size=4",
    "model.num_steps=4", "eval_every=0", "images_every=0", "save_every=0", "progress=false",
]  # fmt: skip
CLI = "import sys; from rlgen_cli.cli import main; sys.exit(main())"


# -- throughput ---------------------------------------------------------------------------------------
def train_run(
    name: str, overrides: list[str], epochs: int, root: Path, threads: int | None
) -> dict[str, float]:
    run = root / name
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            CLI,
            "train",
            *GEOMETRY,
            f"epochs={epochs}",
            *overrides,
            f"hydra.run.dir={run}",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steady = sorted(r["time/rollout"] + r["time/reward"] + r["time/update"] for r in rows[1:] or rows)
    epoch_s = steady[len(steady) // 2]  # the median: robust to a neighbour's burst on shared cores
    samples = 4 * 4  # prompts_per_epoch × group_size: the global batch
    return {
        "samples_per_s": round(samples / epoch_s, 3),
        "epoch_s": round(epoch_s, 3),
        "wall_s": round(wall, 1),
        "startup_s": round(
            wall - sum(r["time/rollout"] + r["time/reward"] + r["time/update"] for r in rows), 1
        ),
    }


def throughput(epochs: int, root: Path, engines: bool) -> dict[str, object]:
    single = ["algo.gradient_accumulation_steps=2"]
    runs = {
        "1proc": train_run("one", single, epochs, root, threads=None),
        "1proc_1thread": train_run("one_1t", single, epochs, root, threads=1),
        "2proc": train_run(
            "two", ["launcher=accelerate", "launcher.num_processes=2"], epochs, root, threads=1
        ),
    }
    if engines:  # the same two-process run, with the engine owning reduction, clipping and the step
        for launcher in ("deepspeed_zero2", "fsdp"):
            if launcher.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
                continue
            overrides = [f"launcher={launcher}", "launcher.num_processes=2"]
            runs[f"2proc_{launcher}"] = train_run(launcher, overrides, epochs, root, threads=1)
    return {
        **runs,
        "speedup_2proc_vs_1proc": round(runs["2proc"]["samples_per_s"] / runs["1proc"]["samples_per_s"], 3),
        "speedup_2proc_vs_1thread": round(
            runs["2proc"]["samples_per_s"] / runs["1proc_1thread"]["samples_per_s"], 3
        ),
        "global_batch": 16,
        "cores": os.cpu_count(),
    }


# -- checkpoints --------------------------------------------------------------------------------------
class SyntheticTrainable:
    """``n`` fp32 trained parameters, saved and loaded the way a policy's ``trainable`` does."""

    def __init__(self, n: int) -> None:
        self.weight = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(0)))

    def parameters(self) -> list[torch.nn.Parameter]:
        return [self.weight]

    def save(self, directory: Path) -> None:
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        save_file({"weight": self.weight.detach()}, directory / "weights.safetensors")

    def load(self, directory: Path) -> None:
        from safetensors.torch import load_file

        with torch.no_grad():
            self.weight.copy_(load_file(directory / "weights.safetensors")["weight"])


def adamw_state(params: list[torch.nn.Parameter]) -> dict:
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()  # real moments, real layout
    return optimizer.state_dict()


def time_checkpoint(name: str, trainable, root: Path, repeats: int = 2) -> dict[str, object]:
    """Save / load seconds of a checkpoint of ``trainable`` (``parameters``, ``save``, ``load``) with its
    AdamW state."""
    from omegaconf import OmegaConf

    from rlgen_cli.training.checkpoints.checkpoint import COUNTERS_KEY, OPTIMIZER_KEY, save_checkpoint

    params = trainable.parameters()
    state = {OPTIMIZER_KEY: adamw_state(params), COUNTERS_KEY: {"epoch": 1, "global_step": 1}}
    config = OmegaConf.create({"benchmark": name})
    run = root / name
    saves, loads = [], []
    for i in range(repeats):
        start = time.perf_counter()
        ckpt = save_checkpoint(run, i + 1, trainable.save, state, config, keep_last=1)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        ckpt.state()
        trainable.load(ckpt.weights)
        loads.append(time.perf_counter() - start)
    size = sum(f.stat().st_size for f in ckpt.path.rglob("*") if f.is_file())
    shutil.rmtree(run)
    return {
        "name": name,
        "params": sum(p.numel() for p in params),
        "mb": round(size / 2**20, 2),
        "save_s": round(min(saves), 4),
        "load_s": round(min(loads), 4),
    }


def checkpoints(sizes_m: list[float], root: Path) -> list[dict[str, object]]:
    from omegaconf import OmegaConf

    from rlgen_cli._hydra import conf_dir
    from rlgen_cli.models import build_policy
    from rlgen_cli.schema.model import option_section

    rows = []
    for lora in (True, False):
        raw = option_section(OmegaConf.load(conf_dir() / "model" / "tiny_sd3.yaml"))
        raw.lora.enabled = lora
        policy = build_policy(OmegaConf.to_object(raw), torch.device("cpu"))
        name = "tiny_sd3_lora" if lora else "tiny_sd3_full"
        rows.append(time_checkpoint(name, policy.trainable, root))
    for millions in sizes_m:
        rows.append(
            time_checkpoint(f"synthetic_{millions:g}M", SyntheticTrainable(int(millions * 1e6)), root)
        )
    return rows


def main() -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--epochs", type=int, default=6, help="epochs per throughput run (the first is warm-up)"
    )
    parser.add_argument("--sizes", default="1,4,16,64", help="synthetic state sizes, millions of parameters")
    parser.add_argument("--no-engines", action="store_true", help="skip the DeepSpeed ZeRO-2 / FSDP runs")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rlgen-scaling-"))
    try:
        result = {
            "throughput": throughput(args.epochs, root, engines=not args.no_engines),
            "checkpoint": checkpoints([float(s) for s in args.sizes.split(",")], root),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
