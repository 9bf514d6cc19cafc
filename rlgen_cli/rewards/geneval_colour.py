"""GenEval's colour check: CLIP zero-shot over ten colours on each detected object's crop.

How an object is cut out is ``colour_crop``:

* ``mask`` (the original benchmark): the object's instance mask is pasted on grey (``#999``), then the
  box is cropped, so background colours do not vote. Needs a detector that gives masks.
* ``box``: the box is cropped as it is (any detector; background inside the box is seen).

Each colour's classifier weight is the normalised mean of the normalised text embeddings of GenEval's
three templates for the object class; the crop's colour is the arg-max cosine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import numpy as np
import torch
from PIL import Image

from rlgen_cli.geneval_rules import Detection
from rlgen_cli.rewards.geneval_detect import resolve_device

logger = logging.getLogger(__name__)

__all__ = [
    "COLORS", "COLOUR_CROPS", "CROP_BACKGROUND", "CLIPColorClassifier", "ColorClassifier", "ColourCrop",
    "check_colour_crop", "crop_object",
]  # fmt: skip

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
COLOR_TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")
CROP_BACKGROUND = "#999"  # GenEval's background behind masked crops
ColourCrop = Literal["mask", "box"]
COLOUR_CROPS: tuple[str, ...] = ("mask", "box")


class ColorClassifier(Protocol):
    """Anything that names object colours: one of :data:`COLORS` per object."""

    def classify(self, image: Image.Image, objects: Sequence[Detection], classname: str) -> list[str]: ...


def check_colour_crop(colour_crop: str) -> None:
    """Raise a ValueError naming the options for an unknown ``colour_crop``."""
    if colour_crop not in COLOUR_CROPS:
        raise ValueError(
            f"reward.kwargs.geneval.colour_crop={colour_crop!r}; choose mask (the instance on grey, as the "
            "original GenEval; needs a Mask2Former detector) or box (the raw box crop, any detector)."
        )


def crop_object(image: Image.Image, obj: Detection, colour_crop: ColourCrop | None = None) -> Image.Image:
    """Cut one object out for the colour check.

    Args:
        image: The whole RGB image.
        obj: The detection (box in ``image``'s pixels, optional mask).
        colour_crop: ``mask`` pastes the mask on grey first and requires one; ``box`` ignores any mask;
            ``None`` uses the mask when the detection has one.

    Raises:
        ValueError: If ``colour_crop="mask"`` and the detection has no mask.
    """
    if colour_crop == "mask" and obj.mask is None:
        raise ValueError(
            f"colour_crop=mask needs instance masks but the {obj.label!r} detection has a box only; use a "
            "Mask2Former (instance segmentation) detector_path, or set reward.kwargs.geneval.colour_crop=box."
        )
    if obj.mask is not None and colour_crop != "box":
        mask = Image.fromarray(np.asarray(obj.mask, dtype=bool).astype(np.uint8) * 255)
        image = Image.composite(image, Image.new("RGB", image.size, CROP_BACKGROUND), mask)
    x0, y0, x1, y1 = (int(round(v)) for v in obj.box)
    x0, y0 = min(max(x0, 0), image.width - 1), min(max(y0, 0), image.height - 1)
    return image.crop((x0, y0, max(x1, x0 + 1), max(y1, y0 + 1)))


def _unit(output: Any) -> torch.Tensor:
    """L2-normalised projected features from ``get_*_features`` (tensor or output with ``pooler_output``)."""
    features = output if isinstance(output, torch.Tensor) else output.pooler_output
    return torch.nn.functional.normalize(features.float(), dim=-1)


class CLIPColorClassifier:
    """:class:`ColorClassifier` by CLIP zero-shot over :data:`COLORS`, GenEval's templates averaged.

    Args:
        path: Local dir or hub id of a ``CLIPModel`` checkpoint with its processor.
        device: Torch device; ``None`` = cuda if available, else cpu.
        local_files_only: Never reach the hub.
        colour_crop: ``mask`` or ``box`` (see the module doc).
    """

    def __init__(
        self,
        path: str,
        device: str | None = "cpu",
        local_files_only: bool = False,
        colour_crop: ColourCrop = "mask",
    ) -> None:
        check_colour_crop(colour_crop)
        self.path, self.device, self.local_files_only = path, resolve_device(device), local_files_only
        self.colour_crop = colour_crop
        self._model: Any = None
        self._processor: Any = None
        self._text: dict[str, torch.Tensor] = {}

    def _load(self) -> None:
        """Load CLIP and its processor once."""
        if self._model is None:
            from transformers import AutoProcessor, CLIPModel

            logger.info("loading GenEval colour CLIP from %s", self.path)
            kwargs = {"local_files_only": self.local_files_only}
            self._processor = AutoProcessor.from_pretrained(self.path, **kwargs)
            self._model = CLIPModel.from_pretrained(self.path, **kwargs).to(self.device).eval()

    def _class_weights(self, classname: str) -> torch.Tensor:
        """``(len(COLORS), D)`` unit text embeddings for one class, averaged over templates."""
        if classname not in self._text:
            prompts = [t.format(c=c, cls=classname) for c in COLORS for t in COLOR_TEMPLATES]
            tokens = self._processor(text=prompts, return_tensors="pt", padding=True).to(self.device)
            emb = _unit(self._model.get_text_features(**tokens)).view(len(COLORS), len(COLOR_TEMPLATES), -1)
            self._text[classname] = torch.nn.functional.normalize(emb.mean(dim=1), dim=-1)
        return self._text[classname]

    @torch.no_grad()
    def classify(self, image: Image.Image, objects: Sequence[Detection], classname: str) -> list[str]:
        """Return one colour from :data:`COLORS` per object (boxes/masks index into ``image``).

        Raises:
            ValueError: With ``colour_crop="mask"``, for an object without a mask.
        """
        if not objects:
            return []
        crops = [crop_object(image, obj, self.colour_crop) for obj in objects]
        self._load()
        pixels = self._processor(images=crops, return_tensors="pt").to(self.device)
        feats = _unit(self._model.get_image_features(**pixels))
        best = (feats @ self._class_weights(classname).T).argmax(dim=-1)
        return [COLORS[int(i)] for i in best]
