"""A tiny text policy that writes R3's formats, for tests that need well-formed completions.

A random model never closes a ``<think>`` block, so every text reward is 0 and the text track has no
signal. Upstream R3 starts from a model fine-tuned on its formats; this does the same to the tiny
Qwen2.5-VL in a few seconds: full fine-tuning on the reason prompt's completions ``plans`` (equal
weight). With the one plan (the default), sampled at temperature 1 it closes its plan most of the time,
not always: reason groups mix well-formed and malformed texts. With a well-formed and a bare plan it
opens with either about half the time and then writes that plan: one early choice decides the format.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from rlgen_cli.r3.prompts import REASON_SYSTEM, reason_user

PLAN = "<think>a cat</think>"
PROMPT = "a photo of a cat"


def _chat(processor, system: str, user: str, image: bool) -> str:
    content = [{"type": "image"}] * image + [{"type": "text", "text": user}]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def warm_started_text_policy(
    directory: Path, plans: Sequence[str] = (PLAN,), steps: int = 100, seed: int = 0
) -> Path:
    """Fine-tune the tiny Qwen2.5-VL to answer the reason prompt of ``PROMPT`` with ``plans`` and
    ``save_pretrained`` it (with its processor)."""
    from rlgen_cli.models.tiny import tiny_vlm
    from rlgen_cli.vlm.tokenizer import tiny_processor

    processor = tiny_processor(min_pixels=64, max_pixels=1024)
    model = tiny_vlm(processor, kind="qwen2_5_vl", seed=seed).train(False)
    prompt = _chat(processor, REASON_SYSTEM, reason_user(PROMPT), False)
    processor.tokenizer.padding_side = "right"  # every row starts with the same prompt
    texts = [prompt + plan + "<|im_end|>" for plan in plans]
    encoded = processor(text=texts, return_tensors="pt", padding=True)
    labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)
    labels[:, : len(processor(text=[prompt]).input_ids[0])] = -100  # loss on the completions only
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(**encoded, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
