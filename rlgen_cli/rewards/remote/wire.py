"""rlgen's reward wire format, shared by the server (:mod:`rlgen_cli.server.app`) and the clients
(:mod:`rlgen_cli.rewards.remote`).

JSON request (``POST /v1/score``, ``Content-Type: application/json``)::

    {"reward": "jpeg_compressibility",
     "images": ["<base64 PNG or JPEG>", ...],
     "prompts": ["a cat", ...],
     "metadata": [{...}, ...]}          # optional, one dict per image

JSON reply: ``{"scores": [float | null, ...], "details": {key: [value per sample]}}``. JSON has no NaN:
a failed (NaN) or infinite score travels as ``null`` and decodes back to ``NaN``, never to 0. Every score
reply carries the hosted reward's fingerprint in the :data:`FINGERPRINT_HEADER` header. A request has
only those four fields; metadata must be JSON data on every wire (:func:`metadata_to_jsonable`), and the
float images must be finite and in [0, 1] before they are quantised (:func:`check_pixels`).

Binary variant (``Content-Type: application/msgpack``): the same map, and the reply is msgpack too. Each
``images`` entry is either

* the PNG/JPEG file as raw bytes (``"msgpack"`` in the clients), or
* **raw pixels** (``"raw"``, the ``remote`` client's default): a map ``{"shape": [C, H, W], "dtype":
  "uint8", "data": <C·H·W bytes>}`` — channels first, row-major, ``C`` in {1, 2, 3, 4}, ``round(x·255)``
  of the float image. No codec runs on either side; the server checks that ``shape × dtype`` matches the
  byte count exactly, the pixel limit and the dims, and refuses anything else with a 4xx.

Entries of both kinds may be mixed in one request. ``benchmarks/wire_format.py`` compares the formats.

Only PNG and JPEG files are decoded (Pillow is never asked to open another format), and each keeps the
channels it carries: grey ``L`` → 1, grey + alpha ``LA`` → 2, ``RGB`` → 3, ``RGBA`` → 4 (a palette or
1-bit PNG becomes RGB(A) or grey, CMYK JPEG becomes RGB, 16-bit grey keeps its high byte), so the reward
gets the array the client encoded — the one it would get in-process. The size of every file is read from
its header before anything is decoded (:func:`read_image_header`).

This module imports only torch, numpy, PIL and the standard library, so the reward clients may use it
without pulling in aiohttp or the server.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import struct
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image
from torch import Tensor

__all__ = [
    "CHANNELS",
    "FINGERPRINT_HEADER",
    "FORMATS",
    "JSON_TYPE",
    "MAX_SIDE",
    "MSGPACK_TYPE",
    "RAW_DTYPES",
    "ImageHeader",
    "WireError",
    "b64_to_bytes",
    "check_image_size",
    "check_pixels",
    "decode_image",
    "decode_image_array",
    "decode_image_file",
    "decode_raw_image",
    "decode_reply",
    "encode_image",
    "encode_request",
    "image_to_b64",
    "metadata_to_jsonable",
    "nan_to_none",
    "none_to_nan",
    "pixels_to_float",
    "quantize",
    "range_tolerance",
    "raw_entries",
    "read_image_header",
    "to_jsonable",
]

FINGERPRINT_HEADER = "X-Rlgen-Reward-Fingerprint"  # what the hosted reward computes (server/fingerprint.py)
JSON_TYPE = "application/json"
MSGPACK_TYPE = "application/msgpack"
FORMATS = ("raw", "msgpack", "json")  # raw pixels in msgpack; PNG in msgpack; base64 PNG in JSON
RAW_DTYPES = {"uint8": np.dtype(np.uint8)}
CHANNELS = (1, 2, 3, 4)  # grey, grey + alpha, RGB, RGBA: what PNG stores and PIL's fromarray makes
MAX_SIDE = 65_500  # default server.max_image_side: the largest side a JPEG (and so a JPEG reward) allows
_RAW_KEYS = frozenset(("shape", "dtype", "data"))
_MODES = {"L": "grey", "LA": "grey + alpha", "RGB": "RGB", "RGBA": "RGBA"}  # kept as they are


class WireError(ValueError):
    """A payload that does not follow the wire format; the message names the offending field.

    Attributes:
        status: The HTTP status the server answers with: 400, 413 for an image above a size limit, 415
            for an image format other than PNG/JPEG.
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _to_uint8_hwc(image: Tensor) -> np.ndarray:
    """Quantise a ``(C, H, W)`` float image in [0, 1] to ``(H, W, C)`` uint8 (``round(x·255)``)."""
    if image.ndim != 3 or image.shape[0] not in CHANNELS:
        raise WireError(
            f"expected an image (C, H, W) with C in {{1, 2, 3, 4}}, got shape {tuple(image.shape)}"
        )
    array = quantize(image).numpy().transpose(1, 2, 0)
    return array[:, :, 0] if array.shape[2] == 1 else array


