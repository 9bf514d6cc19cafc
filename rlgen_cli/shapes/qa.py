"""ShapesQA: questions about rendered ShapesEval scenes, with rule-checked answers and R1-VL reasoning chains.

Every question is built together with its scene (the ShapesEval renderer and vocabulary), and its answer
is read back from the placed objects by a rule (:func:`answer_of`), never from the recipe that asked for
them. Three question types:

* ``count`` — "How many red squares are there?" → ``2`` (1–4 targets, 0–2 distractors sharing the colour
  or the shape, so counting needs both attributes);
* ``colour`` — "What colour is the triangle?" → ``red`` (one object of that shape, 1–2 of other shapes);
* ``relation`` — "Is the circle left of the square?" → ``yes`` / ``no`` (two objects placed so GenEval's
  position rule gives exactly the asked relation, or exactly its opposite).

Each question carries a short chain in R1-VL's format — ``### Image Description:`` (the objects, grouped,
left to right), ``### Rationales:``, ``### Step N:`` bodies naming what is seen, ``### The final answer
is:`` — and the key step StepRAR looks for (``rewards/r1vl.py`` parses exactly these headers).

Splits: ``train`` and ``test`` are drawn from disjoint scene seeds over the same combinations; ``heldout``
asks only about the combinations of :mod:`rlgen_cli.shapes.vocab` held out of ShapesEval's training
(colour–shape pairs for ``count`` / ``colour``, layouts for ``relation``), which never appear in a
``train`` or ``test`` scene. Written files (``python -m rlgen_cli.shapes.qa rlgen_cli/assets/vlm/shapesqa``):

* ``train.json`` — R1-VL-10K rows (``image_path``, ``problem``, ``solution``, ``key_steps``, ``category``);
* ``test.jsonl`` / ``heldout.jsonl`` — the same rows, one per line (``rlgen eval``'s per-category table);
* ``sft.jsonl`` — ShareGPT conversations of the train questions with their chains (the SFT warm-up);
* ``images/`` — the 32×32 PNGs.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from rlgen_cli.geneval_rules import relative_position
from rlgen_cli.shapes.render import PlacedObject, RenderConfig, render
from rlgen_cli.shapes.vocab import COLORS, HELDOUT_COLOR_SHAPES, HELDOUT_RELATIONS, SHAPES, plural

__all__ = [
    "QUESTION_TYPES",
    "SPLIT_SIZES",
    "Question",
    "answer_of",
    "build_split",
    "chain_of",
    "describe",
    "is_heldout",
    "write_sets",
]

QUESTION_TYPES: tuple[str, ...] = ("count", "colour", "relation")
SPLIT_SIZES: dict[str, int] = {"train": 480, "test": 150, "heldout": 90}
"""Questions per split (a third of each type)."""
SPLIT_SEEDS: dict[str, int] = {"train": 0, "test": 1_000_003, "heldout": 2_000_003, "pretrain": 3_000_017}
"""Base seed of each split's scene stream: the streams never share a scene seed."""
OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
MAX_OBJECTS = 5
RENDER = RenderConfig()


@dataclass(frozen=True)
class Question:
    """One question with its scene.

    Attributes:
        kind: One of :data:`QUESTION_TYPES`.
        text: The question.
        subject: ``(colour, shape)`` for ``count``, ``(shape,)`` for ``colour``, ``(a, relation, b)``
            for ``relation``.
        objects: The rendered scene's objects (ground truth for the answer rule).
        image: The rendered scene, ``uint8`` (32, 32, 3).
        seed: The scene seed.
    """

    kind: str
    text: str
    subject: tuple[str, ...]
    objects: tuple[PlacedObject, ...] = field(repr=False)
    image: np.ndarray = field(repr=False, compare=False)
    seed: int

    @property
    def answer(self) -> str:
        return answer_of(self)


# -- the rule -------------------------------------------------------------------------------------
def _only(objects: Sequence[PlacedObject], shape: str) -> PlacedObject:
    found = [o for o in objects if o.shape == shape]
    if len(found) != 1:
        raise ValueError(f"a colour question needs exactly one {shape}, the scene has {len(found)}")
    return found[0]


def relation_seen(objects: Sequence[PlacedObject], a: str, relation: str, b: str) -> str:
    """The relation of the ``a`` to the ``b`` along ``relation``'s axis, by GenEval's rule (margin 0.1)."""
    held = relative_position(_only(objects, a).box, _only(objects, b).box, RENDER.position_margin)
    if relation in held:
        return relation
    if OPPOSITE[relation] in held:
        return OPPOSITE[relation]
    raise ValueError(f"the {a} is neither {relation} nor {OPPOSITE[relation]} the {b} ({sorted(held)})")


