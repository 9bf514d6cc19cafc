"""Tab completion of the Hydra verbs' arguments (``rlgen --install-completion`` installs it for bash, zsh
and fish): config groups and their options from ``conf/`` (``model=`` → ``model=tiny_sd3``), Hydra's own
flags (``--multirun``, ``--cfg job``, …) and rlgen's options.

Shells hand the word being completed over differently: zsh and fish keep ``model=ti`` whole; bash splits
it at ``=`` (``COMP_WORDBREAKS``) into ``model``, ``=``, ``ti`` and inserts what comes back after the
``=``. :func:`complete_overrides` answers both. It reads only the file names under ``conf/``, so a
completion never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from typer.core import CompletionItem, TyperCommand

from rlgen_cli._hydra import config_groups

HYDRA_FLAGS = ("--multirun", "--cfg", "--resolve", "--info", "--package", "--config-dir", "--help")
FLAG_VALUES = {
    "--cfg": ("job", "hydra", "all"),
    "-c": ("job", "hydra", "all"),
    "--info": ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath"),
    "-i": ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath"),
}
_PREFIXES = ("+", "~", "++")  # add / delete a group choice


def complete_overrides(before: Sequence[str], incomplete: str) -> list[str]:
    """Completions of ``incomplete`` after the verb's earlier arguments ``before``.

    ``mod`` → ``model=flux``, ``model=sd3``, …; ``model=ti`` → ``model=tiny_sd3`` (zsh, fish); after
    bash's split (``before`` ending in ``model`` or ``model``, ``=``) → the bare options; ``--c`` →
    ``--cfg``, ``--config-dir``; after ``--cfg`` → ``job``, ``hydra``, ``all``.
    """
    groups = _groups()
    if before and before[-1] in FLAG_VALUES:
        return [v for v in FLAG_VALUES[before[-1]] if v.startswith(incomplete)]
    if incomplete.startswith("-"):
        return [flag for flag in HYDRA_FLAGS if flag.startswith(incomplete)]
    split_group = _bash_split_group(before, groups)
    if split_group is not None:  # bash: the word after "=" is being completed
        return [option for option in groups[split_group] if option.startswith(incomplete)]
    prefix = next((p for p in sorted(_PREFIXES, key=len, reverse=True) if incomplete.startswith(p)), "")
    body = incomplete[len(prefix) :]
    if "=" in body:
        group, _, partial = body.partition("=")
        options = groups.get(group, [])
        return [f"{prefix}{group}={option}" for option in options if option.startswith(partial)]
    matching = [group for group in groups if group.startswith(body)]
    if not body:  # nothing typed yet: the groups only, not every group × option
        return [f"{prefix}{group}=" for group in matching]
    return [f"{prefix}{group}={option}" for group in matching for option in groups[group]]


def _bash_split_group(before: Sequence[str], groups: dict[str, list[str]]) -> str | None:
    """The group whose option bash asks for after splitting ``group=…`` at ``=``: ``before`` ends in
    ``group`` (the cursor right after ``=``) or in ``group``, ``=`` (part of the option typed)."""
    words = list(before[:-1] if before and before[-1] == "=" else before)
    if not words:
        return None
    group = words[-1].lstrip("+~")
    return group if group in groups else None


def _groups() -> dict[str, list[str]]:
    try:
        return config_groups()
    except FileNotFoundError:
        return {}


class HydraVerb(TyperCommand):
    """A verb whose arguments Hydra parses: completes them with :func:`complete_overrides`."""

    def shell_complete(self, ctx, incomplete: str) -> list[CompletionItem]:  # type: ignore[no-untyped-def]
        return [CompletionItem(value) for value in complete_overrides(ctx.args, incomplete)]


def complete_group_name(incomplete: str) -> list[str]:
    """``rlgen ls <TAB>``: the config groups."""
    return [group for group in _groups() if group.startswith(incomplete)]
