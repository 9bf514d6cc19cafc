"""One Flow-GRPO-Fast epoch of a real-size model at random init: parameters, FLOPs, memory, time, MFU.

    python benchmarks/real_size.py                  # every variant's parameters (meta device, seconds)
    python benchmarks/real_size.py VARIANT [--resolution R] [--frames F] [--batch B] [--steps S]
        [--layers N] [--dtype bfloat16] [--device auto] [key=value …]

Builds ``VARIANT`` (``models/real_size.py``: sd3_5_medium, sd3_5_large, flux_1_dev, flux_1_kontext_dev,
qwen_image, qwen_image_edit, wan2_1_t2v_1_3b, wan2_1_t2v_14b, bagel_7b_mot) with ``model.weights=random_init`` — the
published architecture, random weights, no download — through its family's ``conf/model`` option, and
runs one epoch of ``algo=grpo_fast`` (B samples of one prompt, a 2-step SDE window (1 step below 3 steps), JPEG-compressibility
reward, no evaluation) on cuda when present, else the CPU. Without flags the geometry is the family's
production one (its conf/model resolution or height × width, frames, steps and CFG) with B = 4; the flags
reduce it (``--resolution`` sets a square side, Wan's too); trailing ``key=value`` are Hydra overrides
(``model.text_encoders=stand_in``, ``model.guidance_scale=1``, ``model.max_sequence_length=32``).
``--layers N`` (BAGEL) keeps N of the language model's MoT layers, every width as published: BAGEL-7B-MoT
is 14.6 B parameters, 29 GB in bf16, which a host with less memory cannot build; each layer is 0.47 B
(0.93 GB), the rest 1.5 B. The record then says ``"layers"`` and counts what was built.

Prints one JSON object:

* ``parameters`` per pipeline component (LoRA excluded) and ``total``; ``trainable_parameters`` (LoRA);
* ``flops_per_forward``: ``torch.utils.flop_counter.FlopCounterMode`` over one ``policy.velocity`` call of
  the rollout (CFG branches included), per sample; ``flops_per_image`` = that × steps;
* ``peak_memory``: ``device_bytes`` (``torch.cuda.max_memory_allocated``, null on the CPU) and
  ``host_rss_bytes`` (peak resident set, ``resource.getrusage``);
* ``seconds``: model build, rollout, reward (the part sampling did not hide), update, epoch;
* ``velocity_rows``: samples × calls of the velocity in the rollout (sampling), with autograd (training)
  and in the KL-to-reference probe after the update (probe; :class:`VelocityMeter`);
* ``tflops`` / ``mfu`` per phase on a GPU: rollout FLOPs (sampling rows × per-sample forward) and update
  FLOPs (training rows × 3 forwards: the backward counted as two; probe rows × 1) over the phase's seconds, and their share
  of the device's dense bf16 peak (:data:`PEAK_TFLOPS`); null on the CPU or a device not listed.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any

import torch
from _common import compose_recipe
from _geometry import run_epoch
from torch.utils.flop_counter import FlopCounterMode

from rlgen_cli.models.bagel.loading import RANDOM_INIT_CONFIGS, random_init_network
from rlgen_cli.models.bagel.vae import build_vae
from rlgen_cli.models.real_size import VARIANTS, count_parameters, flow_components, vlm_model, with_layers
from rlgen_cli.models.tiny import tiny_qwen_tokenizer
from rlgen_cli.recipes import flow_grpo
from rlgen_cli.recipes.flow_run import FlowRun
from rlgen_cli.training.reporting.progress import Progress

FLOW_VARIANTS = [name for name, v in VARIANTS.items() if v.transformer is not None or v.native]
EDITING = {"flux_kontext", "qwen_image_edit"}
PEAK_TFLOPS = (("H100 PCIe", None), ("H100 NVL", None), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0),
               ("L40S", 362.0))  # fmt: skip
"""Dense bf16 tensor-core peaks (TFLOP/s) by a substring of ``torch.cuda.get_device_name``, first match
wins: the H100 SXM and H200 989, A100 312, L40S 362; other H100 forms are not listed (null)."""


def peak_tflops(device: torch.device) -> float | None:
    """The bf16 peak of ``device`` from :data:`PEAK_TFLOPS`; None on the CPU or an unlisted GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def overrides_for(args: argparse.Namespace) -> list[str]:
    """Hydra overrides of the run ``args`` describe."""
    family = VARIANTS[args.variant].family
    out = [f"model={family}", "model.weights=random_init", f"model.variant={args.variant}",
           f"model.dtype={args.dtype}", f"device={args.device}", "reward=jpeg_compressibility",
           "eval_every=0", "images_every=0"]  # fmt: skip
    if family in EDITING:
        out.append("data=tiny_edit")  # source images generated in the run directory
    if args.resolution:
        sides = ["height", "width"] if family == "wan2_1" else ["resolution"]
        out += [f"model.{side}={args.resolution}" for side in sides]
    if args.frames:
        out.append(f"model.num_frames={args.frames}")
    if args.steps:
        out.append(f"model.num_steps={args.steps}")
    window = max(1, min(2, args.steps - 1)) if args.steps else 2  # the window stays clear of the last step
    out += [
        "algo=grpo_fast",
        "algo.prompts_per_epoch=1",
        f"algo.group_size={args.batch}",
        f"algo.sample_batch_size={args.batch}",
        f"algo.train_batch_size={args.batch}",
        "algo.gradient_accumulation_steps=1",
        f"algo.window.size={window}",
        "algo.ema.enabled=false",
    ]
    return out + args.overrides


