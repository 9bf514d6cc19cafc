"""``rlgen eval``: checkpoint (or base model) × test prompts × rewards → ``results.json`` and a table."""

from __future__ import annotations

import json
import logging

import torch
from omegaconf import DictConfig

from rlgen_cli.schema.families import family_spec
from rlgen_cli.tasks.common import refuse_overrides, run_dir_of, user_errors, validated
from rlgen_cli.tasks.prerequisites import (
    Prerequisites,
    checkpoint_problems,
    data_problems,
    model_problems,
    model_sections,
    reward_problems,
)

RESULTS = "results.json"
SAMPLES = "samples.jsonl"
log = logging.getLogger(__name__)


TRAINING_DATA = {
    "data.train": "it names rlgen train's prompts; rlgen eval scores the test prompts, data.test",
    "data.eval_num_prompts": "it sizes rlgen train's periodic evaluation; rlgen eval scores the first "
    "max_prompts test prompts (0 = all): set max_prompts",
    "data.eval_images_per_prompt": "it sizes rlgen train's periodic evaluation; rlgen eval draws "
    "images_per_prompt images per test prompt: set images_per_prompt",
}
"""The ``data`` keys ``rlgen eval`` composes (the data options are shared with training) and never reads."""

R3_DATA = {
    "data.test": "a unified policy's evaluation reads its prompts from r3.val_data_path (r3.dataset_name "
    "says their format): set r3.val_data_path",
}
"""The ``data`` keys R3's evaluation does not read either."""


@user_errors
def eval_task(cfg: DictConfig) -> float:
    """Returns the mean mixed reward (the number a sweeper would optimise)."""
    typed = validated(cfg)
    refuse_overrides(TRAINING_DATA, "eval")
    kind = family_spec(typed.model.family).kind  # what is evaluated is the model, whatever trained it
    if kind == "unified":  # multi-round reflect → refine evaluation of a unified policy
        refuse_overrides(R3_DATA, "eval")
        return _eval_r3(typed, cfg)
    if kind == "vlm":  # benchmark accuracy of a multimodal LLM
        return _eval_vlm(typed, cfg)
    from rlgen_cli.data.images import source_images
    from rlgen_cli.data.paths import load_prompts
    from rlgen_cli.rewards import RewardBatch, build_mix
    from rlgen_cli.sde.sampling import sample_images
    from rlgen_cli.tasks.loading import describe_model, load_policy, with_checkpoint_model
    from rlgen_cli.training.reporting.images import save_grid
    from rlgen_cli.training.reporting.progress import Progress
    from rlgen_cli.training.reporting.report import detail_summaries
    from rlgen_cli.training.reporting.run_dir import prepare_run_dir, setup_logging

    missing = Prerequisites().add(checkpoint_problems(typed.checkpoint, "checkpoint"))
    if not missing.missing:  # the checkpoint's own model draws: resolved.yaml records it
        cfg = with_checkpoint_model(cfg, typed.checkpoint, "eval")
        typed = validated(cfg)
    run_dir = prepare_run_dir(run_dir_of(typed), cfg)
    setup_logging(run_dir)
    # before the reward and the policy load: every missing file, weight and server at once
    missing.add(data_problems(typed, run_dir, ("test",))).add(model_problems(typed))
    missing.add(reward_problems(typed)).require()
    log.info("evaluating %s", describe_model(typed.model, typed.checkpoint))
    dataset = load_prompts(typed.data.test, run_dir, "data.test")
    examples = list(dataset)[: typed.max_prompts or len(dataset)]
    examples = [ex for ex in examples for _ in range(typed.images_per_prompt)]
    reward = build_mix(dict(typed.reward.weights), **{k: dict(v) for k, v in typed.reward.kwargs.items()})
    policy = load_policy(typed.model, typed.checkpoint, typed.device)
    num_steps = typed.num_steps or policy.cfg.eval_num_steps
    prompts = [ex.prompt for ex in examples]
    sources = None
    if policy.capabilities.takes_source_images:  # editing models: each row's source image
        height, width = policy.cfg.height or policy.cfg.resolution, policy.cfg.width or policy.cfg.resolution
        sources = source_images(examples, dataset, height, width)
    with Progress(typed.progress) as progress:
        task = progress.task("sampling", total=len(prompts))
        images = sample_images(
            policy,
            prompts,
            num_steps,
            typed.batch_size,
            typed.seed,
            sources=sources,
            on_batch=lambda n: progress.advance(task, n),
        )
    metadata = [dict(ex.metadata) for ex in examples]
    result = reward.score(RewardBatch(prompts=prompts, images=images, metadata=metadata, ref_images=sources))
    summary = _summary(result.scores, {name: result.details[name] for name in reward.rewards})
    summary["details"] = detail_summaries(result.details, by_tag=True)
    summary |= {"checkpoint": typed.checkpoint, "num_samples": len(examples), "num_steps": num_steps}
    summary["model"] = describe_model(typed.model, typed.checkpoint)
    (run_dir / RESULTS).write_text(json.dumps(summary, indent=2), encoding="utf-8")
    with (run_dir / SAMPLES).open("w", encoding="utf-8") as out:
        for i, ex in enumerate(examples):
            row = {"index": ex.index, "prompt": ex.prompt, "reward": _finite(result.scores[i])}
            row |= {name: _finite(result.details[name][i]) for name in reward.rewards}
            out.write(json.dumps(row) + "\n")
    if typed.save_images:
        save_grid(images, run_dir / "eval_grid.png", upscale=2)
    _print_table(summary, run_dir)
    _print_tag_tables(summary["details"], list(reward.rewards))
    return summary["reward"]["mean"]


