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
from typing import Annotated, Literal

__all__ = [
    "AdvAggregation",
    "Branch",
    "CfgGrad",
    "Dtype",
    "EvalReportKind",
    "ExpertsTrain",
    "KlForm",
    "Launcher",
    "LogprobForm",
    "LogprobReduce",
    "LoraInit",
    "LrSchedule",
    "MixedPrecision",
    "Objective",
    "PrefLoss",
    "PretrainSource",
    "PromptFormat",
    "R3Dataset",
    "Recipe",
    "SdeKind",
    "SigmaSampling",
    "SlidingStrategy",
    "StdEstimator",
    "StepKind",
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
LoraInit = Literal["gaussian", "kaiming"]
"""peft ``init_lora_weights``: ``gaussian`` (upstream Flow-GRPO) or ``kaiming`` (peft's default, ``True``:
Kaiming-uniform A, zero B)."""
ExpertsTrain = Literal["both", "high_noise", "low_noise"]
"""Which expert of a two-expert family (Wan2.2 A14B) trains; the other stays frozen."""

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
StdEstimator = Literal["population", "unbiased"]
AdvAggregation = Literal["sum_then_normalize", "normalize_then_sum"]
LrSchedule = Literal["constant", "cosine", "linear"]
PrefLoss = Literal["dpo", "sft"]
PretrainSource = Literal["shapes"]
EvalReportKind = Literal["none", "shapes"]
"""``eval_report``: what a flow run writes from its evaluations at the end (``training/report.py``)."""
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
MixedPrecision = Literal["fp32", "fp16", "bf16"]
"""accelerate's mixed precision; ``fp32`` is accelerate's ``no`` (a YAML boolean when unquoted)."""


@functools.cache
def _hints(schema: type) -> dict[str, object]:
    return typing.get_type_hints(schema, include_extras=True)


def choices_of(schema: type, name: str) -> tuple[str, ...] | None:
    """The allowed values of field ``name`` of dataclass ``schema`` (None when it is not a choice)."""
    hint = _hints(schema).get(name)
    if typing.get_origin(hint) is not Annotated:
        return None
    for meta in hint.__metadata__:
        if typing.get_origin(meta) is Literal:
            return typing.get_args(meta)
    return None
