"""``model.frozen_dtype`` and ``model.vae_dtype``: where each weight lives, loaded without a round trip
through ``model.dtype``, on-policy in every combination, and counted by ``rlgen plan``
(docs/precision.md)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from rlgen_cli.errors import UserError
from rlgen_cli.models.loading import frozen_dtype, load_dtypes, vae_dtype
from tests.conftest import TINY_RUN, run_cli
from tests.models.helpers import CPU, model_cfg

BF16, FP32 = torch.bfloat16, torch.float32


def _cfg(name: str, **changes):
    return dataclasses.replace(model_cfg(name), **changes)


def _dtypes(module: torch.nn.Module, trainable: bool) -> set[torch.dtype]:
    return {p.dtype for p in module.parameters() if p.requires_grad == trainable}


# -- the settings ------------------------------------------------------------------------------------


def test_null_keeps_model_dtype_and_the_family_vae():
    cfg = _cfg("tiny_sd3", dtype="bfloat16")
    assert (frozen_dtype(cfg), load_dtypes(cfg)) == (BF16, BF16)  # one dtype: from_pretrained as before
    assert vae_dtype(cfg, fp32_by_default=False) == BF16  # SD3 / FLUX: the VAE in model.dtype
    assert vae_dtype(cfg, fp32_by_default=True) == FP32  # Qwen-Image / Wan / Z-Image: fp32


def test_explicit_dtypes_load_the_transformers_and_the_vae_in_them():
    cfg = _cfg("tiny_sd3", dtype="bfloat16", frozen_dtype="float32", vae_dtype="float32")
    assert frozen_dtype(cfg) == FP32
    expected = {"default": BF16, "transformer": FP32, "transformer_2": FP32, "vae": FP32}
    assert load_dtypes(cfg) == expected
    wan_in_bf16 = _cfg("tiny_wan2_1", dtype="bfloat16", vae_dtype="bfloat16")
    assert vae_dtype(wan_in_bf16, fp32_by_default=True) == BF16  # an explicit choice wins over the family's


@pytest.mark.parametrize(("dtype", "frozen"), [("bfloat16", "float16"), ("float32", "bfloat16")])
def test_frozen_weights_below_fp32_in_another_dtype_than_the_forward_are_refused(dtype, frozen):
    with pytest.raises(UserError, match=f"model.frozen_dtype={frozen} with model.dtype={dtype}"):
        _cfg("tiny_sd3", dtype=dtype, frozen_dtype=frozen)


# -- where the weights live -------------------------------------------------------------------------


def test_tiny_sd3_keeps_fp32_frozen_weights_and_vae_as_built():
    from rlgen_cli.models import build_policy
    from rlgen_cli.models.tiny import tiny_sd3_pipeline

    policy = build_policy(
        _cfg("tiny_sd3", dtype="bfloat16", frozen_dtype="float32", vae_dtype="float32"), CPU
    )
    pipe = policy.pipeline
    assert _dtypes(pipe.transformer, trainable=False) == {FP32}
    assert _dtypes(pipe.transformer, trainable=True) == {FP32}  # LoRA
    assert _dtypes(pipe.vae, trainable=False) == {FP32}
    assert _dtypes(pipe.text_encoder_3, trainable=False) == {BF16}  # text encoders stay in model.dtype
    # the very weights built in fp32: no round trip through bf16 on the way
    built = tiny_sd3_pipeline(model_cfg("tiny_sd3").tiny_seed).transformer.state_dict()
    kept = {
        k.replace(".base_layer", ""): v for k, v in pipe.transformer.state_dict().items() if "lora_" not in k
    }
    assert kept.keys() == built.keys()
    assert all(torch.equal(kept[k], built[k]) for k in built)


def test_tiny_sd3_defaults_are_unchanged():
    from rlgen_cli.models import build_policy

    pipe = build_policy(_cfg("tiny_sd3", dtype="bfloat16"), CPU).pipeline
    assert _dtypes(pipe.transformer, trainable=False) == {BF16}
    assert _dtypes(pipe.vae, trainable=False) == {BF16}


def test_wan_vae_follows_vae_dtype_and_its_fp32_default():
    from rlgen_cli.models import build_policy

    default = build_policy(_cfg("tiny_wan2_1", dtype="bfloat16"), CPU).pipeline
    assert _dtypes(default.vae, trainable=False) == {FP32}
    lowered = build_policy(_cfg("tiny_wan2_1", dtype="bfloat16", vae_dtype="bfloat16"), CPU).pipeline
    assert _dtypes(lowered.vae, trainable=False) == {BF16}


def test_the_real_loader_reads_fp32_weights_straight_from_the_checkpoint(tmp_path: Path):
    from rlgen_cli.models.sd3 import load_sd3_pipeline
    from rlgen_cli.models.tiny import tiny_sd3_pipeline

    saved = tiny_sd3_pipeline(0)
    saved.save_pretrained(tmp_path / "sd3")
    cfg = _cfg(
        "tiny_sd3",
        tiny=False,
        path=str(tmp_path / "sd3"),
        local_files_only=True,
        dtype="bfloat16",
        frozen_dtype="float32",
        vae_dtype="float32",
    )
    pipe = load_sd3_pipeline(cfg)
    assert {p.dtype for p in pipe.transformer.parameters()} == {FP32}
    assert {p.dtype for p in pipe.vae.parameters()} == {FP32}
    assert {p.dtype for p in pipe.text_encoder.parameters()} == {BF16}
    for name, value in saved.transformer.state_dict().items():
        assert torch.equal(pipe.transformer.state_dict()[name], value), name


# -- on-policy in every combination ------------------------------------------------------------------

SMALL = [
    *TINY_RUN,
    "algo.prompts_per_epoch=1",
    "algo.sample_batch_size=2",
    "algo.train_batch_size=2",
    "model.num_steps=2",
]
CHECK_TOLERANCE = 1e-6  # check.tolerance's default: the same batches recompute exactly in every dtype


def _combinations():
    """(family, model.dtype, frozen_dtype, vae_dtype): the upstream and the memory-saving choice with
    autocast (bf16) and without (fp32), each VAE choice. One case per default suite; the rest are slow."""
    fast = {("tiny_sd3", "bfloat16", "float32", "float32")}
    for family in (
        "tiny_sd3",
        "tiny_flux",
        "tiny_flux_kontext",
        "tiny_qwen_image",
        "tiny_wan2_1",
        "tiny_z_image",
    ):
        for dtype, frozen in (("bfloat16", "float32"), ("bfloat16", "null"), ("float32", "null")):
            for vae in ("float32", "bfloat16"):
                case = (family, dtype, frozen, vae)
                marks = [] if case in fast else [pytest.mark.slow]
                yield pytest.param(*case, marks=marks, id="-".join(case))


@pytest.mark.parametrize(("family", "dtype", "frozen", "vae"), list(_combinations()))
def test_check_onpolicy_passes(tmp_path: Path, family, dtype, frozen, vae):
    settings = [f"model.dtype={dtype}", f"model.frozen_dtype={frozen}", f"model.vae_dtype={vae}"]
    code, out = run_cli("check-onpolicy", f"model={family}", *SMALL, *settings, f"hydra.run.dir={tmp_path}")
    assert code == 0, out
    errors = [float(e) for e in re.findall(r"PASS max error ([0-9.e+-]+)", out)]
    assert errors and max(errors) <= CHECK_TOLERANCE, out


# -- rlgen plan counts it ----------------------------------------------------------------------------


def _plan(tmp_path: Path, *overrides: str) -> dict:
    import json

    args = ["plan", "model=tiny_sd3", "model.dtype=bfloat16", *overrides, "plan.format=json"]
    code, out = run_cli(*args, f"hydra.run.dir={tmp_path}")
    assert code == 0, out
    return json.loads((tmp_path / "plan.json").read_text())


def _row(report: dict, what: str) -> int:
    (nbytes,) = [r["bytes"] for r in report["rows"] if r["what"] == what]
    return nbytes


def test_plan_counts_fp32_frozen_weights_at_twice_their_bf16_bytes(tmp_path: Path):
    saving = _plan(tmp_path / "null")
    upstream = _plan(tmp_path / "fp32", "model.frozen_dtype=float32")
    bf16 = _row(saving, "transformer weights (bfloat16, frozen)")
    assert _row(upstream, "transformer weights (float32, frozen)") == 2 * bf16
    assert upstream["state_bytes"] - saving["state_bytes"] == bf16  # nothing else moved
    assert upstream["total_bytes"] >= saving["total_bytes"] + bf16  # the planned peak grows with it


@pytest.mark.parametrize(
    ("option", "setting"),
    [
        ("shapes_base", "model.vae_dtype=float32"),
        ("tiny_qwen2_vl", "model.vae_dtype=float32"),
        ("tiny_qwen2_vl", "model.frozen_dtype=float32"),
        ("tiny_r3", "model.frozen_dtype=float32"),
    ],
)
def test_a_setting_the_family_would_not_read_is_refused(option, setting):
    from hydra.errors import ConfigCompositionException

    from rlgen_cli._hydra import compose_verb

    key = setting.split("=")[0]
    with pytest.raises(ConfigCompositionException, match=f"Could not override '{key}'"):
        compose_verb("train", [f"model={option}", setting])  # the CLI exits 2 with this message
