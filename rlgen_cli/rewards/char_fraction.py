"""Character-share reward for generated texts: a dense sanity-check signal any text policy can learn.

``char_fraction`` scores a completion by the share of its characters that belong to a regex character
class (``chars``, the part between the brackets; default ``" -~"``, printable ASCII): 1.0 when every
character matches, 0.0 for none or for an empty completion. Every generated token moves it, so even a
random-weight model climbs it within a few updates (the VLM learning tests use it), and on a real model
it is a language-consistency check (``chars="a-zA-Z0-9 .,"``) or a guard against stray bytes.
``reward.weights.char_fraction=-1`` asks for the opposite.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rlgen_cli.rewards.r1vl import TextRuleReward
from rlgen_cli.rewards.registry import register

__all__ = ["CharFractionKwargs", "build_char_fraction", "char_fraction"]

PRINTABLE_ASCII = " -~"


def char_fraction(text: str, pattern: re.Pattern[str]) -> float:
    """Share of the characters of ``text`` that ``pattern`` (one character class) matches; 0.0 when empty."""
    if not text:
        return 0.0
    return len(pattern.findall(text)) / len(text)


def _character_class(chars: str) -> re.Pattern[str]:
    """Compile ``[chars]``, or raise a ValueError that names the key and shows a valid value."""
    try:
        return re.compile(f"[{chars}]")
    except re.error as err:
        raise ValueError(
            f"char_fraction chars={chars!r} is not a regex character class body ({err}); give what goes "
            "between the brackets, e.g. reward.kwargs.char_fraction.chars='a-z'"
        ) from None


@dataclass
class CharFractionKwargs:
    """``reward.kwargs.char_fraction``."""

    chars: str = PRINTABLE_ASCII
    """Body of the regex character class whose share is scored, e.g. ``a-z``."""


@register("char_fraction", kwargs=CharFractionKwargs)
def build_char_fraction(chars: str = PRINTABLE_ASCII) -> TextRuleReward:
    """``char_fraction``: the share of characters in the class ``[chars]``.

    Args:
        chars: Body of a regex character class, e.g. ``"a-z"``; must not be empty.

    Returns:
        The reward.

    Raises:
        ValueError: If ``chars`` is empty or not a valid character class.
    """
    if not chars:
        raise ValueError("char_fraction needs a non-empty chars (a character class body such as 'a-z')")
    pattern = _character_class(chars)
    return TextRuleReward("char_fraction", lambda text, meta: char_fraction(text, pattern))
