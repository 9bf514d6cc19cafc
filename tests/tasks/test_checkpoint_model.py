"""``rlgen sample`` / ``rlgen eval`` of a checkpoint draw with its saved model section: overrides that keep
its weights (dtype, guidance, decoding; ``++`` ones too) apply on top, and whatever would make the weights
not fit — another LoRA or base, another family or kind of model — exits 2 naming it, never a silent
change or a traceback. Checkpoints: one tiny SD3 and one tiny Qwen2-VL epoch, trained here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rlgen_cli.errors import UserError
from tests.conftest import TINY_RUN, run_cli
from tests.vlm.conftest import TINY_VLM

VLM_EVAL = ["model=tiny_qwen2_vl", "data=tiny_vlm", "reward=r1vl", "max_prompts=1"]


def _trained(tmp_path_factory, name: str, *args: str) -> Path:
    run_dir = tmp_path_factory.mktemp(name) / "run"
    code, out = run_cli("train", *args, "epochs=1", "save_every=1", f"hydra.run.dir={run_dir}")
    assert code == 0, out
    return run_dir / "checkpoints" / "epoch_000001"


@pytest.fixture(scope="module")
def sd3_checkpoint(tmp_path_factory) -> Path:
    return _trained(tmp_path_factory, "sd3", *TINY_RUN, "eval_every=0")


@pytest.fixture(scope="module")
def flux_checkpoint(tmp_path_factory) -> Path:
    return _trained(tmp_path_factory, "flux", *TINY_RUN, "model=tiny_flux", "eval_every=0")


@pytest.fixture(scope="module")
def vlm_checkpoint(tmp_path_factory) -> Path:
    return _trained(tmp_path_factory, "vlm", *TINY_VLM, "algo=step_grpo", "reward=length")


def _saved(checkpoint: Path, key: str):
    return OmegaConf.select(OmegaConf.load(checkpoint.parent.parent / "resolved.yaml"), key)


def _cli(verb: str, *args: str, out: Path) -> tuple[int, str]:
    code, output = run_cli(verb, *args, "progress=false", f"hydra.run.dir={out}")
    return code, " ".join(output.split())  # rich wraps long lines


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        ("model.lora.alpha=64", "lora.alpha", "64"),
        ("model.lora.rank=4", "lora.rank", "4"),
        ("model.tiny_seed=7", "tiny_seed", "7"),
        ("++model.tiny_seed=7", "tiny_seed", "7"),  # Hydra's ++ prefix: the same key
    ],
)
def test_an_override_of_the_saved_weights_exits_2_naming_both_values(
    sd3_checkpoint: Path, tmp_path: Path, override: str, key: str, value: str
):
    code, out = _cli("sample", f"checkpoint={sd3_checkpoint}", "prompts=[a red cube]", override, out=tmp_path)
    saved = _saved(sd3_checkpoint, f"model.{key}")
    assert code == 2, out
    assert f"model.{key}={value} would change the weights checkpoint={sd3_checkpoint} holds" in out, out
    assert f"trained with model.{key}={saved}" in out and "Drop the override" in out, out


def test_overrides_that_keep_the_weights_apply_on_top_of_the_saved_model(
    sd3_checkpoint: Path, tmp_path: Path
):
    alpha = _saved(sd3_checkpoint, "model.lora.alpha")
    code, out = _cli(
        "sample", f"checkpoint={sd3_checkpoint}", "prompts=[a red cube]", "num_steps=1",
        f"model.lora.alpha={alpha}", "++model.guidance_scale=2.0", out=tmp_path,
    )  # fmt: skip
    assert code == 0, out
    model = OmegaConf.load(tmp_path / "resolved.yaml").model
    assert (model.lora.alpha, model.guidance_scale) == (alpha, 2.0)


@pytest.mark.parametrize(
    ("verb", "choice", "shown"),
    [
        ("eval", "model=tiny_flux", "model=tiny_flux is a model.family=flux model"),
        ("sample", "model.family=flux", "model.family=flux is a model.family=flux model"),
        (
            "eval",
            "experiment=shapes_eval",
            "model=shapes_base (from experiment=shapes_eval) is a model.family=shapes model",
        ),
    ],
)
def test_another_family_chosen_beside_a_checkpoint_exits_2(
    sd3_checkpoint: Path, tmp_path: Path, verb: str, choice: str, shown: str
):
    prompts = ["prompts=[a red cube]"] if verb == "sample" else ["max_prompts=1"]
    code, out = _cli(verb, choice, f"checkpoint={sd3_checkpoint}", *prompts, out=tmp_path)
    assert code == 2, out
    assert f"{shown}, and checkpoint={sd3_checkpoint} holds a model.family=sd3 model" in out, out
    assert "its weights fit only sd3" in out and "tiny_sd3" in out, out


@pytest.mark.parametrize("verb", ["sample", "eval"])
def test_without_a_model_choice_the_checkpoints_own_family_draws(
    flux_checkpoint: Path, tmp_path: Path, verb: str
):
    """The verbs' default model (the tiny SD3) is no choice: a FLUX checkpoint draws with its FLUX."""
    prompts = ["prompts=[a red cube]"] if verb == "sample" else ["max_prompts=1"]
    code, out = _cli(verb, f"checkpoint={flux_checkpoint}", *prompts, "num_steps=1", out=tmp_path)
    assert code == 0, out
    assert OmegaConf.load(tmp_path / "resolved.yaml").model.family == "flux"


