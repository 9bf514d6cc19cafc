"""Rollout and the training-path log-probabilities of a Qwen-VL policy.

* :func:`generate` — batched ``model.generate`` with the KV cache, explicit sampling options
  (temperature, top-p, top-k — generate's implicit top-k 50 and the checkpoint's near-greedy
  generation config are both overridden), stop at ``<|im_end|>`` / ``<|endoftext|>``, vision tokens
  suppressed, and per-token log-probs of the sampled tokens from the *raw* logits (before the
  temperature, top-k / top-p and suppression processors; from ``output_logits`` for a small model,
  step by step beyond :data:`RECORD_ALL_BYTES`: ``vlm/sampler_logprobs.py``), put through the training
  transform — temperature 1, vision tokens out of the softmax — so they are the trainer's quantity,
  computed by the sampler (``rlgen check-onpolicy`` compares the two).
* :func:`check_context` — prompt + image tokens + completion budget must fit the context: prompts are
  never truncated (that cuts image tokens; TRL's advice), a too-long sample fails early with a
  :class:`UserError` naming the sample and the fix.
* :func:`collate` / :func:`completion_logprobs` — the one training layout (left-padded prompt, then the
  completion, right-padded) and its per-token log-probs at temperature 1 with the same vision-token
  mask; π_old, π_ref and π_θ are all computed through it, so the first update is exactly on-policy.

GRPO: Shao et al. 2024 (DeepSeekMath); StepGRPO: R1-VL, Zhang et al. 2025; layout and pitfalls as TRL.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from rlgen_cli.data.images import read_rgb
from rlgen_cli.errors import UserError
from rlgen_cli.vlm.policy import VLMPolicy
from rlgen_cli.vlm.sampler_logprobs import SamplerLogprobs

__all__ = [
    "Completions",
    "SamplingOptions",
    "TokenBatch",
    "check_context",
    "collate",
    "completion_logprobs",
    "encode_prompts",
    "generate",
    "generation_config",
    "load_image",
    "load_images",
    "pad_stack",
]

IMAGE_TOKEN = "<|image_pad|>"


@dataclass(frozen=True)
class SamplingOptions:
    """Decoding options, always passed explicitly to ``generate``."""

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int


@dataclass
class Completions:
    """Sampled completions of one batch.

    Attributes:
        ids: Per sample, the completion token ids (L_i,), including the stop token when one was sampled.
        truncated: Per sample, True when ``max_new_tokens`` ran out before a stop token.
        logprobs: Per sample, (L_i,) log-probs of the sampled tokens under the raw logits (or None).
    """

    ids: list[Tensor]
    truncated: list[bool]
    logprobs: list[Tensor] | None


@dataclass
class TokenBatch:
    """The training layout of B samples: model inputs plus the completion grid.

    Attributes:
        inputs: Model kwargs: ``input_ids`` (B, P + L), ``attention_mask``, ``mm_token_type_ids`` and, with
            images, ``pixel_values`` / ``image_grid_thw``.
        completion_ids: (B, L) completion tokens, padded with the pad id.
        completion_mask: (B, L) 1 on real completion tokens.
    """

    inputs: dict[str, Tensor]
    completion_ids: Tensor
    completion_mask: Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())


def load_image(path: Path | None) -> Image.Image | None:
    """An RGB image, upright and 8-bit (``data/images.py: read_rgb``: RGBA / palette converted, EXIF
    orientation applied, 16-bit and float pixels rescaled), or None for a text-only prompt."""
    if path is None:
        return None
    return read_rgb(path)


def load_images(paths: Sequence[Path | None]) -> list[Image.Image | None]:
    """:func:`load_image` of each path, every file read once: the rows of a path share one image object,
    which is how :func:`encode_prompts` knows a group's copies of a prompt for the same."""
    loaded: dict[Path, Image.Image | None] = {}
    for path in paths:
        if path is not None and path not in loaded:
            loaded[path] = load_image(path)
    return [None if path is None else loaded[path] for path in paths]


