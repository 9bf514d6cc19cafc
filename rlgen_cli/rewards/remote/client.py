"""Remote rewards: clients for the three wire protocols rlgen speaks, usable in a mix like any reward.

* ``remote`` — rlgen's own server (``rlgen serve-reward``, :mod:`.wire`); by default the
  images travel as raw uint8 pixels in msgpack (``wire_format="raw"``: no PNG codec on either side),
  or as PNG in msgpack (``"msgpack"``) or base64 PNG in JSON (``"json"``, interoperable and readable).
* ``flowgrpo_remote`` — the Flow-GRPO reward-server protocol (pickled JPEG batches, e.g. its GenEval
  server). Pickle can execute code, so this is an explicit opt-in: pass ``allow_pickle=True``. Replies are
  loaded with a restricted unpickler that only admits plain containers and numpy arrays/scalars.
* ``openai_judge`` — an OpenAI-compatible chat-completions VLM judge (vLLM / SGLang): one user message
  with the image as a base64 JPEG ``image_url`` and the prompt text, temperature 0; the answer is parsed
  into a score by ``parser`` (``unifiedreward``: "Final Score: x" → x/5, ``qwenvl``: ``<Score>X</Score>``
  → X/5, both parsed like the local judge in :mod:`rlgen_cli.rewards.vlm_judge`, or any
  ``module:function``). The ``qwenvl`` default prompt is that module's rubric, so served and local
  scores are comparable. ``geneval_plus`` and ``tiif`` build their prompt from each sample's metadata
  and parse JSON answers (:mod:`rlgen_cli.rewards.judge_prompts`).

Presets registered under their own names, so they can sit side by side in one mix: ``unifiedreward``,
``geneval_plus`` and ``tiif`` (``openai_judge`` with that parser) and ``deqa`` (DeQA-Score behind
Flow-GRPO's reward server: ``flowgrpo_remote`` reading the ``outputs`` key, already ``score/5``).

All three share :class:`~.transport.EndpointPool`: least-in-flight balancing over every
endpoint, lazy health checks, timeouts, retries with exponential backoff and failover, and counters
(``stats()``). A sample whose score cannot be obtained raises :class:`RemoteRewardError`
(``on_failure="raise"``, the default) or becomes ``NaN`` (``on_failure="nan"``), counted in
``stats()["nan_samples"]`` — never a silent 0. A 4xx reply (bad token, unknown reward, request too
large) is a configuration mistake and always raises :class:`RequestRefusedError`. An endpoint that
refuses connections or times out (a frozen server) is left out for a cool-down, so later calls do not
wait for it again.

Before anything is sent, every client refuses (``ValueError``) images the wire would change — NaN/inf,
values outside [0, 1], integer pixels (:func:`.wire.check_pixels`) — and ``remote`` and
``flowgrpo_remote`` metadata that is not JSON data (:func:`.wire.metadata_to_jsonable`). Those two pin
the reward fingerprint of the first reply and refuse an endpoint that serves another
(:class:`~.transport.FingerprintMismatchError`).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from rlgen_cli.errors import UserError
from rlgen_cli.rewards.base import RewardBatch, RewardResult
from rlgen_cli.rewards.judge_prompts import JUDGES, JudgeSpec, plain_spec
from rlgen_cli.rewards.registry import register
from rlgen_cli.rewards.remote import kwargs as kwarg_types
from rlgen_cli.rewards.remote import protocols, wire
from rlgen_cli.rewards.remote.transport import (
    EndpointPool,
    RemoteRewardError,
    RequestRefusedError,
    parse_endpoints,
)
from rlgen_cli.rewards.vlm_judge import DEFAULT_RUBRIC, SCORE_MAX, parse_final_score, parse_score_tag

logger = logging.getLogger(__name__)

__all__ = [
    "PARSERS",
    "FlowGrpoRemoteReward",
    "OpenAIJudgeReward",
    "RemoteReward",
    "RemoteRewardError",
    "RequestRefusedError",
    "deqa",
    "parse_qwenvl",
    "parse_unifiedreward",
]

UNIFIEDREWARD_PROMPT = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this "
    "image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the "
    "provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as described "
    "in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, assign a score from "
    "1 to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
)


def _check_on_failure(on_failure: str) -> str:
    if on_failure not in ("raise", "nan"):
        raise UserError(f"on_failure={on_failure!r} is not valid; use 'raise' (default) or 'nan' (counted)")
    return on_failure


def _images_of(batch: RewardBatch, name: str) -> Tensor:
    """The batch's images, checked before anything is sent: ``(B, C, H, W)``, finite, in [0, 1].

    Raises:
        ValueError: Otherwise (see :func:`wire.check_pixels`); no request is made.
    """
    if batch.images is None or batch.images.ndim != 4:
        shape = None if batch.images is None else tuple(batch.images.shape)
        raise ValueError(
            f"reward {name!r} sends images (B, C, H, W) to its server, got {shape}; decode to images first"
        )
    wire.check_pixels(batch.images, name)
    return batch.images


def _cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _run_chunks(fn: Callable[[list[int]], Any], n: int, size: int, workers: int) -> list[Any]:
    """Apply ``fn`` to index chunks of ``range(n)`` in parallel threads; results in chunk order."""
    chunks = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    if len(chunks) <= 1 or workers <= 1:
        return [fn(chunk) for chunk in chunks]
    with ThreadPoolExecutor(
        max_workers=min(workers, len(chunks)), thread_name_prefix="remote-reward"
    ) as pool:
        return list(pool.map(fn, chunks))


def _collect(n: int, parts: list[tuple[list[int], list[float], dict[str, list[Any]]]]) -> RewardResult:
    """Assemble per-chunk scores and details into one result; numeric detail columns become tensors."""
    scores = torch.full((n,), math.nan, dtype=torch.float32)
    details: dict[str, list[Any]] = {}
    for indices, chunk_scores, chunk_details in parts:
        scores[indices] = torch.tensor(chunk_scores, dtype=torch.float32)
        for key, values in chunk_details.items():
            column = details.setdefault(key, [None] * n)
            for i, value in zip(indices, values):
                column[i] = value
    out: dict[str, Any] = {}
    for key, column in details.items():
        numeric = all(v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in column)
        out[key] = (
            torch.tensor([wire.none_to_nan(v) for v in column], dtype=torch.float32) if numeric else column
        )
    return RewardResult(scores=scores, details=out)


class _RemoteBase:
    """Chunking, parallelism and failure policy shared by the remote rewards."""

    served = True  # scores by waiting on a server: a worker thread can hide that wait (base.is_served)
    name: str
    pool: EndpointPool
    batch_size: int
    on_failure: str
    max_concurrency: int

    def stats(self) -> dict[str, Any]:
        """Counters: requests, ok, failures by kind, retries, failovers, nan_samples, per endpoint."""
        return self.pool.stats()

    def _guarded(self, fn: Callable[[list[int]], tuple[list[float], dict]]) -> Callable[[list[int]], tuple]:
        """Wrap a chunk scorer so a failed chunk becomes NaN (counted) when ``on_failure='nan'``."""

        def run(indices: list[int]) -> tuple[list[int], list[float], dict]:
            try:
                scores, details = fn(indices)
            except RequestRefusedError:
                self.pool.count("failed_samples", len(indices))
                raise  # a 4xx is a configuration mistake: never hidden behind NaN
            except RemoteRewardError as err:
                self.pool.count("failed_samples", len(indices))
                if self.on_failure == "raise":
                    raise RemoteRewardError(f"reward {self.name!r}: {err}") from err
                self.pool.count("nan_samples", len(indices))
                logger.error(
                    "reward %r: %d samples scored NaN (on_failure='nan'): %s", self.name, len(indices), err
                )
                return indices, [math.nan] * len(indices), {}
            return indices, scores, details

        return run

    def _score_chunks(self, n: int, fn: Callable[[list[int]], tuple[list[float], dict]]) -> RewardResult:
        parts = _run_chunks(self._guarded(fn), n, self.batch_size, self.max_concurrency)
        result = _collect(n, parts)
        n_nan = int(torch.isnan(result.scores).sum())
        if n_nan:
            logger.warning("reward %r: %d of %d scores are NaN", self.name, n_nan, n)
        return result


@register("remote", kwargs=kwarg_types.RemoteKwargs)
class RemoteReward(_RemoteBase):
    """Client of rlgen's reward server (``rlgen serve-reward``), balanced over several endpoints."""

    def __init__(
        self,
        reward: str | None = None,
        endpoints: str | Sequence[str] | None = None,
        hosts: str | Sequence[str] | None = None,
        ports: int | Sequence[int] | None = None,
        token: str | None = None,
        batch_size: int = 32,
        timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        health_interval_s: float = 10.0,
        max_concurrency: int | None = None,
        on_failure: str = "raise",
        binary: bool | None = None,
        name: str = "remote",
        wire_format: str | None = None,
    ) -> None:
        """Create the client (no network access until the first score).

        Args:
            reward: Name of the reward on the server (``GET /v1/rewards`` lists them).
            endpoints: Server URLs; or ``hosts`` × ``ports``.
            hosts: Hosts, combined with every port.
            ports: Ports (e.g. one per ``server.workers`` process).
            token: Bearer token (``server.token``).
            batch_size: Images per request; larger batches are split and sent in parallel.
            timeout_s: Per-attempt timeout: connecting, sending and the whole reply.
            retries: Extra attempts per request, each on another endpoint when possible.
            backoff_s: First retry delay (doubles each retry).
            health_interval_s: Cool-down of an endpoint that refused, timed out or failed its probe
                (doubling while it keeps failing, see :class:`EndpointPool`), and the probe interval.
            max_concurrency: Requests in flight per ``score`` call (default: number of endpoints).
            on_failure: ``raise`` or ``nan`` for samples whose score could not be obtained.
            binary: Legacy switch, used only when ``wire_format`` is not given: ``True`` = ``"msgpack"``,
                ``False`` = ``"json"``.
            name: Name used in logs and errors.
            wire_format: How images travel: ``"raw"`` (default: msgpack with uint8 pixels, no PNG codec,
                needs an rlgen server that knows it), ``"msgpack"`` (msgpack with PNG bytes) or ``"json"``
                (JSON with base64 PNG: interoperable, readable). All three are lossless after the
                ``round(x·255)`` quantisation, so served scores are equal across them.
        """
        if not reward:
            raise UserError(
                "reward 'remote' needs reward=NAME, the reward to call on the server (GET /v1/rewards)"
            )
        if batch_size < 1:
            raise UserError(f"batch_size must be ≥ 1, got {batch_size}")
        if wire_format is None:
            wire_format = "raw" if binary is None else ("msgpack" if binary else "json")
        if wire_format not in wire.FORMATS:
            raise UserError(f"wire_format={wire_format!r} is not valid; use one of {', '.join(wire.FORMATS)}")
        self.name, self.reward, self.batch_size = name, reward, batch_size
        self.wire_format, self.binary = wire_format, wire_format != "json"
        self.on_failure = _check_on_failure(on_failure)
        urls = parse_endpoints(endpoints, hosts, ports)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        pin = wire.FINGERPRINT_HEADER  # never balance over servers hosting this reward with other settings
        self.pool = EndpointPool(
            urls, timeout_s, retries, backoff_s, "/healthz", health_interval_s, headers, pin_header=pin
        )
        self.max_concurrency = max_concurrency or len(urls)
        # Raw chunks are quantised at most half-the-cores at a time (and sent in parallel): on a small
        # machine the first request then reaches the server after one chunk's quantisation, not after all
        # of them. PNG encoding (~20× dearer, often the bottleneck) keeps every thread busy.
        slots = max(1, _cpus() // 2) if wire_format == "raw" else max(1, self.max_concurrency)
        self._encoding = threading.BoundedSemaphore(slots)

    def score(self, batch: RewardBatch) -> RewardResult:
        """Score ``batch`` on the server (chunks of ``batch_size`` in parallel).

        Raises:
            RemoteRewardError: A chunk failed after every retry (``on_failure='raise'``) or was refused.
        """
        images = _images_of(batch, self.name)
        metas = (
            None if batch.metadata is None else wire.metadata_to_jsonable(batch.metadata)
        )  # before sending

        def chunk(indices: list[int]) -> tuple[list[float], dict]:
            metadata = None if metas is None else [metas[i] for i in indices]
            with self._encoding:
                if self.wire_format == "raw":  # chunks are index ranges: one quantisation, no codec
                    encoded = wire.raw_entries(wire.quantize(images[indices[0] : indices[-1] + 1]))
                else:
                    encoded = [wire.encode_image(images[i]) for i in indices]
                body, ctype = wire.encode_request(
                    self.reward, encoded, [batch.prompts[i] for i in indices], metadata, self.binary
                )
                del encoded  # the body holds the pixels now
            scores, details = self.pool.request(
                "/v1/score", body, {"Content-Type": ctype}, _reply_of(len(indices))
            )
            n_null = sum(math.isnan(s) for s in scores)
            if n_null:
                self.pool.count("server_nan", n_null)
            return scores, details

        return self._score_chunks(len(batch), chunk)


def _reply_of(n: int) -> Callable[[bytes, str], tuple[list[float], dict]]:
    """A parser of ``/v1/score`` replies for ``n`` images: one score and one entry per detail each."""

    def parse(body: bytes, ctype: str) -> tuple[list[float], dict]:
        scores, details = wire.decode_reply(body, ctype)
        if len(scores) != n:
            raise wire.WireError(f"server returned {len(scores)} scores for {n} images")
        for key, values in details.items():
            if not isinstance(values, list) or len(values) != n:
                got = f"{len(values)} entries" if isinstance(values, list) else f"a {type(values).__name__}"
                raise wire.WireError(f"server returned details[{key!r}] with {got} for {n} images")
        return scores, details

    return parse


@register("flowgrpo_remote", kwargs=kwarg_types.FlowGrpoRemoteKwargs)
class FlowGrpoRemoteReward(_RemoteBase):
    """Client of a Flow-GRPO reward server (pickle protocol, ``POST /``); opt-in via ``allow_pickle``."""

    reads_prompts = True  # it sends them; a server of an image-only reward (deqa) ignores them

    def __init__(
        self,
        endpoints: str | Sequence[str] | None = None,
        hosts: str | Sequence[str] | None = None,
        ports: int | Sequence[int] | None = None,
        allow_pickle: bool = False,
        only_strict: bool = True,
        batch_size: int = 64,
        timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        jpeg_quality: int = 75,
        on_failure: str = "raise",
        max_concurrency: int | None = None,
        score_key: str = "scores",
        name: str = "flowgrpo_remote",
    ) -> None:
        """Create the client.

        Args:
            endpoints: Server URLs (``http://host:port``); or ``hosts`` × ``ports``.
            hosts: Hosts, combined with every port.
            ports: Ports.
            allow_pickle: Must be True: the protocol is pickle, which executes code when loaded.
            only_strict: Sent as ``only_strict`` (GenEval: skip the partial-credit scores).
            batch_size: Images per request (Flow-GRPO uses 64).
            timeout_s: Per-attempt timeout, the whole reply included (Flow-GRPO: 120 s).
            retries: Extra attempts on connection errors and 500s, each on another endpoint when possible.
                Flow-GRPO's client retries up to 1000 times (urllib3 backoff from 1 s, capped at 120 s,
                so practically until the server answers); R3's GenEval client 3 times.
            backoff_s: First retry delay (doubles each retry).
            jpeg_quality: JPEG quality (Flow-GRPO's client uses PIL's default, 75).
            on_failure: ``raise`` or ``nan``.
            max_concurrency: Requests in flight per call (default: number of endpoints).
            score_key: Reply key holding the scores (``scores``; the DeQA server uses ``outputs``).
            name: Name used in logs and errors.

        Raises:
            UserError: Without ``allow_pickle=True``.
        """
        if not allow_pickle:
            raise UserError(
                "flowgrpo_remote speaks Flow-GRPO's pickle protocol, and unpickling can execute arbitrary code; "
                "use it only with a server you trust and opt in with allow_pickle=true "
                f"(reward.kwargs.{name}.allow_pickle=true). rlgen's own server (reward 'remote') is safe."
            )
        self.name, self.batch_size, self.only_strict, self.jpeg_quality = (
            name,
            batch_size,
            only_strict,
            jpeg_quality,
        )
        self.score_key = score_key
        self.on_failure = _check_on_failure(on_failure)
        urls = parse_endpoints(endpoints, hosts, ports)
        self.pool = EndpointPool(
            urls, timeout_s, retries, backoff_s, None, 10.0, pin_header=wire.FINGERPRINT_HEADER
        )  # an rlgen server speaking Flow-GRPO's protocol sends its fingerprint; Flow-GRPO's own none
        self.max_concurrency = max_concurrency or len(urls)

    def score(self, batch: RewardBatch) -> RewardResult:
        """Score ``batch`` on the Flow-GRPO server; details carry rewards, strict rewards, the per-tag
        group rewards (NaN for images of another tag, see :func:`~.protocols.flowgrpo_reply`)
        and each image's tag."""
        images = _images_of(batch, self.name)
        metadata = wire.metadata_to_jsonable(batch.metadata or [{} for _ in range(len(batch))])

        def chunk(indices: list[int]) -> tuple[list[float], dict]:
            jpegs = [wire.encode_image(images[i], "jpeg", self.jpeg_quality) for i in indices]
            prompts = [batch.prompts[i] for i in indices]
            body = protocols.flowgrpo_request(
                jpegs, [metadata[i] for i in indices], self.only_strict, prompts
            )
            headers = {"Content-Type": "application/octet-stream"}
            parse = protocols.flowgrpo_reply(len(indices), self.score_key)
            return self.pool.request("/", body, headers, parse)

        return self._score_chunks(len(batch), chunk)


def parse_unifiedreward(text: str) -> float:
    """``"... Final Score: 4.5"`` → 0.9 (the last score in [1, 5], divided by 5).

    Raises:
        ValueError: If the answer has no such score.
    """
    value = parse_final_score(text)
    if value is None:
        raise ValueError("no 'Final Score: x' with x in [1, 5] in the answer")
    return value / SCORE_MAX


def parse_qwenvl(text: str) -> float:
    """``"<Score>4</Score>"`` → 0.8 (the last tag's X in [1, 5], divided by 5).

    Raises:
        ValueError: If the answer has no such tag.
    """
    value = parse_score_tag(text)
    if value is None:
        raise ValueError("no '<Score>X</Score>' with X in [1, 5] in the answer")
    return value / SCORE_MAX


PARSERS: dict[str, Callable[[str], float]] = {"unifiedreward": parse_unifiedreward, "qwenvl": parse_qwenvl}
PROMPTS: dict[str, str] = {"unifiedreward": UNIFIEDREWARD_PROMPT, "qwenvl": DEFAULT_RUBRIC}


def _resolve_parser(parser: str | Callable[[str], float]) -> Callable[[str], float]:
    """A text-only parser from its built-in name, a ``module:function`` path, or a callable."""
    if callable(parser):
        return parser
    if parser in PARSERS:
        return PARSERS[parser]
    if ":" in parser:
        module, _, attr = parser.partition(":")
        return getattr(importlib.import_module(module), attr)
    names = ", ".join([*PARSERS, *JUDGES])
    raise UserError(f"unknown judge parser {parser!r}; use {names} or 'module:function'")


def _resolve_judge(
    parser: str | Callable[[str], float], prompt_template: str | None, system_prompt: str | None
) -> JudgeSpec:
    """The judge spec for ``parser``, with the template and system prompt overridden when given.

    Metadata-aware judges (``geneval_plus``, ``tiif``) come from :data:`judge_prompts.JUDGES`; any other
    parser is text-only and its template needs a ``{prompt}`` slot.
    """
    if isinstance(parser, str) and parser in JUDGES:
        spec = JUDGES[parser]
    else:
        template = prompt_template or (PROMPTS.get(parser) if isinstance(parser, str) else None)
        if template is None:
            raise UserError(
                f"openai_judge with parser {parser!r} needs prompt_template (with a {{prompt}} slot)"
            )
        spec = plain_spec(str(parser), template, _resolve_parser(parser))
    overrides = {"template": prompt_template, "system_prompt": system_prompt}
    return dataclasses.replace(spec, **{k: v for k, v in overrides.items() if v is not None})


@register("openai_judge", kwargs=kwarg_types.OpenAIJudgeKwargs)
class OpenAIJudgeReward(_RemoteBase):
    """A VLM judge behind an OpenAI-compatible ``/v1/chat/completions`` API (vLLM, SGLang), one call per image."""

    def __init__(
        self,
        endpoints: str | Sequence[str] | None = None,
        hosts: str | Sequence[str] | None = None,
        ports: int | Sequence[int] | None = None,
        model: str | None = None,
        parser: str | Callable[[str], float] = "unifiedreward",
        prompt_template: str | None = None,
        system_prompt: str | None = None,
        api_key: str | None = None,
        max_tokens: int = 4096,
        temperature: float = 0.0,
        timeout_s: float = 300.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        health_interval_s: float = 30.0,
        max_concurrency: int = 8,
        jpeg_quality: int = 95,
        on_failure: str = "raise",
        name: str = "openai_judge",
    ) -> None:
        """Create the judge client.

        Args:
            endpoints: Base URLs ending in ``/v1`` (``http://h:p/v1``); or ``hosts`` × ``ports``.
            hosts: Hosts, combined with every port into ``http://h:p/v1``.
            ports: Ports.
            model: Served model name; ``None`` = the first id of ``GET /v1/models``.
            parser: ``unifiedreward``, ``qwenvl``, ``geneval_plus``, ``tiif`` (metadata-aware, see
                :mod:`rlgen_cli.rewards.judge_prompts`), ``module:function`` or a callable
                ``parse(text) -> float``.
            prompt_template: User text; defaults to the parser's built-in prompt. Slots: ``{prompt}``,
                plus ``{checklist}`` (``geneval_plus``) or ``{questions}`` (``tiif``).
            system_prompt: System message; defaults to the parser's (``geneval_plus`` has one).
            api_key: Sent as ``Authorization: Bearer``.
            max_tokens: Answer length limit.
            temperature: Sampling temperature (0 = deterministic judging).
            timeout_s: Per-attempt timeout: connecting, sending and the whole reply.
            retries: Extra attempts per request (connection errors, 5xx, malformed replies).
            backoff_s: First retry delay (doubles each retry).
            health_interval_s: Cool-down of an endpoint that refused, timed out or failed its probe
                (doubling while it keeps failing), and the ``/models`` probe interval.
            max_concurrency: Judge calls in flight per ``score`` call.
            jpeg_quality: Quality of the JPEG sent to the judge.
            on_failure: ``raise`` or ``nan`` for a failed call or an unparsable answer (both counted).
            name: Name used in logs and errors.
        """
        self.name, self.model = name, model
        self.spec = _resolve_judge(parser, prompt_template, system_prompt)
        self.max_tokens, self.temperature, self.jpeg_quality = max_tokens, temperature, jpeg_quality
        self.on_failure = _check_on_failure(on_failure)
        self.batch_size, self.max_concurrency = 1, max(1, max_concurrency)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        urls = parse_endpoints(endpoints, hosts, ports, suffix="/v1")
        self.pool = EndpointPool(urls, timeout_s, retries, backoff_s, "/models", health_interval_s, headers)

    @property
    def prompt_template(self) -> str:
        """The user-text template sent to the judge."""
        return self.spec.template

    @property
    def system_prompt(self) -> str | None:
        """The system message sent to the judge, if any."""
        return self.spec.system_prompt

    def _model_name(self) -> str:
        """The configured model, or the first one the server lists (looked up once)."""
        if self.model is None:
            ids = self.pool.request("/models", None, {}, protocols.models_reply, method="GET")
            if not ids:
                raise RemoteRewardError(f"judge servers {self.pool.urls} list no models; set model=NAME")
            self.model = ids[0]
        return self.model

    def user_texts(self, batch: RewardBatch) -> list[str]:
        """The user text of every sample, built before any call so bad metadata fails fast.

        Raises:
            ValueError: If the judge needs metadata the batch lacks or that is malformed.
        """
        metadata = batch.metadata or [None] * len(batch)
        texts = []
        for i, (prompt, meta) in enumerate(zip(batch.prompts, metadata)):
            try:
                texts.append(self.spec.fill(self.spec.template, prompt, meta))
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"reward {self.name!r}, sample {i}: {err}") from err
        return texts

    def _judge(self, text: str, image: Tensor, metadata: dict | None) -> tuple[float, str]:
        """Ask the judge about one image; returns the parsed score and the raw answer."""
        image_b64 = wire.image_to_b64(image, "jpeg", self.jpeg_quality)
        body = protocols.chat_request(
            self._model_name(), text, [image_b64], self.spec.system_prompt, self.max_tokens, self.temperature
        )
        answer = self.pool.request(
            "/chat/completions", body, {"Content-Type": "application/json"}, protocols.chat_reply
        )
        try:
            value = float(self.spec.parse(answer, metadata))
            if not math.isfinite(value):
                raise ValueError(f"parsed a non-finite score {value}")
        except Exception as err:
            self.pool.count("parse_failures")
            raise RemoteRewardError(f"unparsable judge answer ({err}): {answer[:300]!r}") from err
        return value, answer

    def score(self, batch: RewardBatch) -> RewardResult:
        """Judge every image; details carry the raw answers under ``judge_answer``.

        Raises:
            ValueError: The judge needs per-sample metadata that is missing or malformed.
            RemoteRewardError: A call failed or an answer was unparsable (``on_failure='raise'``).
        """
        images = _images_of(batch, self.name)
        texts = self.user_texts(batch)
        metadata = batch.metadata or [None] * len(batch)

        def one(indices: list[int]) -> tuple[list[float], dict]:
            i = indices[0]
            value, answer = self._judge(texts[i], images[i], metadata[i])
            return [value], {"judge_answer": [answer]}

        return self._score_chunks(len(batch), one)


