"""The ShapesQA base: a small Qwen2-VL built from a config, with a real processor, chat template and tokenizer.

The architecture is transformers' ``Qwen2VLForConditionalGeneration`` (vision tower with 4-px patches merged
2×2, so a 32×32 scene is 16 image tokens; M-RoPE; tied embeddings), only small. The tokenizer is a
byte-level BPE trained offline on the ShapesQA texts (every question, chain and caption word, so a chain
is a few dozen tokens) with Qwen's special tokens, behind a real ``Qwen2VLProcessor`` and the Qwen2-VL
chat template of the tiny VLM family (``vlm/tokenizer.py``). :func:`save_random_base` writes it to a
directory that ``model.path`` loads like any Qwen2-VL checkpoint; scripts/pretrain_shapesqa_base.py
pretrains it with ``rlgen train`` and ships the result as ``builtin:shapesqa_base``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlgen_cli.models.tiny.vlm import qwen_vl_model, special_token_ids
from rlgen_cli.shapes.qa import build_split, chain_of, describe
from rlgen_cli.shapes.vocab import COLORS, SHAPES, plural
from rlgen_cli.vlm.tokenizer import CHAT_TEMPLATE, BytePairs, qwen_tokenizer, train_byte_bpe

__all__ = ["BaseSize", "shapesqa_processor", "shapesqa_tokenizer", "random_base", "save_random_base"]

PATCH, MERGE, TEMPORAL = 4, 2, 2
IMAGE_PIXELS = 32 * 32
CAPTION_QUESTION = "Describe the image."


@dataclass(frozen=True)
class BaseSize:
    """Widths and depths of the ShapesQA base (defaults: the shipped one)."""

    hidden: int = 96
    layers: int = 3
    heads: int = 4
    kv_heads: int = 2
    vision_width: int = 48
    vision_depth: int = 2
    vocab: int = 512


def _corpus() -> list[str]:
    """Texts the BPE learns from: chains and captions of train scenes, every name and question form."""
    texts = [q.text + "\n" + chain_of(q) for q in build_split("train", 90)]
    texts += [describe(q.objects) for q in build_split("pretrain", 60)]
    names = [f"{n} {c} {s if n == 1 else plural(s)}" for n in range(1, 5) for c in COLORS for s in SHAPES]
    texts += [" ".join(names), CAPTION_QUESTION, "You are a helpful assistant. system user assistant yes no"]
    return texts


@functools.cache
def _trained_bpe(vocab_size: int) -> BytePairs:
    return train_byte_bpe(_corpus(), vocab_size)


def shapesqa_tokenizer(vocab_size: int = BaseSize.vocab) -> Any:
    """A ``Qwen2Tokenizer`` on the ShapesQA BPE plus Qwen's special tokens (EOS ``<|im_end|>``)."""
    return qwen_tokenizer(*_trained_bpe(vocab_size))


def shapesqa_processor(vocab_size: int = BaseSize.vocab) -> Any:
    """A ``Qwen2VLProcessor``: 4-px patches merged 2×2, 32×32 images kept whole (16 image tokens)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    geometry = {"patch_size": PATCH, "temporal_patch_size": TEMPORAL, "merge_size": MERGE}
    size = {"shortest_edge": IMAGE_PIXELS, "longest_edge": IMAGE_PIXELS}
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, **geometry),
        video_processor=Qwen2VLVideoProcessor(size=size, **geometry),
        tokenizer=shapesqa_tokenizer(vocab_size),
        chat_template=CHAT_TEMPLATE,
    )


def random_base(processor: Any, size: BaseSize = BaseSize(), seed: int = 0) -> Any:
    """A randomly initialised ``Qwen2VLForConditionalGeneration`` of ``size`` for ``processor``."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tokenizer = processor.tokenizer
    ids, special = special_token_ids(tokenizer)
    half = size.hidden // size.heads // 2  # M-RoPE splits half the head between time, height and width
    text = dict(
        vocab_size=len(tokenizer), hidden_size=size.hidden, intermediate_size=3 * size.hidden,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
        max_position_embeddings=512, tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0,
            "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
        },
        **special,
    )  # fmt: skip
    vision = dict(
        depth=size.vision_depth, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL, embed_dim=size.vision_width, hidden_size=size.hidden, mlp_ratio=2,
    )  # fmt: skip
    return qwen_vl_model(Qwen2VLConfig, Qwen2VLForConditionalGeneration, text, vision, (ids, special), seed)


def save_random_base(path: str | Path, size: BaseSize = BaseSize(), seed: int = 0) -> Path:
    """Write the random base and its processor to ``path`` (a Qwen2-VL directory ``model.path`` loads)."""
    path = Path(path)
    processor = shapesqa_processor(size.vocab)
    random_base(processor, size, seed).save_pretrained(path)
    processor.save_pretrained(path)
    return path


def pretraining_rows(size: int, image_dir: Path) -> list[dict[str, Any]]:
    """ShareGPT rows for pretraining on ``size`` scenes of the ``pretrain`` stream (never a train, test or
    held-out scene): a caption of every scene and the short answer to its question; images written."""
    from rlgen_cli.shapes.qa import save_image

    image_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, question in enumerate(build_split("pretrain", size)):
        name = image_dir / f"pretrain_{i:05d}.png"
        save_image(question, name)
        rows.append(_conversation(CAPTION_QUESTION, describe(question.objects), name))
        rows.append(_conversation(question.text, f"### The final answer is: {question.answer}", name))
    return rows


def _conversation(question: str, reply: str, image: Path) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": f"<image>{question}"},
            {"role": "assistant", "content": reply},
        ],
        "images": [str(image)],
    }
