"""The valid range of every numeric setting, and one pass that checks every setting with the key's full name.

Each schema dataclass lists its numeric fields in :data:`RANGES` (a field inherits the range of the class
that declares it); a choice field carries its allowed values in its annotation (``schema/choices.py``).
:func:`check_settings` walks a composed config section by section *before* the typed objects are built,
so a bad value stops the run with exit code 2 naming the key (``algo.lr must be > 0, got nan``,
``sampler.kind='sde' is not valid; choose one of ode, flow_sde, dance, cps``) instead of failing later,
deep in a recipe. The same pass rejects keys no schema declares: a ``+algo.lrr=1e-3`` typo is named with
the closest real key instead of landing silently in resolved.yaml.

Checks that involve several fields stay in each dataclass's ``__post_init__``; ``tests/schema/
test_ranges.py`` fails when a numeric field has no range here, so a new setting cannot skip the check.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from rlgen_cli.errors import UserError
from rlgen_cli.schema.algo import (
    AdvantageConfig,
    AlgoConfig,
    EMAConfig,
    FlashConfig,
    FlowForwardAlgoConfig,
    FlowGrpoAlgoConfig,
    PolicyGradientConfig,
    PrefConfig,
    PretrainConfig,
    SamplerConfig,
    TokenAlgoConfig,
    WindowConfig,
)
from rlgen_cli.schema.check import CheckConfig
from rlgen_cli.schema.choices import choices_of
from rlgen_cli.schema.forward import ForwardConfig, OldPolicyConfig
from rlgen_cli.schema.gardo import GardoConfig
from rlgen_cli.schema.hacking_guard import GuardConfig
from rlgen_cli.schema.plan import PlanOptions
from rlgen_cli.schema.r3 import R3Config
from rlgen_cli.schema.recipes import FlowRolloutRunConfig, FlowRunConfig
from rlgen_cli.schema.run import (
    DataConfig,
    EvalConfig,
    ExpertsConfig,
    FlowDataConfig,
    LauncherConfig,
    LoraConfig,
    ModelConfig,
    RewardConfig,
    RunConfig,
    SampleConfig,
)
from rlgen_cli.schema.serve import ServerConfig
from rlgen_cli.schema.vlm import TokenGRPOOptions, TokenScheduleOptions, VLMOptions

__all__ = ["RANGES", "Pattern", "Range", "check_settings"]


@dataclass(frozen=True)
class Range:
    """Finite numbers between ``low`` and ``high`` (each bound included unless ``*_open``)."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def admits(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        if self.low == -math.inf and self.high == math.inf:
            return "a finite number"
        if self.high == math.inf:
            return f"{'>' if self.low_open else '≥'} {_number(self.low)}"
        if self.low == -math.inf:
            return f"{'<' if self.high_open else '≤'} {_number(self.high)}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{_number(self.low)}, {_number(self.high)}{right}"


@dataclass(frozen=True)
class Pattern:
    """Strings matching ``regex`` in full; ``choices`` says which in words."""

    regex: str
    choices: str

    def admits(self, value: Any) -> bool:
        return isinstance(value, str) and re.fullmatch(self.regex, value) is not None

    def describe(self) -> str:
        return f"one of {self.choices}"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def at_least(n: int) -> Range:
    return Range(low=n)


ANY = Range()  # any finite number
POSITIVE = Range(low=0, low_open=True)
NON_NEGATIVE = Range(low=0)
COUNT = at_least(1)
PROBABILITY = Range(0, 1)
FRACTION = Range(0, 1, low_open=True)  # (0, 1]: a share that cannot be empty
BELOW_ONE = Range(0, 1, high_open=True)  # [0, 1): Adam betas, warm-up and dropout shares
PORT = Range(1, 65535)
DEVICE = Pattern(r"auto|cpu|mps|cuda(:\d+)?", "auto, cpu, cuda, cuda:N (N = GPU index), mps")

