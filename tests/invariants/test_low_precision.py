"""Low precision on CPU, the paths real runs take: every flow family in bf16 (SD3 also in fp16, the dtype
its real config uses, with its loss scaler) and the tiny VLM in bf16, with frozen weights in
``model.dtype``, trained weights and latents in fp32 (docs/precision.md).

Each case trains one step (finite loss, a gradient, frozen weights in ``model.dtype``, saved trained
weights in fp32, every tensor the first step must move moved), then runs ``rlgen check-onpolicy`` on the
trained weights — a non-zero adapter, unlike a fresh one — against the stated tolerance:
``check.tolerance`` (1e-6) for the flow families, ``TEXT_TOLERANCES[dtype]`` for the VLM. The
batch-invariant families recompute in micro-batches of 1, unlike the rollout's 4.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from rlgen_cli.schema.check import TEXT_TOLERANCES
from tests.conftest import TINY_RUN, run_cli
from tests.vlm.conftest import TINY_VLM, compose_config

FLOW_TOLERANCE = 1e-6  # check.tolerance's default, in every dtype
SHAPES = [
    "experiment=tiny_cpu", "model=shapes_base", "data=shapes", "reward=jpeg_compressibility", "algo=grpo_tiny",
    "algo.prompts_per_epoch=1",
    "algo.group_size=2", "algo.sample_batch_size=2", "algo.train_batch_size=2",
    "algo.gradient_accumulation_steps=1", "model.num_steps=2", "progress=false",
]  # fmt: skip
VLM = ["experiment=tiny_cpu", *TINY_VLM, "algo=step_grpo", "reward=length"]

# (model, dtype): overrides. One bf16 family stays in the default suite; the rest are slow.
CASES = {
    ("tiny_sd3", "bfloat16"): ["model=tiny_sd3", *TINY_RUN],
    ("tiny_sd3", "float16"): ["model=tiny_sd3", *TINY_RUN],
    ("tiny_flux", "bfloat16"): ["model=tiny_flux", *TINY_RUN],
    ("tiny_flux_kontext", "bfloat16"): ["model=tiny_flux_kontext", *TINY_RUN],
    ("tiny_qwen_image", "bfloat16"): ["model=tiny_qwen_image", *TINY_RUN],
    ("tiny_qwen_image_edit", "bfloat16"): ["model=tiny_qwen_image_edit", *TINY_RUN],
    ("tiny_wan2_1", "bfloat16"): ["model=tiny_wan2_1", *TINY_RUN],
    ("shapes_base", "bfloat16"): SHAPES,
    ("tiny_qwen2_vl", "bfloat16"): VLM,
}
DEFAULT_SUITE = {("tiny_sd3", "bfloat16")}
# Families whose forward is batch-invariant in low precision: the check recomputes in micro-batches of 1
# (the rollout's are 4), as training does once zero-advantage filtering or a window mask re-batches the
# samples. Qwen-Image trims the text padding to each batch's longest prompt, and the ShapesEval text
# encoder (PyTorch's TransformerEncoder) is batch-dependent in bf16 (docs/precision.md).
REBATCHED = {"tiny_sd3", "tiny_flux", "tiny_flux_kontext", "tiny_wan2_1"}


def _params():
    for key in CASES:
        marks = [] if key in DEFAULT_SUITE else [pytest.mark.slow]
        yield pytest.param(*key, marks=marks, id=f"{key[0]}-{key[1]}")


def _max_error(out: str) -> float:
    """The check's worst |ratio − 1| / |Δ log p| (flow: "PASS max error …"; text: "… max error …")."""
    errors = [float(m) for m in re.findall(r"max error ([0-9.e+-]+)", out)]
    assert errors, out
    return max(errors)


def _policy(overrides: list[str]):
    """The policy as the run built it (same seed, so the same initial adapter)."""
    typed, _ = compose_config("train", overrides)
    torch.manual_seed(typed.seed)  # the recipes seed torch before building the adapter
    if typed.model.family == "qwen2_vl":
        from rlgen_cli.vlm.policy import build_vlm

        return build_vlm(typed.model, torch.device("cpu"))
    from rlgen_cli.models import build_policy

    return build_policy(typed.model, torch.device("cpu"))


def _trained_module(policy) -> torch.nn.Module:
    from rlgen_cli.vlm.policy import VLMPolicy

    return policy.model if isinstance(policy, VLMPolicy) else policy.trainable.module


def _weights(policy):
    """(trained parameters, load) of a VLM policy or of a flow policy's ``trainable``."""
    from rlgen_cli.vlm.policy import VLMPolicy

    if isinstance(policy, VLMPolicy):
        return policy.trainable_parameters, policy.load_trainable
    return policy.trainable.parameters, policy.trainable.load


def _frozen_dtypes(policy) -> set[torch.dtype]:
    module = _trained_module(policy)
    return {p.dtype for p in module.parameters() if not p.requires_grad}


