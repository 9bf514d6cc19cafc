"""``rlgen plan``: the memory one training process needs, whether it fits a device, and what makes it fit.

It composes exactly the config ``rlgen train`` would run, builds that run's model on the meta device
(every tensor a shape and a dtype, nothing allocated: a 20 B-parameter model plans on a laptop; a
pretrained family is built as its real-size architecture, ``models/real_size.py``, so no weight is read),
then

1. counts parameters and buffers per component (transformer, text encoders, VAE, …), dtype, frozen or
   trainable, LoRA or base, and the local reward models;
2. traces one training forward of the trained model at the configured resolution, frames, prompt length
   and micro-batch (``training/memory_trace.py``: exact saved-for-backward bytes, attributed to blocks, so
   the same trace gives the figure with gradient checkpointing), at micro-batches 1 and
   ``algo.train_batch_size`` so a smaller micro-batch can be priced;
3. adds gradients, optimizer states, EMA, reference copy and the launcher's own buffers, sharded as the
   launcher shards them (``training/memory_plan.py``), and checks ``plan.device_memory_gb`` less
   ``plan.headroom``; when it does not fit, searches the cheapest change that does.

It prints a table (or ``plan.format=json``), writes ``plan.json`` into its run directory, and exits 0
when the run fits, 1 when it does not. What it cannot count (a reward model loaded on its first score)
is named under the table, never left out silently. The conditioning of a tiny family is encoded by a
CPU twin (its encoders read their masks' values); a real one's on the meta device, where integer tensors
stay on the CPU (``training/memory_trace.py``). Flow recipes only: VLM and R3 runs stop with exit code 2.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from rlgen_cli.schema.errors import UserError
from rlgen_cli.tasks.common import run_dir_of, user_errors, validated

log = logging.getLogger(__name__)

EXIT_DOES_NOT_FIT = 1
FLOW_RECIPES = ("flow_grpo", "flow_pref", "flow_pretrain", "flow_forward")
LAUNCH_KINDS = {
    "local": "local", "accelerate": "ddp", "multinode": "ddp", "deepspeed_zero2": "zero2",
    "deepspeed_zero3": "zero3", "fsdp": "fsdp",
}  # fmt: skip
META = torch.device("meta")
TRACE_PROMPT = "a photo of a red cube to the left of a blue sphere"
TRACE_SIGMA = 0.5


@user_errors
def plan_task(cfg: DictConfig) -> dict[str, Any]:
    """Returns the plan as the JSON object it prints with ``plan.format=json``."""
    typed = validated(cfg)
    if typed.recipe not in FLOW_RECIPES:
        raise UserError(
            f"rlgen plan covers the flow-model recipes ({', '.join(FLOW_RECIPES)}); recipe={typed.recipe} "
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


def plan_run(cfg: Any) -> dict[str, Any]:
    """The plan of the training run ``cfg`` describes (a validated flow training config), as a dict."""
    from rlgen_cli.training.memory_plan import GIB, plan_memory, smallest_fix

    model_cfg, model_note = planned_model(cfg.model)
    policy = build_on_meta(model_cfg)
    components = components_of(policy)
    groups = param_groups(components)
    trained = tuple(name for name, module in components.items() if _trains(module))
    training = training_of(cfg, components, trained)
    try:
        activations = trace_activations(policy, cfg, [components[name] for name in trained])
    except (RuntimeError, NotImplementedError) as err:
        raise UserError(
            f"model.family={cfg.model.family}: its training forward reads tensor values the meta device does "
            f"not have ({str(err).splitlines()[0]}); plan its tiny variant (model.tiny=true) at the run's "
            "resolution instead"
        ) from err
    rewards, not_counted = reward_groups(cfg)
    not_counted = [model_note, *not_counted] if model_note else not_counted
    groups += rewards
    launch = launch_of(cfg.launcher)
    plan = plan_memory(groups, activations, launch, training)
    device_bytes = int(cfg.plan.device_memory_gb * GIB)
    fix = smallest_fix(groups, activations, launch, training, device_bytes, cfg.plan.headroom)
    activation_bytes = activations.at(training.micro_batch, training.gradient_checkpointing)
    how = [] if fix is None else [_setting_or_note(step) for step in fix.how]
    return {
        "model": cfg.model.family, "recipe": cfg.recipe, "launcher": cfg.launcher.name,
        "processes": cfg.launcher.world_size, "micro_batch": training.micro_batch,
        "resolution": [*_size(cfg.model), cfg.model.num_frames],
        "gradient_checkpointing": training.gradient_checkpointing,
        "rows": [{"what": r.what, "bytes": r.nbytes, "note": r.note} for r in plan.rows],
        "notes": not_counted,
        "activations": {
            "plain_bytes": activations.at(training.micro_batch, False),
            "checkpointed_bytes": activations.at(training.micro_batch, True),
        },
        "state_bytes": plan.total - activation_bytes,
        "total_bytes": plan.total, "device_bytes": device_bytes,
        "usable_bytes": int(device_bytes * (1 - cfg.plan.headroom)),
        "fits": plan.fits(device_bytes, cfg.plan.headroom),
        "fix": None if fix is None else {
            "changes": list(fix.changes), "how": how, "total_bytes": fix.plan.total, "fits": fix.fits,
        },
    }  # fmt: skip


def _setting_or_note(override: str) -> str:
    """``override`` as it is, or, when its key is not a setting of this version, what to do instead."""
    from rlgen_cli.schema.flow import ModelConfig

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

    from rlgen_cli.schema.flow import REAL_SIZE_VARIANTS

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
    with _empty_weights(loads):
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


@contextlib.contextmanager
def _empty_weights(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        yield


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
    from rlgen_cli.training.memory_plan import ParamGroup

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


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks: every element of the module lists directly under ``module`` (diffusers'
    ``transformer_blocks``, ``single_transformer_blocks``, ``blocks``, ``layers``, …) — what gradient
    checkpointing wraps and FSDP / ZeRO-3 gather one at a time. A network that keeps them deeper (BAGEL's
    ``language_model.model.layers``) names them by its checkpointing switch: the module lists of the
    submodules that carry a ``gradient_checkpointing`` attribute."""
    blocks = _blocks_in(module)
    if blocks:
        return blocks
    for sub in module.modules():
        if sub is not module and hasattr(sub, "gradient_checkpointing"):
            blocks += _blocks_in(sub)
    return blocks


