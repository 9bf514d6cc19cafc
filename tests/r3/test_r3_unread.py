"""R3 refuses settings that validate but would do nothing: the VLM recipes' prompt, length and evaluation
keys of its text policy (R3 writes its own prompts, ``r3.max_output_token_n_*`` tokens, greedily when
evaluating), and a tuned track that can receive no gradient (``grad_norm`` 0 every step)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlgen_cli.errors import UserError
from tests.conftest import run_cli, validated_train
from tests.r3.conftest import TINY_R3


def _r3(*overrides: str):
    return validated_train("model=tiny_r3", *overrides, experiment=None)


@pytest.mark.parametrize(
    "override,instead",
    [
        ("+r3.policy.text.vlm.system_prompt=Answer in French.", "its own system prompts"),
        ("r3.policy.text.vlm.prompt_format=mulberry", "its own reason and reflect prompts"),
        ("r3.policy.text.vlm.completion_cap=1", "set those instead"),
        ("r3.policy.text.vlm.eval_max_new_tokens=4", "r3.max_output_token_n_gen"),
        ("r3.policy.text.vlm.eval_temperature=0.7", "decodes greedily"),
        ("r3.policy.text.vlm.eval_top_p=0.5", "decodes greedily"),
        ("r3.policy.text.vlm.eval_top_k=5", "decodes greedily"),
    ],
)
def test_a_text_policy_setting_r3_never_reads_is_refused(override: str, instead: str):
    key, value = override.lstrip("+").split("=", 1)
    with pytest.raises(UserError, match="does nothing with R3") as refused:
        _r3(override)
    assert f"{key}={value}" in str(refused.value) and instead in str(refused.value)


@pytest.mark.parametrize("model", ["tiny_r3", "r3_qwen"])
def test_the_r3_model_options_and_experiments_set_no_unread_text_setting(model: str):
    typed = validated_train(f"model={model}", experiment=None)
    assert typed.r3.policy.text.vlm.eval_max_new_tokens == 1024  # the schema's default: R3 never reads it
    validated_train("experiment=r3_geneval", f"model={model}", experiment=None)


def test_a_checkpoint_saved_with_an_unread_text_setting_still_loads():
    """An older rlgen's tiny_r3 saved ``eval_max_new_tokens: 8``, which R3 never read: evaluating that
    checkpoint (its policy under the schema again) is not refused."""
    from rlgen_cli.schema.r3 import typed_policy

    saved = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(_r3().r3.policy)))  # plain yaml
    saved.text.vlm.eval_max_new_tokens = 8
    policy = OmegaConf.to_object(typed_policy("r3_composite", saved))
    assert policy.text.vlm.eval_max_new_tokens == 1024 and policy.text.vlm.max_context == 1024


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["r3.tune_text_cot=false", "r3.enable_sde_gen=false", "r3.enable_sde_edit=false"],
            "draw every image by ODE.*the text track is off too: this run would train nothing",
        ),
        (
            ["r3.enable_sde_gen=false", "r3.enable_sde_edit=false"],
            "draw every image by ODE.*or r3.tune_image_cot=false to train the text track alone",
        ),
        (["r3.ce_weight=0"], "r3.ce_weight=0 weights the text track's loss to nothing"),
        (["r3.ce_weight=0", "r3.tune_image_cot=false"], "the image track is off too"),
        (["r3.mse_weight=0", "r3.kl_weight_image=0"], "r3.tune_image_cot=true trains no image"),
    ],
)
def test_a_tuned_track_that_can_receive_no_gradient_is_refused(overrides: list[str], message: str):
    with pytest.raises(UserError, match=message):
        _r3(*overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        ["r3.tune_image_cot=false", "r3.enable_sde_gen=false", "r3.enable_sde_edit=false"],
        ["r3.tune_text_cot=false", "r3.enable_sde_gen=false"],
        ["r3.mse_weight=0"],  # the image KL still trains it
    ],
)
def test_every_tuned_track_with_a_gradient_is_accepted(overrides: list[str]):
    _r3(*overrides)


def test_the_cli_refuses_an_unread_text_setting_before_any_model_loads(tmp_path: Path):
    override = "+r3.policy.text.vlm.system_prompt=Answer in French."
    code, out = run_cli("train", *TINY_R3, "epochs=2", override, f"hydra.run.dir={tmp_path}")
    assert code == 2, out
    assert "r3.policy.text.vlm.system_prompt=Answer in French. does nothing with R3" in out
    assert not (tmp_path / "metrics.jsonl").exists()
