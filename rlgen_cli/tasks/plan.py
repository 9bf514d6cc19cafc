"""``rlgen plan``: the memory one training process needs, whether it fits a device, and what makes it fit.

It composes exactly the config ``rlgen train`` would run, builds that run's model on the meta device
(every tensor a shape and a dtype, nothing allocated: a 20 B-parameter model plans on a laptop; a
pretrained family is built as its real-size architecture, ``models/real_size.py``, so no weight is read),
then

1. counts parameters and buffers per component (transformer, text encoders, VAE, …), dtype, frozen or
   trainable, LoRA or base; the local reward models (or refuses a reward whose model it cannot build,
   naming it), the prompt caches at their cap, the float64 gradient sums of ``launcher.exact_reduction``;
2. runs the recipe's own code on the meta device and traces the peak of each phase of an epoch
   (``training/memory/trace.py``; one :class:`EpochTracer` per flow recipe — Flow-GRPO, DiffusionNFT /
   AWM, DPO / SFT, pretraining): one sampling batch of ``algo.sample_batch_size`` (the sampling forwards,
   what it keeps for the update, the decode), and one training step — the recipe's update itself, with
   Flow-GRPO's folds of ``algo.timesteps_per_pass``, NFT's old-policy and reference forwards, DPO's
   winner and loser, the KL reference forward, the CFG branches, the backward and the optimizer step — so
   the saved activations, the gradients, the backward's buffers and the optimizer's temporaries are all
   counted;
3. also traces the saved activations of one training forward, attributed to blocks (the figure with and
   without gradient checkpointing, for the table);
4. adds the launcher's own buffers, sharded as the launcher shards them (``training/memory/plan.py``), and
   checks ``plan.device_memory_gb`` less ``plan.headroom``; when it does not fit, searches the cheapest
   change that does; and names the smallest common device (24 / 40 / 48 / 80 / 141 GB) that holds one
   process, with the settings it takes.

It prints a table (or ``plan.format=json``), writes ``plan.json`` into its run directory, and exits 0
when the run fits, 1 when it does not. An option whose memory it does not model stops it with exit code 2
naming the option (:func:`refuse_unmodelled`): it never says "fits" on a guess; nor for a run ``rlgen
train`` refuses at startup (:func:`require_startup`: the same checks, with the same messages). The conditioning of a
tiny family is encoded by a CPU twin (its encoders read their masks' values); a real one's on the meta
device, where integer tensors stay on the CPU (``training/memory/trace.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import types
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.recipes.plan_trace import (
    LAUNCH_KINDS,
    META,
    Encode,
    EpochTracer,
    empty_weights,
    folded_steps,
    gradient_checkpointing,
    micro_batch_of,
    repeated_blocks,
    rows_per_unit,
    shape_of,
)
from rlgen_cli.recipes.registry import PLANNED_RECIPES, plan_of
from rlgen_cli.tasks.common import run_dir_of, user_errors, validated
from rlgen_cli.tasks.plan_report import print_report
from rlgen_cli.tasks.plan_rewards import reward_rows
from rlgen_cli.tasks.switched_off import refuse_switched_off

log = logging.getLogger(__name__)

EXIT_DOES_NOT_FIT = 1
MODELLED_RECIPES = PLANNED_RECIPES  # every flow recipe runs its own epoch on the meta device
TRACE_SIGMA = 0.5


@user_errors
def plan_task(cfg: DictConfig) -> dict[str, Any]:
    """Returns the plan as the JSON object it prints with ``plan.format=json``."""
    typed = validated(cfg)
    refuse_switched_off(typed)  # a setting train refuses as doing nothing: the plan says so, not "fits"
    if plan_of(typed) is None:
        raise UserError(
            f"rlgen plan covers the flow-model recipes ({', '.join(PLANNED_RECIPES)}); recipe={typed.recipe} "
            f"(model.family={typed.model.family}) is not one of them yet"
        )
    report = plan_run(typed)
    run_dir = run_dir_of(typed)
    run_dir.mkdir(parents=True, exist_ok=True)
    as_json = json.dumps(report, indent=2) + "\n"
    (run_dir / "plan.json").write_text(as_json)
    if typed.plan.format == "json":
        sys.stdout.write(as_json)  # raw JSON for machines: no console markup or wrapping
    else:
        print_report(report)
    if not report["fits"]:
        sys.exit(EXIT_DOES_NOT_FIT)
    return report


def refuse_unmodelled(cfg: Any) -> None:
    """Stops the plan (exit code 2) on every setting whose memory it does not model, naming each."""
    unmodelled = []
    if cfg.model.compile:
        unmodelled.append(
            "model.compile=true: a compiled step keeps other buffers than the eager step the plan runs; "
            "plan without it"
        )
    if cfg.launcher.mixed_precision != "fp32":
        unmodelled.append(
            f"launcher.mixed_precision={cfg.launcher.mixed_precision}: the launcher's 16-bit copies of the "
            "trained weights are not modelled; plan with launcher.mixed_precision=fp32 (model.dtype sets "
            "the compute dtype the plan does model)"
        )
    if cfg.launcher.config_file:
        unmodelled.append(
            f"launcher.config_file={cfg.launcher.config_file}: the plan models the launcher configs rlgen "
            "ships (launcher=accelerate, deepspeed_zero2, deepspeed_zero3, fsdp), not a file's"
        )
    if unmodelled:
        raise UserError("rlgen plan does not model the memory of:\n  " + "\n  ".join(unmodelled))


def require_startup(cfg: Any, policy: Any) -> None:
    """The refusals ``rlgen train`` makes at startup, once its engine and model exist, that the config and
    the model already decide: the EMA under FSDP (``recipes/flow_run.py``), fp16 compute under DeepSpeed
    without its fp16 mode (``training/distributed/dist.py``), GARDO's reference refresh under a sharding
    launcher or for a family that cannot refresh (``recipes/gardo.py``). The plan calls the run's own
    checks, so it stops (exit code 2, the run's message) where the run would.

    Raises:
        UserError: Naming the setting and the fix, as ``rlgen train`` does.
    """
    from rlgen_cli.recipes.flow_run import require_ema_engine
    from rlgen_cli.recipes.gardo import GardoHooks
    from rlgen_cli.training.distributed.dist import require_deepspeed_scaling

    kind = LAUNCH_KINDS[cfg.launcher.name]
    require_ema_engine(cfg.algo.ema.enabled, fsdp=kind == "fsdp")
    if kind in ("zero2", "zero3"):
        require_deepspeed_scaling(cfg.model.dtype, cfg.launcher.mixed_precision)
    if getattr(cfg.algo, "gardo", None) is not None:
        dist = types.SimpleNamespace(sharded=cfg.launcher.shards_weights)  # what the engine would shard
        GardoHooks.for_run(
            types.SimpleNamespace(cfg=cfg, start_epoch=0, dist=dist, policy=policy, device=META)
        )


def plan_run(cfg: Any) -> dict[str, Any]:
    """The plan of the training run ``cfg`` describes (a validated flow training config), as a dict."""
    from rlgen_cli.training.memory.plan import GIB, Epoch, device_fits, plan_memory, smallest_fix

    refuse_unmodelled(cfg)
    held, reward_notes = reward_rows(cfg)  # a reward it cannot count stops the plan before any build
    prompt = planning_prompt(cfg)
    model_cfg, model_note = planned_model(cfg.model)
    policy = build_on_meta(model_cfg)
    require_startup(cfg, policy)
    components = components_of(policy)
    groups = param_groups(components)
    trained = tuple(name for name, module in components.items() if _trains(module))
    encode = conditioning_of(policy, cfg, prompt)
    shape_of(cfg).require_plannable(cfg, policy)
    tracer = tracer_for(cfg, policy, [components[name] for name in trained], encode)
    try:
        training = training_of(cfg, components, trained, held=(*held, *cache_rows(policy, tracer)))
        activations = trace_activations(policy, cfg, [components[name] for name in trained], encode)
        epoch = Epoch(
            shape_of(cfg).samples_per_epoch(cfg),
            tracer.kept_per_sample(),
            tracer.rollout_peak,
            tracer.step_peak,
            update_copies=tracer.update_copies,
            update_global_copies=tracer.update_global_copies,
            phase=tracer.phase,
        )
        launch = launch_of(cfg.launcher)
        plan = plan_memory(groups, activations, launch, training, epoch)
        device_bytes = int(cfg.plan.device_memory_gb * GIB)
        fix = smallest_fix(groups, activations, launch, training, epoch, device_bytes, cfg.plan.headroom)
        devices = device_fits(groups, activations, launch, training, epoch, cfg.plan.headroom)
    except (RuntimeError, NotImplementedError) as err:
        raise UserError(
            f"model.family={cfg.model.family}: its training step reads tensor values the meta device does "
            f"not have ({str(err).splitlines()[0]}); plan its tiny variant (model.tiny=true) at the run's "
            "resolution instead"
        ) from err
    notes = [note for note in (model_note, *reward_notes) if note]
    how = [] if fix is None else [_setting_or_note(step) for step in fix.how]
    return {
        "model": cfg.model.family,
        "recipe": cfg.recipe,
        "launcher": cfg.launcher.name,
        "processes": cfg.launcher.world_size,
        "micro_batch": training.micro_batch,
        "micro_batch_unit": shape_of(cfg).micro_batch_unit(cfg),
        "sample_batch": training.sample_batch,
        "timesteps_per_pass": getattr(cfg.algo, "timesteps_per_pass", 1),
        "resolution": [*_size(cfg.model), cfg.model.num_frames],
        "gradient_checkpointing": training.gradient_checkpointing,
        "rows": [{"what": r.what, "bytes": r.nbytes, "note": r.note} for r in plan.rows],
        "peaks": [{"what": r.what, "bytes": r.nbytes, "note": r.note} for r in plan.peaks],
        "notes": notes,
        "activations": {
            "plain_bytes": activations.at(training.micro_batch, False),
            "checkpointed_bytes": activations.at(training.micro_batch, True),
        },
        "step_peak_bytes": tracer.step_peak(training.micro_batch, training.gradient_checkpointing),
        "rollout_peak_bytes": tracer.rollout_peak(training.sample_batch),
        "kept_per_sample_bytes": epoch.kept_per_sample,
        "state_bytes": plan.state,
        "total_bytes": plan.total,
        "device_bytes": device_bytes,
        "usable_bytes": int(device_bytes * (1 - cfg.plan.headroom)),
        "fits": plan.fits(device_bytes, cfg.plan.headroom),
        "devices": [
            {
                "device_gb": device.device_gb,
                "changes": list(device.changes),
                "how": [_setting_or_note(step) for step in device.how],
                "total_bytes": device.plan.total,
            }
            for device in devices
        ],
        "fix": None
        if fix is None
        else {
            "changes": list(fix.changes),
            "how": how,
            "total_bytes": fix.plan.total,
            "fits": fix.fits,
        },
    }


def _setting_or_note(override: str) -> str:
    """``override`` as it is, or, when its key is not a setting of this version, what to do instead."""
    from rlgen_cli.schema.run import ModelConfig

    key = override.split("=", 1)[0]
    if (
        key == "model.gradient_checkpointing"
        and "gradient_checkpointing" not in ModelConfig.__dataclass_fields__
    ):
        return "(gradient checkpointing: enable_gradient_checkpointing() on the transformer; no setting yet)"
    return override


# -- the model on the meta device ----------------------------------------------------------------------
def planned_model(model_cfg: Any) -> tuple[Any, str | None]:
    """The model config to build: a pretrained family with a real-size variant is planned on that
    architecture (``model.weights=random_init``: the checkpoint its conf option names), so planning reads
    no weights and downloads nothing; and a note saying so."""
    import dataclasses

    from rlgen_cli.schema.run import REAL_SIZE_VARIANTS

    if model_cfg.tiny or model_cfg.weights == "random_init" or model_cfg.family not in REAL_SIZE_VARIANTS:
        return model_cfg, None
    variant = REAL_SIZE_VARIANTS[model_cfg.family][0]
    note = (
        f"model.path={model_cfg.path} is planned as the architecture of {variant} (model.weights=random_init); "
        "its weights are not read"
    )
    return dataclasses.replace(model_cfg, weights="random_init", variant="auto"), note


def build_on_meta(model_cfg: Any) -> Any:
    """The policy of ``model_cfg`` with every weight on the meta device. Tiny families are built (small)
    then moved; real ones are created with empty weights, so nothing of their size is ever allocated."""
    from rlgen_cli.models import build_policy

    loads = not model_cfg.tiny and model_cfg.weights != "random_init"  # random_init builds on META itself
    with empty_weights(loads):
        try:
            policy = build_policy(model_cfg, META)
        except (NotImplementedError, RuntimeError, OSError, ValueError) as err:
            raise UserError(
                f"model.family={model_cfg.family} could not be built on the meta device for planning: {err}"
            ) from err
    for module in components_of(policy).values():
        if hasattr(module, "tie_weights"):  # moving a built model to meta unties shared embeddings (T5's)
            module.tie_weights()
    return policy


def components_of(policy: Any) -> dict[str, nn.Module]:
    """The policy's modules by name (a diffusers pipeline's components, the policy's own module
    attributes, or those of the object holding its network: BAGEL's ``owner.transformer``), each once."""
    found: dict[str, nn.Module] = {}
    holders = (policy, *(getattr(policy, name, None) for name in ("pipeline", "_holder", "owner")))
    for holder in holders:
        if holder is None:
            continue
        items = getattr(holder, "components", None)
        items = items.items() if isinstance(items, dict) else vars(holder).items()
        for name, value in items:
            if isinstance(value, nn.Module) and all(value is not m for m in found.values()):
                found[name.lstrip("_")] = value
    return found


def _trains(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def param_groups(components: dict[str, nn.Module]) -> list[Any]:
    """Parameters and buffers per (component, dtype, trainable, LoRA), each tensor counted once."""
    from rlgen_cli.training.memory.plan import ParamGroup

    counts: dict[tuple[str, str, bool, bool], int] = {}
    seen: set[int] = set()
    for component, module in components.items():
        named = [(n, t, t.requires_grad) for n, t in module.named_parameters()]
        named += [(n, t, False) for n, t in module.named_buffers()]
        for name, tensor, trainable in named:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            key = (component, str(tensor.dtype).removeprefix("torch."), trainable, "lora_" in name)
            counts[key] = counts.get(key, 0) + tensor.numel()
    return [
        ParamGroup(c, dtype, numel, trainable, lora) for (c, dtype, trainable, lora), numel in counts.items()
    ]


def _module_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def training_of(
    cfg: Any, components: dict[str, nn.Module], trained: tuple[str, ...], held: tuple[Any, ...] = ()
) -> Any:
    """What the recipe keeps besides weights and optimizer, its micro-batch and sampling batch per
    process; ``held``: other rows kept whatever the phase (prompt caches, declared reward models)."""
    from rlgen_cli.training.memory.plan import Training

    modules = [components[name] for name in trained]
    blocks = [block for module in modules for block in repeated_blocks(module)]
    shape = shape_of(cfg)
    batch, setting = shape.micro_batch(cfg)
    exact = cfg.launcher.reduces_exactly and LAUNCH_KINDS[cfg.launcher.name] in ("local", "ddp")
    trainable_tensors = sum(p.requires_grad for m in modules for p in m.parameters())
    return Training(
        micro_batch=batch,
        gradient_checkpointing=any(getattr(m, "gradient_checkpointing", False) for m in modules),
        ema=cfg.algo.ema.enabled,
        full_reference=not cfg.model.lora.enabled,
        trained=trained,
        largest_block_bytes=max((_module_bytes(b) for b in blocks), default=0),
        accumulation=shape.micro_batches_per_process(cfg),
        micro_batch_setting=setting,
        accumulation_setting=shape.accumulation_setting,
        weight_copies=shape.weight_copies(cfg),
        sample_batch=cfg.algo.sample_batch_size,
        exact_sum_tensors=trainable_tensors if exact else 0,
        held=held,
    )


def launch_of(launcher: Any) -> Any:
    from rlgen_cli.training.memory.plan import Launch

    return Launch(LAUNCH_KINDS[launcher.name], launcher.world_size)


# -- activations ---------------------------------------------------------------------------------------


def trace_activations(policy: Any, cfg: Any, trained: list[nn.Module], encode: Encode) -> Any:
    """Saved-for-backward bytes of one training forward at ``algo.train_batch_size`` (each sample as many
    rows as one call folds of its trained steps, ``algo.timesteps_per_pass``), with gradient checkpointing
    off (the trace attributes them to blocks; the checkpointed figure follows). For the table: the plan's
    total comes from the traced step (:class:`EpochTracer`)."""
    from rlgen_cli.training.memory.plan import Activations

    batch, _ = micro_batch_of(cfg)
    with gradient_checkpointing(trained, False):
        saved = _trace(policy, cfg, batch * rows_per_unit(cfg) * folded_steps(cfg), trained, encode)
    return Activations.from_two(
        batch, (saved.total, saved.checkpointed), batch, (saved.total, saved.checkpointed)
    )


def _trace(policy: Any, cfg: Any, rows: int, trained: list[nn.Module], encode: Encode) -> Any:
    from rlgen_cli.models.base import cfg_gradient
    from rlgen_cli.training.memory.trace import trace_saved

    cond = encode(rows)
    x = policy.noise(rows)
    sigma = torch.full((rows,), TRACE_SIGMA, device=META)
    cfg_grad = getattr(cfg.algo, "cfg_grad", "both")

    def forward() -> Tensor:
        with cfg_gradient(cfg_grad):
            return (
                policy.velocity(x, sigma, cond).square().mean()
            )  # the loss saves the velocity, as training's

    weights = [t for m in components_of(policy).values() for t in (*m.parameters(), *m.buffers())]
    blocks = [block for module in trained for block in repeated_blocks(module)]
    return trace_saved(forward, weights, blocks)


def planning_prompt(cfg: Any) -> str:
    """The prompt the plan encodes: the longest of the run's training and test prompts (families that trim
    the text padding keep as many tokens as a batch's longest prompt). An unreadable prompt file stops the
    plan as it would stop the run, naming the setting."""
    from pathlib import Path

    from rlgen_cli.data.paths import load_prompts

    workdir = Path(cfg.run_dir) if cfg.run_dir else None  # where a generated set (tiny_edit) is written
    sets = ((cfg.data.train, "data.train"), (cfg.data.test, "data.test"))
    return max((ex.prompt for spec, key in sets for ex in load_prompts(spec, workdir, key)), key=len)


def conditioning_of(policy: Any, cfg: Any, prompt: str) -> Encode:
    """How the plan encodes ``batch`` copies of ``prompt`` (and source images) on the meta device, shaped
    as the run's: a tiny family encodes on the CPU (its encoders are small, and they read their masks'
    values, which meta tensors do not have) with one CPU twin; a real one on the meta device."""
    from rlgen_cli.training.memory.trace import autocast_on_meta, meta_values

    if not cfg.model.tiny:

        def encode_on_meta(batch: int) -> Any:
            prompts = [prompt] * batch
            images = torch.zeros(batch, 3, *_size(cfg.model), device=META) if _takes_images(policy) else None
            with autocast_on_meta(), meta_values():
                return policy.encode(prompts, images)

        return encode_on_meta
    from rlgen_cli.models import build_policy

    twin = build_policy(dataclasses.replace(cfg.model, prompt_cache_mb=0.0), torch.device("cpu"))

    def encode_on_cpu(batch: int) -> Any:
        images = torch.rand(batch, 3, *_size(cfg.model)) if _takes_images(policy) else None
        with torch.no_grad():
            cond = twin.encode([prompt] * batch, images)
        # integer tensors (masks, source shapes) stay on the CPU: the model reads their values
        tensors = {k: v.to(META) if v.is_floating_point() else v for k, v in cond.tensors.items()}
        return type(cond)(tensors, dict(cond.extras))

    return encode_on_cpu


def _takes_images(policy: Any) -> bool:
    return policy.capabilities.takes_source_images


def _size(model_cfg: Any) -> tuple[int, int]:
    return model_cfg.height or model_cfg.resolution, model_cfg.width or model_cfg.resolution


# -- the epoch, run on the meta device -------------------------------------------------------------------


def tracer_for(cfg: Any, policy: Any, trained: list[nn.Module], encode: Encode) -> EpochTracer:
    """The tracer of ``cfg.recipe``'s epoch."""
    return shape_of(cfg).tracer(cfg, policy, trained, encode)


def cache_rows(policy: Any, tracer: EpochTracer) -> list[Any]:
    """The policy's prompt caches: the prompts' at its cap (``model.prompt_cache_mb``: a long run sees
    enough prompts to fill it); the negative prompt's, keyed by batch size, at most one entry per size
    up to the largest batch the run encodes (sampling, or a training call's rows)."""
    from rlgen_cli.models.prompt_cache import PromptCache
    from rlgen_cli.training.memory.plan import Row

    prompts = getattr(policy.encode, "cache", None)
    holders = [policy, *(v for v in vars(policy).values() if hasattr(v, "__dict__"))]
    negatives = {
        id(v): v for h in holders for v in vars(h).values() if isinstance(v, PromptCache) and v is not prompts
    }
    rows = []
    if isinstance(prompts, PromptCache):
        rows.append(
            Row("prompt cache", prompts.max_bytes, "model.prompt_cache_mb: its cap, which a long run fills")
        )
    largest = tracer.largest_encode()
    for cache in negatives.values():
        sizes = largest * (largest + 1) // 2  # one entry of n rows for every n ≤ largest
        nbytes = min(cache.max_bytes, sizes * tracer.negative_per_sample())
        rows.append(Row("negative-prompt cache", nbytes, f"an entry per batch size, up to {largest} rows"))
    return rows


# -- output ----------------------------------------------------------------------------------------------
