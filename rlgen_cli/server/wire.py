"""rlgen's reward wire format, shared by the server (:mod:`rlgen_cli.server.app`) and the clients
(:mod:`rlgen_cli.rewards.remote`).

JSON request (``POST /v1/score``, ``Content-Type: application/json``)::

    {"reward": "jpeg_compressibility",
     "images": ["<base64 PNG or JPEG>", ...],
     "prompts": ["a cat", ...],
     "metadata": [{...}, ...]}          # optional, one dict per image

JSON reply: ``{"scores": [float | null, ...], "details": {key: [value per sample]}}``. JSON has no NaN:
a failed (NaN) or infinite score travels as ``null`` and decodes back to ``NaN``, never to 0.

Binary variant (``Content-Type: application/msgpack``): the same map, and the reply is msgpack too. Each
``images`` entry is either

* the PNG/JPEG file as raw bytes (``"msgpack"`` in the clients), or
* **raw pixels** (``"raw"``, the ``remote`` client's default): a map ``{"shape": [C, H, W], "dtype":
  "uint8", "data": <C·H·W bytes>}`` — channels first, row-major, ``C`` in {1, 3}, ``round(x·255)`` of
  the float image. No codec runs on either side; the server checks that ``shape × dtype`` matches the
  byte count exactly, the pixel limit and the dims, and refuses anything else with a 4xx.

Entries of both kinds may be mixed in one request. ``benchmarks/wire_format.py`` compares the formats.

This module imports only torch, numpy, PIL and the standard library, so the reward clients may use it
without pulling in aiohttp or the server.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

__all__ = [
    "FORMATS",
    "JSON_TYPE",
    "MSGPACK_TYPE",
    "RAW_DTYPES",
    "WireError",
    "b64_to_bytes",
    "decode_image",
    "decode_image_array",
    "decode_raw_image",
    "decode_reply",
    "encode_image",
    "encode_request",
    "image_to_b64",
    "nan_to_none",
    "none_to_nan",
    "pixels_to_float",
    "quantize",
    "raw_entries",
    "to_jsonable",
]

JSON_TYPE = "application/json"
MSGPACK_TYPE = "application/msgpack"
FORMATS = ("raw", "msgpack", "json")  # raw pixels in msgpack; PNG in msgpack; base64 PNG in JSON
RAW_DTYPES = {"uint8": np.dtype(np.uint8)}
_RAW_KEYS = frozenset(("shape", "dtype", "data"))


class WireError(ValueError):
    """A payload that does not follow the wire format; the message names the offending field.

    Attributes:
        status: The HTTP status the server answers with (400, or 413 for an image above the pixel limit).
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _to_uint8_hwc(image: Tensor) -> np.ndarray:
    """Quantise a ``(C, H, W)`` float image in [0, 1] to ``(H, W, C)`` uint8 (``round(x·255)``)."""
    if image.ndim != 3 or image.shape[0] not in (1, 3):
        raise WireError(f"expected an image (C, H, W) with C in {{1, 3}}, got shape {tuple(image.shape)}")
    array = quantize(image).numpy().transpose(1, 2, 0)
    return array[:, :, 0] if array.shape[2] == 1 else array


def encode_image(image: Tensor, fmt: str = "png", quality: int = 95) -> bytes:
    """Encode one image tensor as PNG (lossless) or JPEG bytes.

    Args:
        image: ``(C, H, W)`` float in [0, 1], ``C`` in {1, 3}.
        fmt: ``"png"`` or ``"jpeg"``.
        quality: JPEG quality (ignored for PNG).

    Returns:
        The encoded file bytes.
    """
    buffer = io.BytesIO()
    pil = Image.fromarray(_to_uint8_hwc(image))
    if fmt == "png":
        pil.save(buffer, format="PNG", compress_level=1)
    elif fmt == "jpeg":
        pil.save(buffer, format="JPEG", quality=quality)
    else:
        raise ValueError(f"image format must be 'png' or 'jpeg', got {fmt!r}")
    return buffer.getvalue()


