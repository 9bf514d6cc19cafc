"""Reward serving overhead and scale-out: JPEG compressibility in-process vs through loopback servers.

Scores the same 64-image batches three ways and prints one JSON line:

* ``inproc`` — ``jpeg_compressibility`` called directly, as a local reward in training;
* ``one`` — through one ``rlgen serve-reward`` worker process on 127.0.0.1 (the ``remote`` client splits
  each batch into ``--chunk``-image requests, ``--concurrency`` in flight);
* ``two`` — through two worker processes, the client balancing across them (2× the concurrency).

Reported: images/s and p50/p99 latency per 64-image batch for each, ``loopback_ratio`` =
one/inproc throughput (targets ≥ 0.8) and ``scaling_ratio`` = two/one (≥ 1.6 where the cores allow it:
each worker needs its own core, and the client needs one too). ``jpeg_ms_per_image`` and
``png_encode_ms_per_image`` / ``png_decode_ms_per_image`` (single-threaded) show the wire's share: the
client encodes every image as lossless PNG and the server decodes it, so for a reward as cheap as JPEG
compressibility the wire costs more than the reward; for model rewards on a GPU it is amortised.

    python benchmarks/reward_server.py [--size 512] [--batches 20] [--chunk 16] [--concurrency 4] [--msgpack]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch

from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards.remote import RemoteReward

REWARD = "jpeg_compressibility"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def photo_like(n: int, size: int, seed: int) -> torch.Tensor:
    """Smooth gradients plus mild noise: JPEG/PNG sizes like real generations."""
    g = torch.Generator().manual_seed(seed)
    base = torch.nn.functional.interpolate(
        torch.rand(n, 3, 8, 8, generator=g), size=(size, size), mode="bicubic"
    )
    return (base + 0.03 * torch.randn(n, 3, size, size, generator=g)).clamp(0, 1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"reward worker exited with {proc.returncode} before serving")
        try:
            with _NO_PROXY.open(url + "/healthz", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"reward worker {url} not healthy after {timeout_s:.0f}s")


@contextmanager
def worker(max_batch: int, tmp: str) -> Iterator[str]:
    """One reward-server worker process (as ``server.workers`` starts them); yields its URL."""
    port = _free_port()
    spec = os.path.join(tmp, f"worker-{port}.json")
    settings = {"port": port, "max_batch": max_batch, "max_wait_ms": 2}
    with open(spec, "w", encoding="utf-8") as out:
        json.dump({"rewards": {REWARD: {}}, "settings": settings, "log_level": "WARNING"}, out)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rlgen_cli.server.runner", spec], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def codec_costs(batch: RewardBatch, local: object) -> dict[str, float]:
    """Single-threaded ms per image of the reward itself and of the PNG wire encode/decode."""
    from rlgen_cli.server import wire

    n = len(batch)
    began = time.perf_counter()
    local.score(batch)
    jpeg = time.perf_counter() - began
    began = time.perf_counter()
    encoded = [wire.encode_image(image) for image in batch.images]
    encode = time.perf_counter() - began
    began = time.perf_counter()
    for i, data in enumerate(encoded):
        wire.decode_image(data, i)
    decode = time.perf_counter() - began
    return {
        "jpeg_ms_per_image": round(jpeg / n * 1000, 2),
        "png_encode_ms_per_image": round(encode / n * 1000, 2),
        "png_decode_ms_per_image": round(decode / n * 1000, 2),
        "png_kb_per_image": round(sum(map(len, encoded)) / n / 1000, 1),
    }


def measure(
    score: Callable[[RewardBatch], object], batches: list[RewardBatch], warmup: int
) -> dict[str, float]:
    """Throughput (images/s) and p50/p99 batch latency (ms) of ``score`` over ``batches``."""
    for batch in batches[:warmup]:
        score(batch)
    latencies = []
    began = time.perf_counter()
    for batch in batches[warmup:]:
        start = time.perf_counter()
        score(batch)
        latencies.append(time.perf_counter() - start)
    total = time.perf_counter() - began
    images = sum(len(b) for b in batches[warmup:])
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "images_per_s": round(images / total, 1),
        "p50_ms": round(statistics.median(latencies) * 1000, 1),
        "p99_ms": round(p99 * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64, help="images per scored batch")
    parser.add_argument("--size", type=int, default=512, help="image side in pixels")
    parser.add_argument("--batches", type=int, default=20, help="timed batches per setup")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=16, help="images per request (client batch_size)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight per server")
    parser.add_argument("--msgpack", action="store_true", help="binary wire (msgpack + raw PNG)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)

    local = build_reward(REWARD)
    batches = [
        RewardBatch(prompts=["p"] * args.images, images=photo_like(args.images, args.size, seed))
        for seed in range(args.warmup + args.batches)
    ]
    expected = [local.score(b).scores for b in batches]
    costs = codec_costs(batches[0], local)
    results: dict[str, dict[str, float]] = {"inproc": measure(local.score, batches, args.warmup)}

    def client(urls: list[str]) -> Callable[[RewardBatch], object]:
        remote = RemoteReward(
            REWARD, endpoints=urls, batch_size=args.chunk, max_concurrency=args.concurrency * len(urls),
            binary=args.msgpack,
        )  # fmt: skip

        def score(batch: RewardBatch) -> object:
            return remote.score(batch)

        for batch, want in zip(batches[:1], expected):  # served scores equal local ones
            if not torch.equal(remote.score(batch).scores, want):
                raise AssertionError("served scores differ from in-process scores")
        return score

    with tempfile.TemporaryDirectory(prefix="rlgen-bench-") as tmp, ExitStack() as stack:
        urls = [stack.enter_context(worker(args.images, tmp)) for _ in range(2)]
        results["one"] = measure(client(urls[:1]), batches, args.warmup)
        results["two"] = measure(client(urls), batches, args.warmup)
    print(
        json.dumps(
            {
                "reward": REWARD,
                "images_per_batch": args.images,
                "size": args.size,
                "wire": "msgpack" if args.msgpack else "json",
                "chunk": args.chunk,
                "concurrency_per_server": args.concurrency,
                "cpu_count": os.cpu_count(),
                "load_avg_1m": round(os.getloadavg()[0], 2),
                **costs,
                **{f"{k}_{m}": v for k, r in results.items() for m, v in r.items()},
                "loopback_ratio": round(
                    results["one"]["images_per_s"] / results["inproc"]["images_per_s"], 3
                ),
                "scaling_ratio": round(results["two"]["images_per_s"] / results["one"]["images_per_s"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
