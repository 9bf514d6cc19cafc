"""ShapesEval: a CPU-scale compositional text-to-image benchmark with GenEval-format prompts.

Shapes {circle, square, triangle} × a 6-colour palette, rendered on a black background at 32×32 by
default. Modules:

* :mod:`~rlgen_cli.shapes.vocab`: shapes, palette, relations, held-out combinations;
* :mod:`~rlgen_cli.shapes.prompts`: GenEval-style prompts + metadata and the train/test/heldout splits;
* :mod:`~rlgen_cli.shapes.render`: deterministic ground-truth rendering from metadata + seed;
* :mod:`~rlgen_cli.shapes.detect`: connected components + palette colour + geometric shape class;
* :mod:`~rlgen_cli.shapes.score`: GenEval scoring, ShapesEval strict accuracy, extra objects, summaries;
* :mod:`~rlgen_cli.shapes.build`: ``python -m rlgen_cli.shapes.build OUT_DIR`` writes the splits.

The reward is :mod:`rlgen_cli.rewards.shapes` (``shapes_geneval``).
"""

from rlgen_cli.shapes.detect import ShapeDetection, ShapeDetector
from rlgen_cli.shapes.prompts import SplitConfig, build_splits, is_heldout, prompt_universe
from rlgen_cli.shapes.render import RenderConfig, render, render_batch
from rlgen_cli.shapes.score import (
    ShapesResult,
    format_summary,
    score_detections,
    score_images,
    summarise_results,
)

__all__ = [
    "RenderConfig", "ShapeDetection", "ShapeDetector", "ShapesResult", "SplitConfig", "build_splits",
    "format_summary", "is_heldout", "prompt_universe", "render", "render_batch", "score_detections",
    "score_images", "summarise_results",
]  # fmt: skip
