"""Experiments named after an upstream recipe reproduce it, and say where they do not.

Each such experiment carries a ``fidelity`` record (schema/fidelity.py): the upstream source, ``matches``
({dotted.key: upstream value}) and ``differs`` ({dotted.key: {upstream, why}}). Composing the experiment
must give every ``matches`` value, must NOT give any ``differs`` upstream value, and every semantics knob
of the experiment's recipe (the lists below) must appear in one of the two maps — so a default that moves
under an experiment, or a knob nobody audited, fails here.

Derived keys (no single config key holds them):
* ``geometry.samples_per_optimizer_step`` = algo.train_batch_size × algo.gradient_accumulation_steps
  (global; null = one per process: × launcher world size) — the samples one optimizer step averages over (drop_zero_advantage only shrinks it);
* ``geometry.optimizer_steps_per_epoch`` = prompts_per_epoch × group_size × num_inner_epochs / the above;
* ``precision.autocast`` = the dtype the transformer's forward autocasts to: model.dtype below fp32, else
  null (no autocast; docs/precision.md).
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import pytest
from omegaconf import OmegaConf

from rlgen_cli._hydra import conf_dir, config_groups
from rlgen_cli.schema.algo import WINDOW_OPTIONS
from rlgen_cli.schema.r3 import R3_FAMILIES
from rlgen_cli.tasks.common import validated
from tests.schema.test_compose import _compose

Knobs = tuple[tuple[str, ...], ...]
"""Each entry is one knob: a tuple of keys, any one of which the record must list."""

FLOW_RL_KNOBS: Knobs = (
    ("algo.objective",),
    ("algo.kl_form",), ("algo.kl_weight",),
    ("algo.global_std",), ("algo.std_estimator",), ("algo.adv_eps",), ("algo.adv_clip_max",),
    ("algo.clip_range",),
    ("sampler.kind",), ("sampler.noise_level",), ("sampler.logprob_form",), ("sampler.logprob_reduce",),
    ("algo.window.kind",),
    ("algo.drop_zero_advantage",),
    ("model.guidance_scale",), ("algo.cfg_grad",),
    ("model.num_steps",),
    ("algo.shared_initial_noise",),
    ("algo.group_size",), ("algo.prompts_per_epoch",), ("algo.num_inner_epochs",),
    ("geometry.samples_per_optimizer_step",), ("geometry.optimizer_steps_per_epoch",),
    ("algo.lr",), ("algo.max_grad_norm",),
    ("algo.ema.enabled",),
    ("reward.weights",), ("reward.aggregation",),
)  # fmt: skip
EMA_KNOBS: Knobs = (("algo.ema.decay",), ("algo.ema.update_every",), ("algo.ema.warmup",))

FLOW_PREF_KNOBS: Knobs = (
    ("algo.pref.loss",), ("algo.pref.timesteps_per_sample",),
    ("algo.group_size",), ("algo.prompts_per_epoch",),
    ("model.num_steps",), ("model.guidance_scale",),
    ("algo.lr",), ("algo.max_grad_norm",), ("algo.ema.enabled",),
    ("reward.weights",),
)  # fmt: skip
PREF_LOSS_KNOBS: dict[str, Knobs] = {
    "dpo": (("algo.pref.dpo_beta",), ("algo.pref.ref_update_step",)),
    "sft": (("algo.pref.anchor_weight",), ("algo.pref.top_k",), ("algo.global_std",)),
}

VLM_RL_KNOBS: Knobs = (
    ("algo.kl_weight",),
    ("algo.token.loss_type",), ("algo.token.scale_rewards",), ("algo.token.std_estimator",),
    ("algo.clip_range", "algo.token.epsilon_high"),
    ("algo.group_size",), ("algo.prompts_per_epoch",), ("geometry.samples_per_optimizer_step",),
    ("algo.lr",),
    ("algo.token.temperature",), ("algo.token.max_completion_tokens",), ("algo.token.num_iterations",),
    ("reward.weights",),
)  # fmt: skip

R3_KNOBS: Knobs = (
    ("r3.kl_weight_text",), ("r3.kl_weight_image",), ("r3.ce_weight",), ("r3.mse_weight",),
    ("r3.clip_range",), ("r3.scale_by_std",),
    ("r3.group_size",), ("r3.prompts_per_step",),
    ("r3.tune_text_cot",), ("r3.tune_image_cot",),
    ("r3.lr",),
    ("r3.sde_kind",), ("r3.eta_schedule",), ("r3.enable_sde_gen",), ("r3.enable_sde_edit",),
    ("r3.noise_level_gen",), ("r3.noise_level_edit",),
    ("r3.num_timesteps_gen",), ("r3.num_timesteps_edit",),
    ("r3.temperature",),
)  # fmt: skip
R3_POLICY_KNOBS: dict[str, Knobs] = {
    "r3_composite": (("r3.policy.generator.guidance_scale",), ("r3.policy.editor.guidance_scale",)),
    "r3_bagel": (("r3.policy.bagel.guidance_scale",), ("r3.policy.bagel.image_guidance_scale",)),
}
"""The guidance of the networks each unified family's policy holds."""

