"""A tiny text policy that writes R3's formats, for tests that need well-formed completions.

A random model never closes a ``<think>`` block, so every text reward is 0 and the text track has no
signal. Upstream R3 starts from a model fine-tuned on its formats; this does the same to the tiny
Qwen2.5-VL in a few seconds: full fine-tuning on one plan for the reason prompt. Sampled at temperature 1
it then closes its plan most of the time, not always: reason groups mix well-formed and malformed texts.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlgen_cli.r3.prompts import REASON_SYSTEM, reason_user

PLAN = "<think>a cat</think>"


def _chat(processor, system: str, user: str, image: bool) -> str:
    content = [{"type": "image"}] * image + [{"type": "text", "text": user}]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def warm_started_text_policy(directory: Path, steps: int = 100, seed: int = 0) -> Path:
    """Fine-tune the tiny Qwen2.5-VL on the R3 formats and ``save_pretrained`` it (with its processor)."""
    from rlgen_cli.models.tiny import tiny_vlm
    from rlgen_cli.vlm.tokenizer import tiny_processor

    processor = tiny_processor(min_pixels=64, max_pixels=1024)
    model = tiny_vlm(processor, kind="qwen2_5_vl", seed=seed).train(False)
    prompt = _chat(processor, REASON_SYSTEM, reason_user("a photo of a cat"), False)
    encoded = processor(text=[prompt + PLAN + "<|im_end|>"], return_tensors="pt")
    labels = encoded["input_ids"].clone()
    labels[:, : len(processor(text=[prompt]).input_ids[0])] = -100  # loss on the completion only
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(**encoded, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