def encode_prompts(
    policy: VLMPolicy,
    prompts: Sequence[str],
    images: Sequence[Image.Image | None],
    device: torch.device | None = None,
) -> dict:
    """Processor outputs for chat-templated ``prompts`` (left-padded, images expanded), on ``device``
    (default: the policy's)."""
    tokenizer = policy.tokenizer
    tokenizer.padding_side = "left"
    present = [image for image in images if image is not None]
    if present and len(present) != len(images):
        raise UserError("a batch mixes prompts with and without images; keep one kind per dataset")
    rows, firsts = distinct_rows(prompts, images)
    encoded = policy.processor(
        text=[prompts[i] for i in firsts],
        images=[images[i] for i in firsts] if present else None,
        return_tensors="pt",
        padding=True,
    )
    if len(firsts) < len(rows):
        encoded = repeated_rows(dict(encoded), rows)
    return {key: value.to(device or policy.device) for key, value in encoded.items()}


def distinct_rows(
    prompts: Sequence[str], images: Sequence[Image.Image | None]
) -> tuple[list[int], list[int]]:
    """``(rows, firsts)``: each row's index among the distinct (prompt, image object) pairs, and the row
    where each distinct pair first appears. A GRPO batch holds every prompt ``group_size`` times; encoding
    each once is exact, since a row's encoding depends on its own text and image alone (and on the
    longest row for the left padding, which is among the distinct ones)."""
    index: dict[tuple[str, int], int] = {}
    rows, firsts = [], []
    for row, key in enumerate(zip(prompts, map(id, images), strict=True)):
        if key not in index:
            index[key] = len(firsts)
            firsts.append(row)
        rows.append(index[key])
    return rows, firsts


ROW_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
"""Processor outputs with one row per prompt."""


def repeated_rows(encoded: dict[str, Tensor], rows: Sequence[int]) -> dict[str, Tensor]:
    """The processor outputs of the distinct prompts laid out as ``rows``: per-prompt tensors indexed by
    row; the images' patches (``pixel_values``, one block of ``t·h·w`` rows per image, concatenated) and
    their grids repeated likewise.

    Raises:
        ValueError: For an output this layout does not know (another processor's), rather than guess it.
    """
    unknown = set(encoded) - {*ROW_KEYS, "pixel_values", "image_grid_thw"}
    if unknown:
        raise ValueError(f"encode_prompts: cannot repeat processor outputs {sorted(unknown)} by row")
    index = torch.tensor(rows)
    out = {key: value[index] for key, value in encoded.items() if key in ROW_KEYS}
    if "pixel_values" in encoded:
        grids = encoded["image_grid_thw"]
        blocks = encoded["pixel_values"].split(grids.prod(-1).tolist())
        out["pixel_values"] = torch.cat([blocks[row] for row in rows])
        out["image_grid_thw"] = grids[index]
    return out


def check_context(policy: VLMPolicy, encoded: dict, max_new_tokens: int, labels: Sequence[Any]) -> None:
    """Fail before generating when a prompt (with its image tokens) + the completion budget won't fit.

    Raises:
        UserError: Naming the sample (``labels[i]``), its token counts and the settings to change.
    """
    limit = min(policy.cfg.vlm.max_context, policy.max_positions)
    lengths = encoded["attention_mask"].sum(-1).tolist()
    image_id = policy.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    for i, length in enumerate(lengths):
        if length + max_new_tokens > limit:
            image_tokens = int((encoded["input_ids"][i] == image_id).sum())
            raise UserError(
                f"sample {labels[i]}: prompt is {length} tokens ({image_tokens} of them image tokens) + "
                f"{max_new_tokens} completion tokens = {length + max_new_tokens} > context {limit} "
                f"(model.vlm.max_context={policy.cfg.vlm.max_context}, model positions {policy.max_positions}); "
                "prompts are never truncated (that would cut image tokens): raise model.vlm.max_context, "
                "lower model.vlm.max_pixels or the completion budget, or drop the sample"
            )