EXPERIMENTS = config_groups()["experiment"]


@functools.cache
def _composed_once(experiment: str) -> Any:
    cfg = _compose("train", [f"experiment={experiment}"])
    validated(cfg)  # the record's own checks (schema/fidelity.py) and every cross-field check
    return cfg


def _composed(experiment: str) -> Any:
    """The composed experiment (a copy: tests may edit it)."""
    return copy.deepcopy(_composed_once(experiment))


def _with_fidelity() -> list[str]:
    """Experiments whose file carries a fidelity record (read, not composed: collection stays cheap)."""
    folder = conf_dir() / "experiment"
    return [e for e in EXPERIMENTS if "fidelity" in OmegaConf.load(folder / f"{e}.yaml")]


def _geometry(cfg: Any) -> dict[str, float]:
    algo = cfg.algo
    world = cfg.launcher.num_processes * cfg.launcher.num_machines
    # gradient_accumulation_steps counts micro-batches over all processes; null = one per process
    per_step = algo.train_batch_size * (algo.gradient_accumulation_steps or world)
    inner_epochs = algo.num_inner_epochs if "num_inner_epochs" in algo else 1  # others: one pass per epoch
    per_epoch = algo.prompts_per_epoch * algo.group_size * inner_epochs
    return {
        "geometry.samples_per_optimizer_step": per_step,
        "geometry.optimizer_steps_per_epoch": per_epoch / per_step,
    }


_MISSING = object()


def _value(cfg: Any, key: str) -> Any:
    """The composed value at ``key`` (derived keys included), plain Python; _MISSING when absent."""
    if key.startswith("geometry."):  # only runs with an ``algo`` section have a geometry
        return _geometry(cfg).get(key, _MISSING) if "algo" in cfg else _MISSING
    if key == "precision.autocast":
        return None if cfg.model.dtype == "float32" else cfg.model.dtype
    node = OmegaConf.select(cfg, key, default=_MISSING)
    return OmegaConf.to_container(node) if OmegaConf.is_config(node) else node


def _same(actual: Any, expected: Any) -> bool:
    """Equality with YAML's number spellings tolerated (``1e-4`` is a string in YAML 1.1)."""
    if isinstance(actual, float | int) and not isinstance(actual, bool) and isinstance(expected, str):
        try:
            expected = float(expected)
        except ValueError:
            return False
    if isinstance(actual, bool) or isinstance(expected, bool):
        return actual is expected
    if isinstance(actual, float | int) and isinstance(expected, float | int):
        return math.isclose(actual, expected, rel_tol=1e-12, abs_tol=0.0)
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(_same(actual[k], expected[k]) for k in actual)
    if isinstance(actual, list) and isinstance(expected, list):
        return len(actual) == len(expected) and all(_same(a, e) for a, e in zip(actual, expected))
    return actual == expected


