"""Offline tokenizer and processor of the tiny Qwen-VL: a byte-level BPE trained in-process.

The BPE is trained with 🤗 tokenizers on a small built-in corpus (R1-VL's step format, digits, common
words), deterministically, in well under a second; it carries Qwen's special tokens (``<|im_start|>``,
``<|im_end|>``, ``<|endoftext|>``, the vision tokens) and a Qwen2-VL chat template (default system
prompt, ``<|vision_start|><|image_pad|><|vision_end|>`` per image). The processor is a real
``Qwen2VLProcessor`` (image + video processors) with 4-pixel patches, so the whole multimodal path —
image-token expansion, M-RoPE, pixel bounds — runs exactly as with Qwen2-VL, only smaller.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from typing import Any

from rlgen_cli.models.tiny.vlm import MERGE, PATCH, TEMPORAL

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "tiny_processor", "tiny_tokenizer", "trained_bpe"]

SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
DEFAULT_SYSTEM = "You are a helpful assistant."
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    + DEFAULT_SYSTEM
    + "<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = (
    "### Image Description:\n### Rationales:\n### Let's think step by step.\n### Step 1:\n### Step 2:\n"
    "### Step 3:\n### The final answer is: ",
    "You are a helpful assistant. system user assistant",
    "How many squares are there in the image? What colour is the shape? Answer the question.",
    "The image shows a red square, a green circle and a blue triangle on a white background.",
    "Count the objects: there are 1 2 3 4 5 6 7 8 9 0 of them, so the answer is 3.",
    "the area of the triangle is half the base times the height, angle, length, value, total",
)


BytePairs = tuple[tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]
"""A byte-level BPE as ``(vocab, merges)``: (token, id) pairs by id, and the merges in order."""


def train_byte_bpe(corpus: Iterable[str], vocab_size: int) -> BytePairs:
    """Train a byte-level BPE on ``corpus`` (deterministic for a given corpus and size).

    Args:
        corpus: The texts, in order.
        vocab_size: Target size before the special tokens (the 256 byte symbols are always present).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(list(corpus), trainer)
    model = json.loads(tokenizer.to_str())["model"]
    merges = tuple(tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"])
    vocab = tuple(sorted(model["vocab"].items(), key=lambda item: item[1]))
    return vocab, merges  # type: ignore[return-value]


@functools.cache
def trained_bpe(vocab_size: int = 512) -> BytePairs:
    """A byte-level BPE trained on the built-in corpus (cached)."""
    return train_byte_bpe(list(_CORPUS) * 4, vocab_size)


def qwen_tokenizer(vocab: Sequence[tuple[str, int]], merges: Sequence[tuple[str, str]]) -> Any:
    """A ``Qwen2Tokenizer`` of this BPE plus Qwen's special tokens (EOS ``<|im_end|>``) after its ids."""
    from transformers import Qwen2Tokenizer

    ids = dict(vocab)
    ids.update({token: len(vocab) + i for i, token in enumerate(SPECIAL_TOKENS)})
    return Qwen2Tokenizer(
        vocab=ids,
        merges=[tuple(m) for m in merges],
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )


def tiny_tokenizer(vocab_size: int = 512) -> Any:
    """:func:`qwen_tokenizer` of :func:`trained_bpe`."""
    return qwen_tokenizer(*trained_bpe(vocab_size))


def tiny_processor(min_pixels: int = 64, max_pixels: int = 32 * 32) -> Any:
    """A ``Qwen2VLProcessor`` (4-px patches, 2×2 merge) over :func:`tiny_tokenizer`, pixels bounded."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    geometry = {"patch_size": PATCH, "temporal_patch_size": TEMPORAL, "merge_size": MERGE}
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, **geometry),
        video_processor=Qwen2VLVideoProcessor(size=size, **geometry),
        tokenizer=tiny_tokenizer(),
        chat_template=CHAT_TEMPLATE,
    )
