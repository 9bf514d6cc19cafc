"""Checking a score request before anything is decoded: its fields (``reward``, ``images``, ``prompts``,
``metadata``), each image's size and file structure, and the decoded size of all its images together;
then decoding the checked images to ``(C, H, W)`` uint8 pixels."""

from __future__ import annotations

import difflib
from collections.abc import Collection
from typing import Any

import numpy as np

from rlgen_cli.rewards.remote import wire
from rlgen_cli.server import limits
from rlgen_cli.server.refusal import ApiError, wire_error
from rlgen_cli.server.settings import ServerSettings

__all__ = ["SCORE_FIELDS", "Checked", "check_all", "decode_checked", "score_fields"]

SCORE_FIELDS = ("reward", "images", "prompts", "metadata")
"""The fields of a ``/v1/score`` request (``metadata`` optional); any other is refused."""


def _list_field(payload: dict[str, Any], key: str, item_type: type | tuple[type, ...], required: bool) -> Any:
    """Return ``payload[key]`` after checking it is a list of ``item_type`` (or absent when optional)."""
    value = payload.get(key)
    if key not in payload and required:
        raise ApiError(400, f"missing field {key!r}: a list is required")
    if value is None and not required:
        return None
    if not isinstance(value, list):
        raise ApiError(400, f"field {key!r} must be a list, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, item_type):
            names = " or ".join(
                t.__name__ for t in (item_type if isinstance(item_type, tuple) else (item_type,))
            )
            raise ApiError(400, f"{key}[{i}] has type {type(item).__name__}; expected {names}")
    return value


def _refuse_unknown_fields(payload: dict[str, Any]) -> None:
    """400 for a field the server would otherwise ignore (a misspelt ``metadata``, per-request
    ``kwargs``), naming it and the accepted ones."""
    unknown = sorted(str(key) for key in payload if key not in SCORE_FIELDS)
    if not unknown:
        return
    hints = [
        f"{key!r} → {close[0]!r}?"
        for key in unknown
        if (close := difflib.get_close_matches(key, SCORE_FIELDS, n=1, cutoff=0.7))
    ]
    hint = f" (did you mean {', '.join(hints)})" if hints else ""
    where = f"; a score request has only {', '.join(SCORE_FIELDS)} (metadata optional)"
    if "kwargs" in unknown:  # a reward's settings are fixed when the server starts, for every client
        where += "; reward settings live on the server: rlgen serve-reward reward.kwargs.NAME.KEY=…"
    raise ApiError(400, f"unknown fields {unknown!r:.300}{hint}{where}")


def score_fields(
    payload: dict[str, Any], binary: bool, hosted: Collection[str], max_metadata_depth: int
) -> tuple[str, list, list, Any]:
    """Check the fields of a score request for one of the ``hosted`` rewards (images as msgpack sends
    them when ``binary``, else base64 strings); returns ``(reward, raw_images, prompts, metadata)``.
    Fields other than :data:`SCORE_FIELDS` are refused (400)."""
    _refuse_unknown_fields(payload)
    if "reward" not in payload:
        raise ApiError(400, "missing field 'reward': give the name of a hosted reward (GET /v1/rewards)")
    name = payload["reward"]
    if not isinstance(name, str):
        raise ApiError(
            400, f"field 'reward' must be a string (a hosted reward's name), got {type(name).__name__}"
        )
    if name not in hosted:
        raise ApiError(
            404,
            f"unknown reward {name!r}; this server hosts: {', '.join(sorted(hosted))}",
            "not_found",
        )
    images = _list_field(payload, "images", (bytes, dict) if binary else str, required=True)
    prompts = _list_field(payload, "prompts", str, required=True)
    metadata = _list_field(payload, "metadata", dict, required=False)
    if len(images) != len(prompts):
        raise ApiError(
            400, f"images has {len(images)} entries but prompts has {len(prompts)}; send one per image"
        )
    if metadata is not None and len(metadata) != len(prompts):
        raise ApiError(
            400, f"metadata has {len(metadata)} entries but prompts has {len(prompts)}; send one per image"
        )
    if metadata is not None:
        try:
            limits.check_depth(metadata, max_metadata_depth, "metadata")
        except wire.WireError as err:
            raise wire_error(err) from err
    return name, images, prompts, metadata


def _checked_entry(data: Any, index: int, settings: ServerSettings) -> tuple[Any, int]:
    """Validate one ``images`` entry without decoding it: ``(raw view | (file bytes, header), C·H·W)``;
    a PNG/JPEG's chunk/segment headers are pre-scanned against the structure caps."""
    max_pixels, max_side = settings.max_image_pixels, settings.max_image_side
    if isinstance(data, dict):
        view = wire.decode_raw_image(data, index, max_pixels, max_side)
        return view, view.nbytes
    if isinstance(data, str):
        data = wire.b64_to_bytes(data, index)
    header = wire.read_image_header(data, index)
    wire.check_image_size(index, header.height, header.width, max_pixels, max_side)
    limits.scan_image_structure(data, header.format, index)
    return (data, header), header.nbytes


Checked = list[tuple[Any, int]]  # per entry: (raw view | (file bytes, header), C·H·W)


def check_all(raw: list[Any], settings: ServerSettings) -> tuple[Checked, int]:
    """Check every entry's size (raw shapes, PNG/JPEG headers and structure) and sum it against
    ``max_decoded_mb`` before anything is decoded; returns the entries and their decoded bytes."""
    checked = [_checked_entry(data, i, settings) for i, data in enumerate(raw)]
    total = sum(nbytes for _, nbytes in checked)
    if total > settings.max_decoded_bytes:
        raise wire.WireError(
            f"the request's {len(raw)} images decode to {total} bytes (Σ C·H·W), above "
            f"server.max_decoded_mb={settings.max_decoded_mb:g} ({settings.max_decoded_bytes} bytes); send "
            "fewer or smaller images per request (client batch_size) or raise server.max_decoded_mb",
            status=413,
        )
    return checked, total


def decode_checked(checked: Checked) -> list[np.ndarray]:
    """Turn every checked entry into ``(C, H, W)`` uint8 pixels; the batcher converts to float once per
    batch."""
    out = []
    for i, (entry, _) in enumerate(checked):
        if isinstance(entry, np.ndarray):
            out.append(entry)
        else:
            out.append(wire.decode_image_file(*entry, i).transpose(2, 0, 1))
    return out
