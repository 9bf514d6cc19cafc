"""What every task does first: validate the composed config and turn user errors into exit code 2."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlgen_cli._hydra import EXIT_USER_ERROR
from rlgen_cli.errors import UserError

T = TypeVar("T")
log = logging.getLogger(__name__)


def validated(cfg: DictConfig) -> Any:
    """The typed config (``OmegaConf.to_object``): every key declared and every value in its range
    (``schema/ranges.py``) first, then every ``__post_init__`` cross-field check."""
    from rlgen_cli.schema.ranges import check_settings

    try:
        check_settings(cfg)
        typed = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise UserError(str(err).replace("\n", "; ")) from err
    if hasattr(typed, "reward"):
        require_known_rewards(typed)
    if getattr(typed, "guard", None) is not None:  # the flow recipes' held-out rewards, checked alike
        from rlgen_cli.training.control.hacking_guard import require_known_monitors

        require_known_monitors(typed.guard)
    return typed


def rewards_of(cfg: Any) -> tuple[dict[str, float], dict[str, dict[str, Any]], str]:
    """``({name: weight}, {name: kwargs}, the key that chose them)`` of the rewards a run builds: R3 picks
    them from ``r3.reward_fn`` (or its offline stand-in), every other config from ``reward.weights``."""
    if getattr(cfg, "recipe", None) == "r3":  # serve-reward's config hosts rewards and has no recipe
        from rlgen_cli.r3.scoring import reward_spec

        weights, kwargs = reward_spec(cfg.r3, cfg.reward)
        key = "r3.offline.reward" if cfg.r3.offline.enabled else "r3.reward_fn"
        if not cfg.r3.offline.enabled and cfg.r3.reward_fn == "mix":
            key = "reward.weights"
        return weights, kwargs, key
    return dict(cfg.reward.weights), {k: dict(v) for k, v in cfg.reward.kwargs.items()}, "reward.weights"


def require_known_rewards(cfg: Any) -> None:
    """Every reward the run builds is registered and its ``reward.kwargs`` are ones it takes, checked
    before any model loads."""
    from rlgen_cli.rewards import available
    from rlgen_cli.rewards.registry import check_kwargs

    weights, kwargs, key = rewards_of(cfg)
    unknown = sorted(set(weights) - set(available()))
    if not unknown:
        for name in weights:  # every component of a mix
            check_kwargs(name, kwargs.get(name, {}))
        return
    if key == "reward.weights":
        what = f"{key} names unknown reward{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
    else:
        what = f"{key}={unknown[0]!r} is not a known reward"
    raise UserError(f"{what}; known rewards: {', '.join(available())}")


def require_reward_servers(cfg: Any, timeout_s: float = 5.0) -> None:
    """Stop with the first of :func:`reward_server_problems`."""
    problems = reward_server_problems(cfg, timeout_s)
    if problems:
        raise UserError(problems[0])


def reward_server_problems(cfg: Any, timeout_s: float = 5.0) -> list[str]:
    """Each served reward of the run (the clients in ``rewards/remote/``: an rlgen reward server, a
    Flow-GRPO-style server, an OpenAI-compatible judge) with no endpoint that accepts a connection, so a
    server that is down or a mistyped address stops the run before any model loads instead of after
    the first epoch's rollouts. An endpoint that does not answer while another does is only reported: the
    client fails over to the others."""
    from rlgen_cli.rewards.registry import REWARDS, build_reward
    from rlgen_cli.rewards.remote import client as remote

    weights, kwargs, key = rewards_of(cfg)
    problems = []
    for name in weights:
        if getattr(REWARDS.get(name), "__module__", None) != remote.__name__:
            continue  # computed in this process
        client = build_reward(name, **kwargs.get(name, {}))  # opens no connection until it scores
        urls = client.pool.urls
        failures = {url: err for url in urls if (err := _unreachable(url, timeout_s))}
        if len(failures) == len(urls):
            where = (
                "r3.reward_server_urls / r3.reward_server_port"
                if key.startswith("r3.")
                else f"reward.kwargs.{name}.endpoints (or .hosts and .ports)"
            )
            reasons = "; ".join(f"{url}: {err}" for url, err in failures.items())
            problems.append(
                f"reward {name!r}: no server answers ({reasons}). Start it first (rlgen serve-reward … for "
                f"rlgen's own), or point {where} at a running one"
            )
            continue
        for url, err in failures.items():
            log.warning(
                "reward %r: %s does not answer (%s); scoring with the other endpoints", name, url, err
            )
    return problems


def _unreachable(url: str, timeout_s: float) -> str | None:
    """Why a TCP connection to ``url``'s host and port fails, or None when it opens."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with socket.create_connection((parts.hostname or "", port), timeout=timeout_s):
            return None
    except (OSError, ValueError) as err:
        return str(err) or type(err).__name__


