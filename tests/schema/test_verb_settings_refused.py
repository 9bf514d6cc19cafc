"""``rlgen sample``, ``rlgen eval`` and ``rlgen check-onpolicy``: a setting the verb composes but never reads
is refused at the config boundary (a ``UserError``, exit 2) with what to set instead; its neighbours that
the verb does read still pass.

Each case composes the verb through the real config path (Hydra, the verb's schema, the one validation
pass); the command-line checks of the ``data`` keys the verbs share with training run through the CLI.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlgen_cli._hydra import compose_verb
from rlgen_cli.errors import UserError
from rlgen_cli.tasks.common import validated
from tests.conftest import run_cli

VLM_EVAL = ["model=tiny_qwen2_vl", "data=tiny_vlm", "reward=r1vl"]
VLM_CHECK = ["model=tiny_qwen2_vl", "data=tiny_vlm", "algo=step_grpo", "reward=length"]


def _validated(verb: str, *overrides: str):
    cfg = compose_verb(verb, list(overrides))
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = "/tmp/unused"
    return validated(cfg)


REFUSED = {
    # sample: two prompt sources, or an editing set without rows
    "prompts_and_file": (
        ("sample", "prompts=[a red cube]", "prompts_file=p.txt"),
        r"prompts=\[…\] and prompts_file=p.txt both name the prompts to draw: pass one of them",
    ),
    "edit_set_inline_prompts": (
        ("sample", "edit_set=true", "prompts=[a red cube]"),
        r"edit_set=true builds an editing set from the rows of a GenEval-style prompts file.*pass "
        r"prompts_file=FILE.jsonl instead of prompts=",
    ),
    # sample: the ODE step draws no noise, and sampling computes no log-probabilities
    "ode_noise_level": (
        ("sample", "sampler.noise_level=0.5"),
        r"sampler.noise_level=0.5 sets the step noise of a stochastic sampler, and sampler.kind=ode draws "
        r"without it: set sampler.kind=flow_sde",
    ),
    "logprob_reduce": (
        ("sample", "sampler.kind=flow_sde", "sampler.logprob_reduce=sum"),
        r"sampler.logprob_reduce=sum shapes the log-probabilities training computes, and rlgen sample computes "
        r"none: drop sampler.logprob_reduce \(back to its default, mean\)",
    ),
    "logprob_form": (
        ("sample", "sampler.kind=cps", "sampler.noise_level=0.8", "sampler.logprob_form=upstream"),
        r"sampler.logprob_form=upstream shapes the log-probabilities",
    ),
    # eval of a VLM: one near-greedy answer per question, no images
    "vlm_images_per_prompt": (
        ("eval", *VLM_EVAL, "images_per_prompt=2"),
        r"images_per_prompt=2 does nothing for model.family=qwen2_vl: a VLM's evaluation answers each test "
        r"question once .* Drop images_per_prompt \(back to its default, 1\)",
    ),
    "vlm_num_steps": (
        ("eval", *VLM_EVAL, "num_steps=3"),
        r"num_steps=3 does nothing for model.family=qwen2_vl",
    ),
    "vlm_save_images": (
        ("eval", *VLM_EVAL, "save_images=false"),
        r"save_images=false does nothing for model.family=qwen2_vl",
    ),
    # eval of a unified policy (R3): one image per prompt, its own step counts
    "r3_images_per_prompt": (
        ("eval", "model=tiny_r3", "images_per_prompt=2"),
        r"images_per_prompt=2 does nothing for model.family=\w+: R3's evaluation draws one image per prompt in "
        r"r3.num_timesteps_gen − 1 denoising steps",
    ),
    "r3_num_steps": (("eval", "model=tiny_r3", "num_steps=3"), r"num_steps=3 does nothing for model.family="),
    "r3_batch_size": (
        ("eval", "model=tiny_r3", "batch_size=3"),
        r"batch_size=3 does nothing for model.family=",
    ),
    # check-onpolicy: one process, and each kind's own tolerance
    "check_launcher": (
        ("check_onpolicy", "launcher=fsdp", "launcher.num_processes=2"),
        r"launcher=fsdp spreads a training run over processes, and rlgen check-onpolicy rolls out and "
        r"recomputes in this one process",
    ),
    "check_flow_text_tolerance": (
        ("check_onpolicy", "check.text_tolerance=1e-3"),
        r"check.text_tolerance=0.001 does nothing for model.family=sd3: it bounds the text tracks",
    ),
    "check_vlm_tolerance": (
        ("check_onpolicy", *VLM_CHECK, "check.tolerance=1e-5"),
        r"check.tolerance=1e-05 does nothing for model.family=qwen2_vl: .*set check.text_tolerance instead",
    ),
    "check_vlm_train_noise_level": (
        ("check_onpolicy", *VLM_CHECK, "check.train_noise_level=0.8"),
        r"check.train_noise_level=0.8 does nothing for model.family=qwen2_vl: it recomputes flow steps",
    ),
    # a negative prompt is encoded only by a CFG branch
    "negative_prompt_without_cfg": (
        ("sample", "model.negative_prompt=blurry"),
        r"model.negative_prompt='blurry' is encoded by classifier-free guidance's unguided branch, and "
        r"model.guidance_scale=1.0 runs none: set model.guidance_scale > 1",
    ),
    "negative_prompt_guidance_distilled": (
        ("sample", "model=tiny_flux", "model.guidance_scale=3.5", "model.negative_prompt=blurry"),
        r"model.negative_prompt='blurry' does nothing for model.family=flux: its guidance scale is an input "
        r"embedding",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_an_unread_setting_is_refused_naming_it_and_the_fix(case: str):
    (verb, *overrides), message = REFUSED[case]
    with pytest.raises(UserError, match=message):
        _validated(verb, *overrides)


READ = {
    "prompts_alone": ("sample", "prompts=[a red cube]"),
    "edit_set_with_a_file": ("sample", "edit_set=true", "prompts_file=p.jsonl"),
    "sde_noise_level": ("sample", "sampler.kind=flow_sde", "sampler.noise_level=0.5"),
    "flow_eval_images": ("eval", "images_per_prompt=2", "num_steps=3", "save_images=false"),
    "vlm_eval_defaults": ("eval", *VLM_EVAL, "batch_size=3"),
    "r3_eval_read_settings": ("eval", "model=tiny_r3", "max_prompts=2", "save_images=false"),
    "check_flow_tolerance": ("check_onpolicy", "check.tolerance=1e-5", "check.train_noise_level=0.8"),
    "check_vlm_text_tolerance": ("check_onpolicy", *VLM_CHECK, "check.text_tolerance=1e-4"),
    "check_unified_tolerances": ("check_onpolicy", "model=tiny_r3", "check.tolerance=1e-5", "check.text_tolerance=1e-4"),
    "negative_prompt_with_cfg": ("sample", "model.guidance_scale=4.5", "model.negative_prompt=blurry"),
    "blank_negative_prompt_without_cfg": ("sample", "model=tiny_qwen_image", "model.guidance_scale=1", "model.negative_prompt=' '"),
}  # fmt: skip


@pytest.mark.parametrize("case", READ)
def test_the_neighbours_of_each_refusal_still_pass(case: str):
    verb, *overrides = READ[case]
    _validated(verb, *overrides)


COMMAND_LINE = {
    "eval_num_prompts": (
        ("eval", "data.eval_num_prompts=1"),
        "data.eval_num_prompts=1 is not read by rlgen eval: it sizes rlgen train's periodic evaluation; rlgen "
        "eval scores the first max_prompts test prompts (0 = all): set max_prompts. Drop the override",
    ),
    "eval_images_per_prompt": (
        ("eval", "++data.eval_images_per_prompt=3"),
        "++data.eval_images_per_prompt=3 is not read by rlgen eval",
    ),
    "r3_eval_test": (
        ("eval", "model=tiny_r3", "data.test=/nonexistent.txt"),
        "data.test=/nonexistent.txt is not read by rlgen eval: a unified policy's evaluation reads its prompts from "
        "r3.val_data_path",
    ),
    "sample_train": (("sample", "data.train=/nonexistent.txt"), "data.train=/nonexistent.txt is not read by rlgen sample"),
    "sample_eval_num_prompts": (("sample", "data.eval_num_prompts=1"), "data.eval_num_prompts=1 is not read by rlgen sample"),
    "sample_test_beside_prompts": (
        ("sample", "prompts=[a]", "data.test=/nonexistent.txt"),
        "data.test=/nonexistent.txt is not read by rlgen sample: rlgen sample draws data.test only without prompts and "
        "prompts_file, and prompts=[…] is given",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", COMMAND_LINE)
def test_an_override_of_a_training_data_key_exits_2(case: str, tmp_path: Path):
    (verb, *overrides), message = COMMAND_LINE[case]
    code, out = run_cli(verb, *overrides, "progress=false", f"hydra.run.dir={tmp_path}")
    assert code == 2 and message in " ".join(out.split()), out
