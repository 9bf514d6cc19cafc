"""The valid range of every numeric setting, and one pass that checks every setting with the key's full name.

A numeric field carries its range in its annotation, written once where the field is declared
(``epochs: Annotated[int, COUNT] = 100``), as a choice field carries its allowed values
(``schema/choices.py``).
:func:`check_settings` walks a composed config section by section *before* the typed objects are built,
so a bad value stops the run with exit code 2 naming the key (``algo.lr must be > 0, got nan``,
``sampler.kind='sde' is not valid; choose one of ode, flow_sde, dance, cps``) instead of failing later,
deep in a recipe. The same pass rejects keys no schema declares: a ``+algo.lrr=1e-3`` typo is named with
the closest real key instead of landing silently in resolved.yaml.

Checks that involve several fields stay in each dataclass's ``__post_init__``; ``tests/schema/
test_ranges.py`` fails when a numeric field has no range, so a new setting cannot skip the check.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from rlgen_cli.errors import UserError
from rlgen_cli.schema.choices import choices_of

__all__ = ["Pattern", "Range", "check_settings", "range_of"]


@dataclass(frozen=True)
class Range:
    """Finite numbers between ``low`` and ``high`` (each bound included unless ``*_open``)."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def admits(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        if self.low == -math.inf and self.high == math.inf:
            return "a finite number"
        if self.high == math.inf:
            return f"{'>' if self.low_open else '≥'} {_number(self.low)}"
        if self.low == -math.inf:
            return f"{'<' if self.high_open else '≤'} {_number(self.high)}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{_number(self.low)}, {_number(self.high)}{right}"


@dataclass(frozen=True)
class Pattern:
    """Strings matching ``regex`` in full; ``choices`` says which in words."""

    regex: str
    choices: str

    def admits(self, value: Any) -> bool:
        return isinstance(value, str) and re.fullmatch(self.regex, value) is not None

    def describe(self) -> str:
        return f"one of {self.choices}"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def at_least(n: int) -> Range:
    return Range(low=n)


ANY = Range()  # any finite number
POSITIVE = Range(low=0, low_open=True)
NON_NEGATIVE = Range(low=0)
COUNT = at_least(1)
PROBABILITY = Range(0, 1)
FRACTION = Range(0, 1, low_open=True)  # (0, 1]: a share that cannot be empty
BELOW_ONE = Range(0, 1, high_open=True)  # [0, 1): Adam betas, warm-up and dropout shares
PORT = Range(1, 65535)
DEVICE = Pattern(r"auto|cpu|mps|cuda(:\d+)?", "auto, cpu, cuda, cuda:N (N = GPU index), mps")


@functools.cache
def _hints(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema, include_extras=True)


def range_of(schema: type, name: str) -> Range | Pattern | None:
    """The rule of field ``name``: the :class:`Range` or :class:`Pattern` in its ``Annotated`` type
    (``seed: Annotated[int, NON_NEGATIVE] = 42``), where the field is declared."""
    hint = _hints(schema).get(name)
    if hint is None or typing.get_origin(hint) is not Annotated:
        return None
    return next((meta for meta in hint.__metadata__ if isinstance(meta, Range | Pattern)), None)


@functools.cache
def _nested(schema: type) -> dict[str, type]:
    """Fields of ``schema`` that hold another schema dataclass (optionally None): name → that class."""
    hints = typing.get_type_hints(schema)
    out = {}
    for f in dataclasses.fields(schema):
        inner = [t for t in (typing.get_args(hints[f.name]) or (hints[f.name],)) if t is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            out[f.name] = inner[0]
    return out


def check_settings(cfg: DictConfig, prefix: str = "") -> None:
    """Every key of a composed config is declared by its schema, and every value with a rule in its
    annotation is in range; sections are checked recursively.

    Raises:
        UserError: Naming the first unknown key (and the closest real one) or out-of-range value.
    """
    schema = OmegaConf.get_type(cfg)
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        return
    names = [f.name for f in dataclasses.fields(schema)]
    for key in cfg:
        if key not in names:
            raise UserError(_unknown_key(prefix, str(key), names))
    nested = _nested(schema)
    for name in names:
        rule = range_of(schema, name)
        valid = choices_of(schema, name)
        if name in nested:
            section = cfg[name]
            if section is not None:
                check_settings(section, f"{prefix}{name}.")
        elif rule is not None:
            _check_value(f"{prefix}{name}", cfg[name], rule)
        elif valid is not None and cfg[name] not in valid:
            raise UserError(_not_a_choice(f"{prefix}{name}", cfg[name], valid))


def _check_value(key: str, value: Any, rule: Range | Pattern) -> None:
    if value is None:  # an optional setting left unset
        return
    if isinstance(value, DictConfig | ListConfig | Mapping | list):
        items = value.items() if isinstance(value, DictConfig | Mapping) else enumerate(value)
        for sub, item in items:
            _check_value(f"{key}.{sub}" if isinstance(sub, str) else f"{key}[{sub}]", item, rule)
        return
    if not rule.admits(value):
        raise UserError(f"{key} must be {rule.describe()}, got {value!r}")


def _not_a_choice(key: str, value: Any, valid: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value), [str(v) for v in valid], n=1, cutoff=0.8)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{key}={value!r} is not valid{hint}; choose one of {', '.join(str(v) for v in valid)}"


def _unknown_key(prefix: str, key: str, names: list[str]) -> str:
    section = prefix.rstrip(".") or "the top level"
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = f"did you mean {prefix}{close[0]}?" if close else f"{section} has: {', '.join(names)}."
    return (
        f"{prefix}{key} is not a setting of {section}; {hint} ('+' adds keys only to free-form maps such "
        "as reward.weights and reward.kwargs)"
    )
