"""The score pipeline of the reward server: one request from admission to reply, whatever its protocol.

A request first takes a slot of ``max_inflight_requests`` and its body's share of the memory budget
(:mod:`.admission`), then its protocol's reader (rlgen's wire, or Flow-GRPO's pickle) reads and parses
it under the limits (:mod:`.body`); its images' sizes are checked and their decoded bytes reserved from
the pixel half of the budget before anything is decoded (:mod:`.payload`); the decoded images join the
reward's micro-batch (:mod:`.batcher`), and the reply goes out in the request's own format. Parsing,
checking and decoding run in the decode pool unless the work is small (raw pixels, short bodies).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rlgen_cli.rewards.base import Reward, accepts_uint8, reads_prompts
from rlgen_cli.rewards.remote import wire
from rlgen_cli.server import flowgrpo
from rlgen_cli.server.admission import Budget
from rlgen_cli.server.batcher import ScoringError
from rlgen_cli.server.body import INLINE_PARSE_BYTES, is_identity, read_body, read_payload
from rlgen_cli.server.payload import check_all, decode_checked, score_fields
from rlgen_cli.server.pickle_scan import PickleScanner
from rlgen_cli.server.refusal import ApiError, wire_error
from rlgen_cli.server.state import STATE, ServerState

logger = logging.getLogger(__name__)

__all__ = ["score", "score_flowgrpo"]


async def _in_pool(state: ServerState, inline: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` here when ``inline``, else in the decode pool; a WireError becomes its ApiError."""
    try:
        if inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(state.decoder, fn, *args)
    except wire.WireError as err:
        raise wire_error(err) from err


async def _admit(state: ServerState, budget: Budget, amount: int, what: str) -> None:
    """Take ``amount`` of ``budget`` within ``admission_wait_s``, else 503 with ``Retry-After``."""
    wait_s = state.settings.admission_wait_s
    if not await budget.acquire(amount, wait_s):
        raise ApiError(
            503,
            f"the server is busy: {what} stayed full for server.admission_wait_s={wait_s:g} s; retry later "
            "or on another endpoint",
            kind="busy",
            headers={"Retry-After": "1"},
        )


def _pixel_cost(decoded_bytes: int, reward: Reward) -> int:
    """What a request's pixels hold at most: the uint8 arrays and, for a reward that takes float pixels,
    their float32 copy (4 bytes each)."""
    return decoded_bytes * (1 if accepts_uint8(reward) else 5)


def _reply(body: dict[str, Any], binary: bool) -> web.Response:
    if binary:
        import msgpack

        return web.Response(body=msgpack.packb(body, use_bin_type=True), content_type=wire.MSGPACK_TYPE)
    return web.json_response(body)


@dataclass
class _ScoreJob:
    """A parsed score request, whatever its protocol: the reward, its images (not yet checked), prompts,
    metadata, how to answer it from the scores and details, and a check that the reward has the prompts
    it reads."""

    reward: str
    raw: list[Any]
    prompts: list[str]
    metadata: list[dict] | None
    respond: Callable[[list[float], dict[str, list]], web.Response]
    check_prompts: Callable[[], None] = lambda: None  # raises WireError when the reward lacks its prompts


async def _native_job(request: web.Request, state: ServerState) -> _ScoreJob:
    """Read a ``/v1/score`` request (JSON or msgpack); the reply uses its format, NaN sent as null."""
    payload, binary = await read_payload(request, state)
    hosted, depth = state.batchers, state.settings.max_metadata_depth
    name, raw, prompts, metadata = score_fields(payload, binary, hosted, depth)

    def respond(scores: list[float], details: dict[str, list]) -> web.Response:
        return _reply({"scores": [wire.nan_to_none(s) for s in scores], "details": details}, binary)

    return _ScoreJob(name, raw, prompts, metadata, respond)


def _flowgrpo_reward(request: web.Request, state: ServerState) -> str:
    """The reward a Flow-GRPO request names by its path: ``/<reward>``, or ``/`` when only one is hosted."""
    hosted = sorted(state.batchers)
    name = request.match_info.get("reward")
    if name is None:
        if len(hosted) == 1:
            return hosted[0]
        raise ApiError(
            404,
            f"this server hosts several rewards ({', '.join(hosted)}); POST Flow-GRPO requests to "
            "/<reward>, e.g. http://HOST:PORT/" + hosted[0],
            "not_found",
        )
    if name not in state.batchers:
        raise ApiError(404, f"unknown reward {name!r}; this server hosts: {', '.join(hosted)}", "not_found")
    return name