class VelocityMeter:
    """Wraps ``policy.velocity``: counts sample rows by what called them, keeps the first call's inputs to
    count its FLOPs afterwards (outside the timed phases).

    ``sampling``: no-grad calls inside the rollout (``flow_grpo.sample_rollouts``, patched while the meter
    is installed); ``training``: calls with autograd (forward + backward ≈ 3 forwards); ``probe``: no-grad
    calls outside the rollout — the KL-to-reference probe after the update (policy and reference forwards
    of 4 samples), timed with the update, one forward each. Counting the probe as sampling credited the
    rollout with FLOPs it never ran."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.original = policy.velocity
        self.rows = {"sampling": 0, "training": 0, "probe": 0}
        self.first: tuple | None = None
        self.in_rollout = False
        policy.velocity = self
        self.sample_rollouts = flow_grpo.sample_rollouts
        flow_grpo.sample_rollouts = self.metered_rollouts  # grpo_epoch looks it up at each call

    def metered_rollouts(self, *args: Any, **kwargs: Any) -> Any:
        """``flow_grpo.sample_rollouts``, its velocity calls counted as sampling."""
        self.in_rollout = True
        try:
            return self.sample_rollouts(*args, **kwargs)
        finally:
            self.in_rollout = False

    def close(self) -> None:
        """Put ``flow_grpo.sample_rollouts`` and the policy's velocity back."""
        flow_grpo.sample_rollouts = self.sample_rollouts
        self.policy.velocity = self.original

    def __enter__(self) -> VelocityMeter:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, cond: Any) -> torch.Tensor:
        kind = "training" if torch.is_grad_enabled() else "sampling" if self.in_rollout else "probe"
        self.rows[kind] += x.shape[0]
        if self.first is None:
            self.first = (x.detach().clone(), sigma.detach().clone(), cond)
        return self.original(x, sigma, cond)

    def update_flops(self, per_row: float) -> float:
        """FLOPs of the update phase: its training rows (forward + backward) and the probe's forwards."""
        return (3 * self.rows["training"] + self.rows["probe"]) * per_row

    def flops_per_row(self) -> float:
        """FLOPs of one velocity call on the first call's inputs, per sample row (no autograd)."""
        x, sigma, cond = self.first
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            self.original(x, sigma, cond)
        return counter.get_total_flops() / x.shape[0]


def parameters_of(policy: Any) -> dict[str, int]:
    """Parameters per pipeline component (LoRA adapters excluded) and their total; a native family (no
    pipeline: BAGEL) counts its network, position tables included, as its weight file holds them."""
    counts = {}
    pipeline = getattr(policy, "pipeline", None)
    parts = (
        pipeline.components if pipeline is not None else {"network": policy.transformer, "vae": policy.vae}
    )
    for name, module in parts.items():
        if isinstance(module, torch.nn.Module):
            counts[name] = sum(p.numel() for n, p in module.named_parameters() if "lora_" not in n)
            counts[name] += 0 if pipeline is not None else sum(b.numel() for b in module.buffers())
    counts["total"] = sum(counts.values())
    return counts