def image_to_b64(image: Tensor, fmt: str = "png", quality: int = 95) -> str:
    """Encode one ``(C, H, W)`` image in [0, 1] as a base64 PNG/JPEG string (see :func:`encode_image`)."""
    return base64.b64encode(encode_image(image, fmt, quality)).decode("ascii")


def b64_to_bytes(data: Any, index: int) -> bytes:
    """Decode the base64 string of image ``index``.

    Raises:
        WireError: If ``data`` is not a string of valid base64.
    """
    if not isinstance(data, str):
        raise WireError(f"images[{index}] must be a base64 string, got {type(data).__name__}")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise WireError(
            f"images[{index}] is not valid base64 ({err}); send base64-encoded PNG/JPEG bytes"
        ) from err


def decode_image_array(data: bytes, index: int, max_pixels: int | None = None) -> np.ndarray:
    """Decode PNG/JPEG bytes into an ``(H, W, 3)`` uint8 array (RGB).

    The pixel count is checked from the header, before the pixels are decoded.

    Args:
        data: The file bytes.
        index: Position in the request, used in errors.
        max_pixels: Largest allowed ``H × W``; ``None`` = no limit.

    Returns:
        ``(H, W, 3)`` uint8 array.

    Raises:
        WireError: If the bytes are not a decodable image (400) or it has too many pixels (413).
    """
    try:
        with Image.open(io.BytesIO(data)) as pil:
            width, height = pil.size
            if max_pixels is not None and width * height > max_pixels:
                raise WireError(
                    f"images[{index}] is {width}×{height} = {width * height} pixels, above the server's "
                    f"max_image_pixels={max_pixels}; send smaller images or raise server.max_image_pixels",
                    status=413,
                )
            return np.asarray(pil.convert("RGB"), dtype=np.uint8)
    except WireError:
        raise
    except Exception as err:  # PIL raises several unrelated types for corrupt data
        raise WireError(f"images[{index}] could not be decoded as PNG/JPEG: {err}") from err


def decode_image(data: bytes, index: int, max_pixels: int | None = None) -> Tensor:
    """Decode PNG/JPEG bytes into a ``(3, H, W)`` float32 tensor in [0, 1] (see :func:`decode_image_array`).

    Raises:
        WireError: If the bytes are not a decodable image or it has too many pixels.
    """
    return torch.from_numpy(pixels_to_float(decode_image_array(data, index, max_pixels).transpose(2, 0, 1)))