def _blocks_in(module: nn.Module) -> list[nn.Module]:
    blocks: list[nn.Module] = []
    for child in module.children():
        if isinstance(child, nn.ModuleList):
            blocks += [block for block in child if any(True for _ in block.parameters())]
    return blocks


def _module_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def training_of(cfg: Any, components: dict[str, nn.Module], trained: tuple[str, ...]) -> Any:
    """What the recipe keeps besides weights and optimizer, and its micro-batch per process."""
    from rlgen_cli.training.memory_plan import Training

    modules = [components[name] for name in trained]
    blocks = [block for module in modules for block in repeated_blocks(module)]
    batch, setting = micro_batch_of(cfg)
    copies: tuple[str, ...] = ()
    if cfg.recipe == "flow_forward":
        copies = ("old policy",)
    elif cfg.recipe == "flow_pref" and cfg.algo.pref.loss == "dpo" and cfg.algo.pref.ref_update_step > 0:
        copies = ("online DPO reference",)
    return Training(
        micro_batch=batch,
        gradient_checkpointing=any(getattr(m, "gradient_checkpointing", False) for m in modules),
        ema=cfg.algo.ema.enabled,
        full_reference=not cfg.model.lora.enabled,
        trained=trained,
        largest_block_bytes=max((_module_bytes(b) for b in blocks), default=0),
        accumulation=cfg.algo.micro_batches_per_step(cfg.launcher.world_size) // cfg.launcher.world_size,
        micro_batch_setting=setting,
        weight_copies=copies,
    )