RANGES: dict[type, dict[str, Range | Pattern]] = {
    RunConfig: {
        "seed": NON_NEGATIVE, "epochs": COUNT, "eval_every": NON_NEGATIVE, "save_every": NON_NEGATIVE,
        "keep_last": COUNT, "device": DEVICE,
    },
    FlowRunConfig: {"time_limit_minutes": NON_NEGATIVE},
    GuardConfig: {
        "monitors": ANY, "window": COUNT, "margin": NON_NEGATIVE, "noise_k": NON_NEGATIVE, "rise_k": NON_NEGATIVE,
        "rollback_lr_scale": FRACTION, "rollback_kl_scale": at_least(1), "max_rollbacks": NON_NEGATIVE,
    },
    FlowRolloutRunConfig: {"images_every": NON_NEGATIVE},
    ModelConfig: {
        "tiny_seed": NON_NEGATIVE, "resolution": COUNT, "height": COUNT, "width": COUNT, "num_frames": COUNT,
        "guidance_scale": at_least(1), "image_guidance_scale": at_least(1), "shift": ANY, "num_steps": COUNT, "eval_num_steps": COUNT,
        "noise_level": NON_NEGATIVE, "max_sequence_length": COUNT, "prompt_cache_mb": NON_NEGATIVE,
    },
    LoraConfig: {"rank": COUNT, "alpha": POSITIVE},
    ExpertsConfig: {"guidance_scale_2": at_least(1)},
    VLMOptions: {
        "min_pixels": COUNT, "max_pixels": COUNT, "max_context": at_least(16), "completion_cap": COUNT,
        "eval_max_new_tokens": COUNT, "eval_temperature": NON_NEGATIVE, "eval_top_p": FRACTION,
        "eval_top_k": NON_NEGATIVE,
    },
    SamplerConfig: {"noise_level": NON_NEGATIVE},
    AlgoConfig: {
        "group_size": at_least(2), "prompts_per_epoch": COUNT, "sample_batch_size": COUNT,
        "train_batch_size": COUNT, "gradient_accumulation_steps": COUNT,
        "lr": POSITIVE, "lr_decay_start": BELOW_ONE, "lr_min_ratio": PROBABILITY, "lr_warmup_epochs": NON_NEGATIVE,
        "adam_beta1": BELOW_ONE, "adam_beta2": BELOW_ONE, "adam_eps": POSITIVE, "weight_decay": NON_NEGATIVE,
        "max_grad_norm": ANY,
    },
    AdvantageConfig: {"adv_eps": NON_NEGATIVE, "kl_weight": NON_NEGATIVE},
    PolicyGradientConfig: {"adv_clip_max": NON_NEGATIVE},
    FlowGrpoAlgoConfig: {
        "num_inner_epochs": COUNT, "clip_range": POSITIVE, "best_of_n": NON_NEGATIVE, "timesteps_per_pass": COUNT,
        "prompts_per_draw": COUNT,
    },
    GardoConfig: {  # the fractions' order (min ≤ start ≤ max < 1) is GardoConfig.__post_init__'s
        "gate_fraction": FRACTION, "gate_fraction_min": FRACTION, "gate_fraction_max": FRACTION,
        "gate_fraction_rate": NON_NEGATIVE, "gate_window": COUNT, "refresh_every": NON_NEGATIVE,
    },
    FlowForwardAlgoConfig: {"num_inner_epochs": COUNT},
    TokenAlgoConfig: {"clip_range": POSITIVE},
    WindowConfig: {
        "timestep_fraction": FRACTION, "size": NON_NEGATIVE, "range": NON_NEGATIVE, "stride": NON_NEGATIVE,
        "shift_every": COUNT, "end_offset": NON_NEGATIVE, "min_shift_every": COUNT, "max_shift_every": COUNT,
        "exp_decay_rate": NON_NEGATIVE, "exp_decay_start": NON_NEGATIVE, "max_index": COUNT,
    },
    FlashConfig: {"ratio": FRACTION},
    EMAConfig: {"decay": PROBABILITY, "update_every": COUNT},
    PrefConfig: {
        "dpo_beta": POSITIVE, "anchor_weight": NON_NEGATIVE, "ref_update_step": NON_NEGATIVE, "top_k": COUNT,
        "timesteps_per_sample": COUNT,
    },
    ForwardConfig: {
        "timestep_fraction": FRACTION, "num_timesteps": COUNT, "nft_beta": POSITIVE, "ghuber_power": POSITIVE,
        "advantage_max": POSITIVE, "old_weight": NON_NEGATIVE, "dgpo_beta": POSITIVE,
        "dgpo_clip_range": NON_NEGATIVE,
    },
    OldPolicyConfig: {"flat_steps": NON_NEGATIVE, "rate": NON_NEGATIVE, "max_decay": BELOW_ONE},
    PretrainConfig: {
        "steps_per_epoch": COUNT, "batch_size": COUNT, "cond_dropout": BELOW_ONE, "warmup_steps": NON_NEGATIVE,
        "min_lr_ratio": PROBABILITY,
    },
    TokenGRPOOptions: {
        "epsilon_high": POSITIVE, "temperature": NON_NEGATIVE, "top_p": FRACTION, "top_k": NON_NEGATIVE,
        "max_completion_tokens": COUNT, "num_iterations": COUNT, "vllm_gpu_memory_utilization": FRACTION,
    },
    TokenScheduleOptions: {"warmup_ratio": BELOW_ONE},
    RewardConfig: {"weights": ANY},
    DataConfig: {"eval_num_prompts": NON_NEGATIVE, "eval_images_per_prompt": COUNT},
    FlowDataConfig: {"tag_repeats": NON_NEGATIVE},
    LauncherConfig: {
        "num_processes": COUNT, "num_machines": COUNT, "machine_rank": NON_NEGATIVE, "main_process_port": PORT,
    },
    R3Config: {
        "kl_weight_text": NON_NEGATIVE, "kl_weight_image": NON_NEGATIVE, "group_size": at_least(2),
        "prompts_per_step": COUNT, "max_output_token_n_gen": COUNT, "max_output_token_n_edit": COUNT,
        "num_timesteps_gen": at_least(2), "num_timesteps_edit": at_least(2), "reward_server_port": PORT,
        "format_weight": ANY, "ce_weight": NON_NEGATIVE, "mse_weight": NON_NEGATIVE, "clip_range": POSITIVE,
        "perfect_ratio": PROBABILITY, "perfect_threshold": ANY, "buffer_size": COUNT,
        "max_sde_timestep_idx_for_edit": COUNT, "temperature": POSITIVE, "top_p": FRACTION,
        "noise_level_gen": NON_NEGATIVE, "noise_level_edit": NON_NEGATIVE, "micro_batch_size": COUNT,
        "lr": POSITIVE, "warmup_steps": NON_NEGATIVE, "adam_beta1": BELOW_ONE, "adam_beta2": BELOW_ONE,
        "weight_decay": NON_NEGATIVE, "max_grad_norm": ANY, "eval_rounds": NON_NEGATIVE,
        "eval_max_prompts": NON_NEGATIVE,
    },
    CheckConfig: {
        "tolerance": POSITIVE, "text_tolerance": POSITIVE, "train_noise_level": NON_NEGATIVE,
        "train_batch_size": COUNT, "perturb_weights": NON_NEGATIVE,
    },
    PlanOptions: {"device_memory_gb": POSITIVE, "headroom": BELOW_ONE, "reward_memory_gb": POSITIVE},
    SampleConfig: {
        "seed": NON_NEGATIVE, "images_per_prompt": COUNT, "batch_size": COUNT, "num_steps": COUNT,
        "device": DEVICE,
    },
    EvalConfig: {
        "seed": NON_NEGATIVE, "images_per_prompt": COUNT, "batch_size": COUNT, "num_steps": COUNT,
        "max_prompts": NON_NEGATIVE, "device": DEVICE,
    },
    ServerConfig: {
        "port": Range(0, 65535), "max_batch": COUNT, "max_wait_ms": NON_NEGATIVE, "max_request_mb": POSITIVE,
        "max_image_pixels": COUNT, "max_image_side": COUNT, "max_decoded_mb": POSITIVE,
        "max_request_items": COUNT, "max_metadata_depth": COUNT, "workers": COUNT,
        "shutdown_timeout_s": NON_NEGATIVE, "max_inflight_requests": COUNT, "max_inflight_decoded_mb": POSITIVE,
        "admission_wait_s": NON_NEGATIVE, "max_connections": COUNT, "header_timeout_s": POSITIVE,
        "body_timeout_s": POSITIVE,
    },
}  # fmt: skip
"""{schema class: {field: its valid values}}; a list or map field's range applies to each element."""


