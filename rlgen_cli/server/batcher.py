"""Micro-batching of concurrent score requests for one reward.

Requests for the same reward wait in a queue; a single consumer task takes the first one, then keeps
taking more until the batch holds ``max_batch`` images or ``max_wait_ms`` has passed since the first,
scores them together in a one-thread executor (the event loop stays responsive and the reward is never
called concurrently), and hands each request its own slice of the scores and details. Samples are
grouped by image size (only equal sizes stack) and each group is scored in chunks of at most
``max_batch``. If a merged batch fails, each request is rescored alone, so one bad request cannot fail
its neighbours.

Images arrive as ``(C, H, W)`` uint8 pixels (numpy views of the request body, or decoded PNG/JPEG) and
stay uint8 until a ``Reward.score`` chunk is built: each is then divided by 255 straight into the float
batch (one pass, no intermediate copies), or, for a reward that ``accepts_uint8`` (it would quantise
again at once), stacked as uint8. A request waits for company only while its micro-batch is not
full: one that fills ``max_batch`` by itself is scored at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlgen_cli.rewards.base import Reward, RewardBatch, accepts_uint8, check_result
from rlgen_cli.rewards.remote.wire import pixels_to_float, to_jsonable
from rlgen_cli.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)
_MIN_SLICE = 4  # fewest images per slice when a batch's float conversion is split over threads

__all__ = ["Job", "MicroBatcher", "Scored", "ScoringError", "score_samples", "stack_images"]


class ScoringError(Exception):
    """The reward failed on a request; ``status`` is 422 for a ``ValueError`` (bad input), else 500."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Scored:
    """One request's share of a scored batch: a score and the details per sample."""

    scores: list[float]
    details: dict[str, list[Any]] = field(default_factory=dict)
    calls: list[tuple[int, float]] = field(default_factory=list)  # (images, seconds) per Reward.score


@dataclass
class Job:
    """One queued request: its decoded samples and the future its handler awaits."""

    images: list[np.ndarray | Tensor]  # each (C, H, W): uint8 pixels, or float in [0, 1]
    prompts: list[str]
    metadata: list[dict] | None
    future: asyncio.Future = field(repr=False)

    def __len__(self) -> int:
        return len(self.prompts)


def _per_sample(details: dict[str, Any], n: int) -> dict[str, list[Any]]:
    """Keep the details that have one entry per sample, as JSON-ready lists."""
    out = {}
    for key, value in details.items():
        length = int(value.shape[0]) if isinstance(value, Tensor) and value.ndim else None
        if length is None and isinstance(value, list | tuple):
            length = len(value)
        if length == n:
            out[key] = to_jsonable(value)
        else:
            logger.debug("dropping detail %r: not one entry per sample", key)
    return out


