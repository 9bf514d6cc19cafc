"""Offline tokenizers for the tiny model variants, built from in-memory vocabularies.

The vocabularies are character level: every printable ASCII character is a token, so any prompt
tokenises without a download. Real models load their own tokenizers with the pipeline.
"""

from __future__ import annotations

import string

_CHARS = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]


def tiny_clip_tokenizer(max_length: int = 77):  # -> transformers.CLIPTokenizer
    """A CLIP BPE tokenizer over single characters (plus the ``</w>`` end-of-word forms), no merges."""
    from transformers import CLIPTokenizer

    specials = ["<|startoftext|>", "<|endoftext|>"]
    tokens = specials + _CHARS + [f"{c}</w>" for c in _CHARS if c != " "]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def tiny_t5_tokenizer(max_length: int = 256):  # -> transformers.T5Tokenizer
    """A T5 unigram tokenizer whose pieces are single characters (``▁`` marks a word start)."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -3.0) for c in _CHARS if c != " "]
    pieces += [(f"▁{c}", -2.5) for c in _CHARS if c != " "]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def vocab_size(tokenizer) -> int:
    """Number of ids the tokenizer can emit (embedding rows a tiny encoder needs)."""
    return len(tokenizer)