def _quantize_into(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst[...] = clamp(round(src·255), 0, 255)`` for one float32 image (a temporary of one image)."""
    tmp = np.multiply(src, np.float32(255.0), dtype=np.float32)
    np.rint(tmp, out=tmp)  # round half to even, like torch.round
    np.clip(tmp, 0, 255, out=tmp)
    with np.errstate(invalid="ignore"):  # NaN pixels: undefined, as in torch's cast
        dst[...] = tmp


def quantize(images: Tensor) -> Tensor:
    """``round(x·255)`` clamped to [0, 255], as contiguous uint8 on the CPU (same shape as ``images``).

    Bit for bit the quantisation of :func:`encode_image` and of the JPEG rewards. A GPU batch is quantised
    on its device and crosses to the host as uint8 (4× smaller); a CPU batch is quantised one image at a
    time with numpy into a preallocated output, so no batch-sized float temporary is allocated (on small
    machines the page faults of such temporaries cost more than the arithmetic).
    """
    images = images.detach()
    if images.device.type != "cpu":
        pixels = images.to(torch.float32) * 255.0
        return pixels.round_().clamp_(0, 255).to(device="cpu", dtype=torch.uint8).contiguous()
    out = np.empty(tuple(images.shape), dtype=np.uint8)
    rows = zip(images, out) if images.ndim >= 4 else [(images, out)]
    for image, dst in rows:
        _quantize_into(image.to(torch.float32).numpy(), dst)
    return torch.from_numpy(out)


def pixels_to_float(pixels: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 pixels → float32 ``x / 255`` in [0, 1] in one pass (into ``out`` when given); any shape."""
    return np.divide(pixels, np.float32(255.0), out=out, dtype=np.float32)


def raw_entries(pixels: Tensor) -> list[dict[str, Any]]:
    """The raw-pixel ``images`` entries of a ``(N, C, H, W)`` uint8 batch (see :func:`quantize`).

    ``data`` is a zero-copy view of each image; msgpack copies it once into the request body.

    Raises:
        WireError: If ``pixels`` is not uint8 ``(N, C, H, W)`` with ``C`` in {1, 3}.
    """
    if pixels.dtype != torch.uint8 or pixels.ndim != 4 or pixels.shape[1] not in (1, 3):
        raise WireError(
            f"raw images must be uint8 (N, C, H, W) with C in {{1, 3}}, got {pixels.dtype} {tuple(pixels.shape)}"
        )
    array = np.ascontiguousarray(pixels.numpy())
    shape = list(array.shape[1:])
    return [{"shape": shape, "dtype": "uint8", "data": memoryview(image)} for image in array]


def _raw_shape(shape: Any, index: int) -> tuple[int, int, int]:
    """Check a raw entry's ``shape``: three positive ints ``[C, H, W]`` with ``C`` in {1, 3}."""
    if not isinstance(shape, list | tuple) or len(shape) != 3:
        raise WireError(
            f"images[{index}].shape must be [C, H, W] (3 ints, channels first), got {shape!r:.80}"
        )
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
        raise WireError(f"images[{index}].shape must hold positive ints, got {shape!r:.80}")
    channels, height, width = shape
    if channels not in (1, 3):
        raise WireError(f"images[{index}].shape={list(shape)} has C={channels}; send 1 or 3 channels first")
    return channels, height, width


def decode_raw_image(entry: Any, index: int, max_pixels: int | None = None) -> np.ndarray:
    """Validate one raw-pixel entry and view it as a ``(3, H, W)`` uint8 array (no copy, no codec).

    Args:
        entry: ``{"shape": [C, H, W], "dtype": "uint8", "data": bytes}``.
        index: Position in the request, used in errors.
        max_pixels: Largest allowed ``H × W``; ``None`` = no limit.

    Returns:
        ``(3, H, W)`` uint8 array (a 1-channel image is broadcast to 3, as PNG decoding converts to RGB).

    Raises:
        WireError: 400 for a malformed entry or a byte count other than ``C·H·W·itemsize``; 413 above
            ``max_pixels``.
    """
    if not isinstance(entry, dict):
        raise WireError(
            f"images[{index}] must be a raw-pixel map or PNG/JPEG bytes, got {type(entry).__name__}"
        )
    if entry.keys() != _RAW_KEYS:
        missing = sorted(_RAW_KEYS - entry.keys())
        extra = sorted(map(str, entry.keys() - _RAW_KEYS))
        raise WireError(
            f"images[{index}] must have exactly the keys data, dtype, shape (missing {missing}, unexpected "
            f"{extra!r:.120})"
        )
    channels, height, width = _raw_shape(entry["shape"], index)
    dtype_name, data = entry["dtype"], entry["data"]
    if not isinstance(dtype_name, str) or dtype_name not in RAW_DTYPES:
        raise WireError(
            f"images[{index}].dtype={dtype_name!r:.40} is not supported; send {', '.join(RAW_DTYPES)}"
        )
    if not isinstance(data, bytes):
        raise WireError(f"images[{index}].data must be bytes (msgpack bin), got {type(data).__name__}")
    if max_pixels is not None and height * width > max_pixels:
        raise WireError(
            f"images[{index}] is {width}×{height} = {height * width} pixels, above the server's "
            f"max_image_pixels={max_pixels}; send smaller images or raise server.max_image_pixels",
            status=413,
        )
    dtype = RAW_DTYPES[dtype_name]
    expected = channels * height * width * dtype.itemsize
    if len(data) != expected:
        raise WireError(
            f"images[{index}] declares shape [{channels}, {height}, {width}] × {dtype_name} = {expected} bytes "
            f"but data has {len(data)} bytes"
        )
    array = np.frombuffer(data, dtype=dtype).reshape(channels, height, width)
    return np.broadcast_to(array, (3, height, width)) if channels == 1 else array


def nan_to_none(value: float) -> float | None:
    """Map a non-finite float (NaN, ±inf) to ``None`` (JSON ``null``); pass finite floats through."""
    value = float(value)
    return value if math.isfinite(value) else None


def none_to_nan(value: Any) -> float:
    """Map ``None`` (JSON ``null``) back to ``NaN``; convert anything else with ``float``."""
    return math.nan if value is None else float(value)


def to_jsonable(value: Any) -> Any:
    """Convert tensors, arrays and nested containers to JSON-ready values (non-finite floats → ``None``).

    Args:
        value: A tensor, numpy array/scalar, float, or a list/tuple/dict of these.

    Returns:
        Plain lists, dicts, numbers, strings, booleans and ``None``.
    """
    if isinstance(value, Tensor):
        value = value.detach().cpu().tolist()
    elif isinstance(value, np.ndarray | np.generic):
        value = value.tolist()
    if isinstance(value, float):
        return nan_to_none(value)
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | str):
        return value
    return str(value)


