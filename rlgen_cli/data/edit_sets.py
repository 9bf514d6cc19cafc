"""The tiny editing set, generated where a run needs it (``builtin:tiny_edit_train.jsonl`` / ``_test``).

Editing families take a source image per prompt. For the tiny in-process models (random weights, CPU
tests and demos) the sources are ShapesEval scenes rendered on the fly: a few coloured shapes on black,
exact and deterministic, so nothing binary ships with rlgen. Each row is a counting or colour edit in the
counting-edit format the real editing recipes read (``{"prompt", "image", "tag", "include", "exclude"}``,
GenEval metadata of the wanted result, ``image`` relative to the jsonl file), plus ``source_prompt``.

The set is written once into ``<run dir>/tiny_edit/`` and reused; several processes of one run may ask
for it at the same time (each builds in a private directory, the first rename wins).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from rlgen_cli.shapes.vocab import COLORS, SHAPES, plural

DIRECTORY = "tiny_edit"
SPLIT_SIZES = {"tiny_edit_train.jsonl": 16, "tiny_edit_test.jsonl": 8}
"""Generated file name → number of edits (the names ``builtin:`` accepts besides the shipped files)."""
SPLIT_SEEDS = {"tiny_edit_train.jsonl": 0, "tiny_edit_test.jsonl": 1}
IMAGE_SIZE = 32  # the tiny models' resolution (sources are resized to the model's size anyway)
NUMBERS = {1: "one", 2: "two", 3: "three"}
MAX_SOURCE_COUNT = 2  # at most two objects in a source, three after a counting edit: they fit in 32 px


def _phrase(count: int, color: str, shape: str) -> str:
    return f"a {color} {shape}" if count == 1 else f"{NUMBERS[count]} {color} {plural(shape)}"


def _counting_edit(rng: random.Random, shape: str, color: str) -> tuple[int, dict[str, Any]]:
    """Source count and the row of "change the number of <shape>s to N" (GenEval metadata of the result)."""
    source = rng.randint(1, MAX_SOURCE_COUNT)
    target = rng.choice([n for n in NUMBERS if n != source])
    row = {
        "prompt": f"Change the number of {plural(shape)} to {NUMBERS[target]}.",
        "tag": "counting",
        "include": [{"class": shape, "count": target}],
        "exclude": [{"class": shape, "count": target + 1}],
    }
    return source, row


def _colour_edit(rng: random.Random, shape: str, color: str) -> tuple[int, dict[str, Any]]:
    """Source count (one object) and the row of "make the <shape> <new colour>"."""
    target = rng.choice([c for c in COLORS if c != color])
    row = {
        "prompt": f"Make the {shape} {target}.",
        "tag": "colors",
        "include": [{"class": shape, "count": 1, "color": target}],
    }
    return 1, row


def edit_rows(name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``(source scene metadata, edit row without "image")`` pairs of one generated split, deterministic."""
    rng = random.Random(SPLIT_SEEDS[name])
    pairs = []
    for i in range(SPLIT_SIZES[name]):
        shape, color = SHAPES[i % len(SHAPES)], rng.choice(COLORS)
        count, row = (_counting_edit if i % 2 == 0 else _colour_edit)(rng, shape, color)
        source = {
            "prompt": _phrase(count, color, shape),
            "include": [{"class": shape, "count": count, "color": color}],
        }
        pairs.append((source, {**row, "source_prompt": source["prompt"]}))
    return pairs


def _write_split(directory: Path, name: str) -> None:
    from PIL import Image

    from rlgen_cli.shapes.render import render  # imports the GenEval scorer: only when writing

    stem = name.removesuffix(".jsonl")
    (directory / "images").mkdir(exist_ok=True)
    with (directory / name).open("w", encoding="utf-8") as out:
        for i, (source, row) in enumerate(edit_rows(name)):
            image, _ = render(source, seed=SPLIT_SEEDS[name] * 1000 + i)
            pixels = (image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
            relative = f"images/{stem}_{i:03d}.png"
            Image.fromarray(pixels).save(directory / relative)
            out.write(json.dumps({**row, "image": relative}) + "\n")


def tiny_edit_set(workdir: Path) -> Path:
    """``workdir/tiny_edit/`` holding every generated split and its source images (written on first use)."""
    final = Path(workdir) / DIRECTORY
    if all((final / name).is_file() for name in SPLIT_SIZES):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DIRECTORY}-", dir=final.parent))
    try:
        for name in SPLIT_SIZES:
            _write_split(staging, name)
        os.rename(staging, final)
    except OSError:
        if not all((final / name).is_file() for name in SPLIT_SIZES):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone after a rename; a loser's copy otherwise
    return final
