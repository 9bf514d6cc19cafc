"""Plain-dict registry of reward factories, keyed by the name used in configs and mixes, with the typed
kwargs each one takes.

Register a factory (a class or a function returning a :class:`~rlgen_cli.rewards.base.Reward`) together
with the dataclass of its keyword arguments, declared next to it::

    @dataclass
    class JpegKwargs:
        quality: int = 95
        \"\"\"JPEG quality.\"\"\"

    @register("jpeg_compressibility", kwargs=JpegKwargs)
    def jpeg_compressibility(quality: int = 95) -> JpegReward: ...

The dataclass is the reward's ``reward.kwargs.<name>`` schema: :func:`check_kwargs` runs at the config
boundary (``tasks/common.py``), before any model loads, so a misspelt key or a wrong type stops the run
with exit code 2 naming the reward, the key and the valid keys. Its fields are the factory's keyword
arguments with the same defaults (``tests/rewards/test_reward_kwargs.py`` keeps the two in step); field
types are ones OmegaConf checks (``str``, ``int``, ``float``, ``bool``, optional, ``list``/``dict``),
``Any`` where a factory accepts several forms; a choice is ``Annotated[str, Literal[...]]`` as in the
config schemas (``schema/choices.py``). Build a reward with ``build_reward("name", **kwargs)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlgen_cli.errors import UserError
from rlgen_cli.rewards.base import Reward
from rlgen_cli.schema.choices import choices_of

logger = logging.getLogger(__name__)

__all__ = ["NoKwargs", "REWARDS", "REWARD_KWARGS", "available", "build_reward", "check_kwargs", "register"]

REWARDS: dict[str, Callable[..., Reward]] = {}
REWARD_KWARGS: dict[str, type] = {}
"""{reward name: the dataclass of its kwargs}."""

F = TypeVar("F", bound=Callable[..., Reward])


@dataclasses.dataclass
class NoKwargs:
    """The kwargs of a reward that takes none."""


def register(name: str, *, kwargs: type | None = None) -> Callable[[F], F]:
    """Return a decorator that registers a reward factory under ``name``.

    Args:
        name: Registry key, e.g. ``"jpeg_compressibility"``.
        kwargs: The dataclass of the factory's keyword arguments (see the module docstring).

    Returns:
        A decorator that stores the factory in :data:`REWARDS` and returns it unchanged.

    Raises:
        ValueError: If ``name`` is empty or already registered.
    """
    if not name:
        raise ValueError("reward name must be a non-empty string.")
    assert kwargs is None or dataclasses.is_dataclass(kwargs), kwargs

    def decorator(factory: F) -> F:
        if name in REWARDS:
            raise ValueError(
                f"reward {name!r} is already registered (by {REWARDS[name]!r}); "
                "choose a different name or remove the duplicate registration."
            )
        REWARDS[name] = factory
        if kwargs is not None:
            REWARD_KWARGS[name] = kwargs
        return factory

    return decorator


def available() -> list[str]:
    """Return the registered reward names, sorted."""
    return sorted(REWARDS)


def check_kwargs(name: str, kwargs: Mapping[str, Any]) -> None:
    """``kwargs`` (``reward.kwargs.<name>``) are keyword arguments reward ``name`` takes, of its types.

    Raises:
        UserError: Naming the reward, the first bad key and the valid keys (or the expected type).
    """
    schema = REWARD_KWARGS.get(name)
    if schema is None:
        return
    valid = [f.name for f in dataclasses.fields(schema)]
    for key in kwargs:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}? " if close else ""
            raise UserError(
                f"reward.kwargs.{name}.{key}: reward {name!r} takes no {key!r}; {hint}"
                f"its kwargs are {', '.join(valid) or 'none'}"
            )
    for key, value in kwargs.items():
        allowed = choices_of(schema, key)
        if allowed is not None and value not in allowed:
            raise UserError(
                f"reward.kwargs.{name}.{key}={value!r} is not valid; choose one of {', '.join(allowed)}"
            )
    typed = OmegaConf.structured(schema)  # a type OmegaConf cannot check is a programming error here
    OmegaConf.set_readonly(typed, False)  # frozen kwargs dataclasses are merged into, not assigned
    try:
        OmegaConf.merge(typed, OmegaConf.create(dict(kwargs)))
    except OmegaConfBaseException as err:
        raise UserError(f"reward.kwargs.{name}.{err.key}: {str(err).splitlines()[0]}") from None


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