def _saved_dtypes(weights: Path) -> set[torch.dtype]:
    from safetensors.torch import load_file

    return {t.dtype for f in weights.rglob("*.safetensors") for t in load_file(f).values()}


@pytest.mark.parametrize(("model", "dtype"), list(_params()))
def test_one_step_then_check_onpolicy_in_low_precision(tmp_path: Path, model: str, dtype: str):
    overrides = [*CASES[model, dtype], f"model.dtype={dtype}"]
    run = tmp_path / "train"
    one_step = [
        "epochs=1",
        "save_every=1",
        "eval_every=0",
        *([] if model == "tiny_qwen2_vl" else ["images_every=0"]),
    ]
    code, out = run_cli("train", *overrides, *one_step, f"hydra.run.dir={run}")
    assert code == 0, out
    (metrics,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert math.isfinite(metrics["policy_loss"]), metrics
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0, metrics
    if dtype == "float16":  # the loss scaler's initial 2^16 overflows nothing here (measured)
        assert (metrics["loss_scale"], metrics["skipped_steps"]) == (2.0**16, 0), metrics
    else:
        assert "loss_scale" not in metrics, metrics

    checkpoint = run / "checkpoints" / "epoch_000001"
    rebatch = ["check.train_batch_size=1"] if model in REBATCHED else []
    check_dir = f"hydra.run.dir={tmp_path / 'check'}"
    code, out = run_cli("check-onpolicy", *overrides, "epochs=1", f"resume={checkpoint}", *rebatch, check_dir)
    tolerance = TEXT_TOLERANCES[dtype] if model == "tiny_qwen2_vl" else FLOW_TOLERANCE
    assert code == 0, out
    assert _max_error(out) <= tolerance, out

    policy = _policy(overrides)
    frozen_dtypes = _frozen_dtypes(policy)  # none under full fine-tuning
    assert not frozen_dtypes or getattr(torch, dtype) in frozen_dtypes, frozen_dtypes  # frozen: model.dtype
    assert _saved_dtypes(checkpoint / "weights") == {torch.float32}  # trained weights: fp32
    parameters, load = _weights(policy)
    fresh = [p.detach().clone() for p in parameters()]
    load(checkpoint / "weights")
    trained = [p.detach() for p in parameters()]
    # LoRA B starts at 0, so the first step's gradient reaches B only (A's is B·… = 0): every B must move.
    # Full fine-tuning: every tensor.
    must_move = [i for i, t in enumerate(fresh) if not t.any()] or list(range(len(fresh)))
    frozen = [i for i in must_move if torch.equal(fresh[i], trained[i])]
    assert not frozen, f"{len(frozen)} of {len(must_move)} tensors that must move did not"


def test_bf16_check_fails_when_the_weights_move_after_the_rollout(tmp_path: Path):
    # bf16 rounding does not hide a change of the weights: LoRA noise of std 1e-3 (B starts at 0, so the
    # adapter moves by ~1e-6) fails the 1e-6 tolerance
    overrides = [*CASES["tiny_sd3", "bfloat16"], "model.dtype=bfloat16", "check.perturb_weights=1e-3"]
    code, out = run_cli("check-onpolicy", *overrides, f"hydra.run.dir={tmp_path}")
    assert code == 1, out
    assert _max_error(out) > 10 * FLOW_TOLERANCE, out  # measured 3.6e-5


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_tiny_pipeline_holds_the_dtypes_a_loaded_one_would(dtype):
    # as from_pretrained(torch_dtype=...): Wan's transformer keeps its norms, time embedder and modulation
    # table in fp32; transformers keeps T5's ``wo`` in fp32 in fp16 only; Wan's loader moves the VAE to fp32
    from dataclasses import replace

    from rlgen_cli.models.loading import in_model_dtype
    from rlgen_cli.models.tiny import tiny_wan_pipeline
    from tests.models.helpers import model_cfg

    low = getattr(torch, dtype)
    pipe = in_model_dtype(tiny_wan_pipeline(0, 32), replace(model_cfg("tiny_wan2_1"), dtype=dtype), ("vae",))
    params = dict(pipe.transformer.named_parameters())
    assert params["blocks.0.attn1.to_q.weight"].dtype == low and params["proj_out.weight"].dtype == low
    for name in (
        "scale_shift_table",
        "blocks.0.norm2.weight",
        "condition_embedder.time_embedder.linear_1.weight",
    ):
        assert params[name].dtype == torch.float32, name
    wo = pipe.text_encoder.encoder.block[0].layer[1].DenseReluDense.wo.weight
    assert wo.dtype == (torch.float32 if dtype == "float16" else low)
    assert pipe.text_encoder.shared.weight.dtype == low
    assert {p.dtype for p in pipe.vae.parameters()} == {torch.float32}
