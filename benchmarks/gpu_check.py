"""The device check: one command that says whether rlgen works, and how fast, on a CUDA device.

    python benchmarks/gpu_check.py                # on a CUDA device (make gpu-check); ≤ 8 minutes
    python benchmarks/gpu_check.py --dry-run      # every row at tiny sizes on the CPU (a few minutes)
    python benchmarks/gpu_check.py --predict      # the planner's predictions for the rows, on the CPU
    python benchmarks/gpu_check.py --rows sd3_epoch,onpolicy --limit 300

No weight is downloaded: every model is its published architecture at random init
(``model.weights=random_init``, docs/real_size.md) with two-layer stand-in text encoders
(``model.text_encoders=stand_in``: no row measures the encoders). Rows, each independent (a row that
fails or runs past its budget is recorded as such and the next one runs):

* ``sd3_epoch`` — SD3.5-Medium, 512 px, bf16, LoRA, Flow-GRPO-Fast, one prompt × group 8: seconds by
  phase, TFLOP/s and MFU per phase, ``torch.cuda.max_memory_allocated`` against ``rlgen plan``'s total
  for the same config;
* ``rollout_vs_diffusers`` — the same model without LoRA sampled by rlgen (noise level 0) and by diffusers'
  ``StableDiffusion3Pipeline.__call__`` on the same weights, initial noise, steps, guidance and batch:
  speed ratio, and the decoded images' difference, beside a near miss's (the pipeline one step short);
* ``onpolicy`` — ``rlgen check-onpolicy``'s flow check in bf16: max |ratio − 1| as is, and with the
  trainable weights perturbed (that arm must fail);
* ``flux_step`` — FLUX.1-dev with gradient checkpointing, one training step at 512 px: peak against the
  plan, step time;
* ``wan_step`` — Wan2.1-T2V-1.3B, 33 frames at 480 × 832, one training step: peak against the plan;
* ``folded_timesteps`` — SD3.5-Medium, the update of the same rollouts with ``algo.timesteps_per_pass=4``
  and 1: update and epoch ratio, and the two gradients' relative difference (an arm with the advantages
  reversed must exceed it);
* ``two_processes`` — ``rlgen train launcher=accelerate launcher.num_processes=2`` for one epoch when two
  devices are present; else skipped, saying so.

Prints one JSON object on its last line of stdout (every row's record: ``status`` ok / failed / timeout
/ skipped, ``wall_s``, ``budget_s`` and its numbers); what the rows print goes to stderr. The whole run
stops at ``--limit`` seconds (480) with the rows it has; a row gets the smaller of its budget and the time
left, and a row stuck where its alarm cannot reach it is cut by a watchdog 20 s past the limit.
docs/gpu.md reads the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from _common import compose_recipe
from _geometry import run_epoch
from omegaconf import OmegaConf
from real_size import VelocityMeter, peak_tflops, throughput

from rlgen_cli._hydra import compose_verb
from rlgen_cli.recipes import flow_grpo
from rlgen_cli.recipes.flow_run import FlowRun
from rlgen_cli.tasks.common import validated
from rlgen_cli.training.reporting.progress import Progress

EXIT_NO_DEVICE = 2
LIMIT_S = 480.0
"""The whole run's wall-clock limit: 8 minutes, model builds included."""
PROMPTS = [
    "a red apple on a wooden table", "a lighthouse at dusk", "two cats on a sofa", "a bowl of ramen",
    "a bicycle leaning on a wall", "a snowy mountain village", "a glass of orange juice", "an old map",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Context:
    """Where the rows run: ``dry_run`` shrinks every model to its tiny variant on the CPU."""

    dry_run: bool
    device: str
    predict_only: bool = False
    device_memory_gb: float = 80.0
    """What the plan is asked to fit (the device's memory, GiB)."""

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")


# -- run configs -------------------------------------------------------------------------------------


def common_overrides(ctx: Context) -> list[str]:
    """What every row's run shares: the device, bf16, a cheap reward, no evaluation or images, and no
    prompt cache (the plan counts a cache at its cap, which a one-epoch run never fills)."""
    return [
        f"device={ctx.device}",
        "model.dtype=bfloat16",
        "model.prompt_cache_mb=0",
        "reward=jpeg_compressibility",
        "data=tiny",
        "eval_every=0",
        "images_every=0",
        "save_every=0",
        "algo.ema.enabled=false",
    ]


def sd3_model(ctx: Context) -> list[str]:
    """SD3.5-Medium at 512 px with 10 steps and CFG 4.5 (conf/model/sd3); the tiny SD3 in a dry run."""
    if ctx.dry_run:
        return ["model=tiny_sd3", "model.resolution=32", "model.num_steps=3", "model.guidance_scale=4.5"]
    return [
        "model=sd3",
        "model.weights=random_init",
        "model.variant=sd3_5_medium",
        "model.text_encoders=stand_in",
        "model.resolution=512",
    ]


def flux_model(ctx: Context) -> list[str]:
    """FLUX.1-dev at 512 px, gradient checkpointing on; the tiny FLUX in a dry run."""
    if ctx.dry_run:
        return ["model=tiny_flux", "model.num_steps=3", "model.gradient_checkpointing=true"]
    return [
        "model=flux",
        "model.weights=random_init",
        "model.variant=flux_1_dev",
        "model.text_encoders=stand_in",
        "model.resolution=512",
        "model.gradient_checkpointing=true",
    ]


def wan_model(ctx: Context) -> list[str]:
    """Wan2.1-T2V-1.3B, 33 frames at 480 × 832; the tiny Wan (5 frames) in a dry run."""
    if ctx.dry_run:
        return ["model=tiny_wan2_1", "model.num_steps=3"]
    return [
        "model=wan2_1",
        "model.weights=random_init",
        "model.variant=wan2_1_t2v_1_3b",
        "model.text_encoders=stand_in",
        "model.num_frames=33",
        "model.height=480",
        "model.width=832",
        "model.num_steps=4",
    ]


def fast_algo(group: int, window: int, train_batch: int) -> list[str]:
    """Flow-GRPO-Fast on one prompt: ``group`` samples in one sampling batch, a ``window``-step window."""
    return [
        "algo=grpo_fast",
        "algo.prompts_per_epoch=1",
        f"algo.group_size={group}",
        f"algo.sample_batch_size={group}",
        f"algo.train_batch_size={train_batch}",
        f"algo.gradient_accumulation_steps={group // train_batch}",
        f"algo.window.size={window}",
    ]


def sd3_epoch_overrides(ctx: Context) -> list[str]:
    group = 2 if ctx.dry_run else 8
    return [*sd3_model(ctx), *common_overrides(ctx), *fast_algo(group, window=2, train_batch=group)]


def flux_step_overrides(ctx: Context) -> list[str]:
    return [*flux_model(ctx), *common_overrides(ctx), *fast_algo(2, window=1, train_batch=2)]


def wan_step_overrides(ctx: Context) -> list[str]:
    return [*wan_model(ctx), *common_overrides(ctx), *fast_algo(2, window=1, train_batch=2)]


def every_step_overrides(ctx: Context) -> list[str]:
    """Flow-GRPO training every step (what folding groups), one prompt × 4 (2 in a dry run), on SD3.5-Medium."""
    group = 2 if ctx.dry_run else 4
    return [
        *sd3_model(ctx),
        *common_overrides(ctx),
        "algo=grpo",
        "algo.kl_weight=0",
        "algo.window.timestep_fraction=1.0",
        "algo.prompts_per_epoch=1",
        f"algo.group_size={group}",
        f"algo.sample_batch_size={group}",
        f"algo.train_batch_size={group}",
        "algo.gradient_accumulation_steps=1",
    ]


def folded_overrides(ctx: Context) -> list[str]:
    """:func:`every_step_overrides` without gradient clipping, whose scale would hide a difference."""
    return [*every_step_overrides(ctx), "algo.max_grad_norm=0"]


# -- measuring ---------------------------------------------------------------------------------------


def synchronize(ctx: Context) -> None:
    if ctx.on_gpu:
        torch.cuda.synchronize()


def fresh_device(ctx: Context) -> None:
    """Free what the last row left and restart the peak counter, so each row's peak is its own."""
    gc.collect()
    if ctx.on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def device_peak(ctx: Context) -> int | None:
    return torch.cuda.max_memory_allocated() if ctx.on_gpu else None


def device_gib(device: str) -> float:
    """The memory of CUDA device ``device`` in GiB."""
    return torch.cuda.get_device_properties(torch.device(device)).total_memory / 2**30


def composed(verb: str, overrides: list[str]) -> Any:
    """The config ``rlgen VERB OVERRIDES`` runs with, its run directory a fresh one in /tmp."""
    cfg = compose_verb(verb, ["progress=false", *overrides])
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = tempfile.mkdtemp(prefix="rlgen-gpu-check-")
    return cfg


def planned(ctx: Context, overrides: list[str]) -> dict[str, Any]:
    """``rlgen plan``'s prediction for ``overrides``: the configured run only (the search over common
    devices, which prices other settings, is skipped: it costs minutes of CPU for a large model)."""
    from rlgen_cli.tasks.plan import plan_run
    from rlgen_cli.training.memory import plan as memory_plan

    cfg = composed("plan", [*overrides, f"plan.device_memory_gb={ctx.device_memory_gb}", "plan.headroom=0"])
    with mock.patch.object(memory_plan, "device_fits", lambda *args, **kwargs: []):
        report = plan_run(validated(cfg))
    return {
        "total_bytes": report["total_bytes"],
        "state_bytes": report["state_bytes"],
        "step_peak_bytes": report["step_peak_bytes"],
        "rollout_peak_bytes": report["rollout_peak_bytes"],
        "fits": report["fits"],
    }


class Predictions:
    """The plans of the rows that compare a peak with one, traced on the meta device by a CPU process of
    their own (``--predict``) while the device runs the rows: a plan of a large model takes a minute of
    CPU, which would otherwise come out of the rows' budgets."""

    def __init__(self, ctx: Context, names: list[str], limit: float) -> None:
        self.rows = [name for name in names if name in PLANNED_ROWS]
        self.process = None
        if self.rows:
            command = [sys.executable, str(Path(__file__).resolve()), "--predict", "--rows", ",".join(self.rows),
                       "--limit", str(limit), "--device-memory-gb", str(ctx.device_memory_gb)]  # fmt: skip
            command += ["--dry-run"] if ctx.dry_run else []
            environment = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # planning touches no device
            self.process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=environment
            )

    def collect(self, timeout: float) -> dict[str, Any]:
        """Each planned row's record (``plan`` or why there is none), waiting at most ``timeout`` s."""
        if self.process is None:
            return {}
        try:
            out, _ = self.process.communicate(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            return {name: {"error": "the plan did not finish within the run's limit"} for name in self.rows}
        lines = out.strip().splitlines()
        if self.process.returncode != 0 or not lines:
            return {
                name: {"error": f"the planning process exited {self.process.returncode}"}
                for name in self.rows
            }
        return json.loads(lines[-1])["rows"]


def with_plan(row: dict[str, Any], prediction: dict[str, Any]) -> dict[str, Any]:
    """``row`` with the plan's prediction and the measured peak ÷ the planned total (null without both)."""
    if "plan" not in prediction:
        return {
            **row,
            "plan": None,
            "plan_error": prediction.get("error", prediction.get("status")),
            "peak_vs_plan": None,
        }
    plan, peak = prediction["plan"], row.get("peak_bytes")
    return {
        **row,
        "plan": plan,
        "peak_vs_plan": None if peak is None else round(peak / plan["total_bytes"], 4),
    }


@contextlib.contextmanager
def built_run(overrides: list[str]) -> Iterator[FlowRun]:
    run = compose_recipe(overrides)
    try:
        yield run
    finally:
        run.logger.close()


def timed_epoch(ctx: Context, run: FlowRun) -> tuple[dict[str, float], float]:
    with Progress(enabled=False) as progress:
        start = time.perf_counter()
        metrics = run_epoch(run, 0, progress)
        synchronize(ctx)
    return metrics, time.perf_counter() - start


def phase_seconds(metrics: dict[str, float], epoch_s: float) -> dict[str, float]:
    return {
        "rollout": round(metrics["time/rollout"], 3),
        "reward": round(metrics["time/reward"], 3),
        "update": round(metrics["time/update"], 3),
        "epoch": round(epoch_s, 3),
    }


# -- the rows ----------------------------------------------------------------------------------------


def sd3_epoch(ctx: Context) -> dict[str, Any]:
    """One Flow-GRPO-Fast epoch: seconds, TFLOP/s and MFU by phase, peak against the plan."""
    overrides = sd3_epoch_overrides(ctx)
    if ctx.predict_only:
        return {"plan": planned(ctx, overrides)}
    fresh_device(ctx)
    with built_run(overrides) as run, VelocityMeter(run.policy) as meter:
        metrics, epoch_s = timed_epoch(ctx, run)
        peak = device_peak(ctx)
        per_row = meter.flops_per_row()
        device_peak_tflops = peak_tflops(run.device)
    seconds = phase_seconds(metrics, epoch_s)
    rollout = throughput(meter.rows["sampling"] * per_row, seconds["rollout"], device_peak_tflops)
    update = throughput(meter.update_flops(per_row), seconds["update"], device_peak_tflops)
    return {
        "seconds": seconds,
        "flops_per_forward": per_row,
        "velocity_rows": dict(meter.rows),
        "tflops": {"rollout": rollout[0], "update": update[0]} if ctx.on_gpu else None,
        "mfu": {"rollout": rollout[1], "update": update[1]} if ctx.on_gpu else None,
        "peak_bytes": peak,
    }


def rollout_vs_diffusers(ctx: Context) -> dict[str, Any]:
    """rlgen's sampling path at noise level 0 against ``StableDiffusion3Pipeline.__call__`` on the same
    weights and initial noise; each timed on its second call (the first warms the kernels up)."""
    from rlgen_cli.models import build_policy
    from rlgen_cli.models.trainable import autocast
    from rlgen_cli.sde.noise import Stream, sample_generators
    from rlgen_cli.sde.rollout import StepSpec
    from rlgen_cli.sde.sampling import sample_images

    if ctx.predict_only:
        return {}
    fresh_device(ctx)
    cfg = validated(composed("train", [*sd3_model(ctx), *common_overrides(ctx)])).model
    policy = build_policy(
        dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, enabled=False)), torch.device(ctx.device)
    )
    prompts = PROMPTS[: 2 if ctx.dry_run else 8]
    steps, seed = cfg.num_steps, 0

    def ours(guidance: float) -> torch.Tensor:
        policy.guidance_scale = guidance
        spec = StepSpec("flow_sde", 0.0)
        return sample_images(policy, prompts, steps, len(prompts), seed, spec=spec)

    def theirs(guidance: float, steps: int = steps) -> torch.Tensor:
        generators = sample_generators(seed, 0, range(len(prompts)), policy.device, salt=Stream.INITIAL_NOISE)
        pipe = policy.pipeline
        pipe.set_progress_bar_config(disable=True)
        with autocast(policy.device, policy.dtype):  # the run keeps some weights in fp32, as rlgen runs them
            images = pipe(
                prompts,
                negative_prompt=cfg.negative_prompt,
                height=cfg.resolution,
                width=cfg.resolution,
                num_inference_steps=steps,
                guidance_scale=guidance,
                latents=policy.noise(len(prompts), generators),
                max_sequence_length=cfg.max_sequence_length,
                output_type="pt",
            ).images
        return images.float().cpu()

    with torch.no_grad():
        ours_s, got = best_of_two(ctx, lambda: ours(cfg.guidance_scale))
        theirs_s, expected = best_of_two(ctx, lambda: theirs(cfg.guidance_scale))
        near_miss = theirs(cfg.guidance_scale, steps - 1)
    difference = (got - expected).abs()
    tolerance = torch.finfo(policy.dtype).eps
    """Mean |Δ| of decoded pixels (in [0, 1]) allowed: one rounding of the model dtype. The pipeline keeps
    its latents in that dtype between steps and mixes CFG in it, rlgen in fp32, so the two differ by such
    roundings; the near miss says whether the tolerance can tell a wrong sampler."""
    return {
        "steps": steps,
        "batch": len(prompts),
        "guidance_scale": cfg.guidance_scale,
        "seconds": {"rlgen": round(ours_s, 3), "diffusers": round(theirs_s, 3)},
        "speed_ratio": round(theirs_s / ours_s, 4),  # > 1: rlgen samples faster
        "mean_abs_difference": float(difference.mean()),
        "max_abs_difference": float(difference.max()),
        "near_miss_mean_abs_difference": float((near_miss - expected).abs().mean()),
        "tolerance": tolerance,
        "equal": bool(difference.mean() <= tolerance),
        "near_miss_exceeds_tolerance": bool((near_miss - expected).abs().mean() > tolerance),
    }


