"""Wire formats of the two foreign protocols the remote rewards speak (docs/rewards.md, "Served rewards").

* **Flow-GRPO reward server** (``POST /``): the body is a pickle of ``{"images": [JPEG bytes],
  "meta_datas": [dict], "only_strict": bool, "prompts": [str]}``; the reply a pickle of ``{"scores", "rewards",
  "strict_rewards", "group_rewards", "group_strict_rewards"}``. Pickle executes code when loaded, so
  replies go through :class:`PlainUnpickler`, which admits only plain containers, numbers, strings and
  numpy arrays/scalars; the client still requires an explicit ``allow_pickle=True`` opt-in.
* **OpenAI-compatible chat completions** (vLLM / SGLang): one user message whose content holds the
  images as ``data:image/jpeg;base64,…`` ``image_url`` parts followed by the text part.
"""

from __future__ import annotations

import io
import json
import numbers
import pickle
from collections.abc import Callable
from typing import Any

from rlgen_cli.rewards.remote.wire import WireError

__all__ = [
    "OTHER_TAG", "PlainUnpickler", "chat_reply", "chat_request", "flowgrpo_reply", "flowgrpo_request",
]  # fmt: skip

OTHER_TAG = -10.0
"""What the Flow-GRPO GenEval server writes in ``group_*_rewards[tag]`` for an image of another tag."""


class PlainUnpickler(pickle.Unpickler):
    """Loads only plain containers, numbers, strings and numpy arrays/scalars — no arbitrary callables."""

    ALLOWED = {
        ("builtins", n)
        for n in ("list", "dict", "tuple", "set", "frozenset", "float", "int", "str", "bool", "complex")
    } | {
        ("collections", "OrderedDict"),
        ("collections", "defaultdict"),
        ("numpy", "dtype"),
        ("numpy", "ndarray"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
    }

    def find_class(self, module: str, name: str) -> Any:
        """Resolve a global only if it is in :attr:`ALLOWED`."""
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a reward-server reply")
        return super().find_class(module, name)


def flowgrpo_request(
    jpegs: list[bytes], meta_datas: list[dict], only_strict: bool, prompts: list[str]
) -> bytes:
    """Pickle one Flow-GRPO request body, prompts included: the GenEval and DeQA servers ignore them,
    UnifiedReward's and rlgen's read them (without them, a text-conditioned reward has nothing to score
    against)."""
    body = {
        "images": list(jpegs),
        "meta_datas": list(meta_datas),
        "only_strict": bool(only_strict),
        "prompts": [str(p) for p in prompts],
    }
    return pickle.dumps(body)


def _numbers(values: Any, key: str, n: int) -> list[float]:
    """A reply list (or numpy array) of ``n`` numbers, as floats.

    Raises:
        WireError: For anything else, naming ``key``.
    """
    if hasattr(values, "tolist"):  # a numpy array
        values = values.tolist()
    if not isinstance(values, list | tuple):
        raise WireError(f"Flow-GRPO reply field {key!r} must be a list, got {type(values).__name__}")
    if len(values) != n:
        raise WireError(f"Flow-GRPO reply field {key!r} has {len(values)} entries for {n} images")
    bad = [v for v in values if not isinstance(v, numbers.Real)]
    if bad:
        raise WireError(f"Flow-GRPO reply field {key!r} holds {bad[0]!r:.40}, not a number")
    return [float(v) for v in values]


def _tag_column(values: Any, key: str, n: int) -> list[float | None]:
    """One per-tag list of the reply: the server's other-tag sentinel becomes None (not applicable)."""
    return [None if v == OTHER_TAG else v for v in _numbers(values, key, n)]


def _groups(reply: dict, key: str, n: int) -> dict[str, list[float | None]]:
    """A ``group_*_rewards`` map ``{tag: [value per image]}`` of the reply (empty when absent)."""
    groups = reply.get(key)
    if groups is None:
        return {}
    if not isinstance(groups, dict):
        raise WireError(
            f"Flow-GRPO reply field {key!r} must be a dict of per-tag lists, got {type(groups).__name__}"
        )
    return {str(tag): _tag_column(values, f"{key}[{tag!r}]", n) for tag, values in groups.items()}


def _tags_from_groups(groups: dict[str, list[float | None]], n: int) -> list[str] | None:
    """Each image's tag: the one per-tag list that holds a value for it (None when that is ambiguous)."""
    tags = []
    for i in range(n):
        owners = [tag for tag, values in groups.items() if values[i] is not None]
        if len(owners) != 1:
            return None
        tags.append(owners[0])
    return tags


def flowgrpo_reply(
    n: int, score_key: str = "scores"
) -> Callable[[bytes, str], tuple[list[float], dict[str, list]]]:
    """A parser of Flow-GRPO replies for ``n`` images: ``(scores, details)``.

    ``details`` holds ``rewards`` and ``strict_rewards``, each per-tag ``group_rewards/{tag}`` and
    ``group_strict_rewards/{tag}`` list that has one entry per image, and ``tag`` (each image's tag, read
    off those lists). The GenEval server fills a tag's list with the sentinel :data:`OTHER_TAG` for images
    of other tags; those entries become None (NaN once collected), so a tag's mean covers only its own
    images. ``score_key`` names the list of scores: ``scores`` (GenEval server) or ``outputs`` (DeQA).
    """

    def parse(body: bytes, _content_type: str) -> tuple[list[float], dict[str, list]]:
        try:
            reply = PlainUnpickler(io.BytesIO(body)).load()
        except Exception as err:
            raise WireError(f"malformed Flow-GRPO reply: {type(err).__name__}: {err}") from err
        if not isinstance(reply, dict) or score_key not in reply:
            raise WireError(f"malformed Flow-GRPO reply: no {score_key!r} in {type(reply).__name__} reply")
        scores = _numbers(reply[score_key], score_key, n)
        details: dict[str, list] = {}
        for key in ("rewards", "strict_rewards"):
            if reply.get(key) is not None:
                details[key] = _numbers(reply[key], key, n)
        for key in ("group_rewards", "group_strict_rewards"):
            groups = _groups(reply, key, n)
            details.update({f"{key}/{tag}": values for tag, values in groups.items()})
            tags = _tags_from_groups(groups, n) if groups and "tag" not in details else None
            if tags is not None:
                details["tag"] = tags
        return scores, details

    return parse


def chat_request(
    model: str, text: str, images_b64: list[str], system: str | None, max_tokens: int, temperature: float
) -> bytes:
    """JSON body of one ``/chat/completions`` request: image parts (JPEG data URLs), then the text."""
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{b64}"}} for b64 in images_b64
    ]
    content.append({"type": "text", "text": text})
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content}
    ]
    body = {"model": model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens}
    return json.dumps(body).encode("utf-8")


def chat_reply(body: bytes, _content_type: str) -> str:
    """The answer text of a chat-completions reply (``choices[0].message.content``).

    Raises:
        WireError: If the reply does not have that shape.
    """
    try:
        content = json.loads(body)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise WireError(f"malformed chat-completions reply ({err}): {body[:200]!r}") from err
    if not isinstance(content, str):
        raise WireError(f"chat-completions content is {type(content).__name__}, expected text")
    return content


def models_reply(body: bytes, _content_type: str) -> list[str]:
    """Model ids from a ``GET /models`` reply."""
    try:
        return [str(m["id"]) for m in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError) as err:
        raise WireError(f"malformed /models reply ({err}): {body[:200]!r}") from err