def _judge_preset(parser: str) -> Callable[..., OpenAIJudgeReward]:
    """A factory of ``openai_judge`` with ``parser`` fixed, registered under the parser's name."""

    def build(**kwargs: Any) -> OpenAIJudgeReward:
        kwargs.setdefault("name", parser)
        return OpenAIJudgeReward(parser=parser, **kwargs)

    build.__name__ = build.__qualname__ = parser
    build.__doc__ = f"``openai_judge`` with ``parser={parser!r}`` (see :class:`OpenAIJudgeReward`)."
    return build


for _parser in ("unifiedreward", "geneval_plus", "tiif"):
    register(_parser, kwargs=kwarg_types.JudgePresetKwargs)(_judge_preset(_parser))


@register("deqa", kwargs=kwarg_types.DeqaKwargs)
def deqa(
    endpoints: str | Sequence[str] | None = None,
    hosts: str | Sequence[str] | None = None,
    ports: int | Sequence[int] | None = None,
    allow_pickle: bool = False,
    **kwargs: Any,
) -> FlowGrpoRemoteReward:
    """DeQA-Score image quality (≈ 0.2–1: the model's 1–5 score divided by 5 on the server).

    DeQA-Score (``zhiyuanyou/DeQA-Score-Mix3``, mPLUG-Owl2 with remote code) is served the way Flow-GRPO
    serves it: its reward server's ``app_deqa.py`` (Flask/gunicorn, pickle, ``POST /``, default port
    18086) replies ``{"outputs": [score / 5, ...]}``. This is ``flowgrpo_remote`` reading ``outputs``;
    like it, it needs ``allow_pickle=True``. Other args as :class:`FlowGrpoRemoteReward`.
    """
    kwargs.setdefault("name", "deqa")
    reward = FlowGrpoRemoteReward(
        endpoints, hosts, ports, allow_pickle=allow_pickle, score_key="outputs", **kwargs
    )
    reward.reads_prompts = False  # DeQA-Score rates the image alone
    return reward
