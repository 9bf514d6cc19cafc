"""Plain-dict registry of reward factories, keyed by the name used in configs and mixes.

Register a factory (a class or a function returning a :class:`~rlgen_cli.rewards.base.Reward`) with
``@register("name")``; build it with ``build_reward("name", **kwargs)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from rlgen_cli.rewards.base import Reward

logger = logging.getLogger(__name__)

__all__ = ["REWARDS", "available", "build_reward", "register"]

REWARDS: dict[str, Callable[..., Reward]] = {}

F = TypeVar("F", bound=Callable[..., Reward])


def register(name: str) -> Callable[[F], F]:
    """Return a decorator that registers a reward factory under ``name``.

    Args:
        name: Registry key, e.g. ``"jpeg_compressibility"``.

    Returns:
        A decorator that stores the factory in :data:`REWARDS` and returns it unchanged.

    Raises:
        ValueError: If ``name`` is empty or already registered.
    """
    if not name:
        raise ValueError("reward name must be a non-empty string.")

    def decorator(factory: F) -> F:
        if name in REWARDS:
            raise ValueError(
                f"reward {name!r} is already registered (by {REWARDS[name]!r}); "
                "choose a different name or remove the duplicate registration."
            )
        REWARDS[name] = factory
        return factory

    return decorator


def available() -> list[str]:
    """Return the registered reward names, sorted."""
    return sorted(REWARDS)


def build_reward(name: str, /, **kwargs: object) -> Reward:
    """Build the reward registered under ``name``.

    Args:
        name: Registry key (positional-only, so a factory may take its own ``name`` kwarg).
        **kwargs: Passed to the reward's factory.

    Returns:
        The constructed reward.

    Raises:
        ValueError: If ``name`` is not registered; the message lists the valid names.
    """
    if name not in REWARDS:
        raise ValueError(
            f"unknown reward {name!r}; valid names: {', '.join(available())}. "
            "Check the spelling in your reward config."
        )
    logger.debug("building reward %r with %s", name, kwargs)
    return REWARDS[name](**kwargs)
