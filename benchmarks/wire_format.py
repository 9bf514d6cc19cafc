"""JSON + base64 vs msgpack + raw bytes on rlgen's reward wire (``POST /v1/score``).

Starts a reward server on loopback hosting a trivial reward (the image mean, so transport dominates),
then scores the same batch through the ``remote`` client with ``binary=False`` (JSON) and ``binary=True``
(msgpack), alternating, and reports median round-trip times, request sizes and the ratio
``json_s / msgpack_s`` (> 1 means msgpack is faster). Also times just the payload encode+decode.

    python benchmarks/wire_format.py [--images 16] [--size 512] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

from rlgen_cli.rewards.base import RewardBatch, RewardResult
from rlgen_cli.rewards.remote import RemoteReward
from rlgen_cli.server import wire
from rlgen_cli.server.app import ServerSettings, build_app
from rlgen_cli.server.runner import BackgroundServer


class MeanReward:
    """Scores an image by its mean pixel value: almost free, so the wire format dominates."""

    name = "mean"

    def score(self, batch: RewardBatch) -> RewardResult:
        return RewardResult(scores=batch.images.mean(dim=(1, 2, 3)))


def smooth_images(n: int, size: int) -> torch.Tensor:
    """Photo-like images (smooth gradients + mild noise) whose PNGs have a realistic size."""
    g = torch.Generator().manual_seed(0)
    base = torch.nn.functional.interpolate(
        torch.rand(n, 3, 8, 8, generator=g), size=(size, size), mode="bicubic"
    )
    return (base + 0.02 * torch.randn(n, 3, size, size, generator=g)).clamp(0, 1)


def payload_codec_s(encoded: list[bytes], binary: bool, repeats: int) -> float:
    """Median seconds to build a request body and parse it back (no HTTP, no PNG work)."""
    import msgpack

    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        body, _ = wire.encode_request("mean", encoded, ["p"] * len(encoded), binary=binary)
        if binary:
            msgpack.unpackb(body, raw=False)
        else:
            [wire.b64_to_bytes(s, i) for i, s in enumerate(json.loads(body)["images"])]
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    logging.disable(logging.INFO)
    torch.set_num_threads(2)
    images = smooth_images(args.images, args.size)
    batch = RewardBatch(prompts=["a prompt"] * args.images, images=images)
    encoded = [wire.encode_image(im) for im in images]
    settings = ServerSettings(port=0, max_batch=args.images, max_wait_ms=0)
    with BackgroundServer(build_app({"mean": MeanReward()}, settings)) as server:
        clients = {
            fmt: RemoteReward("mean", endpoints=[server.url], batch_size=args.images, binary=fmt == "msgpack")
            for fmt in ("json", "msgpack")
        }
        times: dict[str, list[float]] = {"json": [], "msgpack": []}
        for _ in range(args.repeats + 1):  # first round warms up
            for fmt, client in clients.items():
                began = time.perf_counter()
                client.score(batch)
                times[fmt].append(time.perf_counter() - began)
    json_s, msgpack_s = (statistics.median(t[1:]) for t in (times["json"], times["msgpack"]))
    sizes = {
        b: len(wire.encode_request("mean", encoded, ["p"] * args.images, binary=b)[0]) for b in (False, True)
    }
    codec = {b: payload_codec_s(encoded, b, args.repeats) for b in (False, True)}
    print(
        json.dumps(
            {
                "images": args.images,
                "size": args.size,
                "png_kb_mean": round(sum(map(len, encoded)) / len(encoded) / 1000, 1),
                "request_mb_json": round(sizes[False] / 1e6, 3),
                "request_mb_msgpack": round(sizes[True] / 1e6, 3),
                "payload_codec_ms_json": round(codec[False] * 1000, 2),
                "payload_codec_ms_msgpack": round(codec[True] * 1000, 2),
                "roundtrip_s_json": round(json_s, 4),
                "roundtrip_s_msgpack": round(msgpack_s, 4),
                "ratio": round(json_s / msgpack_s, 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
