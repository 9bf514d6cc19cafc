"""The ``rlgen`` command: typer owns the verbs, Hydra owns everything after the verb.

Each verb forwards its extra arguments unchanged to ``@hydra.main`` (see ``_hydra.py``), so
``rlgen train model=tiny_sd3 -m algo.lr=1e-4,3e-4``, ``--cfg job``, ``--info`` and ``--config-dir``
work as in any Hydra application. Tasks are imported lazily: ``rlgen --help`` never imports torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import typer

from rlgen_cli import __version__
from rlgen_cli._hydra import EXIT_USER_ERROR, config_groups, run_hydra
from rlgen_cli.completion import HydraVerb, complete_group_name

HYDRA_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}


def _groups_epilog() -> str:
    try:
        groups = config_groups()
    except FileNotFoundError:
        return ""
    lines = [f"{name}=  {' | '.join(opts) or '(none)'}" for name, opts in groups.items()]
    return (
        "Config groups (pick one with group=option; override any key with key=value):\n\n"
        + "\n\n".join(lines)
        + "\n\nlauncher= spreads ONE run over devices; Hydra's hydra/launcher= places sweep (-m) jobs."
    )


app = typer.Typer(
    name="rlgen",
    help="Online reinforcement learning for generative models.",
    no_args_is_help=True,
    add_completion=True,  # rlgen --install-completion [bash|zsh|fish]
    rich_markup_mode=None,
)


HYDRA_COMPLETION_FLAGS = ("-sc", "--shell-completion", "--shell_completion")


def _forward(verb_module: str, function: str, config_name: str, ctx: typer.Context) -> None:
    if any(arg.split("=", 1)[0] in HYDRA_COMPLETION_FLAGS for arg in ctx.args):
        # Hydra's script would call `rlgen -sc query=…`, which the verbs cannot answer
        typer.secho(
            "rlgen completes its verbs, config groups and options itself: run `rlgen --install-completion` "
            "(bash, zsh or fish; `rlgen --show-completion SHELL` prints the script) instead of Hydra's -sc",
            fg="red",
            err=True,
        )
        raise typer.Exit(EXIT_USER_ERROR)
    task = getattr(importlib.import_module(f"rlgen_cli.tasks.{verb_module}"), function)
    run_hydra(task, config_name, ctx.args)


@app.command(cls=HydraVerb, context_settings=HYDRA_CONTEXT, epilog=_groups_epilog())
def train(ctx: typer.Context) -> None:
    """Train a policy online: rollout → reward → advantages → update (Hydra overrides follow).

    With no model=/algo=/reward=/data=/sampler=/experiment= choice it runs ShapesEval
    (experiment=shapes_nft); any choice starts from neutral defaults instead.
    """
    _forward("train", "train_task", "train", ctx)


@app.command(cls=HydraVerb, context_settings=HYDRA_CONTEXT, epilog=_groups_epilog())
def sample(ctx: typer.Context) -> None:
    """Draw images for prompts (optionally from a checkpoint): PNGs + manifest.jsonl."""
    _forward("sample", "sample_task", "sample", ctx)


@app.command(name="eval", cls=HydraVerb, context_settings=HYDRA_CONTEXT, epilog=_groups_epilog())
def evaluate(ctx: typer.Context) -> None:
    """Score a checkpoint (or the base model) on a test set with the configured rewards."""
    _forward("evaluate", "eval_task", "eval", ctx)


@app.command(name="check-onpolicy", cls=HydraVerb, context_settings=HYDRA_CONTEXT, epilog=_groups_epilog())
def check_onpolicy(ctx: typer.Context) -> None:
    """Roll out, recompute log-probs on the training path, and fail if |ratio − 1| exceeds the tolerance."""
    _forward("check_onpolicy", "check_onpolicy_task", "check_onpolicy", ctx)


@app.command(cls=HydraVerb, context_settings=HYDRA_CONTEXT, epilog=_groups_epilog())
def plan(ctx: typer.Context) -> None:
    """Memory per training process for plan.device_memory_gb: weights, LoRA, gradients, optimizer, EMA,
    activations… for the launcher; whether it fits, else the cheapest change (train's overrides follow)."""
    _forward("plan", "plan_task", "plan", ctx)


@app.command()
def plot(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories (each with a metrics.jsonl)."),
    out: Path = typer.Option(Path("curves.png"), "--out", "-o", help="PNG to write."),
) -> None:
    """Draw reward (train and eval) and KL curves of one or several runs into one PNG."""
    from rlgen_cli.training.reporting.plots import plot_runs

    missing = [str(d) for d in run_dirs if not (d / "metrics.jsonl").is_file()]
    if missing:
        typer.secho(
            f"no metrics.jsonl in: {', '.join(missing)}; pass run directories of rlgen train",
            fg="red",
            err=True,
        )
        raise typer.Exit(2)
    typer.echo(plot_runs(run_dirs, out))


@app.command(name="serve-reward", cls=HydraVerb, context_settings=HYDRA_CONTEXT, epilog=_groups_epilog())
def serve_reward(ctx: typer.Context) -> None:
    """Serve the rewards of reward.weights over HTTP (server.port, server.workers, server.token, …)."""
    _forward("serve_reward", "serve_reward_task", "serve_reward", ctx)


def _complete_ls_argument(ctx: typer.Context, incomplete: str) -> list[str]:
    """``rlgen ls <TAB>``: the config groups; after --keys, the recipe's sections."""
    if not ctx.params.get("keys"):
        return complete_group_name(incomplete)
    from rlgen_cli.tasks.ls import complete_section

    return complete_section(ctx.params.get("recipe"), incomplete)


def _complete_recipe(incomplete: str) -> list[str]:
    from rlgen_cli.schema.recipes import TRAIN_SCHEMAS

    return [recipe for recipe in TRAIN_SCHEMAS if recipe.startswith(incomplete)]


@app.command(name="ls")
def list_configs(
    group: str = typer.Argument(
        None, help="Only this group (with --keys: this section).", autocompletion=_complete_ls_argument
    ),
    keys: bool = typer.Option(
        False, "--keys", help="Every key with its type, default, valid values and docstring."
    ),
    recipe: str = typer.Option(
        None,
        "--recipe",
        help="With --keys: the recipe whose keys to list (flow_grpo).",
        autocompletion=_complete_recipe,
    ),
    markdown: bool = typer.Option(
        False, "--markdown", help="As Markdown: the groups' table of README, with --keys docs/settings.md."
    ),
) -> None:
    """List the config groups and their options, the model families and the reward names; with --keys,
    every setting (rlgen ls --keys model, rlgen ls --keys --recipe vlm_rl algo)."""
    if keys or markdown or recipe:
        _list_keys(group, recipe, keys, markdown)
        return
    groups = config_groups()
    if group is not None and group not in groups:
        typer.secho(f"no config group {group!r}; groups: {', '.join(groups)}", fg="red", err=True)
        raise typer.Exit(2)
    registries = _registries()
    for name, options in groups.items():
        if group in (None, name):
            typer.echo(f"{name}: {', '.join(options) or '(none)'}")
            for key, names in registries.get(name, {}).items():
                typer.echo(f"{key}: {', '.join(names)}")


def _list_keys(group: str | None, recipe: str | None, keys: bool, markdown: bool) -> None:
    """``rlgen ls --keys`` / ``--markdown``: what they print comes from ``tasks/ls.py``."""
    from rlgen_cli.errors import UserError
    from rlgen_cli.tasks.ls import keys_markdown, keys_text, options_table

    try:
        if recipe and not keys:
            raise UserError(f"--recipe {recipe} chooses whose keys --keys lists: add --keys")
        if markdown and keys and (group or recipe):
            raise UserError(
                "--keys --markdown prints every recipe's keys (docs/settings.md): drop GROUP and --recipe"
            )
        if keys:
            typer.echo(keys_markdown() if markdown else keys_text(recipe, group), nl=False)
        else:
            typer.echo(options_table(group), nl=False)
    except UserError as e:
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(EXIT_USER_ERROR) from None


def _registries() -> dict[str, dict[str, list[str]]]:
    """Names a config key takes beyond a group's files, by group: every model family (flow, VLM, R3)
    and every registered reward a mix can weigh (rewards without a group file included)."""
    from rlgen_cli.rewards import available
    from rlgen_cli.schema.families import FAMILY_NAMES

    families = sorted(FAMILY_NAMES)
    return {"model": {"model.family": families}, "reward": {"reward.weights": available()}}


@app.command()
def version() -> None:
    """Print the rlgen version."""
    typer.echo(__version__)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