async def _flowgrpo_job(request: web.Request, state: ServerState) -> _ScoreJob:
    """Read a Flow-GRPO pickle request (plain data only, never run); the reply is a pickle too."""
    name = _flowgrpo_reward(request, state)
    settings = state.settings
    body = await read_body(request, PickleScanner(settings.max_request_items))  # walked as it arrives
    inline = len(body) <= INLINE_PARSE_BYTES
    args = (body, settings.max_request_items, settings.max_metadata_depth)
    parsed = await _in_pool(state, inline, flowgrpo.parse_request, *args)

    def respond(scores: list[float], details: dict[str, list]) -> web.Response:
        body = flowgrpo.reply_body(scores, details, parsed.only_strict)
        return web.Response(body=body, content_type=flowgrpo.PICKLE_TYPE)

    def check_prompts() -> None:
        flowgrpo.require_prompts(parsed, name, reads_prompts(state.rewards[name]))

    return _ScoreJob(name, parsed.images, parsed.prompts, parsed.metadata, respond, check_prompts)


JobReader = Callable[[web.Request, ServerState], Awaitable[_ScoreJob]]


def _fingerprinted(response: web.Response, state: ServerState, name: str) -> web.Response:
    """The reply with the reward's fingerprint in its header: clients pin it and refuse another."""
    response.headers[wire.FINGERPRINT_HEADER] = state.fingerprints[name]
    return response


async def _score_with(request: web.Request, read_job: JobReader) -> web.Response:
    """Admit, read (``read_job``), check sizes, admit the pixels, decode, batch, score, reply."""
    state = request.app[STATE]
    await _admit(
        state, state.slots, 1, f"server.max_inflight_requests={state.settings.max_inflight_requests}"
    )
    body_cost = pixel_cost = 0
    state.metrics.in_flight.inc()
    try:
        # Bodies and pixels are two halves of the budget: a request holding its body's share waits only
        # for pixel shares, whose holders never wait, so requests cannot block each other for good.
        declared = request.content_length if is_identity(request) else None  # encoded: inflates past it
        budget_key = f"server.max_inflight_decoded_mb={state.settings.max_inflight_decoded_mb:g}"
        cost = 2 * (state.settings.max_request_bytes if declared is None else declared)  # body + parse
        await _admit(state, state.bodies, cost, budget_key + " (request bodies: half of it)")
        body_cost = cost
        job = await read_job(request, state)
        name, raw = job.reward, job.raw
        if not job.prompts:
            return _fingerprinted(job.respond([], {}), state, name)
        inline = all(isinstance(data, dict) for data in raw)  # raw pixels: cheap checks and views
        checked, decoded = await _in_pool(state, inline, check_all, raw, state.settings)
        await _in_pool(state, True, job.check_prompts)  # after the size checks: limits answer first
        cost = _pixel_cost(decoded, state.rewards[name])
        await _admit(state, state.pixels, cost, budget_key + " (decoded pixels: half of it)")
        pixel_cost = cost
        images = await _in_pool(state, inline, decode_checked, checked)
        del checked, raw
        job.raw = []  # the bodies' strings and bytes are decoded: let them go before scoring
        try:
            scored = await state.batchers[name].submit(images, job.prompts, job.metadata)
        except ScoringError as err:
            raise ApiError(err.status, str(err), kind="scoring") from err
        n_bad = sum(not math.isfinite(s) for s in scored.scores)
        if n_bad:
            state.metrics.nan_scores.inc(n_bad, reward=name)
            logger.warning("reward %r returned %d non-finite scores (sent as null)", name, n_bad)
        return _fingerprinted(job.respond(scored.scores, scored.details), state, name)
    finally:
        state.metrics.in_flight.dec()
        state.bodies.release(body_cost)
        state.pixels.release(pixel_cost)
        state.slots.release(1)


async def score(request: web.Request) -> web.Response:
    """``POST /v1/score``: rlgen's own wire (:mod:`~rlgen_cli.rewards.remote.wire`)."""
    return await _score_with(request, _native_job)


async def score_flowgrpo(request: web.Request) -> web.Response:
    """``POST /`` and ``POST /<reward>`` with ``flowgrpo_protocol``: Flow-GRPO's pickle protocol."""
    return await _score_with(request, _flowgrpo_job)