def encode_image(image: Tensor, fmt: str = "png", quality: int = 95) -> bytes:
    """Encode one image tensor as PNG (lossless) or JPEG bytes.

    Args:
        image: ``(C, H, W)`` float in [0, 1], ``C`` in {1, 2, 3, 4} (JPEG: 1 or 3).
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


class ImageHeader(NamedTuple):
    """What a PNG/JPEG header says about the image: its format and decoded size."""

    format: str  # "PNG" or "JPEG"
    channels: int  # channels of the decoded array (an upper bound for palette PNGs: 4)
    height: int
    width: int

    @property
    def nbytes(self) -> int:
        """Bytes of the decoded uint8 array, ``C·H·W``."""
        return self.channels * self.height * self.width


_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_JPEG_MAGIC = b"\xff\xd8\xff"
_PNG_CHANNELS = {0: 1, 2: 3, 3: 4, 4: 2, 6: 4}  # IHDR colour type → channels (palette: RGBA at most)
_JPEG_CHANNELS = {1: 1, 3: 3, 4: 3}  # frame components → channels (CMYK is converted to RGB)
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # frame headers; C4/C8/CC are not
_JPEG_MAX_SEGMENTS = 512  # segments before the frame header: real files have a few dozen
_OTHER_MAGIC = [
    (b"BM", "BMP"), (b"GIF8", "GIF"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"RIFF", "RIFF (WebP?)"),
    (b"\x00\x00\x01\x00", "ICO"), (b"%!PS", "EPS (PostScript)"), (b"\xc5\xd0\xd3\xc6", "EPS (PostScript)"),
    (b"%PDF", "PDF"), (b"qoif", "QOI"), (b"DDS ", "DDS"), (b"\x00\x00\x00\x0cjP", "JPEG 2000"),
]  # fmt: skip


def _looks_like(data: bytes) -> str:
    """A readable guess of what ``data`` is, for the error that refuses it."""
    for magic, name in _OTHER_MAGIC:
        if data.startswith(magic):
            return f"it looks like {name}"
    if data[:1] == b"P" and data[1:2] in b"1234567" and len(data) > 2:
        return "it looks like PNM (PPM/PGM/PBM)"
    return f"it starts with {data[:8]!r}"


def _png_header(data: bytes, index: int) -> ImageHeader:
    if len(data) < 33 or data[12:16] != b"IHDR":
        raise WireError(f"images[{index}] is not a valid PNG: no IHDR header")
    width, height = struct.unpack(">II", data[16:24])
    channels = _PNG_CHANNELS.get(data[25])
    if channels is None:
        raise WireError(f"images[{index}] is not a valid PNG: colour type {data[25]}")
    return ImageHeader("PNG", channels, height, width)


def _jpeg_header(data: bytes, index: int) -> ImageHeader:
    """Walk the JPEG segments up to the frame header (SOFn) and read its size and components."""
    pos = 2
    for _ in range(_JPEG_MAX_SEGMENTS):
        if pos + 4 > len(data) or data[pos] != 0xFF:
            break
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _JPEG_SOF and pos + 10 <= len(data):
            height, width = struct.unpack(">HH", data[pos + 5 : pos + 9])
            channels = _JPEG_CHANNELS.get(data[pos + 9])
            if channels is None:
                raise WireError(f"images[{index}] is a JPEG with {data[pos + 9]} components; send 1 or 3")
            return ImageHeader("JPEG", channels, height, width)
        if marker in (0xD9, 0xDA):  # end of image or start of scan before any frame header
            break
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    raise WireError(f"images[{index}] is not a valid JPEG: no frame header")


def read_image_header(data: bytes, index: int) -> ImageHeader:
    """Read the format and size of a PNG/JPEG file from its header, without decoding anything.

    Raises:
        WireError: 415 for any other format (Pillow never sees it), 400 for a malformed header.
    """
    if data.startswith(_PNG_MAGIC):
        header = _png_header(data, index)
    elif data.startswith(_JPEG_MAGIC):
        header = _jpeg_header(data, index)
    else:
        raise WireError(
            f"images[{index}] is not a PNG or JPEG file ({_looks_like(data)}): this server decodes only PNG "
            "and JPEG (and raw pixels in msgpack); convert the image to PNG",
            status=415,
        )
    if header.height < 1 or header.width < 1:
        raise WireError(f"images[{index}] has an empty size {header.width}×{header.height}")
    return header


def check_image_size(
    index: int, height: int, width: int, max_pixels: int | None, max_side: int | None
) -> None:
    """Raise a 413 :class:`WireError` when one image is above the pixel or side limit."""
    if max_pixels is not None and height * width > max_pixels:
        raise WireError(
            f"images[{index}] is {width}×{height} = {height * width} pixels, above "
            f"server.max_image_pixels={max_pixels}; send smaller images or raise server.max_image_pixels",
            status=413,
        )
    if max_side is not None and max(height, width) > max_side:
        raise WireError(
            f"images[{index}] is {width}×{height}, a side above server.max_image_side={max_side} px; "
            "send smaller images or raise server.max_image_side",
            status=413,
        )


def _normalised(pil: Image.Image, index: int) -> np.ndarray:
    """The ``(H, W, C)`` uint8 array of a decoded PNG/JPEG, keeping its channels (see module doc)."""
    mode = pil.mode
    if mode in ("I;16", "I;16B", "I"):  # 16-bit grey: the high byte, as Pillow reads 16-bit RGB
        array = (np.asarray(pil).astype(np.uint32) >> 8).astype(np.uint8)
        return array[:, :, None]
    if mode == "1":
        pil = pil.convert("L")
    elif mode in ("P", "PA"):
        pil = pil.convert("RGBA" if mode == "PA" or "transparency" in pil.info else "RGB")
    elif mode == "CMYK":
        pil = pil.convert("RGB")
    elif mode not in _MODES:
        raise WireError(f"images[{index}] has pixel mode {mode}; send 8-bit grey, RGB or RGBA", status=415)
    array = np.asarray(pil, dtype=np.uint8)
    return array[:, :, None] if array.ndim == 2 else array


def decode_image_file(data: bytes, header: ImageHeader, index: int) -> np.ndarray:
    """Decode a PNG/JPEG file whose header was read (and checked) into ``(H, W, C)`` uint8 pixels.

    Pillow is asked to open only ``header.format``.

    Raises:
        WireError: 400 for undecodable data or a size that disagrees with the header, 413 above Pillow's
            own decompression-bomb limit.
    """
    try:
        with Image.open(io.BytesIO(data), formats=[header.format]) as pil:
            if pil.size != (header.width, header.height):
                raise WireError(
                    f"images[{index}] has two sizes: {header.width}×{header.height} in its header, "
                    f"{pil.size[0]}×{pil.size[1]} in its frame"
                )
            return _normalised(pil, index)
    except WireError:
        raise
    except Image.DecompressionBombError as err:
        raise WireError(
            f"images[{index}] is above Pillow's decompression-bomb limit ({err}); "
            "send smaller images (server.max_image_pixels cannot raise Pillow's limit)",
            status=413,
        ) from err
    except Exception as err:  # PIL raises several unrelated types for corrupt data
        raise WireError(f"images[{index}] could not be decoded as {header.format}: {err}") from err


def decode_image_array(
    data: bytes, index: int, max_pixels: int | None = None, max_side: int | None = MAX_SIDE
) -> np.ndarray:
    """Decode PNG/JPEG bytes into an ``(H, W, C)`` uint8 array with the channels the file carries.

    The size is checked from the header, before the pixels are decoded.

    Args:
        data: The file bytes.
        index: Position in the request, used in errors.
        max_pixels: Largest allowed ``H × W``; ``None`` = no limit.
        max_side: Largest allowed ``H`` and ``W``; ``None`` = no limit.

    Returns:
        ``(H, W, C)`` uint8 array, ``C`` in {1, 2, 3, 4}.

    Raises:
        WireError: 415 for another format, 400 for undecodable bytes, 413 above a size limit.
    """
    header = read_image_header(data, index)
    check_image_size(index, header.height, header.width, max_pixels, max_side)
    return decode_image_file(data, header, index)


def decode_image(data: bytes, index: int, max_pixels: int | None = None) -> Tensor:
    """Decode PNG/JPEG bytes into a ``(C, H, W)`` float32 tensor in [0, 1] (see :func:`decode_image_array`).

    Raises:
        WireError: If the bytes are not a decodable image or it is too large.
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


