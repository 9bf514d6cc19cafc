"""``model.dtype`` that cannot run well on the device is flagged once, at model build, with the fix."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from rlgen_cli.models import build_policy
from rlgen_cli.models.registry import slow_dtype_advice

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_float16_on_the_cpu_names_the_dtypes_to_use():
    advice = slow_dtype_advice("float16", CPU)
    assert advice is not None
    assert "model.dtype=float16" in advice
    assert "model.dtype=float32" in advice and "model.dtype=bfloat16" in advice


@pytest.mark.parametrize("dtype,device", [("float32", CPU), ("bfloat16", CPU), ("float16", CUDA)])
def test_dtypes_that_run_well_get_no_advice(dtype, device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert slow_dtype_advice(dtype, device) is None


def test_bfloat16_on_a_gpu_without_bf16_units_suggests_float16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    advice = slow_dtype_advice("bfloat16", CUDA)
    assert "Tesla V100" in advice and "model.dtype=float16" in advice
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert slow_dtype_advice("bfloat16", CUDA) is None


def test_the_model_build_warns_once(tiny_model_cfg, caplog):
    with caplog.at_level(logging.WARNING, logger="rlgen_cli.models.registry"):
        build_policy(dataclasses.replace(tiny_model_cfg, dtype="float16"), CPU)
    ours = [r.getMessage() for r in caplog.records if r.name == "rlgen_cli.models.registry"]  # not diffusers'
    assert ours == [slow_dtype_advice("float16", CPU)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlgen_cli.models.registry"):
        build_policy(tiny_model_cfg, CPU)
    assert not caplog.records