def encode_request(
    reward: str,
    images: list[bytes],
    prompts: list[str],
    metadata: list[dict] | None = None,
    binary: bool = False,
) -> tuple[bytes, str]:
    """Build a ``/v1/score`` request body.

    Args:
        reward: Name of the reward hosted by the server.
        images: One per prompt: encoded PNG/JPEG bytes, or (``binary`` only) raw-pixel maps from
            :func:`raw_entries`.
        prompts: The prompts.
        metadata: Optional per-sample metadata dicts.
        binary: msgpack with raw bytes instead of JSON with base64.

    Returns:
        ``(body, content_type)``.

    Raises:
        ValueError: If raw-pixel entries are given for JSON.
    """
    payload: dict[str, Any] = {"reward": reward, "prompts": list(prompts)}
    if metadata is not None:
        payload["metadata"] = to_jsonable(list(metadata))
    if binary:
        import msgpack

        payload["images"] = list(images)
        return msgpack.packb(payload, use_bin_type=True), MSGPACK_TYPE
    if any(isinstance(data, dict) for data in images):
        raise ValueError(
            "raw-pixel images travel only in msgpack (binary=True); JSON carries base64 PNG/JPEG"
        )
    payload["images"] = [base64.b64encode(data).decode("ascii") for data in images]
    return json.dumps(payload).encode("utf-8"), JSON_TYPE


def decode_reply(body: bytes, content_type: str) -> tuple[list[float], dict[str, list[Any]]]:
    """Parse a ``/v1/score`` reply into NaN-restored scores and per-sample details.

    Args:
        body: The reply body.
        content_type: Its ``Content-Type`` (JSON or msgpack).

    Returns:
        ``(scores, details)`` with ``null`` scores mapped to ``NaN``.

    Raises:
        WireError: If the body is not a valid reply.
    """
    try:
        if content_type.startswith(MSGPACK_TYPE):
            import msgpack

            reply = msgpack.unpackb(body, raw=False)
        else:
            reply = json.loads(body)
        scores = [none_to_nan(s) for s in reply["scores"]]
        details = dict(reply.get("details") or {})
    except (ValueError, KeyError, TypeError) as err:
        raise WireError(f"malformed reward-server reply ({err}): {body[:200]!r}") from err
    return scores, details