_MAX_CLAMP = 0.5 / 255.0  # the largest excess that still rounds to 0 or 255: clamping it changes nothing
_LISTED = 8  # samples named in an error


def _samples(mask: Tensor) -> str:
    """The indices where ``mask`` is true, the first :data:`_LISTED` of them."""
    indices = torch.nonzero(mask).flatten().tolist()
    more = f" and {len(indices) - _LISTED} more" if len(indices) > _LISTED else ""
    return f"{indices[:_LISTED]}{more}"


def range_tolerance(dtype: torch.dtype) -> float:
    """How far outside [0, 1] a pixel of ``dtype`` may be and still count as in range: a few ulps (4 ε),
    never more than what rounds to 0 or 255 anyway, so the clamp of :func:`quantize` changes no pixel."""
    return min(4.0 * torch.finfo(dtype).eps, _MAX_CLAMP)


def check_pixels(images: Tensor, reward_name: str) -> None:
    """Refuse images the wire would change silently: non-float, non-finite, or outside [0, 1].

    The wire quantises ``round(x·255)`` into uint8, which would turn NaN/inf into 0 or 255 and clamp
    out-of-range values, so a served reward would score pixels the policy never produced (a local one
    raises on non-finite pixels). One ``aminmax`` pass over the batch; the samples are located only when
    something is wrong.

    Args:
        images: ``(B, C, H, W)`` (or any ``(B, ...)``) batch.
        reward_name: Named in the error.

    Raises:
        ValueError: Naming the samples and the range received, and how to fix it.
    """
    if not images.is_floating_point():
        raise ValueError(
            f"reward {reward_name!r} sends float images in [0, 1] to its server, got {images.dtype}; "
            "convert uint8 pixels with x.float() / 255"
        )
    if images.numel() == 0:
        return
    low, high = (float(v) for v in torch.aminmax(images.detach()))
    if not (math.isfinite(low) and math.isfinite(high)):
        flat = images.detach().flatten(start_dim=1)
        bad = _samples(~torch.isfinite(flat).all(dim=1))
        raise ValueError(
            f"reward {reward_name!r} got non-finite pixel values (NaN or inf) in samples {bad}; the wire "
            "would send them as 0 or 255 and the server would score an image the policy never made. "
            "Check the decoder output (a local reward refuses them too)."
        )
    tolerance = range_tolerance(images.dtype)
    if low < -tolerance or high > 1.0 + tolerance:
        flat = images.detach().flatten(start_dim=1)
        bad = _samples(((flat < -tolerance) | (flat > 1.0 + tolerance)).any(dim=1))
        raise ValueError(
            f"reward {reward_name!r} sends images in [0, 1] but got values in [{low:.4g}, {high:.4g}] "
            f"(samples {bad}); the wire would clamp them silently. Images in [-1, 1] need (x + 1) / 2; "
            "other ranges, rescale or clamp to [0, 1] yourself"
        )


