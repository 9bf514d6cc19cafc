"""Running the reward server: in the foreground, in a background thread, or as several worker processes.

Scale-out design (the simplest that stays robust): ``server.workers = N`` starts N independent server
processes; worker ``i`` listens on ``port + i`` and sees only device ``devices[i % len(devices)]``
(through ``CUDA_VISIBLE_DEVICES``, so a reward inside it just uses ``cuda``/``cuda:0``). The processes
share nothing; the client (:mod:`rlgen_cli.rewards.remote`) balances requests across the ports and fails
over when one dies. The parent forwards SIGINT/SIGTERM to the workers and watches them: a worker that dies
on its own (an error, a crash, the OOM killer's SIGKILL) is reported with its index, pid, port and exit
status, the others are stopped, and the parent exits non-zero, so the whole group lives and dies together
and a supervisor (systemd, Kubernetes, a shell loop) sees the failure and can restart it.

Each process loads its rewards' models before it listens (:func:`load_models`): a model that does not
load stops it at start, naming the reward and what it reads, and ``/healthz`` never answers ``ok`` while a
model is still missing. Each process shuts down gracefully: it stops accepting connections, finishes in-flight requests (up to
``shutdown_timeout_s``) and drains its batch queues before exiting.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any, NamedTuple

from aiohttp import web

from rlgen_cli.errors import UserError
from rlgen_cli.rewards.base import Reward
from rlgen_cli.server.app import ServerSettings, build_app
from rlgen_cli.server.connections import ServerRunner

logger = logging.getLogger("rlgen_cli.server.runner")  # also when run as __main__ (a worker)

__all__ = [
    "BackgroundServer",
    "build_rewards",
    "configure_logging",
    "load_models",
    "return_large_frees_to_the_os",
    "serve",
    "serve_workers",
    "worker_env",
    "worker_plan",
]


def configure_logging(level: str = "INFO") -> None:
    """Console logging for a server process; per-request access lines only at DEBUG."""
    level = level.upper()
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s [pid %(process)d]: %(message)s"
    )
    logging.getLogger("aiohttp.access").setLevel(logging.DEBUG if level == "DEBUG" else logging.WARNING)


def build_rewards(specs: Mapping[str, Mapping[str, Any]]) -> dict[str, Reward]:
    """Build the hosted rewards from ``{name: constructor kwargs}`` through the reward registry.

    Raises:
        UserError: If a name is not registered (the message lists the valid names).
    """
    from rlgen_cli.rewards import build_reward

    try:
        return {name: build_reward(name, **dict(kwargs)) for name, kwargs in specs.items()}
    except ValueError as err:
        raise UserError(str(err)) from err


def load_models(rewards: Mapping[str, Reward]) -> None:
    """Load every hosted reward's model now (its ``load()``), before the server listens: a reward that
    cannot load stops the server at start, naming the reward and what it reads, and ``/healthz`` answers
    only once every model is in memory, never while the first score request would still wait on it.

    Raises:
        UserError: For the first reward whose model does not load.
    """
    from rlgen_cli.rewards.requirements import requirements_of

    for name, reward in rewards.items():
        load = getattr(reward, "load", None)
        if not callable(load):
            continue  # nothing to load: a rule or a lightweight reward
        logger.info("reward %r: loading its model before serving", name)
        try:
            load()
        except Exception as err:  # noqa: BLE001  (any failure to load is reported the same way)
            reads = ", ".join(f"{r.key}={r.path}" for r in requirements_of(reward) if hasattr(r, "path"))
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(".")
            raise UserError(
                f"reward {name!r} could not load its model{f' ({reads})' if reads else ''}: "
                f"{type(err).__name__}: {first_line}. Fetch it (or point the reward's kwargs at a local "
                "copy) and start the server again"
            ) from err


def worker_env(device: str | None) -> dict[str, str]:
    """Environment overrides that pin a worker to ``device`` (``cuda:K``, ``K``, ``cpu`` or ``cuda``)."""
    if not device or device == "cuda":
        return {}
    if device == "cpu":
        return {"CUDA_VISIBLE_DEVICES": ""}
    index = device.removeprefix("cuda:")
    if not index.isdigit():
        raise UserError(f"server.devices entry {device!r} is not cpu, cuda, cuda:N or N; fix server.devices")
    return {"CUDA_VISIBLE_DEVICES": index}


def worker_plan(settings: ServerSettings) -> list[tuple[int, str | None]]:
    """``(port, device)`` of every worker: ports ``port, port+1, …``, devices round-robin."""
    if settings.workers > 1 and settings.port == 0:
        raise UserError(
            "server.port=0 (any free port) cannot be used with server.workers > 1; give a fixed port"
        )
    devices = list(settings.devices)
    return [
        (settings.port + i, devices[i % len(devices)] if devices else None) for i in range(settings.workers)
    ]


async def _serve_async(rewards: dict[str, Reward], settings: ServerSettings) -> None:
    """Serve until SIGINT/SIGTERM, then shut down gracefully."""
    runner = ServerRunner(build_app(rewards, settings), shutdown_timeout=settings.shutdown_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    logger.info("serving rewards %s on http://%s:%d", sorted(rewards), settings.host, settings.port)
    try:
        await stop.wait()
        logger.info("shutting down: finishing in-flight requests")
    finally:
        await runner.cleanup()


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def return_large_frees_to_the_os() -> None:
    """Make every allocation of 1 MiB or more its own mapping, unmapped as soon as it is freed (glibc).

    glibc otherwise raises its mmap threshold to the largest block freed (up to 32 MiB), so request bodies
    and pixel batches come from heaps that keep their freed pages: the process's RSS then follows the
    largest past load, not what the requests in flight hold (``server.max_inflight_decoded_mb``). A no-op
    where the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        logger.debug("not glibc: freed request memory is returned as the C library decides")


