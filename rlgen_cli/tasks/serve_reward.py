"""``rlgen serve-reward``: host every reward of ``reward.weights`` over HTTP (see :mod:`rlgen_cli.server`)."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from omegaconf import DictConfig

from rlgen_cli.tasks.common import user_errors, validated

logger = logging.getLogger(__name__)


def reward_specs(reward_cfg: Any) -> dict[str, dict[str, Any]]:
    """``{name: constructor kwargs}`` of every reward named in ``reward.weights``."""
    return {name: dict(reward_cfg.kwargs.get(name, {})) for name in reward_cfg.weights}


@user_errors
def serve_reward_task(cfg: DictConfig) -> int:
    """Validate the config, check what each reward loads (all missing ones reported together, exit 2),
    build the rewards, load their models, and serve until SIGINT/SIGTERM.

    Returns:
        0 after a clean shutdown (a failing worker process exits with its own code).
    """
    typed = validated(cfg)
    from rlgen_cli.tasks.prerequisites import Prerequisites, reward_problems

    Prerequisites().add(reward_problems(typed)).require()
    from rlgen_cli.server.app import ServerSettings
    from rlgen_cli.server.runner import configure_logging, serve_workers

    configure_logging(typed.log_level)
    settings = ServerSettings(**asdict(typed.server))
    specs = reward_specs(typed.reward)
    logger.info(
        "hosting rewards %s with %d worker(s) from port %d", sorted(specs), settings.workers, settings.port
    )
    code = serve_workers(specs, settings)
    if code:
        raise SystemExit(code)
    return code