def test_a_vlm_checkpoint_where_a_flow_model_draws_exits_2(vlm_checkpoint: Path, tmp_path: Path):
    for verb, args in (("eval", ["max_prompts=1"]), ("sample", ["prompts=[a red cube]"])):
        code, out = _cli(verb, f"checkpoint={vlm_checkpoint}", *args, out=tmp_path / verb)
        assert code == 2, out
        assert (
            f"checkpoint={vlm_checkpoint} holds a model.family=qwen2_vl model (vlm), and this config "
            "composes model.family=sd3 (flow)" in out
        ), out
        assert "tiny_qwen2_vl" in out, out


def test_a_flow_checkpoint_where_a_vlm_answers_exits_2(sd3_checkpoint: Path, tmp_path: Path):
    code, out = _cli("eval", *VLM_EVAL, f"checkpoint={sd3_checkpoint}", out=tmp_path)
    assert code == 2, out
    assert (
        "holds a model.family=sd3 model (flow), and this config composes model.family=qwen2_vl (vlm)" in out
    )


def test_vlm_eval_of_a_checkpoint_applies_the_decoding_overrides(vlm_checkpoint: Path, tmp_path: Path):
    code, out = _cli(
        "eval", *VLM_EVAL, f"checkpoint={vlm_checkpoint}", "model.vlm.eval_max_new_tokens=3", out=tmp_path
    )
    assert code == 0, out
    assert json.loads((tmp_path / "results.json").read_text())["decoding"]["max_new_tokens"] == 3


def test_vlm_eval_of_a_checkpoint_refuses_another_lora(vlm_checkpoint: Path, tmp_path: Path):
    code, out = _cli("eval", *VLM_EVAL, f"checkpoint={vlm_checkpoint}", "model.lora.rank=4", out=tmp_path)
    assert code == 2 and "model.lora.rank=4 would change the weights" in out, out


def test_lora_weights_of_another_shape_are_a_user_error_naming_the_mismatch(tmp_path: Path):
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    from rlgen_cli.models.trainable import load_lora_state

    def adapted(rank: int) -> torch.nn.Module:
        module = torch.nn.Sequential()
        module.add_module("proj", torch.nn.Linear(8, 8))
        return inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=["proj"]), module)

    state = get_peft_model_state_dict(adapted(8))
    with pytest.raises(
        UserError, match=r"do not fit this model: size mismatch for proj.lora_A.*other model.lora"
    ):
        load_lora_state(adapted(4), state, tmp_path / "weights.safetensors")
