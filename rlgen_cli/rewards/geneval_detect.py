"""GenEval's object finder: a transformers detector turned into :class:`~rlgen_cli.geneval_rules.Detection` s.

Two kinds of checkpoint, told apart by their config:

* **instance segmentation** (Mask2Former, what the original benchmark runs through mmdetection): every
  detection carries its binary mask, so the colour check can paste the object alone on grey. Post-
  processing follows the original's (mmdetection's Mask2Former instance head): class probabilities
  without the "no object" column, the top ``num_queries`` (query, class) pairs, mask logits upsampled to
  the padded input, cropped to the image, upsampled to the original size and thresholded at 0 (sigmoid
  0.5); score = class probability × mean mask probability inside the mask; box = the mask's extent
  (``x1 = last column + 1``).
* **object detection** (DETR, YOLOS, …: ``AutoModelForObjectDetection``): boxes only, through the image
  processor's own ``post_process_object_detection``.

Labels are lower-cased, underscores become spaces and :data:`DEFAULT_LABEL_ALIASES` maps COCO / VOC
spellings onto GenEval's class names.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from rlgen_cli.geneval_rules import Detection
from rlgen_cli.rewards import clip

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_LABEL_ALIASES", "INSTANCE_MODEL_TYPES", "Detector", "TransformersDetector", "instance_detections",
    "mask_boxes", "resolve_device",
]  # fmt: skip

# Detector label spellings (HF COCO / VOC) -> GenEval class names.
DEFAULT_LABEL_ALIASES = {
    "mouse": "computer mouse", "remote": "tv remote", "keyboard": "computer keyboard", "sofa": "couch",
    "hair dryer": "hair drier", "motorbike": "motorcycle", "aeroplane": "airplane", "tvmonitor": "tv",
    "diningtable": "dining table", "pottedplant": "potted plant",
}  # fmt: skip
INSTANCE_MODEL_TYPES = ("mask2former",)  # configs whose checkpoints give instance masks


class Detector(Protocol):
    """Anything that finds objects: ``detect(images) -> detections per image`` (GenEval class labels)."""

    def detect(self, images: Sequence[Image.Image]) -> list[list[Detection]]: ...


def resolve_device(device: str | None) -> torch.device:
    """Parse a device; ``None`` picks cuda when available, else cpu; CUDA without an index is the device
    current now (``clip.resolve_device``: why)."""
    return torch.device(clip.resolve_device(device or None))


def mask_boxes(masks: Tensor) -> Tensor:
    """``(N, 4)`` float boxes ``(x0, y0, x1, y1)`` spanning each ``(N, H, W)`` boolean mask (exclusive end).

    An empty mask gets the zero box.
    """
    boxes = torch.zeros(masks.shape[0], 4)
    cols, rows = masks.any(dim=1), masks.any(dim=2)  # (N, W), (N, H)
    for i in range(masks.shape[0]):
        xs, ys = torch.nonzero(cols[i]).flatten(), torch.nonzero(rows[i]).flatten()
        if len(xs) and len(ys):
            boxes[i] = torch.tensor([xs[0], ys[0], xs[-1] + 1, ys[-1] + 1], dtype=torch.float32)
    return boxes


def instance_detections(
    class_logits: Tensor, mask_logits: Tensor, size: tuple[int, int], threshold: float, label: Any
) -> list[Detection]:
    """Detections of one image from Mask2Former's query outputs.

    Args:
        class_logits: ``(Q, C + 1)``, the last column "no object".
        mask_logits: ``(Q, H, W)`` already at the image's size.
        size: ``(H, W)`` of the image (for the empty case).
        threshold: Keep detections scoring above it.
        label: ``label(class_index) -> GenEval class name``.

    Returns:
        Detections with boolean numpy masks, in top-k order (scoring sorts them again).
    """
    assert mask_logits.shape[-2:] == tuple(size)
    probs = class_logits.float().softmax(-1)[:, :-1]
    num_queries, num_classes = probs.shape
    scores, flat = probs.flatten().topk(num_queries)
    queries, classes = flat // num_classes, flat % num_classes
    logits = mask_logits[queries].float()
    masks = logits > 0
    inside = masks.flatten(1).float()
    mask_score = (logits.sigmoid().flatten(1) * inside).sum(1) / (inside.sum(1) + 1e-6)
    final = scores * mask_score
    keep = torch.nonzero((final > threshold) & masks.flatten(1).any(1)).flatten()
    boxes = mask_boxes(masks[keep])
    return [
        Detection(label(int(classes[k])), tuple(boxes[j].tolist()), float(final[k]), masks[k].cpu().numpy())
        for j, k in enumerate(keep.tolist())
    ]


class TransformersDetector:
    """:class:`Detector` over a transformers checkpoint (Mask2Former instances or a box detector), lazily.

    Args:
        path: Local dir or hub id of the checkpoint and its image processor.
        device: Torch device; ``None`` = cuda if available, else cpu.
        local_files_only: Never reach the hub.
        threshold: Minimum confidence kept (scoring applies its own thresholds on top).
        label_aliases: Detector label -> GenEval class; default :data:`DEFAULT_LABEL_ALIASES`.
        batch_size: Images per forward pass.
    """

    def __init__(
        self,
        path: str,
        device: str | None = "cpu",
        local_files_only: bool = False,
        threshold: float = 0.3,
        label_aliases: Mapping[str, str] | None = None,
        batch_size: int = 8,
    ) -> None:
        self.path, self.device, self.local_files_only = path, resolve_device(device), local_files_only
        self.threshold, self.batch_size = threshold, batch_size
        self.aliases = dict(DEFAULT_LABEL_ALIASES if label_aliases is None else label_aliases)
        self.gives_masks: bool | None = None  # known once loaded
        self._model: Any = None
        self._processor: Any = None

    def _load(self) -> None:
        """Load the model and its image processor once, as instance segmentation or box detection."""
        if self._model is not None:
            return
        from transformers import AutoConfig, AutoImageProcessor

        kwargs = {"local_files_only": self.local_files_only}
        config = AutoConfig.from_pretrained(self.path, **kwargs)
        self.gives_masks = config.model_type in INSTANCE_MODEL_TYPES
        logger.info("loading GenEval detector %s (%s)", self.path, config.model_type)
        self._processor = AutoImageProcessor.from_pretrained(self.path, **kwargs)
        if self.gives_masks:
            model = self._load_instance_model(kwargs)
        else:
            from transformers import AutoModelForObjectDetection

            model = AutoModelForObjectDetection.from_pretrained(self.path, **kwargs)
        self._model = model.to(self.device).eval()

    def _load_instance_model(self, kwargs: dict[str, Any]) -> Any:
        """Mask2Former for universal segmentation (transformers builds its training loss, which needs scipy)."""
        import importlib.util

        if importlib.util.find_spec("scipy") is None:
            raise ValueError(
                f"GenEval detector {self.path} is a Mask2Former, whose transformers class needs scipy: "
                "pip install 'rlgen[geneval]' (or scipy), or use a box detector with "
                "reward.kwargs.geneval.colour_crop=box."
            )
        from transformers import AutoModelForUniversalSegmentation

        return AutoModelForUniversalSegmentation.from_pretrained(self.path, **kwargs)

    def _label(self, index: int) -> str:
        """Map a class index to a GenEval class name."""
        name = str(self._model.config.id2label.get(int(index), index)).strip().lower().replace("_", " ")
        return self.aliases.get(name, name)

    def _boxes(self, chunk: list[Image.Image], inputs: Any) -> list[list[Detection]]:
        """Box detections through the processor's own post-processing."""
        processed = self._processor.post_process_object_detection(
            self._model(**inputs),
            threshold=self.threshold,
            target_sizes=[(im.height, im.width) for im in chunk],
        )
        results = []
        for item in processed:
            boxes, scores, labels = (item[k].float().cpu().tolist() for k in ("boxes", "scores", "labels"))
            results.append(
                [Detection(self._label(c), tuple(b), float(s)) for b, s, c in zip(boxes, scores, labels)]
            )
        return results

    def _instances(self, chunk: list[Image.Image], inputs: Any) -> list[list[Detection]]:
        """Instance detections: masks at the padded input size, cropped to each image, then its own size."""
        outputs = self._model(**inputs)
        padded = inputs["pixel_values"].shape[-2:]
        masks = F.interpolate(outputs.masks_queries_logits, size=padded, mode="bilinear", align_corners=False)
        valid = inputs.get("pixel_mask")
        results = []
        for i, image in enumerate(chunk):
            rows, cols = padded
            if valid is not None:
                rows, cols = int(valid[i].any(1).sum()), int(valid[i].any(0).sum())
            size = (image.height, image.width)
            logits = F.interpolate(
                masks[i : i + 1, :, :rows, :cols], size=size, mode="bilinear", align_corners=False
            )
            dets = instance_detections(
                outputs.class_queries_logits[i], logits[0], size, self.threshold, self._label
            )
            results.append(dets)
        return results

    @torch.no_grad()
    def detect(self, images: Sequence[Image.Image]) -> list[list[Detection]]:
        """Return the detections of every RGB image, boxes (and masks) in that image's pixels."""
        self._load()
        results: list[list[Detection]] = []
        for start in range(0, len(images), self.batch_size):
            chunk = list(images[start : start + self.batch_size])
            inputs = self._processor(images=chunk, return_tensors="pt").to(self.device)
            results += self._instances(chunk, inputs) if self.gives_masks else self._boxes(chunk, inputs)
        return results