def answer_of(question: Question) -> str:
    """The answer read from the scene's objects: a count, a colour name, or ``yes`` / ``no``."""
    objects = question.objects
    if question.kind == "count":
        colour, shape = question.subject
        return str(sum(o.color == colour and o.shape == shape for o in objects))
    if question.kind == "colour":
        return _only(objects, question.subject[0]).color
    a, relation, b = question.subject
    return "yes" if relation_seen(objects, a, relation, b) == relation else "no"


# -- chains ---------------------------------------------------------------------------------------
def _named(count: int, colour: str, shape: str) -> str:
    return f"{count} {colour} {shape if count == 1 else plural(shape)}"


def describe(objects: Sequence[PlacedObject]) -> str:
    """The objects grouped by colour and shape, groups in left-to-right order of their first object."""
    ordered = sorted(objects, key=lambda o: (o.box[0] + o.box[2], o.box[1] + o.box[3]))
    counts: dict[tuple[str, str], int] = {}
    for obj in ordered:
        counts[(obj.color, obj.shape)] = counts.get((obj.color, obj.shape), 0) + 1
    return ", ".join(_named(n, colour, shape) for (colour, shape), n in counts.items()) + "."


def key_step(question: Question) -> str:
    """What the chain must name (StepRAR's key step): the counted group, the colour, or the relation."""
    if question.kind == "count":
        colour, shape = question.subject
        return _named(int(question.answer), colour, shape)
    if question.kind == "colour":
        return f"the {question.subject[0]} is {question.answer}"
    a, relation, b = question.subject
    return f"the {a} is {relation_seen(question.objects, a, relation, b)} the {b}"


def _steps(question: Question) -> list[str]:
    if question.kind == "count":
        return [f"I count {key_step(question)}."]
    if question.kind == "colour":
        return [f"{key_step(question).capitalize()}."]
    a, relation, b = question.subject
    holds = "" if question.answer == "yes" else "not "
    return [f"{key_step(question).capitalize()}.", f"So the {a} is {holds}{relation} the {b}."]


def _rationale(question: Question) -> str:
    if question.kind == "count":
        colour, shape = question.subject
        return f"The question asks for the number of {colour} {plural(shape)}."
    if question.kind == "colour":
        return f"The question asks for the colour of the {question.subject[0]}."
    a, relation, b = question.subject
    return f"The question asks whether the {a} is {relation} the {b}."


def chain_of(question: Question) -> str:
    """The reasoning chain in R1-VL's format, ending with the answer line."""
    steps = "".join(f"### Step {i}:\n{body}\n" for i, body in enumerate(_steps(question), start=1))
    return (
        f"### Image Description:\n{describe(question.objects)}\n### Rationales:\n{_rationale(question)}\n"
        f"### Let's think step by step.\n{steps}### The final answer is: {question.answer}"
    )


# -- held-out combinations ------------------------------------------------------------------------
def _layouts(a: str, relation: str, b: str) -> set[tuple[str, str, str]]:
    """A layout in both phrasings."""
    return {(a, relation, b), (b, OPPOSITE[relation], a)}


def is_heldout(question: Question) -> bool:
    """Whether the question names, or its scene shows, a held-out combination of ShapesEval."""
    if any((o.color, o.shape) in HELDOUT_COLOR_SHAPES for o in question.objects):
        return True
    if question.kind == "relation":
        a, relation, b = question.subject
        seen = relation_seen(question.objects, a, relation, b)
        return bool((_layouts(a, relation, b) | _layouts(a, seen, b)) & HELDOUT_RELATIONS)
    return False


# -- scenes ---------------------------------------------------------------------------------------
def _pairs(heldout: bool) -> list[tuple[str, str]]:
    pairs = [(c, s) for s in SHAPES for c in COLORS]
    return sorted(HELDOUT_COLOR_SHAPES) if heldout else [p for p in pairs if p not in HELDOUT_COLOR_SHAPES]


def _ordinary_pairs() -> list[tuple[str, str]]:
    return _pairs(heldout=False)


def _count_clauses(rng: random.Random, heldout: bool) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
    colour, shape = rng.choice(_pairs(heldout))
    count = rng.randint(1, 4)
    lookalikes = [p for p in _ordinary_pairs() if (p[0] == colour) != (p[1] == shape)]
    others = rng.sample(lookalikes, k=rng.randint(0, min(2, MAX_OBJECTS - count)))
    include = [{"class": shape, "count": count, "color": colour}]
    include += [{"class": s, "count": 1, "color": c} for c, s in others]
    return (colour, shape), include


def _colour_clauses(rng: random.Random, heldout: bool) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
    colour, shape = rng.choice(_pairs(heldout))
    rest = [s for s in SHAPES if s != shape]
    others = rng.sample(rest, k=rng.randint(1, len(rest)))
    return (shape,), [{"class": shape, "count": 1, "color": colour}] + [
        {"class": s, "count": 1} for s in others
    ]


