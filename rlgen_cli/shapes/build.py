"""Write the ShapesEval splits (and optionally ground-truth images): ``python -m rlgen_cli.shapes.build OUT``.

Writes ``OUT/{prefix}train.jsonl``, ``{prefix}test.jsonl`` and ``{prefix}heldout.jsonl`` (GenEval
format, see :mod:`rlgen_cli.shapes.prompts`). With ``--images``, also renders every row to
``OUT/images/{split}/{row:05d}.png`` (seed :func:`scene_seed`), runs the detector on them and logs its
strict accuracy per split — a self-check of the benchmark. The files shipped as
``builtin:shapes_*.jsonl`` are ``python -m rlgen_cli.shapes.build rlgen_cli/assets/prompts --prefix shapes_``.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from rlgen_cli.shapes.prompts import SPLITS, SplitConfig, build_splits, write_jsonl
from rlgen_cli.shapes.render import RenderConfig, render_batch
from rlgen_cli.shapes.score import score_images, summarise_results

logger = logging.getLogger(__name__)

__all__ = ["main", "render_split", "scene_seed", "write_splits"]


def scene_seed(split: str, row: int, seed: int = 0) -> int:
    """Return the render seed of row ``row`` of ``split`` (distinct across splits and rows).

    Args:
        split: One of :data:`~rlgen_cli.shapes.prompts.SPLITS`.
        row: Row index in the split file.
        seed: Base seed.

    Returns:
        A non-negative int.
    """
    return seed * 10_000_019 + SPLITS.index(split) * 1_000_003 + row


def write_splits(
    out_dir: str | Path, splits: dict[str, list[dict[str, Any]]] | None = None, prefix: str = ""
) -> dict[str, Path]:
    """Write the three split files.

    Args:
        out_dir: Output directory (created).
        splits: ``{split: rows}``; default :func:`~rlgen_cli.shapes.prompts.build_splits` ``()``.
        prefix: File name prefix, e.g. ``"shapes_"``.

    Returns:
        ``{split: path}``.
    """
    splits = build_splits() if splits is None else splits
    return {name: write_jsonl(rows, Path(out_dir) / f"{prefix}{name}.jsonl") for name, rows in splits.items()}


def render_split(
    rows: Sequence[dict[str, Any]],
    split: str,
    out_dir: str | Path,
    seed: int = 0,
    config: RenderConfig = RenderConfig(),
) -> float:
    """Render a split's rows to PNGs and return the detector's strict accuracy on them.

    Args:
        rows: GenEval dicts of the split.
        split: Split name (for seeds and the folder).
        out_dir: Images go to ``out_dir/images/split/``.
        seed: Base seed.
        config: Rendering settings.

    Returns:
        Overall (mean over tags) ShapesEval strict accuracy of the detector on the rendered images.
    """
    folder = Path(out_dir) / "images" / split
    folder.mkdir(parents=True, exist_ok=True)
    images = render_batch(rows, [scene_seed(split, i, seed) for i in range(len(rows))], config)
    pixels = (images.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    for i, array in enumerate(pixels):
        Image.fromarray(array).save(folder / f"{i:05d}.png")
    return summarise_results(score_images(images, rows))["strict"]["overall"]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m rlgen_cli.shapes.build", description=__doc__.split("\n")[0]
    )
    parser.add_argument("out_dir", type=Path, help="output directory")
    parser.add_argument("--prefix", default="", help="file name prefix, e.g. shapes_")
    parser.add_argument("--images", action="store_true", help="also render ground-truth PNGs and self-check")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="split and render seed (default 0)")
    defaults = SplitConfig()
    for key in ("train_per_tag", "test_per_tag", "heldout_per_tag"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=getattr(defaults, key))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Build the splits (and images); log a summary. Returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parse(argv)
    config = SplitConfig(args.train_per_tag, args.test_per_tag, args.heldout_per_tag, seed=args.seed)
    splits = build_splits(config)
    paths = write_splits(args.out_dir, splits, args.prefix)
    for name, path in paths.items():
        rows = splits[name]
        tags = sorted({r["tag"] for r in rows})
        logger.info(
            "%-8s %4d rows, %3d distinct prompts, tags %s -> %s",
            name,
            len(rows),
            len({r["prompt"] for r in rows}),
            ",".join(tags),
            path,
        )
        if args.images:
            strict = render_split(rows, name, args.out_dir, args.seed, RenderConfig(size=args.size))
            logger.info(
                "%-8s ground-truth images in %s; detector strict accuracy %.4f",
                name,
                Path(args.out_dir) / "images" / name,
                strict,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
