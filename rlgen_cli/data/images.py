"""Source images of editing sets: read from disk, resized, as (B, 3, H, W) tensors in [0, 1].

Editing examples carry their source image as a path in the metadata (``"image"``, the upstream
counting-edit format); relative paths are resolved against the dataset file's directory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from rlgen_cli.data.prompts import PromptDataset, PromptExample
from rlgen_cli.schema.errors import UserError

SOURCE_IMAGE_KEY = "image"
EDITING_FAMILIES = ("flux_kontext", "qwen_image_edit", "wan2_2_i2v")
"""Model families that edit a source image (their policies declare ``capabilities.takes_source_images``)."""


def source_image_paths(examples: Sequence[PromptExample], dataset_source: str) -> list[Path]:
    """The source-image path of every example (error naming the example when one has none)."""
    base = Path(dataset_source).parent
    paths = []
    for example in examples:
        value = example.metadata.get(SOURCE_IMAGE_KEY)
        if not value:
            raise UserError(
                f"example {example.index} of {dataset_source} has no {SOURCE_IMAGE_KEY!r} field; an editing model "
                f'needs a source image per prompt (jsonl lines like {{"prompt": ..., "image": "src/0001.png"}}); '
                "data=tiny_edit generates a small editing set for the tiny models"
            )
        path = Path(value)
        paths.append(path if path.is_absolute() else base / path)
    return paths


def require_source_images(examples: Sequence[PromptExample], dataset_source: str, key: str) -> None:
    """Every example names a source image that exists (checked before a model is loaded)."""
    for example, path in zip(examples, source_image_paths(examples, dataset_source)):
        if not path.is_file():
            raise UserError(
                f"{key}: example {example.index} of {dataset_source} names source image {path}, which does "
                'not exist; paths in "image" are relative to the dataset file'
            )


def load_images(paths: Sequence[Path], height: int, width: int) -> Tensor:
    """Read, convert to RGB and resize (bicubic) every image; (B, 3, height, width) float in [0, 1]."""
    arrays = []
    for path in paths:
        try:
            with Image.open(path) as image:
                rgb = image.convert("RGB").resize((width, height), Image.BICUBIC)
        except (FileNotFoundError, UnidentifiedImageError, OSError) as err:
            raise UserError(f"cannot read source image {path}: {err}") from err
        arrays.append(np.asarray(rgb, dtype=np.float32) / 255.0)
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def source_images(
    examples: Sequence[PromptExample], dataset: PromptDataset, height: int, width: int
) -> Tensor:
    """Each example's source image in editing set ``dataset``, resized: (B, 3, height, width) in [0, 1]."""
    return load_images(source_image_paths(examples, dataset.source), height, width)