def _relation_clauses(rng: random.Random, heldout: bool) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
    """Ask about ``a relation b``; the scene shows it (yes) or its opposite (no), half each."""
    while True:
        a, b = rng.sample(SHAPES, k=2)
        relation = rng.choice(sorted(OPPOSITE))
        shown = relation if rng.random() < 0.5 else OPPOSITE[relation]
        named = bool((_layouts(a, relation, b) | _layouts(a, shown, b)) & HELDOUT_RELATIONS)
        if named == heldout:
            return (a, relation, b), [
                {"class": b, "count": 1},
                {"class": a, "count": 1, "position": [shown, 0]},
            ]


CLAUSES = {"count": _count_clauses, "colour": _colour_clauses, "relation": _relation_clauses}


def _text(kind: str, subject: tuple[str, ...]) -> str:
    if kind == "count":
        return f"How many {subject[0]} {plural(subject[1])} are there?"
    if kind == "colour":
        return f"What colour is the {subject[0]}?"
    return f"Is the {subject[0]} {subject[1]} the {subject[2]}?"


def make_question(kind: str, seed: int, heldout: bool = False) -> Question:
    """The question of type ``kind`` drawn and rendered from ``seed`` (the same seed, the same question).

    Raises:
        ValueError: If ``kind`` is not one of :data:`QUESTION_TYPES`, or no scene fits after 20 draws.
    """
    if kind not in CLAUSES:
        raise ValueError(f"ShapesQA question type {kind!r}; choose one of {', '.join(QUESTION_TYPES)}")
    rng = random.Random(seed)
    avoid = frozenset() if heldout else HELDOUT_COLOR_SHAPES
    for _ in range(20):
        subject, include = CLAUSES[kind](rng, heldout)
        try:
            pixels, objects = render({"include": include}, rng.randrange(1 << 31), RENDER, avoid)
        except ValueError:  # too many objects for the image this time: draw another scene
            continue
        image = (pixels.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        return Question(kind, _text(kind, subject), subject, tuple(objects), image, seed)
    raise ValueError(f"no {kind} scene fitted a {RENDER.size}-px image in 20 draws from seed {seed}")


def _questions(split: str) -> Iterator[Question]:
    """The split's endless stream, the types interleaved; held-out combinations kept to ``heldout``."""
    heldout = split == "heldout"
    for n in range(1 << 30):
        question = make_question(QUESTION_TYPES[n % len(QUESTION_TYPES)], SPLIT_SEEDS[split] + n, heldout)
        if is_heldout(question) == heldout:
            yield question


def build_split(split: str, size: int | None = None) -> list[Question]:
    """The first ``size`` questions (default :data:`SPLIT_SIZES`) of ``split`` (``train`` | ``test`` |
    ``heldout`` | ``pretrain``), deterministically."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"ShapesQA split {split!r}; choose one of {', '.join(SPLIT_SEEDS)}")
    stream = _questions(split)
    return [next(stream) for _ in range(size if size is not None else SPLIT_SIZES[split])]


# -- files ----------------------------------------------------------------------------------------
def row_of(question: Question, image_path: str) -> dict[str, Any]:
    """An R1-VL-10K row (plus the question type as ``category``)."""
    return {
        "image_path": image_path,
        "problem": question.text,
        "solution": question.answer,
        "key_steps": {"Steps": [[key_step(question)]]},
        "category": question.kind,
    }


def sft_row_of(question: Question, image_path: str) -> dict[str, Any]:
    """A ShareGPT conversation: the image and question, answered with the chain."""
    return {
        "messages": [
            {"role": "user", "content": f"<image>{question.text}"},
            {"role": "assistant", "content": chain_of(question)},
        ],
        "images": [image_path],
    }


def save_image(question: Question, path: Path) -> None:
    Image.fromarray(question.image).save(path, optimize=True)


def write_sets(out_dir: str | Path) -> list[Path]:
    """Write every split's images and data files under ``out_dir``; returns the data files."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    files = []
    for split in SPLIT_SIZES:
        rows, sft = [], []
        for i, question in enumerate(build_split(split)):
            name = f"images/{split}_{i:04d}.png"
            save_image(question, out / name)
            rows.append(row_of(question, name))
            sft.append(sft_row_of(question, name))
        if split == "train":
            files.append(out / "train.json")
            files[-1].write_text(json.dumps(rows, indent=0) + "\n", encoding="utf-8")
            files.append(out / "sft.jsonl")
            files[-1].write_text("".join(json.dumps(r) + "\n" for r in sft), encoding="utf-8")
        else:
            files.append(out / f"{split}.jsonl")
            files[-1].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return files


if __name__ == "__main__":
    write_sets(
        sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent / "assets" / "vlm" / "shapesqa"
    )
