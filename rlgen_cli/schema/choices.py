"""The allowed values of every choice setting, each listed once, as a ``Literal`` type.

A schema field holding a choice is annotated ``Annotated[str, SomeChoice]``: OmegaConf sees a ``str``
(OmegaConf 2.3 does not take ``Literal`` fields), and :func:`choices_of` reads the ``Literal`` back, so
``schema/ranges.py``'s one pass over a composed config rejects a value outside it with the key and the
valid values (exit code 2). Code below the config boundary (``sde/``, ``algos/``) receives checked values
and asserts, it does not validate; ``typing.get_args(SomeChoice)`` is the list where one is needed.

No choice value reads as a YAML boolean (true/false/yes/no/on/off): unquoted, YAML would turn it into one.
"""

from __future__ import annotations

import functools
import typing
from typing import Annotated, Any, Literal

from rlgen_cli.schema.families import FAMILY_NAMES

__all__ = [
    "AdvAggregation",
    "Attention",
    "Branch",
    "CfgGrad",
    "Dtype",
    "EvalReportKind",
    "ExpertsTrain",
    "Family",
    "GuardAction",
    "KlForm",
    "Launcher",
    "LogprobForm",
    "LogprobReduce",
    "LoraInit",
    "LrSchedule",
    "MixedPrecision",
    "ModelWeights",
    "Objective",
    "PrefLoss",
    "PretrainSource",
    "PromptFormat",
    "R3Dataset",
    "RealSizeVariant",
    "Recipe",
    "RewardScoringMode",
    "SdeKind",
    "SigmaSampling",
    "SlidingStrategy",
    "StdEstimator",
    "StepKind",
    "TextEncoderSize",
    "TokenEngine",
    "TokenImportance",
    "TokenLoss",
    "TokenOldLogprobs",
    "TokenRewardScaling",
    "WandbMode",
    "WindowKind",
    "choices_of",
]

Dtype = Literal["float32", "float16", "bfloat16"]
Family = Literal[FAMILY_NAMES]  # type: ignore[valid-type]
"""``model.family``: the rows of ``schema/families.py``, the one table of model families."""
LoraInit = Literal["gaussian", "kaiming"]
"""peft ``init_lora_weights``: ``gaussian`` (upstream Flow-GRPO) or ``kaiming`` (peft's default, ``True``:
Kaiming-uniform A, zero B)."""
ExpertsTrain = Literal["both", "high_noise", "low_noise"]
"""Which expert of a two-expert family (Wan2.2 A14B) trains; the other stays frozen."""
Attention = Literal["sdpa", "eager"]
"""``model.attention``: PyTorch's ``scaled_dot_product_attention`` (fused kernels) or the explicit
softmax(QKᵀ/√d)·V (diffusers' ``_native_math`` backend; transformers' ``eager``); docs/memory_speed.md."""
ModelWeights = Literal["pretrained", "random_init"]
"""``model.weights``: load ``model.path``, or build ``model.variant``'s published architecture with random
weights (``models/real_size.py``)."""
RealSizeVariant = Literal[
    "auto",
    "sd3_5_medium",
    "sd3_5_large",
    "flux_1_dev",
    "flux_1_kontext_dev",
    "qwen_image",
    "qwen_image_edit",
    "wan2_1_t2v_1_3b",
    "wan2_1_t2v_14b",
    "qwen2_vl_2b",
    "qwen2_vl_7b",
    "qwen2_5_vl_3b",
    "qwen2_5_vl_7b",
    "bagel_7b_mot",
]
"""``model.variant``: the checkpoint ``model.weights=random_init`` builds (``schema/run.py:
REAL_SIZE_VARIANTS`` says which family builds which)."""
TextEncoderSize = Literal["real_size", "stand_in"]
"""``model.text_encoders``: a random-init flow model's text encoders as published, or narrow stand-ins."""

SdeKind = Literal["flow_sde", "dance", "cps"]
StepKind = Literal["ode", SdeKind]
LogprobReduce = Literal["mean", "sum"]
LogprobForm = Literal["gaussian", "upstream"]
KlForm = Literal["gaussian", "upstream"]

WindowKind = Literal["all", "random_window", "sliding", "random_subset", "single"]
SlidingStrategy = Literal["progressive", "random", "decay", "exp_decay"]

Recipe = Literal["flow_grpo", "flow_pref", "flow_pretrain", "flow_forward", "vlm_rl", "vlm_sft", "r3"]
Objective = Literal["grpo", "grpo_guard"]
Branch = Literal["independent", "shared_prefix"]
CfgGrad = Literal["conditional", "both"]
ShuffleSamples = Literal["none", "per_process"]
RewardScoringMode = Literal["auto", "thread", "inline"]
StdEstimator = Literal["population", "unbiased"]
AdvAggregation = Literal["sum_then_normalize", "normalize_then_sum", "gdpo"]
LrSchedule = Literal["constant", "cosine", "linear"]
PrefLoss = Literal["dpo", "sft"]
PretrainSource = Literal["shapes"]
EvalReportKind = Literal["none", "shapes"]
"""``eval_report``: what a flow run writes from its evaluations at the end (``training/reporting/report.py``)."""
TimeLimitCounts = Literal["wall", "training"]
"""``time_limit_counts``: which seconds ``time_limit_minutes`` counts (``recipes/session.py``)."""
LrScheduleClock = Literal["epochs", "time_or_epochs"]
"""``lr_schedule_clock``: what says where a run is in its lr schedule (``training/control/schedule.py``)."""
GuardAction = Literal["warn", "stop", "rollback"]
"""``guard.action``: what the reward-hacking guard does on a flagged evaluation (``training/control/hacking_guard.py``)."""
SigmaSampling = Literal["logit_normal", "uniform"]

TokenLoss = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
TokenImportance = Literal["token", "sequence"]
TokenRewardScaling = Literal["group", "batch", "none"]
TokenOldLogprobs = Literal["recompute", "sampler"]
TokenEngine = Literal["hf", "vllm"]
PromptFormat = Literal["plain", "mulberry"]

R3Dataset = Literal["geneval", "geneval_plus", "tiif"]

WandbMode = Literal["online", "offline", "disabled"]
Launcher = Literal["local", "accelerate", "deepspeed_zero2", "deepspeed_zero3", "fsdp", "multinode"]
ENGINE_LAUNCHERS = ("deepspeed_zero2", "deepspeed_zero3", "fsdp")
"""Launchers whose engine reduces, clips and steps the gradients itself and shards the optimizer state
(ZeRO-3 and FSDP the weights too)."""
MixedPrecision = Literal["fp32", "fp16", "bf16"]
"""accelerate's mixed precision; ``fp32`` is accelerate's ``no`` (a YAML boolean when unquoted)."""


@functools.cache
def _hints(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema, include_extras=True)


def choices_of(schema: type, name: str) -> tuple[str, ...] | None:
    """The allowed values of field ``name`` of dataclass ``schema`` (None when it is not a choice)."""
    hint = _hints(schema).get(name)
    if hint is None or typing.get_origin(hint) is not Annotated:
        return None
    for meta in hint.__metadata__:
        if typing.get_origin(meta) is Literal:
            return typing.get_args(meta)
    return None