def masked_log_softmax_gather(logits: Tensor, ids: Tensor, suppressed: Sequence[int]) -> Tensor:
    """log softmax(logits with ``suppressed`` columns at −inf) at ``ids``; (B, L, V), (B, L) → (B, L).

    In chunks of rows whose float32 copy fits :data:`CHUNK_BYTES` (at least one row): a real vocabulary
    keeps one (L, V) copy alive at a time, small ones take the batch in a few calls instead of one per row.
    """
    columns = torch.tensor(list(suppressed), device=logits.device, dtype=torch.long)
    row_bytes = logits.shape[1] * logits.shape[2] * 4
    step = max(1, CHUNK_BYTES // max(row_bytes, 1))
    parts = []
    for start in range(0, logits.shape[0], step):
        chunk = logits[start : start + step].float()
        if columns.numel():
            chunk = chunk.index_fill(-1, columns, float("-inf"))
        picked = chunk.gather(-1, ids[start : start + step].unsqueeze(-1)).squeeze(-1)
        parts.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(parts)


CHUNK_BYTES = 64 << 20
"""Float32 logits :func:`masked_log_softmax_gather` converts at a time (64 MiB), beyond one row."""


def generation_config(policy: VLMPolicy, options: SamplingOptions, record: bool) -> Any:
    """Every sampling option explicit (overrides generate's top-k 50 and the checkpoint's own config)."""
    from transformers import GenerationConfig

    sample = options.temperature > 0
    return GenerationConfig(
        do_sample=sample,
        temperature=options.temperature if sample else None,
        top_p=options.top_p if sample else None,
        top_k=options.top_k if sample else None,
        max_new_tokens=options.max_new_tokens,
        eos_token_id=policy.stop_ids,
        pad_token_id=policy.tokenizer.pad_token_id,
        suppress_tokens=policy.suppressed_ids or None,
        output_logits=record,
        return_dict_in_generate=True,
        use_cache=True,
    )


@torch.no_grad()
def generate(
    policy: VLMPolicy, encoded: dict, options: SamplingOptions, seed: int, record_logprobs: bool = True
) -> Completions:
    """Sample one completion per prompt of ``encoded`` (from :func:`encode_prompts`).

    Args:
        policy: The policy.
        encoded: Left-padded processor outputs on the device.
        options: Decoding options.
        seed: Seeds torch's RNG for this call only (the global RNG state is restored afterwards).
        record_logprobs: Also return the sampled tokens' log-probs from the raw logits.
    """
    from transformers import StoppingCriteriaList

    rows = encoded["input_ids"].shape[0]
    streamed = record_logprobs and not whole_record_fits(policy, rows, options.max_new_tokens)
    config = generation_config(policy, options, record=record_logprobs and not streamed)
    recorder = SamplerLogprobs(policy.suppressed_ids) if streamed else None
    criteria = StoppingCriteriaList([] if recorder is None else [recorder])
    devices = [policy.device] if policy.device.type == "cuda" else []
    recording = contextlib.nullcontext() if recorder is None else recorder.hooked(policy.model)
    with torch.random.fork_rng(devices=devices), policy.autocast(), recording:
        torch.manual_seed(seed)
        out = policy.model.generate(**encoded, generation_config=config, stopping_criteria=criteria)
    generated = out.sequences[:, encoded["input_ids"].shape[1] :]  # (B, L_max)
    stops = torch.isin(generated, torch.tensor(policy.stop_ids, device=generated.device))
    ends, truncated = [], []
    for row in stops:
        hits = row.nonzero()
        ends.append(int(hits[0]) + 1 if hits.numel() else row.numel())
        truncated.append(not hits.numel())
    ids = [generated[i, :end].cpu() for i, end in enumerate(ends)]
    logprobs = None
    if record_logprobs:  # raw logits: temperature 1, no filtering
        if recorder is not None:
            lp = recorder.result(generated.shape[1]).cpu()
        else:  # output_logits: L_max × (B, V)
            lp = masked_log_softmax_gather(torch.stack(out.logits, 1), generated, policy.suppressed_ids).cpu()
        logprobs = [lp[i, :end] for i, end in enumerate(ends)]
    return Completions(ids=ids, truncated=truncated, logprobs=logprobs)


RECORD_ALL_BYTES = 64 << 20
"""Up to this many bytes of float32 logits (rows × max_new_tokens × vocabulary), :func:`generate` records
the sampler's log-probs from ``generate``'s own ``output_logits``, read in one batched pass: the fewest
small ops for a small model. Beyond it — every real Qwen-VL rollout: one row of 128 tokens over the
151 936-token vocabulary is 78 MB — step by step (``vlm/sampler_logprobs.py``), holding one step."""


def whole_record_fits(policy: VLMPolicy, rows: int, max_new_tokens: int) -> bool:
    """Whether ``output_logits`` of ``rows`` completions of up to ``max_new_tokens`` stays within
    :data:`RECORD_ALL_BYTES`."""
    vocabulary = policy.model.get_output_embeddings().weight.shape[0]
    return rows * max_new_tokens * vocabulary * 4 <= RECORD_ALL_BYTES


def pad_stack(rows: Sequence[Tensor], length: int | None = None, value: float = 0.0) -> Tensor:
    """Right-pad 1-D tensors to ``length`` (default: the longest) and stack them: (B, L)."""
    length = length if length is not None else max(int(r.numel()) for r in rows)
    out = torch.full((len(rows), length), value, dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def collate(
    policy: VLMPolicy,
    prompts: Sequence[str],
    images: Sequence[Image.Image | None],
    completions: Sequence[Tensor],
) -> TokenBatch:
    """The training layout: left-padded prompts (as :func:`encode_prompts`), then right-padded completions."""
    encoded = encode_prompts(policy, prompts, images)
    pad = policy.tokenizer.pad_token_id
    ids = pad_stack([c.long() for c in completions], value=pad).to(policy.device)  # (B, L)
    mask = pad_stack([torch.ones(c.numel(), dtype=torch.long) for c in completions]).to(policy.device)
    inputs = dict(encoded)
    inputs["input_ids"] = torch.cat([encoded["input_ids"], ids], dim=1)
    inputs["attention_mask"] = torch.cat([encoded["attention_mask"], mask], dim=1)
    if "mm_token_type_ids" in encoded:  # completion tokens are text (type 0) for M-RoPE
        inputs["mm_token_type_ids"] = torch.cat([encoded["mm_token_type_ids"], torch.zeros_like(ids)], dim=1)
    return TokenBatch(inputs=inputs, completion_ids=ids, completion_mask=mask)


def completion_logprobs(
    policy: VLMPolicy, batch: TokenBatch, model: Any = None, suppressed: Sequence[int] | None = None
) -> Tensor:
    """(B, L) log-probs of the completion tokens at temperature 1 (gradients if enabled).

    Args:
        policy: The policy (its :attr:`~VLMPolicy.train_model` unless ``model`` is given — π_old and π_θ
            take the same path, DDP wrapper included; its vision-token mask and autocast).
        batch: From :func:`collate`.
        model: Another model to score with (the frozen reference).
        suppressed: Vocabulary columns left out of the softmax; None = the policy's vision tokens (what
            training uses). ``()`` normalises over the whole vocabulary, as vLLM's raw log-probs do.
    """
    length = batch.completion_ids.shape[1]
    with policy.autocast():
        out = (model or policy.train_model)(**batch.inputs, logits_to_keep=length + 1, use_cache=False)
    columns = policy.suppressed_ids if suppressed is None else suppressed
    return masked_log_softmax_gather(out.logits[:, :-1], batch.completion_ids, columns)
