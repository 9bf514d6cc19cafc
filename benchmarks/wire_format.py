"""rlgen's reward wire formats (``POST /v1/score``): JSON + base64 PNG, msgpack + PNG, msgpack + raw pixels.

Starts a reward server on loopback hosting a trivial reward (the image mean, so transport dominates),
then scores the same batch through the ``remote`` client with ``wire_format`` ``json``, ``msgpack`` and
``raw``, alternating, and reports median round-trip times, request sizes and the ratios
``json_s / msgpack_s`` (``ratio``) and ``json_s / raw_s`` (``ratio_raw``); > 1 means faster than JSON.
Also times just the payload encode+decode (``payload_codec_ms_*``: building and parsing the body, no
image codec) and the image codec each format needs (``image_codec_ms_png``: PNG encode + decode;
``image_codec_ms_raw``: quantise to uint8 + convert back to float), all for the whole batch.

    python benchmarks/wire_format.py [--images 16] [--size 512] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable

import msgpack
import torch

from rlgen_cli.rewards.base import RewardBatch, RewardResult
from rlgen_cli.rewards.remote import RemoteReward, wire
from rlgen_cli.server.app import ServerSettings, build_app
from rlgen_cli.server.batcher import stack_images
from rlgen_cli.server.runner import BackgroundServer

FORMATS = ("json", "msgpack", "raw")


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


def median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
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
    prompts = ["p"] * args.images
    encoded = [wire.encode_image(im) for im in images]
    raw = wire.raw_entries(wire.quantize(images))
    bodies = {
        "json": wire.encode_request("mean", encoded, prompts, binary=False)[0],
        "msgpack": wire.encode_request("mean", encoded, prompts, binary=True)[0],
        "raw": wire.encode_request("mean", raw, prompts, binary=True)[0],
    }
    settings = ServerSettings(port=0, max_batch=args.images, max_wait_ms=0)
    with BackgroundServer(build_app({"mean": MeanReward()}, settings)) as server:
        clients = {
            fmt: RemoteReward("mean", endpoints=[server.url], batch_size=args.images, wire_format=fmt)
            for fmt in FORMATS
        }
        times: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
        for _ in range(args.repeats + 1):  # first round warms up
            for fmt, client in clients.items():
                began = time.perf_counter()
                client.score(batch)
                times[fmt].append(time.perf_counter() - began)
    roundtrip = {fmt: statistics.median(t[1:]) for fmt, t in times.items()}
    codec = {
        "json": lambda: [
            wire.b64_to_bytes(s, i)
            for i, s in enumerate(json.loads(wire.encode_request("mean", encoded, prompts)[0])["images"])
        ],
        "msgpack": lambda: msgpack.unpackb(wire.encode_request("mean", encoded, prompts, binary=True)[0]),
        "raw": lambda: [
            wire.decode_raw_image(entry, i)
            for i, entry in enumerate(
                msgpack.unpackb(wire.encode_request("mean", raw, prompts, binary=True)[0])["images"]
            )
        ],
    }
    arrays = [wire.decode_raw_image(e, i) for i, e in enumerate(msgpack.unpackb(bodies["raw"])["images"])]
    png = median_s(lambda: [wire.decode_image_array(wire.encode_image(im), 0) for im in images], args.repeats)
    raw_codec = median_s(lambda: (wire.quantize(images), stack_images(arrays)), args.repeats)
    print(
        json.dumps(
            {
                "images": args.images,
                "size": args.size,
                "png_kb_mean": round(sum(map(len, encoded)) / len(encoded) / 1000, 1),
                **{f"request_mb_{fmt}": round(len(body) / 1e6, 3) for fmt, body in bodies.items()},
                **{
                    f"payload_codec_ms_{fmt}": round(median_s(fn, args.repeats) * 1000, 2)
                    for fmt, fn in codec.items()
                },
                "image_codec_ms_png": round(png * 1000, 2),
                "image_codec_ms_raw": round(raw_codec * 1000, 2),
                **{f"roundtrip_s_{fmt}": round(s, 4) for fmt, s in roundtrip.items()},
                "ratio": round(roundtrip["json"] / roundtrip["msgpack"], 3),
                "ratio_raw": round(roundtrip["json"] / roundtrip["raw"], 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