def user_errors(task: Callable[[DictConfig], T]) -> Callable[[DictConfig], T]:
    """Print a :class:`UserError` as one red line and exit 2 (``RLGEN_DEBUG=1`` keeps the traceback)."""

    @functools.wraps(task)
    def wrapper(cfg: DictConfig) -> T:
        try:
            return task(cfg)
        except UserError as err:
            if os.environ.get("RLGEN_DEBUG"):
                raise
            from rich.console import Console
            from rich.markup import escape

            Console(stderr=True, soft_wrap=True).print(
                f"[bold red]error:[/] {escape(str(err))}", highlight=False
            )
            sys.exit(EXIT_USER_ERROR)

    wrapper.check_config = _check_shown  # type: ignore[attr-defined]  (run by `--cfg job`, _hydra.py)
    return wrapper


def _check_shown(cfg: DictConfig) -> None:
    """The checks a task makes first (:func:`validated`), on the config ``--cfg job`` printed: a value
    out of range or a cross-field mistake exits 2 there too, instead of only when the run starts."""
    user_errors(validated)(cfg)


def command_line_overrides() -> list[Any]:
    """The overrides the command line gave this run, as Hydra parses them (``hydra.core.override_parser``:
    ``+`` / ``++`` prefixes, quoting, lists), Hydra's own ``hydra.*`` left out; none outside a Hydra run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not HydraConfig.initialized():
        return []
    return OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task))


def refuse_overrides(unread: dict[str, str], verb: str) -> None:
    """An override of a key in ``unread`` (key → what to set instead) would do nothing in ``rlgen verb``.

    These keys sit in sections the verb shares with ``rlgen train`` (a ``data`` option sets
    ``eval_num_prompts`` for training's evaluations), so the composed value is the option's, not a
    choice: only the command line's override of one is a setting that would silently do nothing.
    """
    for override in command_line_overrides():
        why = unread.get(override.key_or_group)
        if why is not None and not override.is_delete():
            raise UserError(f"{override.input_line} is not read by rlgen {verb}: {why}. Drop the override")


def run_dir_of(cfg: Any) -> Path:
    if not cfg.run_dir:
        raise UserError("run_dir is empty; leave it to Hydra (hydra.run.dir=DIR) or give run_dir=DIR")
    return Path(cfg.run_dir)


def require_data(cfg: Any, run_dir: Path, splits: tuple[str, ...] = ("train", "test")) -> None:
    """Every prompt file the run reads exists (builtin sets generated into ``run_dir``) and parses, and,
    for an editing model, names an existing source image per row (for any other, gives none): checked
    before any model is loaded, so a missing or malformed file costs seconds, not a model load. A split is
    ``train`` / ``test`` (``data.train`` / ``data.test``) or ``eval_heldout`` (the flow recipes' second
    test split, ``cfg.eval_heldout``; nothing to check when it is unset)."""
    from rlgen_cli.data.images import EDITING_FAMILIES, refuse_source_images, require_source_images
    from rlgen_cli.data.paths import BUILTIN_PREFIX, load_prompts, resolve_data_path
    from rlgen_cli.schema.vlm import VLM_FAMILIES

    for split in splits:
        if split == "eval_heldout":  # recipes/flow_run.py setup reads it (train and check-onpolicy)
            spec, key = getattr(cfg, split, None), split
            if not spec:
                continue
        else:
            spec, key = getattr(cfg.data, split), f"data.{split}"
        if cfg.model.family in VLM_FAMILIES:
            if not spec.startswith(BUILTIN_PREFIX):  # shipped VLM sets are resolved by the VLM loader
                resolve_data_path(spec, key, run_dir)
        elif cfg.model.family in EDITING_FAMILIES:
            dataset = load_prompts(spec, run_dir, key)
            require_source_images(list(dataset), dataset.source, key)
        else:  # parsed now too: a malformed or non-UTF-8 file costs seconds, not a model load
            dataset = load_prompts(spec, run_dir, key)
            refuse_source_images(list(dataset), dataset.source, key, cfg.model.family)
