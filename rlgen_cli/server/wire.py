"""rlgen's reward wire format, shared by the server (:mod:`rlgen_cli.server.app`) and the clients
(:mod:`rlgen_cli.rewards.remote`).

JSON request (``POST /v1/score``, ``Content-Type: application/json``)::

    {"reward": "jpeg_compressibility",
     "images": ["<base64 PNG or JPEG>", ...],
     "prompts": ["a cat", ...],
     "metadata": [{...}, ...]}          # optional, one dict per image

JSON reply: ``{"scores": [float | null, ...], "details": {key: [value per sample]}}``. JSON has no NaN:
a failed (NaN) or infinite score travels as ``null`` and decodes back to ``NaN``, never to 0.

Binary variant (``Content-Type: application/msgpack``): the same map with raw image bytes instead of
base64 strings; the reply is msgpack too. ``benchmarks/wire_format.py`` measures what it saves.

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
    "JSON_TYPE",
    "MSGPACK_TYPE",
    "WireError",
    "b64_to_bytes",
    "decode_image",
    "decode_reply",
    "encode_image",
    "encode_request",
    "image_to_b64",
    "nan_to_none",
    "none_to_nan",
    "to_jsonable",
]

JSON_TYPE = "application/json"
MSGPACK_TYPE = "application/msgpack"


class WireError(ValueError):
    """A payload that does not follow the wire format; the message names the offending field."""


def _to_uint8_hwc(image: Tensor) -> np.ndarray:
    """Quantise a ``(C, H, W)`` float image in [0, 1] to ``(H, W, C)`` uint8 (``round(x·255)``)."""
    if image.ndim != 3 or image.shape[0] not in (1, 3):
        raise WireError(f"expected an image (C, H, W) with C in {{1, 3}}, got shape {tuple(image.shape)}")
    pixels = (image.detach().to(device="cpu", dtype=torch.float32) * 255.0).round().clamp(0, 255)
    array = pixels.to(torch.uint8).permute(1, 2, 0).numpy()
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


def decode_image(data: bytes, index: int, max_pixels: int | None = None) -> Tensor:
    """Decode PNG/JPEG bytes into a ``(3, H, W)`` float tensor in [0, 1].

    The pixel count is checked from the header, before the pixels are decoded.

    Args:
        data: The file bytes.
        index: Position in the request, used in errors.
        max_pixels: Largest allowed ``H × W``; ``None`` = no limit.

    Returns:
        ``(3, H, W)`` float32 tensor.

    Raises:
        WireError: If the bytes are not a decodable image or it has too many pixels.
    """
    try:
        with Image.open(io.BytesIO(data)) as pil:
            width, height = pil.size
            if max_pixels is not None and width * height > max_pixels:
                raise WireError(
                    f"images[{index}] is {width}×{height} = {width * height} pixels, above the server's "
                    f"max_image_pixels={max_pixels}; send smaller images or raise server.max_image_pixels"
                )
            array = np.asarray(pil.convert("RGB"), dtype=np.uint8)
    except WireError:
        raise
    except Exception as err:  # PIL raises several unrelated types for corrupt data
        raise WireError(f"images[{index}] could not be decoded as PNG/JPEG: {err}") from err
    return torch.from_numpy(array.copy()).permute(2, 0, 1).to(torch.float32) / 255.0


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
        images: Encoded PNG/JPEG bytes, one per prompt.
        prompts: The prompts.
        metadata: Optional per-sample metadata dicts.
        binary: msgpack with raw bytes instead of JSON with base64.

    Returns:
        ``(body, content_type)``.
    """
    payload: dict[str, Any] = {"reward": reward, "prompts": list(prompts)}
    if metadata is not None:
        payload["metadata"] = to_jsonable(list(metadata))
    if binary:
        import msgpack

        payload["images"] = list(images)
        return msgpack.packb(payload, use_bin_type=True), MSGPACK_TYPE
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