def throughput(flops: float, seconds: float, peak: float | None) -> tuple[float, float | None]:
    """(achieved TFLOP/s, its share of ``peak``)."""
    tflops = flops / seconds / 1e12 if seconds > 0 else 0.0
    return round(tflops, 2), (round(tflops / peak, 4) if peak else None)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Build, run one epoch, count; the JSON record."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    recipe: FlowRun = compose_recipe(overrides_for(args))
    build_s = time.perf_counter() - start
    try:
        with VelocityMeter(recipe.policy) as meter, Progress(enabled=False) as progress:
            start = time.perf_counter()
            metrics = run_epoch(recipe, 0, progress)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            epoch_s = time.perf_counter() - start
        return report(args, recipe, meter, metrics, build_s, epoch_s)
    finally:
        recipe.logger.close()


def report(
    args: argparse.Namespace,
    recipe: FlowRun,
    meter: VelocityMeter,
    metrics: dict[str, float],
    build_s: float,
    epoch_s: float,
) -> dict[str, Any]:
    model, device = recipe.cfg.model, recipe.device
    per_row = meter.flops_per_row()
    seconds = {"build": build_s, "rollout": metrics["time/rollout"], "reward": metrics["time/reward"],
               "update": metrics["time/update"], "epoch": epoch_s}  # fmt: skip
    peak = peak_tflops(device)
    rollout = throughput(meter.rows["sampling"] * per_row, seconds["rollout"], peak)
    update = throughput(meter.update_flops(per_row), seconds["update"], peak)
    on_gpu = device.type == "cuda"
    return {
        "variant": args.variant,
        "checkpoint": VARIANTS[args.variant].checkpoint,
        "layers": args.layers,
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "geometry": {
            "height": model.height or model.resolution,
            "width": model.width or model.resolution,
            "frames": model.num_frames,
            "steps": model.num_steps,
            "batch": args.batch,
            "guidance_scale": model.guidance_scale,
            "dtype": model.dtype,
            "text_encoders": model.text_encoders,
            "max_sequence_length": model.max_sequence_length,
        },
        "parameters": parameters_of(recipe.policy),
        "trainable_parameters": sum(p.numel() for p in recipe.policy.trainable.parameters()),
        "flops_per_forward": per_row,
        "flops_per_image": per_row * model.num_steps,
        "peak_memory": {
            "device_bytes": torch.cuda.max_memory_allocated(device) if on_gpu else None,
            "host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        },
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
        "velocity_rows": dict(meter.rows),
        "tflops": {"rollout": rollout[0], "update": update[0]} if on_gpu else None,
        "mfu": {"rollout": rollout[1], "update": update[1]} if on_gpu and peak else None,
    }


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variant", nargs="?", choices=FLOW_VARIANTS, help="omitted: count every variant")
    parser.add_argument(
        "--resolution", type=int, default=None, help="square image side (default: the family's)"
    )
    parser.add_argument("--frames", type=int, default=None, help="video frames (Wan; default: the family's)")
    parser.add_argument("--batch", type=int, default=4, help="samples of the one prompt (the group), ≥ 2")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the family's)")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="BAGEL: MoT layers to build (default: all 28), widths as published",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:N")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied last (key=value)")
    args = parser.parse_intermixed_args(argv)
    if args.batch < 2:
        parser.error("--batch must be at least 2: GRPO normalises rewards within the group")
    if args.layers is not None:
        if args.variant is None or not VARIANTS[args.variant].native:
            parser.error("--layers applies to a BAGEL variant (bagel_7b_mot)")
        if args.layers < 1:
            parser.error("--layers must be at least 1")
    return args


def meta_counts() -> dict[str, dict[str, int]]:
    """Parameters per component of every variant (real-size text encoders), built on the meta device."""
    counts = {}
    with torch.device("meta"):
        for name in VARIANTS:
            if VARIANTS[name].native:  # BAGEL: its position tables are in its weight file
                network = random_init_network(name)
                counts[name] = {
                    "network": count_parameters(network) + sum(b.numel() for b in network.buffers()),
                    "vae": count_parameters(build_vae(RANDOM_INIT_CONFIGS[name].vae)),
                }
            elif name in FLOW_VARIANTS:
                parts = flow_components(name, stand_in=False)
                counts[name] = {
                    k: count_parameters(m) for k, m in parts.items() if isinstance(m, torch.nn.Module)
                }
            else:
                counts[name] = {"model": count_parameters(vlm_model(name, tiny_qwen_tokenizer()))}
            counts[name]["total"] = sum(counts[name].values())
    return counts


if __name__ == "__main__":
    arguments = parse(sys.argv[1:])
    if arguments.layers is not None:  # this process only: the variant with fewer layers
        VARIANTS[arguments.variant] = with_layers(VARIANTS[arguments.variant], arguments.layers)
    print(json.dumps(measure(arguments) if arguments.variant else meta_counts()))
