"""Source images of editing sets: read from disk, resized, as (B, 3, H, W) tensors in [0, 1].

Editing examples carry their source image as a path in the metadata (``"image"``, the upstream
counting-edit format); relative paths are resolved against the dataset file's directory. Multi-image
editing (Qwen-Image-Edit-Plus) gives a list of paths instead, the same number in every example; the
sources are then (B, N, 3, H, W).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch import Tensor

from rlgen_cli.data.prompts import PromptDataset, PromptExample
from rlgen_cli.errors import UserError
from rlgen_cli.schema.families import families

SOURCE_IMAGE_KEY = "image"
EDITING_FAMILIES = families(editing=True)
"""Model families that edit a source image (their policies declare ``capabilities.takes_source_images``);
the ``editing`` column of ``schema/families.py``."""


def source_image_lists(examples: Sequence[PromptExample], dataset_source: str) -> list[list[Path]]:
    """Every example's source-image paths: one for an ``"image"`` string, N for a list of N paths. Every
    example must give the same number (a batch stacks them); errors name the example."""
    base = Path(dataset_source).parent
    lists = []
    for example in examples:
        value = example.metadata.get(SOURCE_IMAGE_KEY)
        if not value:
            raise UserError(
                f"example {example.index} of {dataset_source} has no {SOURCE_IMAGE_KEY!r} field; an editing model "
                f'needs a source image per prompt (jsonl lines like {{"prompt": ..., "image": "src/0001.png"}}, '
                'or "image": ["a.png", "b.png"] for multi-image editing); data=tiny_edit generates a small '
                "editing set for the tiny models"
            )
        paths = [Path(v) for v in (value if isinstance(value, list) else [value])]
        lists.append([path if path.is_absolute() else base / path for path in paths])
        if len(lists[-1]) != len(lists[0]):
            raise UserError(
                f"example {example.index} of {dataset_source} has {len(lists[-1])} source images but example "
                f"{examples[0].index} has {len(lists[0])}: every example of an editing set gives the same "
                'number of paths in "image"'
            )
    return lists


def source_image_paths(examples: Sequence[PromptExample], dataset_source: str) -> list[Path]:
    """The source-image paths of every example, in order (see :func:`source_image_lists`)."""
    return [path for paths in source_image_lists(examples, dataset_source) for path in paths]


def require_source_images(examples: Sequence[PromptExample], dataset_source: str, key: str) -> None:
    """Every example names a source image that exists (checked before a model is loaded)."""
    for example, paths in zip(examples, source_image_lists(examples, dataset_source)):
        for path in paths:
            if not path.is_file():
                raise UserError(
                    f"{key}: example {example.index} of {dataset_source} names source image {path}, which "
                    'does not exist; paths in "image" are relative to the dataset file'
                )


def refuse_source_images(
    examples: Sequence[PromptExample], dataset_source: str, key: str, family: str
) -> None:
    """No example gives a source image: a family that does not edit would train on the prompts alone and
    drop the images without a word (checked before a model is loaded)."""
    for example in examples:
        if example.metadata.get(SOURCE_IMAGE_KEY):
            raise UserError(
                f"{key}: example {example.index} of {dataset_source} gives a source image ({SOURCE_IMAGE_KEY!r}) "
                f"and model.family={family} does not edit: choose an editing model "
                f"({', '.join(EDITING_FAMILIES)}) or a prompt set without images"
            )


def load_images(paths: Sequence[Path], height: int, width: int) -> Tensor:
    """Read every image upright (its EXIF orientation applied, as a viewer shows it), convert it to RGB
    (16-bit and float pixels rescaled, :func:`eight_bit`) and resize it (bicubic); (B, 3, height, width)
    float in [0, 1]."""
    arrays = []
    for path in paths:
        rgb = read_rgb(path).resize((width, height), Image.BICUBIC)
        arrays.append(np.asarray(rgb, dtype=np.float32) / 255.0)
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


UINT16_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
"""Pillow's modes of unsigned 16-bit grayscale (a 16-bit PNG or TIFF)."""


def read_rgb(path: Path) -> Image.Image:
    """The image at ``path`` upright (its EXIF orientation applied, as a viewer shows it) in 8-bit RGB
    (16-bit and float pixels rescaled, :func:`eight_bit`), as every reader of source and question images
    takes it.

    Raises:
        UserError: A file that cannot be read as an image, or whose pixels :func:`eight_bit` refuses.
    """
    try:
        with Image.open(path) as image:
            ImageOps.exif_transpose(image, in_place=True)
            return eight_bit(image, path).convert("RGB")
    except (FileNotFoundError, UnidentifiedImageError, OSError) as err:
        raise UserError(f"cannot read image {path}: {err}") from err


def eight_bit(image: Image.Image, path: Path) -> Image.Image:
    """``image`` with 8-bit pixels: 16-bit grayscale scaled from [0, 65535] and float grayscale from
    [0, 1] to [0, 255] (rounded), every 8-bit mode as it is. Pillow's own conversion clips them instead
    (mid-gray 32768 → white, 0.5 → black).

    Raises:
        UserError: Naming the file and mode, for 32-bit integer pixels (no fixed range) and float pixels
            outside [0, 1].
    """
    if image.mode in UINT16_MODES or (image.mode == "I" and image.format == "PNG"):  # older Pillow: PNG → I
        pixels = np.asarray(image).astype(np.int64)
        return Image.fromarray(((pixels * 255 + 32767) // 65535).astype(np.uint8), "L")
    if image.mode == "F":
        pixels = np.asarray(image, dtype=np.float64)
        low, high = float(pixels.min()), float(pixels.max())
        if not (np.isfinite(pixels).all() and low >= 0.0 and high <= 1.0):
            raise UserError(
                f"source image {path} has float pixels (mode F) in [{low:g}, {high:g}], outside [0, 1]: "
                "rlgen reads float images as [0, 1]; save it as an 8- or 16-bit PNG"
            )
        return Image.fromarray(np.round(pixels * 255).astype(np.uint8), "L")
    if image.mode.startswith("I"):
        raise UserError(
            f"source image {path} has {image.mode} pixels (32-bit or signed integers), which have no fixed "
            "range to scale to 8 bits: save it as an 8- or 16-bit PNG"
        )
    return image


def source_images(
    examples: Sequence[PromptExample], dataset: PromptDataset, height: int, width: int
) -> Tensor:
    """Each example's source image in editing set ``dataset``, resized: (B, 3, height, width) in [0, 1];
    (B, N, 3, height, width) when the examples list N paths each (multi-image editing)."""
    images = load_images(source_image_paths(examples, dataset.source), height, width)
    if not any(isinstance(ex.metadata.get(SOURCE_IMAGE_KEY), list) for ex in examples):
        return images
    return images.view(len(examples), -1, *images.shape[1:])
