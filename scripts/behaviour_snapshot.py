"""One tiny training per recipe through ``rlgen train``, recorded so that two checkouts can be compared.

    python scripts/behaviour_snapshot.py OUT.json [--only grpo,dpo] [--keep DIR]
    python scripts/behaviour_snapshot.py --compare BEFORE.json AFTER.json

Each run is one process on the CPU with one thread and a fixed seed, small enough for two optimizer steps,
an evaluation and a checkpoint. The snapshot holds, per run: every metrics.jsonl row without its wall-clock
and memory fields, the files of the run directory, and a sha256 of every saved tensor (the weights and the
trainer state). A refactor that changes no behaviour leaves the snapshot identical; ``--compare`` prints
each difference and exits 1 when there is any.

The trainings run the code of the current directory: to snapshot another commit, run the script from a
worktree of it (``git worktree add /tmp/before SHA; cd /tmp/before; PYTHONPATH=/tmp/before python
/work/main/scripts/behaviour_snapshot.py /tmp/before.json``).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLOW = (
    "experiment=tiny_cpu", "model.num_steps=3", "algo.prompts_per_epoch=2", "algo.group_size=4", "epochs=1",
    "eval_every=1", "save_every=1", "images_every=0",
)  # fmt: skip
TWO_STEPS = ("algo.sample_batch_size=1", "algo.train_batch_size=1", "algo.gradient_accumulation_steps=4")
TWO_SIGMAS = ("algo.sample_batch_size=2", "algo.train_batch_size=1", "algo.pref.timesteps_per_sample=2")
VLM = ("model=tiny_qwen2_vl", "data=tiny_vlm", "reward=length", "epochs=1", "eval_every=1", "save_every=1")
TOKEN = (
    *VLM, "algo.prompts_per_epoch=2", "algo.group_size=4", "algo.token.max_completion_tokens=8", "algo.lr=1e-2",
    *TWO_STEPS,
)  # fmt: skip

# run name -> overrides; the recipe each one runs is in the comment
RUNS: dict[str, tuple[str, ...]] = {
    "grpo": (*FLOW, "algo=grpo", "algo.drop_zero_advantage=false", *TWO_STEPS),  # flow_grpo
    "grpo_guard": (*FLOW, "algo=grpo_guard", "algo.drop_zero_advantage=false", *TWO_STEPS),  # flow_grpo
    "dpo": (*FLOW, "algo=dpo", *TWO_SIGMAS),  # flow_pref
    "sft": (*FLOW, "algo=sft", *TWO_SIGMAS),  # flow_pref
    "nft": (*FLOW, "algo=nft", *TWO_STEPS),  # flow_forward
    "awm": (*FLOW, "algo=awm", *TWO_STEPS),  # flow_forward
    "dgpo": (*FLOW, "algo=dgpo", "algo.forward.num_timesteps=2", *TWO_STEPS),  # flow_forward (DGPO)
    "flow_pretrain": (  # flow_pretrain: the ShapesEval base from scratch, two steps
        "experiment=shapes_pretrain",
        "epochs=1",
        "algo.pretrain.steps_per_epoch=2",
        "algo.pretrain.batch_size=8",
        "algo.pretrain.warmup_steps=1",
        "data.eval_num_prompts=4",
        "eval_every=1",
        "save_every=1",
        "algo.sample_batch_size=4",
        "model.eval_num_steps=2",
    ),
    "token_grpo": (*TOKEN, "algo=token_grpo"),  # vlm_rl
    "step_grpo": (*TOKEN, "algo=step_grpo"),  # vlm_rl
    "vlm_sft": (  # vlm_sft: 8 conversations in micro-batches of 1, 2 steps of 4
        *VLM,
        "algo=vlm_sft",
        "data.train=builtin:tiny_sft.jsonl",
        "algo.token.sft_drop_markers=[]",
        "algo.lr=1e-2",
        "algo.train_batch_size=1",
        "algo.gradient_accumulation_steps=4",
    ),
    "r3": ("model=tiny_r3", "epochs=2", "eval_every=2", "save_every=2"),  # r3: a reason and a refine step
}
COMMON = ("seed=0", "progress=false")
UNRECORDED = ("time/", "peak_memory_mb")  # wall-clock and memory: properties of the machine, not the run
WALL_CLOCK = "_seconds"  # the trainer state's clock counters (clock_seconds, train_seconds)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def train(name: str, run_dir: Path, repo: Path) -> int:
    """``rlgen train`` of the checkout in ``repo``, in a process of its own; its exit code."""
    env = {**os.environ, **ONE_THREAD, **OFFLINE, "PYTHONPATH": str(repo)}
    command = [
        sys.executable,
        "-m",
        "rlgen_cli.cli",
        "train",
        *RUNS[name],
        *COMMON,
        f"hydra.run.dir={run_dir}",
    ]
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    if done.returncode != 0:  # recorded, so the comparison names it; the output says why
        print(
            f"{name}: rlgen train exited {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}",
            file=sys.stderr,
        )
    return done.returncode


def metric_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not k.startswith(UNRECORDED)} for row in rows]


def tensor_digest(tensor) -> str:
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat
    shape = "x".join(map(str, tensor.shape))
    return f"{str(tensor.dtype).removeprefix('torch.')}[{shape}] {hashlib.sha256(raw.numpy().tobytes()).hexdigest()}"


def state_digests(value, prefix: str, into: dict[str, str]) -> None:
    """Every tensor (and plain number) in a nested checkpoint state, keyed by its path."""
    import torch

    if prefix.endswith(WALL_CLOCK):
        return
    if isinstance(value, torch.Tensor):
        into[prefix] = tensor_digest(value)
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            state_digests(value[key], f"{prefix}/{key}", into)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            state_digests(item, f"{prefix}/{index}", into)
    elif isinstance(value, bool | int | float | str) or value is None:
        into[prefix] = repr(value)


def saved_tensors(run_dir: Path) -> dict[str, str]:
    """sha256 of each tensor in every .safetensors and .pt file of the run."""
    import torch
    from safetensors.torch import load_file

    digests: dict[str, str] = {}
    for path in sorted(run_dir.rglob("*.safetensors")):
        for key, tensor in sorted(load_file(path).items()):
            digests[f"{path.relative_to(run_dir)}:{key}"] = tensor_digest(tensor)
    for path in sorted(run_dir.rglob("*.pt")):
        state = torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=False)
        state_digests(state, str(path.relative_to(run_dir)), digests)
    return digests


def run_files(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())


def snapshot(names: list[str], repo: Path, keep: Path | None) -> dict:
    result = {}
    with tempfile.TemporaryDirectory(prefix="behaviour_") as scratch:
        for name in names:
            run_dir = (keep or Path(scratch)) / name
            started = time.monotonic()
            code = train(name, run_dir, repo)
            result[name] = {"overrides": [*RUNS[name], *COMMON], "exit_code": code}
            if code == 0:
                result[name] |= {
                    "metrics": metric_rows(run_dir),
                    "files": run_files(run_dir),
                    "tensors": saved_tensors(run_dir),
                }
            print(f"{name}: {time.monotonic() - started:.1f} s", file=sys.stderr)
    return result


def differences(a, b, path: str = "") -> list[str]:
    """Each place where two snapshots differ, as a readable line."""
    if isinstance(a, dict) and isinstance(b, dict):
        lines = [f"{path}/{k}: only in the first" for k in a if k not in b]
        lines += [f"{path}/{k}: only in the second" for k in b if k not in a]
        for key in (k for k in a if k in b):
            lines += differences(a[key], b[key], f"{path}/{key}")
        return lines
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [line for i, (x, y) in enumerate(zip(a, b)) for line in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, list) and isinstance(b, list) and all(isinstance(x, str) for x in a + b):
        gone, new = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        return [f"{path}: only in the first {gone}, only in the second {new}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def compare(first: Path, second: Path) -> int:
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    lines = differences(a, b)
    for line in lines:
        print(line)
    print(f"{len(lines)} difference(s) between {first} and {second}" if lines else "identical")
    return 1 if lines else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, help="where to write the snapshot (JSON)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two snapshots")
    parser.add_argument("--only", help=f"comma-separated runs (default all: {','.join(RUNS)})")
    parser.add_argument("--keep", type=Path, help="keep the run directories here")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        parser.error("give OUT.json, or --compare A.json B.json")
    names = args.only.split(",") if args.only else list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown run(s) {unknown}; choose from {list(RUNS)}")
    result = snapshot(names, Path.cwd(), args.keep)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    failed = [name for name, run in result.items() if run["exit_code"] != 0]
    print(f"wrote {args.out}" + (f"; failed: {failed}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
