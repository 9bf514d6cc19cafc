"""Flow-GRPO's reward-server protocol, spoken by ``rlgen serve-reward`` with ``server.flowgrpo_protocol=true``.

Flow-GRPO's clients (``flow_grpo/rewards.py``: ``geneval_score``, ``deqa_score_remote``,
``unifiedreward_score_remote``) POST a pickle to ``/`` and load the reply with ``pickle.loads``:

* request: ``{"images": [JPEG bytes], "meta_datas": [dict], "only_strict": bool}`` (GenEval),
  ``{"images": [...]}`` (DeQA) or ``{"images": [...], "prompts": [str]}`` (UnifiedReward);
* reply: ``{"scores": [float], "outputs": [float]}`` — GenEval's client reads ``scores``, the others
  ``outputs`` — and, from a reward whose details carry GenEval's ``accuracy``, ``strict`` and ``tag``
  (rlgen's ``geneval``), ``rewards``, ``strict_rewards``, ``group_rewards`` and ``group_strict_rewards``
  as Flow-GRPO's GenEval server builds them: one list per tag of :data:`GENEVAL_TAGS`, holding the
  image's 0/1 for its own tag and :data:`OTHER_TAG` for the others; with ``only_strict`` the non-strict
  ``rewards`` are all 0, as that server does.

The body is loaded by :func:`~rlgen_cli.server.plain_pickle.load_plain`, which builds only plain data
and never runs code; the images then take the same checks as ``/v1/score`` (format, sizes, structure,
decoded bytes). A request without ``prompts`` is scored with each metadata's ``prompt`` (GenEval's carry
one); an image with neither (DeQA's client sends no text) gets an empty prompt only when the reward scores
the image alone (:func:`~rlgen_cli.rewards.base.reads_prompts`), else the request is refused (400).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from rlgen_cli.rewards.remote.wire import WireError
from rlgen_cli.server.plain_pickle import load_plain

__all__ = [
    "GENEVAL_TAGS", "OTHER_TAG", "PICKLE_TYPE", "FlowGrpoRequest", "parse_request", "reply_body", "require_prompts",
]  # fmt: skip

PICKLE_TYPE = "application/octet-stream"
GENEVAL_TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
OTHER_TAG = -10.0  # Flow-GRPO's GenEval server: an image's entry in another tag's list
_KEYS = ("images", "meta_datas", "only_strict", "prompts")
_GENEVAL_DETAILS = ("accuracy", "strict", "tag")


@dataclass
class FlowGrpoRequest:
    """One Flow-GRPO request: file bytes per image, a prompt and metadata (or None) per image, and the
    images that came with no prompt at all (their prompt is empty)."""

    images: list[bytes]
    prompts: list[str]
    metadata: list[dict] | None
    only_strict: bool
    unprompted: list[int]


def _sequence(payload: dict[str, Any], key: str, item_type: type, n: int | None) -> list | None:
    """``payload[key]`` as a list of ``item_type`` (``n`` entries when given); None when absent."""
    if key not in payload:
        return None
    value = payload[key]
    if not isinstance(value, list | tuple):
        raise WireError(f"field {key!r} must be a list, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, item_type):
            raise WireError(f"{key}[{i}] has type {type(item).__name__}; expected {item_type.__name__}")
    if n is not None and len(value) != n:
        raise WireError(f"{key} has {len(value)} entries but images has {n}; send one per image")
    return list(value)


def _prompt_of(metadata: dict | None) -> str | None:
    prompt = (metadata or {}).get("prompt")
    return prompt if isinstance(prompt, str) else None


def parse_request(body: bytes | bytearray | memoryview, max_items: int, max_depth: int) -> FlowGrpoRequest:
    """Load and check a Flow-GRPO request body.

    Args:
        body: The pickle.
        max_items: ``server.max_request_items``.
        max_depth: ``server.max_metadata_depth``; the body may nest two levels more (the request map
            and the ``meta_datas`` list hold the per-image metadata).

    Raises:
        WireError: 400 for a body that is not a plain-data pickle of that shape, 413 past a limit.
    """
    payload = load_plain(body, max_items, max_depth + 2)
    if not isinstance(payload, dict):
        raise WireError(f"the pickle must hold a dict, got {type(payload).__name__}")
    unknown = sorted(str(key) for key in payload if key not in _KEYS)
    if unknown:
        raise WireError(f"unknown fields {unknown}; a Flow-GRPO request has {', '.join(_KEYS)}")
    images = _sequence(payload, "images", bytes, None)
    if images is None:
        raise WireError("missing field 'images': a list of JPEG (or PNG) file bytes is required")
    metadata = _sequence(payload, "meta_datas", dict, len(images))
    prompts = _sequence(payload, "prompts", str, len(images))
    only_strict = payload.get("only_strict", False)
    if not isinstance(only_strict, bool):
        raise WireError(f"field 'only_strict' must be a bool, got {type(only_strict).__name__}")
    if prompts is not None:
        return FlowGrpoRequest(images, prompts, metadata, only_strict, [])
    found = [_prompt_of(m) for m in metadata] if metadata is not None else [None] * len(images)
    unprompted = [i for i, prompt in enumerate(found) if prompt is None]
    return FlowGrpoRequest(images, [p or "" for p in found], metadata, only_strict, unprompted)


def require_prompts(request: FlowGrpoRequest, reward_name: str, reads_prompts: bool) -> None:
    """Refuse a request whose images came without a prompt when the reward scores against prompts.

    Raises:
        WireError: 400, naming the images and how to send their prompts.
    """
    if not request.unprompted or not reads_prompts:
        return
    shown = request.unprompted[:8]
    more = f" and {len(request.unprompted) - len(shown)} more" if len(request.unprompted) > len(shown) else ""
    raise WireError(
        f"reward {reward_name!r} scores each image against its prompt, but this Flow-GRPO request has no "
        f"'prompts' and images {shown}{more} have no meta_datas 'prompt'; send 'prompts': [str, ...] one per "
        "image (rlgen's flowgrpo_remote client does), or host a reward that scores the image alone (one "
        "of your own declares reads_prompts = False)"
    )


def _geneval_fields(details: dict[str, list], only_strict: bool) -> dict[str, Any]:
    """``rewards``, ``strict_rewards`` and the per-tag lists, as Flow-GRPO's GenEval server builds them."""
    correct = [0.0 if only_strict else float(bool(v)) for v in details["accuracy"]]
    strict = [float(bool(v)) for v in details["strict"]]
    group_rewards: dict[str, list[float]] = {}
    group_strict: dict[str, list[float]] = {}
    for tag, right, exact in zip(details["tag"], correct, strict, strict=True):
        for key in GENEVAL_TAGS:  # an image of a tag outside this list fills every list with OTHER_TAG
            group_rewards.setdefault(key, []).append(right if key == tag else OTHER_TAG)
            group_strict.setdefault(key, []).append(exact if key == tag else OTHER_TAG)
    return {
        "rewards": correct,
        "strict_rewards": strict,
        "group_rewards": group_rewards,
        "group_strict_rewards": group_strict,
    }


def reply_body(scores: list[float], details: dict[str, list], only_strict: bool) -> bytes:
    """The pickled reply: plain floats, lists and dicts only (``NaN`` for a failed score)."""
    values = [float(s) for s in scores]
    reply: dict[str, Any] = {"scores": values, "outputs": list(values)}
    if all(key in details for key in _GENEVAL_DETAILS):
        reply.update(_geneval_fields(details, only_strict))
    return pickle.dumps(reply, protocol=4)
