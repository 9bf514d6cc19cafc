"""The tiny Qwen2.5-VL / Qwen2-VL: a text policy, a reward judge and Qwen-Image's text encoder."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


# -- Qwen2.5-VL / Qwen2-VL ------------------------------------------------------------------------
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PATCH, MERGE, TEMPORAL = 4, 2, 2  # vision patch size, spatial merge, temporal patch (images repeat ×2)


def tiny_qwen_tokenizer() -> Any:
    """A byte-level ``Qwen2Tokenizer`` (tokenizers backend) with the Qwen chat and vision special tokens."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {symbol: i for i, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    vocab.update({token: len(vocab) + i for i, token in enumerate(SPECIAL_TOKENS)})
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )


def tiny_vlm_processor(max_pixels: int = 32 * 32) -> Any:
    """A ``Qwen2VLProcessor`` for the tiny model: 4-px patches, 2×2 merge, images ≤ ``max_pixels``."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    geometry = {"patch_size": PATCH, "temporal_patch_size": TEMPORAL, "merge_size": MERGE}
    size = {"shortest_edge": (PATCH * MERGE) ** 2, "longest_edge": max_pixels}
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, **geometry),
        video_processor=Qwen2VLVideoProcessor(size=size, **geometry),
        tokenizer=tiny_qwen_tokenizer(),
        chat_template=CHAT_TEMPLATE,
    )


def tiny_vlm(processor: Any, kind: str = "qwen2_5_vl", hidden_size: int = 32, seed: int = 0) -> Any:
    """A random Qwen2.5-VL (``kind="qwen2_5_vl"``) or Qwen2-VL (``"qwen2_vl"``) matching ``processor``.

    Args:
        processor: From :func:`tiny_vlm_processor` (supplies the vocabulary and special-token ids).
        kind: Model family.
        hidden_size: Text width (4 heads, 2 KV heads, 2 layers).
        seed: Initialisation seed.

    Returns:
        The model in eval mode.

    Raises:
        ValueError: If ``kind`` is unknown.
    """
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    families = {
        "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
        "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
    }
    if kind not in families:
        raise ValueError(f"unknown tiny VLM kind {kind!r}; use one of {sorted(families)}.")
    tokenizer = processor.tokenizer
    ids, special = special_token_ids(tokenizer)
    head_dim = hidden_size // 4
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [head_dim // 8, head_dim // 8, head_dim // 4],
        },
        tie_word_embeddings=True,
        **special,
    )
    vision = dict(
        depth=2, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL
    )
    if kind == "qwen2_5_vl":
        vision.update(
            hidden_size=16, intermediate_size=32, out_hidden_size=hidden_size, window_size=2 * PATCH * MERGE
        )
        vision["fullatt_block_indexes"] = [1]
    else:
        vision.update(embed_dim=16, hidden_size=hidden_size, mlp_ratio=2)
    config_cls, model_cls = families[kind]
    return qwen_vl_model(config_cls, model_cls, text, vision, (ids, special), seed)


def special_token_ids(tokenizer: Any) -> tuple[dict[str, int], dict[str, int]]:
    """The ids of Qwen's special tokens in ``tokenizer``, and the bos / eos / pad ids a config takes."""
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    special = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]}
    special["pad_token_id"] = ids["<|endoftext|>"]
    return ids, special


def qwen_vl_model(
    config_cls: Any,
    model_cls: Any,
    text: dict[str, Any],
    vision: dict[str, Any],
    token_ids: tuple[dict[str, int], dict[str, int]],
    seed: int,
) -> Any:
    """A randomly initialised Qwen VL model (seeded) of these text and vision settings, its special tokens
    those of ``token_ids`` (:func:`special_token_ids`), word embeddings tied."""
    ids, special = token_ids
    config = config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        **special,
    )
    torch.manual_seed(seed)
    return model_cls(config).eval()


def save_tiny_vlm(path: str | Path, kind: str = "qwen2_5_vl", seed: int = 0) -> Path:
    """Build the tiny processor + model and ``save_pretrained`` both to ``path``.

    Args:
        path: Output directory (created).
        kind: ``"qwen2_5_vl"`` or ``"qwen2_vl"``.
        seed: Initialisation seed.

    Returns:
        ``path`` as a :class:`~pathlib.Path`, loadable with ``local_files_only=True``.
    """
    path = Path(path)
    processor = tiny_vlm_processor()
    model = tiny_vlm(processor, kind=kind, seed=seed)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    log.debug("saved tiny %s (%d params) to %s", kind, sum(p.numel() for p in model.parameters()), path)
    return path
