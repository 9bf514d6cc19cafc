"""Scoring a flow rollout's batches as they are decoded: on a worker thread beside the sampler, or in
line between batches (``algo.reward_scoring``), to the same values in the same order either way."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from rlgen_cli.recipes import common, flow_run
from rlgen_cli.recipes.flow_run import FlowRun
from rlgen_cli.rewards.base import is_served

__all__ = ["RewardScoring", "overlaps_sampling"]


class RewardScoring:
    """Scores rollout batches as they arrive (:meth:`submit`); :meth:`results` waits for the rest and joins
    them in rollout order.

    Where scoring can hide behind sampling it runs on one worker thread while the next batch samples: on
    an accelerator (the reward's work runs beside the device's) or when a component is served (the thread
    waits on the network; reward models and servers release the GIL). On a CPU run whose rewards all
    compute locally a thread can hide nothing, since the sampler's intra-op threads already hold every
    core; there its torch ops form a second thread team that slows the sampling beside it (a 64-px SD3
    epoch on 2 threads: the batch sampled beside the thread took twice as long), so batches are scored in
    line, in the same order, to the same values. ``algo.reward_scoring`` forces either way;
    :attr:`inline_s` is the time scoring in line took.
    """

    def __init__(self, run: FlowRun) -> None:
        self.run = run
        self.worker = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlgen-reward")
            if overlaps_sampling(run)
            else None
        )
        self.pending: list[Future] = []
        self.inline_s = 0.0

    def __enter__(self) -> RewardScoring:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.worker is not None:
            self.worker.shutdown(wait=True)

    def submit(
        self, images: Tensor, prompts: list[str], metadata: list[dict], sources: Tensor | None
    ) -> None:
        args = (self.run, images, prompts, metadata, sources)
        if self.worker is not None:
            self.pending.append(self.worker.submit(flow_run.score, *args))
            return
        start = time.perf_counter()
        done: Future = Future()
        done.set_result(flow_run.score(*args))
        self.inline_s += time.perf_counter() - start
        self.pending.append(done)

    def results(self) -> tuple[dict[str, Tensor], dict[str, common.Weighted]]:
        """Components (N,) in rollout order, and each batch's detail summaries weighted by its size (their
        run-wide mean: ``common.reduce_over_ranks``)."""
        results = [future.result() for future in self.pending]
        components = {k: torch.cat([r[0][k] for r in results]) for k in results[0][0]}
        sizes = [float(len(next(iter(r[0].values())))) for r in results]
        summaries = {k: common.Weighted([r[1][k] for r in results], sizes) for k in results[0][1]}
        return components, summaries


def overlaps_sampling(run: FlowRun) -> bool:
    """Whether :class:`RewardScoring` scores on a worker thread beside the sampler: ``algo.reward_scoring``,
    whose ``auto`` picks the thread where it can hide something (see there)."""
    mode = run.cfg.algo.reward_scoring
    if mode != "auto":
        return mode == "thread"
    return run.device.type != "cpu" or any(is_served(reward) for reward in run.reward.rewards.values())