def pixels_to_float(pixels: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 pixels → float32 ``x / 255`` in [0, 1] in one pass (into ``out`` when given); any shape."""
    return np.divide(pixels, np.float32(255.0), out=out, dtype=np.float32)


def raw_entries(pixels: Tensor) -> list[dict[str, Any]]:
    """The raw-pixel ``images`` entries of a ``(N, C, H, W)`` uint8 batch (see :func:`quantize`).

    ``data`` is a zero-copy view of each image; msgpack copies it once into the request body.

    Raises:
        WireError: If ``pixels`` is not uint8 ``(N, C, H, W)`` with ``C`` in {1, 2, 3, 4}.
    """
    if pixels.dtype != torch.uint8 or pixels.ndim != 4 or pixels.shape[1] not in CHANNELS:
        raise WireError(
            "raw images must be uint8 (N, C, H, W) with C in {1, 2, 3, 4}, got "
            f"{pixels.dtype} {tuple(pixels.shape)}"
        )
    array = np.ascontiguousarray(pixels.numpy())
    shape = list(array.shape[1:])
    return [{"shape": shape, "dtype": "uint8", "data": memoryview(image)} for image in array]


def _raw_shape(shape: Any, index: int) -> tuple[int, int, int]:
    """Check a raw entry's ``shape``: three positive ints ``[C, H, W]`` with ``C`` in {1, 2, 3, 4}."""
    if not isinstance(shape, list | tuple) or len(shape) != 3:
        raise WireError(
            f"images[{index}].shape must be [C, H, W] (3 ints, channels first), got {shape!r:.80}"
        )
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
        raise WireError(f"images[{index}].shape must hold positive ints, got {shape!r:.80}")
    channels, height, width = shape
    if channels not in CHANNELS:
        raise WireError(
            f"images[{index}].shape={list(shape)} has C={channels}; send 1 to 4 channels, channels first"
        )
    return channels, height, width


def decode_raw_image(
    entry: Any, index: int, max_pixels: int | None = None, max_side: int | None = MAX_SIDE
) -> np.ndarray:
    """Validate one raw-pixel entry and view it as a ``(C, H, W)`` uint8 array (no copy, no codec).

    Args:
        entry: ``{"shape": [C, H, W], "dtype": "uint8", "data": bytes}``.
        index: Position in the request, used in errors.
        max_pixels: Largest allowed ``H × W``; ``None`` = no limit.
        max_side: Largest allowed ``H`` and ``W``; ``None`` = no limit.

    Returns:
        ``(C, H, W)`` uint8 array, ``C`` as sent (1 to 4): the reward gets the channels the client had.

    Raises:
        WireError: 400 for a malformed entry or a byte count other than ``C·H·W·itemsize``; 413 above
            ``max_pixels`` or ``max_side``.
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
    check_image_size(index, height, width, max_pixels, max_side)
    dtype = RAW_DTYPES[dtype_name]
    expected = channels * height * width * dtype.itemsize
    if len(data) != expected:
        raise WireError(
            f"images[{index}] declares shape [{channels}, {height}, {width}] × {dtype_name} = {expected} bytes "
            f"but data has {len(data)} bytes"
        )
    return np.frombuffer(data, dtype=dtype).reshape(channels, height, width)


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


def _metadata_value(value: Any, path: str) -> Any:
    """One metadata value as JSON data (tensors and numpy values as their plain values, tuples as
    lists); anything JSON cannot carry as it is raises."""
    if isinstance(value, Tensor):
        value = value.detach().cpu().tolist()
    elif isinstance(value, np.ndarray | np.generic):
        value = value.tolist()
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        raise ValueError(f"{path} is {value}: JSON has no NaN or inf; send a finite number or None")
    if isinstance(value, dict):
        keys = [k for k in value if not isinstance(k, str)]
        if keys:
            raise ValueError(f"{path} has keys {keys!r:.80} that are not strings; JSON keys are strings")
        return {k: _metadata_value(v, f"{path}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_metadata_value(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise ValueError(
        f"{path} is a {type(value).__name__}, which JSON does not carry as it is; send dicts, lists, str, "
        "int, float, bool or None"
    )


def metadata_to_jsonable(metadata: list[dict]) -> list[dict]:
    """Per-sample metadata as JSON data, the same on every wire format: refused, naming the place, when
    it holds what JSON would change (a set, bytes, a non-string key, NaN/inf, another object) rather than
    sent as ``str(value)`` or ``null``.

    Raises:
        ValueError: Naming the offending entry, e.g. ``metadata[2]['include'][0]``.
    """
    out = []
    for i, entry in enumerate(metadata):
        if not isinstance(entry, dict):
            raise ValueError(f"metadata[{i}] must be a dict (one per sample), got {type(entry).__name__}")
        out.append(_metadata_value(entry, f"metadata[{i}]"))
    return out


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
        ValueError: If raw-pixel entries are given for JSON, or metadata is not JSON data
            (:func:`metadata_to_jsonable`).
    """
    payload: dict[str, Any] = {"reward": reward, "prompts": list(prompts)}
    if metadata is not None:
        payload["metadata"] = metadata_to_jsonable(list(metadata))
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
        details = reply.get("details") or {}
    except (ValueError, KeyError, TypeError) as err:
        raise WireError(f"malformed reward-server reply ({err}): {body[:200]!r}") from err
    if not isinstance(details, dict):
        raise WireError(f"malformed reward-server reply: details is a {type(details).__name__}, not a map")
    return scores, details
