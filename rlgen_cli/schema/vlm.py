"""Schema sections of the multimodal-LLM side (Qwen2-VL / Qwen2.5-VL): ``model.vlm`` and ``algo.token``.

They sit inside the shared ``ModelConfig`` / ``AlgoConfig`` so one ``rlgen train`` composes flow and
VLM runs alike (``model=tiny_qwen2_vl algo=step_grpo``); flow recipes ignore them. ``algo.token`` holds
the options of both token-level recipes: ``vlm_rl`` (token GRPO / StepGRPO) and ``vlm_sft`` (warm-up).
Defaults follow R1-VL (Zhang et al. 2025) and TRL's ``GRPOConfig``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Annotated, Any

from rlgen_cli.errors import UserError, require
from rlgen_cli.schema.choices import (
    LrSchedule,
    PromptFormat,
    StdEstimator,
    TokenEngine,
    TokenImportance,
    TokenLoss,
    TokenOldLogprobs,
    TokenRewardScaling,
)
from rlgen_cli.schema.families import families
from rlgen_cli.schema.ranges import BELOW_ONE, COUNT, FRACTION, NON_NEGATIVE, POSITIVE, at_least
from rlgen_cli.schema.unread import require_defaults, shown

VLM_FAMILIES = families("vlm")
"""The vision-language families (``kind=vlm`` rows of ``schema/families.py``)."""
REFLECTION_MARKERS = [
    "### Reflection",
    "Reflection:",
    "Wait,",
    "Let me re-examine",
    "Let me reconsider",
    "Upon reflection",
    "re-evaluate",
]


def vllm_installed() -> bool:
    """True when the ``vllm`` package can be found (it is not imported: that would initialise CUDA)."""
    return importlib.util.find_spec("vllm") is not None


@dataclass
class VLMOptions:
    min_pixels: Annotated[int, COUNT] = 3136
    """Processor lower bound on image pixels (Qwen2-VL: 4·28·28)."""
    max_pixels: Annotated[int, COUNT] = 400000
    """Processor upper bound on image pixels (R1-VL: 400000)."""
    max_context: Annotated[int, at_least(16)] = 4096
    """Prompt + image tokens + completion must fit; longer prompts fail early (never truncated)."""
    completion_cap: Annotated[int | None, COUNT] = None
    """Upper bound on generated tokens for this model: rollouts use min(algo.token.max_completion_tokens,
    cap) (logged). Tiny random models set a small cap so CPU runs take seconds; null = no cap."""
    prompt_format: Annotated[str, PromptFormat] = "plain"
    """``plain``: the question as given (R1-VL-10K problems, MathVista queries); ``mulberry``: prefix the
    Mulberry / R1-VL step-format instructions (### Image Description … ### The final answer is:)."""
    system_prompt: str | None = None
    """A system message before each prompt; null = the chat template's default."""
    freeze_vision: bool = False
    """Full fine-tuning: keep the vision tower frozen. LoRA never targets the vision tower."""
    eval_max_new_tokens: Annotated[int, COUNT] = 1024
    """Completion budget of ``rlgen eval``."""
    eval_temperature: Annotated[float, NON_NEGATIVE] = 0.01
    """Near-greedy evaluation decoding (Qwen2-VL's generation config: 0.01 / top-p 0.001 / top-k 1)."""
    eval_top_p: Annotated[float, FRACTION] = 0.001
    """Nucleus (top-p) of evaluation decoding."""
    eval_top_k: Annotated[int, NON_NEGATIVE] = 1
    """Top-k of evaluation decoding (0 = no top-k filtering)."""

    def __post_init__(self) -> None:
        if self.min_pixels > self.max_pixels:
            raise UserError(
                f"model.vlm.min_pixels ({self.min_pixels}) must be ≤ model.vlm.max_pixels ({self.max_pixels})"
            )


@dataclass
class TokenScheduleOptions:
    """The learning-rate schedule of the VLM recipes (token GRPO and SFT)."""

    warmup_ratio: Annotated[float, BELOW_ONE] = 0.0
    """Fraction of optimizer steps of linear learning-rate warm-up (R1-VL SFT: 0.03)."""
    lr_schedule: Annotated[str, LrSchedule] = "constant"
    """After warm-up: constant | cosine | linear decay to 0 (R1-VL SFT: cosine)."""


@dataclass
class TokenSftOptions(TokenScheduleOptions):
    """``recipe=vlm_sft``: the schedule and which samples the warm-up drops."""

    sft_drop_markers: list[str] = field(default_factory=lambda: list(REFLECTION_MARKERS))
    """Drop samples whose assistant turns contain any marker (R1-VL removed Mulberry's reflective data);
    empty = keep all."""


@dataclass
class TokenGRPOOptions(TokenScheduleOptions):
    """``recipe=vlm_rl``: rollouts, the token objective and the schedule."""

    loss_type: Annotated[str, TokenLoss] = "grpo"
    """Loss aggregation: grpo (per-sequence token mean) | bnpo | dr_grpo | dapo."""
    importance_level: Annotated[str, TokenImportance] = "token"
    """Importance ratio per token or per sequence (GSPO-style)."""
    epsilon_high: Annotated[float | None, POSITIVE] = None
    """Upper clip ε (DAPO's clip-higher); null = clip_range."""
    scale_rewards: Annotated[str, TokenRewardScaling] = "group"
    """Advantage std: per group, over the batch, or none."""
    std_estimator: Annotated[str, StdEstimator] = "unbiased"
    """Advantage std estimator: ``unbiased`` (÷ (n − 1), ``torch.std``: R1-VL's trainer and TRL) or
    ``population`` (÷ n, rlgen's flow-side choice); eps 1e-4 either way."""
    temperature: Annotated[float, NON_NEGATIVE] = 1.2
    """Rollout sampling temperature, > 0 (log-probs are always taken at temperature 1); 0 (greedy) is
    refused: a group's completions would be identical, every advantage 0."""
    top_p: Annotated[float, FRACTION] = 1.0
    """Nucleus (top-p) of rollout sampling; 1 = off."""
    top_k: Annotated[int, NON_NEGATIVE] = 0
    """0 = no top-k filtering (generate's default of 50 is overridden explicitly)."""
    max_completion_tokens: Annotated[int, COUNT] = 1024
    """Most tokens a rollout completion generates (``model.vlm.completion_cap`` may lower it)."""
    num_iterations: Annotated[int, COUNT] = 1
    """Updates per rollout batch (μ in GRPO)."""
    old_logprobs: Annotated[str, TokenOldLogprobs] = "recompute"
    """π_old: ``recompute`` = the training forward on the rollout batch right after generation (ratio
    exactly 1 on the first inner epoch); ``sampler`` = generate()'s raw logits (KV-cache numerics differ
    by ≤ 1e-6 in fp32; ``rlgen check-onpolicy`` measures the gap)."""
    engine: Annotated[str, TokenEngine] = "hf"
    """Rollout engine: ``hf`` = transformers ``generate`` on the training model; ``vllm`` = a vLLM engine
    colocated on the same GPU (``pip install vllm``, CUDA), the training weights pushed into it before each
    rollout that follows an optimizer step. π_old is recomputed by the training model either way."""
    vllm_gpu_memory_utilization: Annotated[float, FRACTION] = 0.3
    """``engine=vllm``: fraction of the GPU's memory vLLM takes (weights + KV cache); training needs the rest."""
    mask_truncated_completions: bool = False
    """Completions that hit max_completion_tokens without EOS get no loss (TRL's option)."""
    use_bias_correction_kl: bool = False
    """Weight each token's KL by its importance ratio (not detached), as TRL ≥ 1.16's option of that name
    (its default, on in ``algo=token_grpo``): an unbiased reverse-KL gradient from π_old's samples. Off =
    the k3 KL alone, as R1-VL's trl 0.14 and earlier TRL; it changes the gradient only when β > 0."""

    def __post_init__(self) -> None:
        require(
            self.temperature > 0,
            "algo.token.temperature=0 samples greedily: a group's completions are identical, every advantage "
            "is 0 and nothing trains (top_p / top_k unread too); set a temperature > 0 (R1-VL: 1.0)",
        )
        if self.engine == "vllm":
            if not vllm_installed():
                raise UserError(
                    "algo.token.engine=vllm but vLLM is not installed: pip install vllm (Linux + CUDA GPU; see "
                    "docs/vlm.md), or use algo.token.engine=hf"
                )
            if self.old_logprobs != "recompute":
                raise UserError(
                    "algo.token.engine=vllm needs algo.token.old_logprobs=recompute: π_old is always recomputed "
                    "by the training model, never taken from vLLM"
                )


_ONE_ANSWER = (
    "evaluates one near-greedy answer per test question (accuracy on the first data.eval_num_prompts "
    "questions of data.test): for more questions set data.eval_num_prompts"
)
_SFT_PASS = (
    "an SFT epoch is one shuffled pass over the kept conversations of data.train in micro-batches of "
    "algo.train_batch_size, algo.gradient_accumulation_steps of them per optimizer step"
)
UNREAD_SETTINGS: dict[str, dict[str, str]] = {
    "vlm_rl": {
        "algo.global_std": "it is the flow recipes' choice between each group's and the whole batch's reward "
        "std; token GRPO normalises its advantages as algo.token.scale_rewards says: set "
        "algo.token.scale_rewards=group (each prompt's group), batch (the whole batch) or none instead",
        "algo.std_estimator": "it is the flow recipes' advantage std estimator; token GRPO's is "
        "algo.token.std_estimator: set algo.token.std_estimator=unbiased (÷ (n − 1)) or population (÷ n) "
        "instead",
        "data.eval_images_per_prompt": f"it is the flow recipes' images per test prompt; token GRPO {_ONE_ANSWER}",
    },
    "vlm_sft": {
        "algo.group_size": f"it is the RL recipes' completions per prompt, and SFT samples none: {_SFT_PASS}",
        "algo.prompts_per_epoch": f"it is the RL recipes' prompts per epoch: {_SFT_PASS} (fewer samples per "
        "epoch: a shorter data.train)",
        "algo.sample_batch_size": "it is the RL recipes' rollout batch; SFT samples no rollouts, and its "
        "evaluation answers in batches of algo.train_batch_size",
        "data.eval_images_per_prompt": f"it is the flow recipes' images per test prompt; SFT {_ONE_ANSWER}",
    },
}
"""Per VLM recipe: the settings every run of it composes (``algo``'s shared batch geometry and advantage
keys, ``data``) that it never reads → what they are elsewhere and what to set instead."""


def refuse_unread_settings(cfg: Any) -> None:
    """A setting of :data:`UNREAD_SETTINGS` for ``cfg.recipe`` (``vlm_rl``, ``vlm_sft``) at a value other
    than its schema's default would silently do nothing: refused, naming what to set instead (the recipe
    schemas' ``__post_init__``, so at validation).

    Raises:
        UserError: Naming the first such setting, why it does nothing and what to set instead.
    """
    for key, why in UNREAD_SETTINGS.get(cfg.recipe, {}).items():
        section_name, name = key.split(".")
        section = getattr(cfg, section_name)
        require_defaults(
            section,
            type(section),
            (name,),
            lambda _, value, default, key=key, why=why: (
                f"{key}={shown(value)} does nothing with recipe={cfg.recipe}: {why}. Drop {key} (back to its "
                f"default, {shown(default)})"
            ),
        )