def recipe_knobs(cfg: Any) -> Knobs:
    """The semantics knobs an experiment's record must cover, from its composed recipe."""
    if cfg.model.family in R3_FAMILIES:
        return R3_KNOBS + R3_POLICY_KNOBS[cfg.model.family]
    recipe = cfg.recipe
    if recipe == "flow_grpo":
        window = tuple((f"algo.window.{name}",) for name in WINDOW_OPTIONS[cfg.algo.window.kind])
        return FLOW_RL_KNOBS + window + (EMA_KNOBS if cfg.algo.ema.enabled else ())
    if recipe == "flow_pref":
        return FLOW_PREF_KNOBS + PREF_LOSS_KNOBS[cfg.algo.pref.loss]
    if recipe == "vlm_rl":
        return VLM_RL_KNOBS
    raise AssertionError(f"no fidelity knob list for recipe {recipe!r}; add one to {__name__}")


def fidelity_problems(cfg: Any) -> list[str]:
    """Every way the composed config disagrees with its own fidelity record (empty = faithful)."""
    record = OmegaConf.to_container(cfg.fidelity)
    problems = []
    for key, expected in record["matches"].items():
        actual = _value(cfg, key)
        if actual is _MISSING:
            problems.append(f"matches.{key}: no such key in the composed config")
        elif not _same(actual, expected):
            problems.append(f"matches.{key}: upstream {expected!r}, composed {actual!r}")
    for key, entry in record["differs"].items():
        actual = _value(cfg, key)
        if actual is _MISSING:
            problems.append(f"differs.{key}: no such key in the composed config")
        elif _same(actual, entry["upstream"]):
            problems.append(f"differs.{key}: composed {actual!r} IS upstream's value; move it to matches")
    listed = set(record["matches"]) | set(record["differs"])
    for knob in recipe_knobs(cfg):
        if not listed.intersection(knob):
            problems.append(f"knob {' or '.join(knob)} is in neither matches nor differs")
    return problems


@pytest.mark.parametrize("experiment", _with_fidelity())
def test_experiment_matches_its_fidelity_record(experiment):
    cfg = _composed(experiment)
    assert fidelity_problems(cfg) == [], f"experiment={experiment}"


def test_upstream_recipes_carry_a_fidelity_record():
    upstream = {
        "geneval_sd3", "geneval_sd3_fast_nocfg", "pickscore_sd3_fast_nocfg", "pickscore_sd3_dpo",
        "pickscore_sd3_sft", "pickscore_flux", "geneval_flux_fast", "counting_flux_kontext",
        "pickscore_qwenimage", "counting_qwenimage_edit", "counting_qwenimage_edit_fast", "general_ocr_wan2_1",
        "pickscore_sd3", "general_ocr_sd3",
        # Flow-Factory's examples, and R1-VL's settings on Qwen3-VL
        "clip_pickscore_flux2", "pickscore_flux2_klein", "pickscore_z_image", "pickscore_qwenimage_edit_plus",
        "ocr_wan2_2", "pickscore_qwenimage_2", "r1vl_stepgrpo_qwen3vl_4b",
    }  # fmt: skip
    assert upstream <= set(_with_fidelity())


def test_a_moved_default_is_caught():
    # perturbation: the KL form geneval_sd3 relies on, changed under it, must be reported
    cfg = _composed("geneval_sd3")
    assert fidelity_problems(cfg) == []
    cfg.algo.kl_form = "gaussian"
    assert fidelity_problems(cfg) == ["matches.algo.kl_form: upstream 'upstream', composed 'gaussian'"]


def test_a_difference_that_became_upstream_and_an_unlisted_knob_are_caught():
    cfg = _composed("geneval_sd3")
    cfg.algo.gradient_accumulation_steps = 2  # now upstream's per-GPU value: the record is stale
    del cfg.fidelity.matches["algo.cfg_grad"]  # a knob nobody audited
    problems = fidelity_problems(cfg)
    assert any(p.startswith("differs.algo.gradient_accumulation_steps") for p in problems)
    assert "knob algo.cfg_grad is in neither matches nor differs" in problems
