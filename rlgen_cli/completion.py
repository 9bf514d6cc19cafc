"""Tab completion of the Hydra verbs' arguments (``rlgen --install-completion`` installs it for bash, zsh
and fish): config groups and their options from ``conf/`` (``model=`` → ``model=tiny_sd3``), Hydra's own
flags (``--multirun``, ``--cfg job``, …) and rlgen's options.

Shells hand the word being completed over differently: zsh and fish keep ``model=ti`` whole; bash splits
it at ``=`` (``COMP_WORDBREAKS``) into ``model``, ``=``, ``ti`` and inserts what comes back after the
``=``. :func:`complete_overrides` answers both. It reads only the file names under ``conf/``, so a
completion never imports torch.
"""

from __future__ import annotations

import os
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
    bash's split (``before`` ending in ``model``, ``=``) → the bare options, and nothing after another
    key's ``=`` (bash then completes file names); ``--c`` → ``--cfg``, ``--config-dir``; after ``--cfg``
    → ``job``, ``hydra``, ``all``.
    """
    groups = _groups()
    if before and before[-1] in FLAG_VALUES:
        return [v for v in FLAG_VALUES[before[-1]] if v.startswith(incomplete)]
    if incomplete.startswith("-"):
        return [flag for flag in HYDRA_FLAGS if flag.startswith(incomplete)]
    if before and before[-1] == "=":  # bash: the value after "key=" is being completed
        key = before[-2].lstrip("+~") if len(before) > 1 else ""
        return [option for option in groups.get(key, []) if option.startswith(incomplete)]
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


def bash_completes_after_equals() -> bool:
    """Whether bash asks for the word right after a ``=`` (its ``COMP_WORDS`` split ``key=`` into
    ``key``, ``=`` and the cursor is on the ``=``, which click hands over as an empty word)."""
    words, current = os.environ.get("COMP_WORDS"), os.environ.get("COMP_CWORD", "")
    if words is None or not current.isdigit():
        return False
    split = words.split("\n") if "\n" in words else words.split()  # rlgen's script joins them with newlines
    return int(current) < len(split) and split[int(current)] == "="


def _groups() -> dict[str, list[str]]:
    try:
        return config_groups()
    except FileNotFoundError:
        return {}


class HydraVerb(TyperCommand):
    """A verb whose arguments Hydra parses: completes them with :func:`complete_overrides`."""

    def shell_complete(self, ctx, incomplete: str) -> list[CompletionItem]:  # type: ignore[no-untyped-def]
        before = [*ctx.args, "="] if bash_completes_after_equals() else ctx.args
        return [CompletionItem(value) for value in complete_overrides(before, incomplete)]


def complete_group_name(incomplete: str) -> list[str]:
    """``rlgen ls <TAB>``: the config groups."""
    return [group for group in _groups() if group.startswith(incomplete)]