def stack_images(
    images: list[np.ndarray | Tensor], pool: Executor | None = None, keep_uint8: bool = False
) -> Tensor:
    """Stack equal-shape ``(C, H, W)`` images into a ``(B, C, H, W)`` float32 batch in [0, 1].

    uint8 numpy pixels are divided by 255 straight into the batch, one image at a time (no uint8 stack,
    no batch-sized temporary); with a ``pool``, a large batch is converted in slices on its threads too
    (numpy releases the GIL). Tensors are stacked, uint8 ones then divided by 255. With ``keep_uint8``
    (for a reward that ``accepts_uint8``) all-uint8 pixels are stacked as they are: a uint8 batch.
    """
    if keep_uint8 and all(_is_uint8(image) for image in images):  # np.stack: a writable copy
        return torch.from_numpy(np.stack([np.asarray(image) for image in images]))
    if not all(isinstance(image, np.ndarray) and image.dtype == np.uint8 for image in images):
        stacked = torch.stack([torch.as_tensor(image) for image in images])
        return torch.div(stacked, 255.0) if stacked.dtype == torch.uint8 else stacked
    out = np.empty((len(images), *images[0].shape), dtype=np.float32)

    def convert(start: int, stop: int) -> None:
        for i in range(start, stop):
            pixels_to_float(images[i], out=out[i])

    parts = min(os.cpu_count() or 1, len(images) // _MIN_SLICE) if pool is not None else 1
    if parts < 2:
        convert(0, len(images))
    else:
        bounds = [round(k * len(images) / parts) for k in range(parts + 1)]
        futures = [pool.submit(convert, a, b) for a, b in zip(bounds[1:-1], bounds[2:])]
        convert(bounds[0], bounds[1])  # this thread takes the first slice
        for future in futures:
            future.result()
    return torch.from_numpy(out)


def _is_uint8(image: np.ndarray | Tensor) -> bool:
    return image.dtype in (np.uint8, torch.uint8)


def score_samples(
    reward: Reward,
    images: list[np.ndarray | Tensor],
    prompts: list[str],
    metadata: list[dict] | None,
    max_batch: int,
    pool: Executor | None = None,
) -> Scored:
    """Score samples of possibly different sizes with as few ``Reward.score`` calls as possible.

    Args:
        reward: The reward.
        images: ``(C, H, W)`` images, one per prompt: uint8 pixels or float in [0, 1].
        prompts: The prompts.
        metadata: Optional per-sample metadata.
        max_batch: Largest number of images per ``Reward.score`` call.
        pool: Threads that help convert uint8 pixels to float (see :func:`stack_images`); a reward that
            ``accepts_uint8`` gets uint8 pixels unconverted.

    Returns:
        Scores (in input order), per-sample details, and ``(images, seconds)`` per call.
    """
    n, uint8 = len(prompts), accepts_uint8(reward)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, image in enumerate(images):
        groups.setdefault(tuple(image.shape), []).append(i)
    scores = [float("nan")] * n
    details: dict[str, list[Any]] = {}
    calls = []
    for indices in groups.values():
        for start in range(0, len(indices), max_batch):
            chunk = indices[start : start + max_batch]
            batch = RewardBatch(
                prompts=[prompts[i] for i in chunk],
                images=stack_images([images[i] for i in chunk], pool, keep_uint8=uint8),
                metadata=None if metadata is None else [metadata[i] for i in chunk],
            )
            began = time.perf_counter()
            result = reward.score(batch)
            calls.append((len(chunk), time.perf_counter() - began))
            check_result(result, len(chunk), reward.name)
            for pos, value in zip(chunk, result.scores.detach().cpu().double().tolist()):
                scores[pos] = value
            for key, values in _per_sample(result.details, len(chunk)).items():
                column = details.setdefault(key, [None] * n)
                for pos, value in zip(chunk, values):
                    column[pos] = value
    return Scored(scores=scores, details=details, calls=calls)


class MicroBatcher:
    """Queue, merge and score the requests for one reward.

    Attributes:
        name: The reward's name (metrics label).
        reward: The reward.
        max_batch: Images per micro-batch and per ``Reward.score`` call.
        max_wait_s: How long the first request of a batch waits for company.
        pool: Threads (the server's decode pool) that help convert a batch's pixels to float.
    """

    def __init__(
        self,
        name: str,
        reward: Reward,
        max_batch: int,
        max_wait_ms: float,
        metrics: ServerMetrics,
        pool: Executor | None = None,
    ) -> None:
        self.name, self.reward, self.metrics, self.pool = name, reward, metrics, pool
        self.max_batch, self.max_wait_s = max_batch, max_wait_ms / 1000.0
        self._queue: asyncio.Queue[Job | None] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"reward-{name}")
        self._task: asyncio.Task | None = None
        self._closing = False

    def start(self) -> None:
        """Start the consumer task (call from the running event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"batcher-{self.name}")

    async def close(self) -> None:
        """Score everything already queued, then stop the consumer and the executor."""
        self._closing = True
        await self._queue.put(None)
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=True)

    async def submit(
        self, images: list[np.ndarray | Tensor], prompts: list[str], metadata: list[dict] | None
    ) -> Scored:
        """Queue one request and wait for its scores.

        Raises:
            ScoringError: If the reward failed on this request, or the server is shutting down.
        """
        if self._closing:
            raise ScoringError("the server is shutting down; retry on another endpoint", status=503)
        job = Job(images, prompts, metadata, asyncio.get_running_loop().create_future())
        await self._queue.put(job)
        return await job.future

    async def _collect(self, first: Job) -> tuple[list[Job], bool]:
        """Gather jobs after ``first`` until full or timed out; returns them and whether to stop."""
        loop = asyncio.get_running_loop()
        jobs, size, deadline = [first], len(first), loop.time() + self.max_wait_s
        while size < self.max_batch:
            try:
                job = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    job = await asyncio.wait_for(self._queue.get(), remaining)
                except asyncio.TimeoutError:
                    break
            if job is None:
                return jobs, True
            jobs.append(job)
            size += len(job)
        return jobs, False

    async def _run(self) -> None:
        """Consumer loop: collect a micro-batch, score it, repeat until the stop sentinel."""
        while True:
            first = await self._queue.get()
            if first is None:
                return
            jobs, stop = await self._collect(first)
            try:
                await self._process(jobs)
            except Exception:  # never let the consumer die: fail the batch's requests instead
                logger.exception("reward %r: unexpected error while scoring a batch", self.name)
                for job in jobs:
                    _fail(job, ScoringError(f"reward {self.name!r} failed unexpectedly", 500))
            if stop:
                return

    async def _process(self, jobs: list[Job]) -> None:
        """Score ``jobs`` together; on failure of a merged batch, rescore each job alone."""
        self.metrics.batch_requests.observe(len(jobs), reward=self.name)
        images = [image for job in jobs for image in job.images]
        prompts = [prompt for job in jobs for prompt in job.prompts]
        metadata = None
        if any(job.metadata is not None for job in jobs):
            metadata = [meta for job in jobs for meta in (job.metadata or [{}] * len(job))]
        loop = asyncio.get_running_loop()
        try:
            scored = await loop.run_in_executor(
                self._executor,
                score_samples,
                self.reward,
                images,
                prompts,
                metadata,
                self.max_batch,
                self.pool,
            )
        except Exception as err:
            if len(jobs) > 1:
                logger.warning(
                    "reward %r failed on a merged batch (%s); rescoring each request", self.name, err
                )
                for job in jobs:
                    await self._process([job])
                return
            status = 422 if isinstance(err, ValueError) else 500
            logger.warning("reward %r failed on a request: %s: %s", self.name, type(err).__name__, err)
            _fail(jobs[0], ScoringError(f"reward {self.name!r} failed: {type(err).__name__}: {err}", status))
            return
        self._record(scored)
        _split(jobs, scored)

    def _record(self, scored: Scored) -> None:
        """Update the batch metrics from one scored batch (runs on the event loop)."""
        for size, seconds in scored.calls:
            self.metrics.batch_size.observe(size, reward=self.name)
            self.metrics.score_seconds.observe(seconds, reward=self.name)
        self.metrics.images.inc(len(scored.scores), reward=self.name)


def _split(jobs: list[Job], scored: Scored) -> None:
    """Hand each job its slice of ``scored``."""
    start = 0
    for job in jobs:
        stop = start + len(job)
        part = Scored(
            scores=scored.scores[start:stop],
            details={key: values[start:stop] for key, values in scored.details.items()},
        )
        if not job.future.done():
            job.future.set_result(part)
        start = stop


def _fail(job: Job, error: Exception) -> None:
    if not job.future.done():
        job.future.set_exception(error)