def best_of_two(ctx: Context, call: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    """``call`` twice; the second call's seconds and output."""
    call()
    synchronize(ctx)
    start = time.perf_counter()
    out = call()
    synchronize(ctx)
    return time.perf_counter() - start, out


def onpolicy(ctx: Context) -> dict[str, Any]:
    """``check-onpolicy``'s flow check in bf16, as is and with perturbed trainable weights."""
    from rlgen_cli.recipes.flow_grpo import check_onpolicy
    from rlgen_cli.tasks.check_onpolicy import perturb_weights

    if ctx.predict_only:
        return {}
    arms = {}
    for arm, std in (("as_is", 0.0), ("perturbed", 1e-2)):
        fresh_device(ctx)
        overrides = [*every_step_overrides(ctx), f"check.perturb_weights={std}"]
        raw = composed("check_onpolicy", overrides)
        typed = validated(raw)
        perturb = functools.partial(perturb_weights, std=std, seed=typed.seed)
        worst, passed = check_onpolicy(typed, raw, perturb)
        arms[arm] = {"max_error": worst, "passed": passed}
    return {
        "tolerance": typed.check.tolerance,
        "max_ratio_error": arms["as_is"]["max_error"],
        "passed": arms["as_is"]["passed"],
        "perturbed_max_ratio_error": arms["perturbed"]["max_error"],
        "perturbed_failed": not arms["perturbed"]["passed"],
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def one_step_row(ctx: Context, overrides: list[str]) -> dict[str, Any]:
    """One epoch of one optimizer step: its seconds by phase and the peak against the plan."""
    if ctx.predict_only:
        return {"plan": planned(ctx, overrides)}
    fresh_device(ctx)
    with built_run(overrides) as run:
        metrics, epoch_s = timed_epoch(ctx, run)
        peak = device_peak(ctx)
    return {
        "seconds": phase_seconds(metrics, epoch_s),
        "step_s": round(metrics["time/update"], 3),
        "peak_bytes": peak,
    }


def flux_step(ctx: Context) -> dict[str, Any]:
    return one_step_row(ctx, flux_step_overrides(ctx))


def wan_step(ctx: Context) -> dict[str, Any]:
    return one_step_row(ctx, wan_step_overrides(ctx))


def folded_timesteps(ctx: Context) -> dict[str, Any]:
    """The same rollouts' update with 4 trained steps per transformer call and with 1: seconds and the
    gradient each would apply (no optimizer step, so both see the same weights)."""
    if ctx.predict_only:
        return {}
    fresh_device(ctx)
    with built_run(folded_overrides(ctx)) as run:
        adapter_at_work(run)
        with Progress(enabled=False) as progress:
            start = time.perf_counter()
            rollouts = flow_grpo.sample_rollouts(run, 0, progress)
            synchronize(ctx)
            rollout_s = time.perf_counter() - start
        n = len(rollouts.indices)
        advantages = torch.linspace(-1.0, 1.0, n)  # on the CPU, where the recipe keeps them
        folded_s, folded = update_gradient(ctx, run, rollouts, advantages, per_pass=4)
        per_step_s, per_step = update_gradient(ctx, run, rollouts, advantages, per_pass=1)
        _, reversed_arm = update_gradient(ctx, run, rollouts, advantages.flip(0), per_pass=4)
        dtype = run.policy.dtype
    relative = float((folded - per_step).norm() / per_step.norm())
    tolerance = 16 * torch.finfo(dtype).eps
    """Relative L2 difference allowed: folding changes the rows each kernel sees, which rounds the
    activations differently in the model dtype by an ulp or so, and sums the per-step losses in another
    order."""
    return {
        "update_seconds": {"folded": round(folded_s, 3), "per_step": round(per_step_s, 3)},
        "update_ratio": round(folded_s / per_step_s, 4),
        "epoch_ratio": round((rollout_s + folded_s) / (rollout_s + per_step_s), 4),
        "gradient_relative_difference": relative,
        "tolerance": tolerance,
        "equal": relative <= tolerance,
        "reversed_advantages_relative_difference": float((reversed_arm - per_step).norm() / per_step.norm()),
    }


def adapter_at_work(run: FlowRun) -> None:
    """LoRA B starts at 0, which would leave every A without a gradient: draw it small."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in run.policy.trainable.named():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))


def update_gradient(
    ctx: Context, run: Any, rollouts: Any, advantages: torch.Tensor, per_pass: int
) -> tuple[float, torch.Tensor]:
    """(seconds, the summed gradient) of ``flow_grpo.update`` with ``per_pass`` steps per call. Each
    optimizer step reads the gradients it is handed (no clipping: ``algo.max_grad_norm=0``) and steps at
    learning rate 0, so every arm trains the same weights."""
    params = run.policy.trainable.parameters()
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64, device=run.device)

    def capture(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        total.add_(
            torch.cat([torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten() for p in params])
        )

    rates = [group["lr"] for group in run.optimizer.param_groups]
    for group in run.optimizer.param_groups:
        group["lr"] = 0.0
    hook = run.optimizer.register_step_pre_hook(capture)
    run.cfg.algo.timesteps_per_pass = per_pass
    try:
        with Progress(enabled=False) as progress:
            start = time.perf_counter()
            flow_grpo.update(run, rollouts, advantages, progress)
            synchronize(ctx)
    finally:
        hook.remove()
        for group, rate in zip(run.optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
    return time.perf_counter() - start, total.cpu()


def two_processes(ctx: Context) -> dict[str, Any]:
    """One tiny epoch on two processes (``launcher=accelerate``: DDP over NCCL on CUDA)."""
    devices = torch.cuda.device_count() if ctx.on_gpu else 0
    if ctx.predict_only or ctx.dry_run or devices < 2:
        why = "dry run: one CPU" if ctx.dry_run else f"{devices} CUDA device(s): two are needed"
        return {"skipped": why if not ctx.predict_only else "predictions only"}
    run_dir = tempfile.mkdtemp(prefix="rlgen-gpu-check-ddp-")
    command = [
        str(Path(sys.executable).with_name("rlgen")), "train", "experiment=tiny_cpu", "device=cuda", "epochs=1",
        "eval_every=0", "save_every=0", "images_every=0", "progress=false", "launcher=accelerate",
        "launcher.num_processes=2", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=row_time_left())
    return {
        "exit_code": done.returncode,
        "seconds": round(time.perf_counter() - start, 3),
        "stderr_tail": done.stderr[-2000:] if done.returncode else "",
    }


Row = Callable[[Context], dict[str, Any]]
ROWS: dict[str, tuple[Row, float]] = {
    "sd3_epoch": (sd3_epoch, 90.0),
    "rollout_vs_diffusers": (rollout_vs_diffusers, 60.0),
    "onpolicy": (onpolicy, 60.0),
    "flux_step": (flux_step, 90.0),
    "wan_step": (wan_step, 60.0),
    "folded_timesteps": (folded_timesteps, 60.0),
    "two_processes": (two_processes, 60.0),
}
"""Each row and its budget in seconds on a device (a dry run has the same budgets, far from reached)."""
PLANNED_ROWS = ("sd3_epoch", "flux_step", "wan_step")
"""The rows whose peak is compared with ``rlgen plan``'s prediction."""


# -- running rows within budgets ---------------------------------------------------------------------


class OutOfTime(BaseException):  # noqa: N818 — not an error of the row's code: its budget ran out
    """Raised in the main thread when a row's budget or the whole run's limit is spent (a BaseException,
    so no ``except Exception`` in the code under test swallows it)."""


class Stopped(BaseException):  # noqa: N818
    """SIGTERM / SIGINT: the run stops and prints what it has."""


_deadline = [math.inf]


def row_time_left() -> float:
    return max(1.0, _deadline[0] - time.monotonic())


def _on_alarm(signum: int, frame: Any) -> None:
    raise OutOfTime


def _on_stop(signum: int, frame: Any) -> None:
    raise Stopped


def run_row(ctx: Context, name: str, row: Row, budget: float) -> dict[str, Any]:
    """``row`` under a ``budget``-second alarm; its record, whatever happens."""
    _deadline[0] = time.monotonic() + budget
    signal.setitimer(signal.ITIMER_REAL, budget)
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON alone
            record = {"status": "ok", **row(ctx)}
        if "skipped" in record:
            record["status"] = "skipped"
    except OutOfTime:
        record = {"status": "timeout", "error": f"ran past its budget of {budget:.0f} s"}
    except Exception as err:  # noqa: BLE001 — a failing row is recorded; the next one runs
        traceback.print_exc(file=sys.stderr)
        record = {
            "status": "failed",
            "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
        }
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return {**record, "wall_s": round(time.perf_counter() - start, 3), "budget_s": round(budget, 1)}


def run_rows(ctx: Context, names: list[str], limit: float) -> dict[str, Any]:
    """Every row in ``names`` within its budget and the whole run's ``limit``; the JSON record."""
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGTERM, _on_stop)
    started = time.monotonic()
    predictions = None if ctx.predict_only else Predictions(ctx, names, limit)
    rows: dict[str, Any] = {}
    watchdog = Watchdog(lambda: record_of(ctx, started, limit, rows), limit + GRACE_S)
    stopped = None
    for name in names:
        row, budget = ROWS[name]
        left = limit - (time.monotonic() - started)
        budget = left if ctx.predict_only else min(budget, left)  # predictions: the limit alone
        if stopped or left < 1.0:
            rows[name] = {
                "status": "skipped",
                "skipped": stopped or f"the run's limit of {limit:g} s was reached",
            }
            continue
        watchdog.current = name
        try:
            rows[name] = run_row(ctx, name, row, budget)
        except (Stopped, KeyboardInterrupt):
            stopped = "stopped by a signal"
            rows[name] = {"status": "skipped", "skipped": stopped}
    watchdog.current = None
    if predictions is not None:
        planned_rows = predictions.collect(0.0 if stopped else limit - (time.monotonic() - started))
        for name, prediction in planned_rows.items():
            if rows[name]["status"] == "ok":
                rows[name] = with_plan(rows[name], prediction)
    watchdog.cancel()
    return record_of(ctx, started, limit, rows)


def record_of(ctx: Context, started: float, limit: float, rows: dict[str, Any]) -> dict[str, Any]:
    """The JSON record of the rows run so far."""
    return {
        "device": torch.cuda.get_device_name(torch.device(ctx.device)) if ctx.on_gpu else "cpu",
        "dry_run": ctx.dry_run,
        "predict_only": ctx.predict_only,
        "limit_s": limit,
        "elapsed_s": round(time.monotonic() - started, 3),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "rows": dict(rows),
    }


GRACE_S = 20.0
"""How long past the limit the watchdog waits for the main thread before it prints and exits."""


class Watchdog:
    """The backstop of the limit. A row's alarm is handled between Python bytecodes, so a row stuck in
    native code (a hung collective, a kernel that never returns) would never see it: after ``deadline_s``
    this thread prints the record so far, the stuck row marked ``timeout``, and ends the process."""

    def __init__(self, record: Callable[[], dict[str, Any]], deadline_s: float) -> None:
        self.record = record
        self.current: str | None = None
        self.timer = threading.Timer(deadline_s, self._give_up)
        self.timer.daemon = True
        self.timer.start()

    def _give_up(self) -> None:
        record = self.record()
        if self.current is not None:
            record["rows"][self.current] = {
                "status": "timeout",
                "error": "stuck in native code past the run's limit",
            }
        print(json.dumps(record), file=sys.__stdout__, flush=True)  # the row's stdout goes to stderr
        os._exit(0)

    def cancel(self) -> None:
        self.timer.cancel()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="every row at tiny sizes on the CPU")
    parser.add_argument("--predict", action="store_true", help="the planner's predictions only, on the CPU")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    parser.add_argument("--limit", type=float, default=LIMIT_S, help="the whole run's limit in seconds")
    parser.add_argument("--device", default="cuda", help="the CUDA device to check (cuda, cuda:N)")
    parser.add_argument(
        "--device-memory-gb",
        type=float,
        default=None,
        help="--predict: the memory the plans must fit (default: the device's, else 80)",
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.rows.split(",") if name not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown row(s) {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    if args.limit <= 0:
        parser.error(f"--limit must be positive, got {args.limit}")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.dry_run or args.predict:
        memory = args.device_memory_gb or 80.0
        ctx = Context(dry_run=args.dry_run, device="cpu", predict_only=args.predict, device_memory_gb=memory)
    elif not torch.cuda.is_available():
        print(
            "gpu-check: no CUDA device is visible (torch.cuda.is_available() is False); run it on a machine "
            "with a GPU, or pass --dry-run to run every row at tiny sizes on the CPU",
            file=sys.stderr,
        )
        return EXIT_NO_DEVICE
    else:
        ctx = Context(dry_run=False, device=args.device, device_memory_gb=device_gib(args.device))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(json.dumps(run_rows(ctx, args.rows.split(","), args.limit)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