def _eval_vlm(typed, cfg: DictConfig) -> float:
    """Benchmark accuracy of a multimodal LLM (its checkpoint's saved model with the command line's
    decoding / dtype overrides on top, as ``load_vlm`` builds it)."""
    from rlgen_cli.recipes.vlm_rl import evaluate
    from rlgen_cli.tasks.loading import describe_model, with_checkpoint_model
    from rlgen_cli.training.reporting.run_dir import prepare_run_dir, setup_logging

    missing = Prerequisites().add(checkpoint_problems(typed.checkpoint, "checkpoint"))
    if not missing.missing:
        cfg = with_checkpoint_model(cfg, typed.checkpoint, "eval")
        typed = validated(cfg)
    run_dir = prepare_run_dir(run_dir_of(typed), cfg)
    setup_logging(run_dir)
    missing.add(data_problems(typed, run_dir, ("test",))).add(model_problems(typed)).require()
    log.info("evaluating %s", describe_model(typed.model, typed.checkpoint))
    return evaluate(typed, cfg)


def _eval_r3(typed, cfg: DictConfig) -> float:
    """Per-round accuracy by tag, change fractions and finish rate; returns the last round's overall."""
    from rich.console import Console

    from rlgen_cli.r3.evaluate import run_evaluation
    from rlgen_cli.tasks.loading import describe_model, with_checkpoint_policy
    from rlgen_cli.training.reporting.run_dir import prepare_run_dir, setup_logging

    missing = Prerequisites().add(checkpoint_problems(typed.checkpoint, "checkpoint"))
    if not missing.missing:  # the checkpoint's own policy answers: resolved.yaml records it
        cfg = with_checkpoint_policy(cfg, typed.checkpoint)
        typed = validated(cfg)
    run_dir = prepare_run_dir(run_dir_of(typed), cfg)
    setup_logging(run_dir)
    missing.add(model_problems(typed)).add(reward_problems(typed)).require()
    for key, model in model_sections(typed):
        log.info("evaluating %s: %s", key, describe_model(model, typed.checkpoint))
    summary = run_evaluation(typed, run_dir)
    console = Console()
    console.print(summary["table"], highlight=False, markup=False)
    console.print(f"results: {run_dir / RESULTS}")
    return summary[f"round_{typed.r3.eval_rounds}/overall"]


def _finite(value: torch.Tensor | float) -> float | None:
    value = float(value)
    return value if value == value else None  # NaN → null in JSON


def _stats(values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {
        "mean": values.mean().item(),
        "std": values.std().item() if values.numel() > 1 else 0.0,
        "min": values.min().item(),
        "max": values.max().item(),
    }


def _summary(total: torch.Tensor, components: dict[str, torch.Tensor]) -> dict:
    return {
        "reward": _stats(total),
        "components": {k: _stats(torch.as_tensor(v)) for k, v in components.items()},
    }


def _print_table(summary: dict, run_dir) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rlgen eval — {summary['num_samples']} samples, {summary['num_steps']} steps")
    for column in ("reward", "mean", "std", "min", "max"):
        table.add_column(column, justify="left" if column == "reward" else "right")
    rows = [("mix", summary["reward"]), *summary["components"].items()]
    for name, stats in rows:
        table.add_row(name, *(f"{stats[k]:+.5g}" for k in ("mean", "std", "min", "max")))
    console = Console()
    console.print(table)
    console.print(f"results: {run_dir / RESULTS}")


def _print_tag_tables(details: dict[str, float], rewards: list[str]) -> None:
    """Per-tag accuracy tables of the rewards that report prompt tags (GenEval-style, ShapesEval)."""
    from rich.console import Console

    from rlgen_cli.training.reporting.report import SHAPES_COLUMNS, has_tag_breakdown, tag_table

    for name in rewards:
        columns = [(m, t) for m, t in SHAPES_COLUMNS if has_tag_breakdown(details, name, m, prefix="")]
        if columns:
            Console().print(
                f"{name} by tag\n" + tag_table(details, name, columns, prefix=""), highlight=False
            )
