"""The tiny synthetic VLM sets shipped in ``rlgen_cli/assets/vlm`` (and how to regenerate them).

32×32 PNGs with 1–4 coloured squares; questions about the count or the colour. Three files mirror the
real formats: ``tiny_r1vl.json`` (R1-VL-10K rows with key steps), ``tiny_mathvista.jsonl`` (eval rows
with categories) and ``tiny_sft.jsonl`` (ShareGPT, one reflective conversation the SFT filter drops).

    python -m rlgen_cli.vlm.synthetic rlgen_cli/assets/vlm
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220)}
SIZE = 32


def draw(count: int, colour: str, seed: int) -> Image.Image:
    """A white 32×32 image with ``count`` non-overlapping 6-px squares of ``colour``."""
    rng = np.random.default_rng(seed)
    pixels = np.full((SIZE, SIZE, 3), 255, dtype=np.uint8)
    cells = rng.permutation(16)[:count]  # a 4×4 grid of 8-px cells, one square per cell
    for cell in cells:
        top, left = 8 * (cell // 4) + 1, 8 * (cell % 4) + 1
        pixels[top : top + 6, left : left + 6] = COLOURS[colour]
    return Image.fromarray(pixels)


def _answer(count: int, colour: str) -> str:
    return (
        f"### Image Description:\nThere are {colour} squares.\n### Rationales:\nCount them.\n"
        f"### Let's think step by step.\n### Step 1:\nThe squares are {colour}.\n"
        f"### Step 2:\nThere are {count} squares.\n### The final answer is: {count}"
    )


def write_tiny_sets(out_dir: str | Path) -> list[Path]:
    """Write the images and the three data files under ``out_dir``; returns the data files."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows, evals, sft = [], [], []
    for i in range(8):
        count, colour = 1 + i % 4, list(COLOURS)[i % 3]
        name = f"images/squares_{i}.png"
        draw(count, colour, seed=i).save(out / name)
        key_steps = {"Steps": [[f"{colour} squares", f"squares are {colour}"], f"{count} squares"]}
        rows.append(
            {
                "image_path": name,
                "problem": "How many squares are there?",
                "solution": f"### The final answer is: {count}",
                "key_steps": key_steps,
            }
        )
        if i < 6:
            category, query, answer = (
                ("counting", "How many squares are there?", str(count))
                if i % 2 == 0
                else ("colour", "What colour are the squares?", colour)
            )
            evals.append(
                {"pid": str(i), "image": name, "query": query, "answer": answer, "category": category}
            )
        reply = _answer(count, colour)
        if i == 7:  # Mulberry-style reflective data: the warm-up filter removes it
            reply = reply.replace("### Step 2:", "Wait, let me re-examine.\n### Step 2:")
        sft.append(
            {
                "messages": [
                    {"role": "user", "content": "<image>How many squares are there?"},
                    {"role": "assistant", "content": reply},
                ],
                "images": [name],
            }
        )
    files = [out / "tiny_r1vl.json", out / "tiny_mathvista.jsonl", out / "tiny_sft.jsonl"]
    files[0].write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    files[1].write_text("".join(json.dumps(r) + "\n" for r in evals), encoding="utf-8")
    files[2].write_text("".join(json.dumps(r) + "\n" for r in sft), encoding="utf-8")
    return files


if __name__ == "__main__":
    write_tiny_sets(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent / "assets" / "vlm")