def serve(rewards: dict[str, Reward], settings: ServerSettings) -> None:
    """Serve ``rewards`` in this process (blocks until SIGINT/SIGTERM).

    Args:
        rewards: Rewards to host, by name.
        settings: Server settings; ``workers`` is ignored here (see :func:`serve_workers`).
    """
    return_large_frees_to_the_os()
    asyncio.run(_serve_async(rewards, settings))


def serve_workers(specs: Mapping[str, Mapping[str, Any]], settings: ServerSettings) -> int:
    """Serve with ``settings.workers`` processes (one in-process when 1); returns the exit code.

    Args:
        specs: ``{reward name: constructor kwargs}``; each worker builds its own rewards.
        settings: Server settings.

    Returns:
        0 after a clean shutdown, else the first failing worker's exit code (``128 + N`` for a worker
        killed by signal N, as a shell reports it).
    """
    plan = worker_plan(settings)
    if len(plan) == 1:
        os.environ.update(worker_env(plan[0][1]))
        rewards = build_rewards(specs)
        load_models(rewards)
        serve(rewards, settings)
        return 0
    workers: list[Worker] = []
    stopping = threading.Event()

    def stop_all(_signum: int = signal.SIGTERM, _frame: Any = None) -> None:
        stopping.set()
        for worker in workers:
            if worker.proc.poll() is None:
                worker.proc.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop_all) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with tempfile.TemporaryDirectory(prefix="rlgen-serve-") as tmp:
            for i, (port, device) in enumerate(plan):
                if not stopping.is_set():
                    workers.append(Worker(i, port, _spawn(tmp, i, port, device, specs, settings)))
            return _supervise(workers, stopping, stop_all)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Worker(NamedTuple):
    """One server process of a multi-worker group."""

    index: int
    port: int
    proc: subprocess.Popen


def _spawn(
    tmp: str,
    i: int,
    port: int,
    device: str | None,
    specs: Mapping[str, Mapping[str, Any]],
    settings: ServerSettings,
) -> subprocess.Popen:
    """Start worker ``i`` on ``port`` pinned to ``device``, with its spec in a JSON file under ``tmp``."""
    spec_path = os.path.join(tmp, f"worker{i}.json")
    one = asdict(settings) | {"port": port, "workers": 1, "devices": []}
    with open(spec_path, "w", encoding="utf-8") as out:
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        json.dump(
            {"rewards": {k: dict(v) for k, v in specs.items()}, "settings": one, "log_level": level}, out
        )
    cmd = [sys.executable, "-m", "rlgen_cli.server.runner", spec_path]
    proc = subprocess.Popen(cmd, env=os.environ | worker_env(device))
    logger.info("worker %d: pid %d, port %d, device %s", i, proc.pid, port, device or "inherited")
    return proc


def exit_status(returncode: int) -> tuple[str, int]:
    """How a worker ended, in words, and the exit code the group reports for it (128 + N for signal N)."""
    if returncode >= 0:
        return f"exited with code {returncode}", returncode
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name}", 128 - returncode


def _supervise(workers: list[Worker], stopping: threading.Event, stop_all: Callable[[], None]) -> int:
    """Wait until every worker exited. The first worker to exit on its own (not asked to stop) is
    reported, stops the rest and, unless it exited cleanly, sets the exit code."""
    code = 0
    while any(w.proc.poll() is None for w in workers) or not stopping.is_set():
        for worker in workers:
            rc = worker.proc.poll()
            if rc is None or stopping.is_set():
                continue
            how, code = exit_status(rc)
            report = logger.warning if code == 0 else logger.error
            report(
                "worker %d (pid %d, port %d) %s; stopping the other workers",
                worker.index,
                worker.proc.pid,
                worker.port,
                how,
            )
            stop_all()
        time.sleep(0.2)
    return code


class BackgroundServer:
    """Run an application on a private event loop in a daemon thread (tests, notebooks, benchmarks).

    Example::

        with BackgroundServer(build_app({"jpeg": reward})) as server:
            requests_go_to(server.url)
    """

    def __init__(
        self, app: web.Application, host: str = "127.0.0.1", port: int = 0, shutdown_timeout_s: float = 30.0
    ):
        self.app, self.host, self.port = app, host, port
        self._runner = ServerRunner(app, shutdown_timeout=shutdown_timeout_s)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="rlgen-reward-server", daemon=True
        )

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:40123``."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        """Start listening; returns self with ``port`` set to the bound port."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    async def _start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])  # the bound port when port=0

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful shutdown (in-flight requests finish), then stop the loop and join the thread."""
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=timeout)
        self._loop.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _worker_main(spec_path: str) -> None:
    """Entry point of one worker process: read its spec, build the rewards, serve."""
    with open(spec_path, encoding="utf-8") as spec_file:
        spec = json.load(spec_file)
    configure_logging(spec.get("log_level", "INFO"))
    settings = ServerSettings(**spec["settings"])
    try:
        rewards = build_rewards(spec["rewards"])
        load_models(rewards)
    except UserError as err:  # one line, and the group's supervisor reports this worker's exit code
        logger.error("%s", err)
        sys.exit(2)
    serve(rewards, settings)


if __name__ == "__main__":
    _worker_main(sys.argv[1])