def range_of(schema: type, name: str) -> Range | Pattern | None:
    """The rule of field ``name``, from the class (or base class) that declares it."""
    for cls in schema.__mro__:
        if name in RANGES.get(cls, {}):
            return RANGES[cls][name]
    return None


@functools.cache
def _nested(schema: type) -> dict[str, type]:
    """Fields of ``schema`` that hold another schema dataclass (optionally None): name → that class."""
    hints = typing.get_type_hints(schema)
    out = {}
    for f in dataclasses.fields(schema):
        inner = [t for t in (typing.get_args(hints[f.name]) or (hints[f.name],)) if t is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            out[f.name] = inner[0]
    return out


def check_settings(cfg: DictConfig, prefix: str = "") -> None:
    """Every key of a composed config is declared by its schema, and every value with a rule in
    :data:`RANGES` is in range; sections are checked recursively.

    Raises:
        UserError: Naming the first unknown key (and the closest real one) or out-of-range value.
    """
    schema = OmegaConf.get_type(cfg)
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        return
    names = [f.name for f in dataclasses.fields(schema)]
    for key in cfg:
        if key not in names:
            raise UserError(_unknown_key(prefix, str(key), names))
    nested = _nested(schema)
    for name in names:
        rule = range_of(schema, name)
        valid = choices_of(schema, name)
        if name in nested:
            section = cfg[name]
            if section is not None:
                check_settings(section, f"{prefix}{name}.")
        elif rule is not None:
            _check_value(f"{prefix}{name}", cfg[name], rule)
        elif valid is not None and cfg[name] not in valid:
            raise UserError(_not_a_choice(f"{prefix}{name}", cfg[name], valid))


def _check_value(key: str, value: Any, rule: Range | Pattern) -> None:
    if value is None:  # an optional setting left unset
        return
    if isinstance(value, DictConfig | ListConfig | Mapping | list):
        items = value.items() if isinstance(value, DictConfig | Mapping) else enumerate(value)
        for sub, item in items:
            _check_value(f"{key}.{sub}" if isinstance(sub, str) else f"{key}[{sub}]", item, rule)
        return
    if not rule.admits(value):
        raise UserError(f"{key} must be {rule.describe()}, got {value!r}")


def _not_a_choice(key: str, value: Any, valid: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value), [str(v) for v in valid], n=1, cutoff=0.8)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{key}={value!r} is not valid{hint}; choose one of {', '.join(str(v) for v in valid)}"


def _unknown_key(prefix: str, key: str, names: list[str]) -> str:
    section = prefix.rstrip(".") or "the top level"
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = f"did you mean {prefix}{close[0]}?" if close else f"{section} has: {', '.join(names)}."
    return (
        f"{prefix}{key} is not a setting of {section}; {hint} ('+' adds keys only to free-form maps such "
        "as reward.weights and reward.kwargs)"
    )