def micro_batch_of(cfg: Any) -> tuple[int, str | None]:
    """Samples in one gradient-carrying forward on one process, and the setting that chooses it (None when
    the recipe derives it): GRPO, NFT / AWM ``algo.train_batch_size``; DPO every pair's winner and loser at
    once; SFT the ``top_k`` of every group; pretraining its per-process share of the batch."""
    world = cfg.launcher.world_size
    if cfg.recipe == "flow_pref":
        prompts = max(cfg.algo.prompts_per_epoch // world, 1)
        if cfg.algo.pref.loss == "dpo":
            return 2 * prompts, None
        return cfg.algo.pref.top_k * prompts, None
    if cfg.recipe == "flow_pretrain":
        return max(cfg.algo.pretrain.batch_size // world, 1), None
    return cfg.algo.train_batch_size, "algo.train_batch_size"


def launch_of(launcher: Any) -> Any:
    from rlgen_cli.training.memory_plan import Launch

    return Launch(LAUNCH_KINDS[launcher.name], launcher.world_size)


# -- activations ---------------------------------------------------------------------------------------
def trace_activations(policy: Any, cfg: Any, trained: list[nn.Module]) -> Any:
    """Saved-for-backward bytes of one training forward at micro-batch 1 and ``algo.train_batch_size``,
    with gradient checkpointing off (the trace attributes them to blocks; the checkpointed figure follows)."""
    from rlgen_cli.training.memory_plan import Activations

    batch, _ = micro_batch_of(cfg)
    with _checkpointing_off(trained):
        one = _trace(policy, cfg, 1, trained)
        many = one if batch == 1 else _trace(policy, cfg, batch, trained)
    return Activations.from_two(1, (one.total, one.checkpointed), batch, (many.total, many.checkpointed))


def _trace(policy: Any, cfg: Any, batch: int, trained: list[nn.Module]) -> Any:
    from rlgen_cli.models.base import cfg_gradient
    from rlgen_cli.training.memory_trace import trace_saved

    cond = conditioning(policy, cfg, batch)
    x = policy.noise(batch)
    sigma = torch.full((batch,), TRACE_SIGMA, device=META)
    cfg_grad = getattr(cfg.algo, "cfg_grad", "both")

    def forward() -> Tensor:
        with cfg_gradient(cfg_grad):
            return (
                policy.velocity(x, sigma, cond).square().mean()
            )  # the loss saves the velocity, as training's

    weights = [t for m in components_of(policy).values() for t in (*m.parameters(), *m.buffers())]
    blocks = [block for module in trained for block in repeated_blocks(module)]
    return trace_saved(forward, weights, blocks)


def conditioning(policy: Any, cfg: Any, batch: int) -> Any:
    """The conditioning of ``batch`` prompts (and source images) on the meta device, shaped as the run's:
    a tiny family encodes on the CPU (its encoders are small, and they read their masks' values, which meta
    tensors do not have); a real one on the meta device."""
    from rlgen_cli.training.memory_trace import autocast_on_meta, meta_values

    prompts = [TRACE_PROMPT] * batch
    if not cfg.model.tiny:
        images = torch.zeros(batch, 3, *_size(cfg.model), device=META) if _takes_images(policy) else None
        with autocast_on_meta(), meta_values():
            return policy.encode(prompts, images)
    from rlgen_cli.models import build_policy

    twin = build_policy(cfg.model, torch.device("cpu"))
    images = torch.rand(batch, 3, *_size(cfg.model)) if _takes_images(policy) else None
    cond = twin.encode(prompts, images)
    # integer tensors (masks, source shapes) stay on the CPU: the model reads their values
    tensors = {k: v.to(META) if v.is_floating_point() else v for k, v in cond.tensors.items()}
    return type(cond)(tensors, dict(cond.extras))


def _takes_images(policy: Any) -> bool:
    return policy.capabilities.takes_source_images


@contextlib.contextmanager
def _checkpointing_off(modules: list[nn.Module]) -> Iterator[None]:
    """Trace the blocks' own saved tensors (checkpointing would hide them); the plan prices both."""
    switched = [m for m in modules if getattr(m, "gradient_checkpointing", False)]
    for module in switched:
        module.disable_gradient_checkpointing()
    try:
        yield
    finally:
        for module in switched:
            module.enable_gradient_checkpointing()


def _size(model_cfg: Any) -> tuple[int, int]:
    return model_cfg.height or model_cfg.resolution, model_cfg.width or model_cfg.resolution


# -- reward models ---------------------------------------------------------------------------------------
def reward_groups(cfg: Any) -> tuple[list[Any], list[str]]:
    """The weights of the rewards scored in the training process (served ones live elsewhere), built with
    empty weights and no network; and what could not be counted, with why."""
    from rlgen_cli.rewards.registry import REWARDS, build_reward
    from rlgen_cli.rewards.remote import client as remote
    from rlgen_cli.training.memory_plan import ParamGroup

    groups, not_counted = [], []
    for name in cfg.reward.weights:
        if getattr(REWARDS.get(name), "__module__", None) == remote.__name__:
            continue
        try:
            with _empty_weights(True), _offline():
                reward = build_reward(name, **dict(cfg.reward.kwargs.get(name, {})))
        except (OSError, ValueError, ImportError, RuntimeError) as err:
            not_counted.append(f"reward {name}: not built offline ({str(err).splitlines()[0]})")
            continue
        modules = _modules_in(reward)
        if not modules and hasattr(reward, "device"):  # a model-based reward (runs on a device)
            not_counted.append(
                f"reward {name} loads its model on the first score: its weights are not counted (lower "
                "plan.device_memory_gb by their size, or serve it: rlgen serve-reward)"
            )
        for module in modules:
            for dtype, numel in _dtype_counts(module).items():
                groups.append(ParamGroup(f"reward {name}", dtype, numel))
    return groups, not_counted


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    saved = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved


def _modules_in(obj: Any) -> list[nn.Module]:
    if isinstance(obj, nn.Module):
        return [obj]
    return (
        [value for value in vars(obj).values() if isinstance(value, nn.Module)]
        if hasattr(obj, "__dict__")
        else []
    )


def _dtype_counts(module: nn.Module) -> dict[str, int]:
    counts: dict[str, int] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        dtype = str(tensor.dtype).removeprefix("torch.")
        counts[dtype] = counts.get(dtype, 0) + tensor.numel()
    return counts


# -- output ----------------------------------------------------------------------------------------------
def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f}"


def print_report(report: dict[str, Any]) -> None:
    """The plan as a rich table, whether it fits, and the change that makes it fit."""
    from rich.table import Table

    from rlgen_cli.training.console import new_console

    height, width, frames = report["resolution"]
    title = (
        f"{report['model']} · {report['recipe']} · launcher={report['launcher']} × {report['processes']} · "
        f"micro-batch {report['micro_batch']} · {height}×{width}"
        + (f"×{frames} frames" if frames > 1 else "")
    )
    table = Table(title=f"memory per process — {title}", title_justify="left")
    table.add_column("what")
    table.add_column("GiB", justify="right")
    table.add_column("note", style="dim")
    for row in report["rows"]:
        table.add_row(row["what"], _gib(row["bytes"]), row["note"])
    table.add_section()
    table.add_row("total", _gib(report["total_bytes"]), f"device {_gib(report['device_bytes'])} GiB, "
                  f"usable {_gib(report['usable_bytes'])} GiB", style="bold")  # fmt: skip
    console = new_console()
    console.print(table)
    for line in report["notes"]:
        console.print(f"[yellow]note[/]: {line}", highlight=False)
    if report["fits"]:
        console.print(
            f"[bold green]fits[/]: {_gib(report['total_bytes'])} of {_gib(report['usable_bytes'])} GiB"
        )
        return
    console.print(
        f"[bold red]does not fit[/]: {_gib(report['total_bytes'])} GiB > {_gib(report['usable_bytes'])} GiB"
    )
    fix = report["fix"]
    verdict = "fits" if fix["fits"] else "still does not fit"
    console.print(
        f"smallest change: {' + '.join(fix['changes'])} → {_gib(fix['total_bytes'])} GiB ({verdict})"
    )
    console.print(f"  {' '.join(fix['how'])}", markup=False, highlight=False)
