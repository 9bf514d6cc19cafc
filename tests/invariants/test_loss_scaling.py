"""fp16 loss scaling (training/distributed/loss_scale.py through the Dist surface): the scale lifts fp16 gradients out of
underflow, an overflow skips the step and halves the scale, clean steps grow it, and its state travels
in checkpoints. bf16 / fp32 train without a scaler, exactly as before."""

from __future__ import annotations

import functools
import io
import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlgen_cli.training.checkpoints.checkpoint import OPTIMIZER_KEY, STATE_FILE
from rlgen_cli.training.distributed import dist as dist_module
from rlgen_cli.training.distributed.dist import SCALER_KEY, LocalDist
from rlgen_cli.training.distributed.loss_scale import INIT_SCALE, LossScaler

CPU = torch.device("cpu")


def _fp16_dist(*params: torch.nn.Parameter, lr: float = 1.0) -> tuple[LocalDist, torch.optim.Optimizer]:
    """A LocalDist prepared for fp16 compute around plain SGD (its update is hand-checkable)."""
    dist, optimizer = LocalDist(CPU), torch.optim.SGD(params, lr=lr)
    dist.prepare(None, optimizer, max_grad_norm=0.0, micro_batch_size=1, compute_dtype="float16")
    return dist, optimizer


def test_backward_scales_the_loss_and_the_step_unscales_it():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    dist, optimizer = _fp16_dist(w)
    dist.backward((w * torch.tensor([3.0, -4.0])).sum())
    assert w.grad.tolist() == [3.0 * 2**16, -4.0 * 2**16]  # d(scale·loss)/dw
    norm = dist.clip_and_step(optimizer, [w], max_norm=float("inf"))
    assert norm == 5.0  # the true gradient's norm, |(3, −4)|
    assert w.tolist() == [1.0 - 3.0, 2.0 + 4.0] and w.grad is None  # SGD, lr 1, on the true gradient
    assert dist.loss_scale_metrics() == {"loss_scale": 2.0**16, "skipped_steps": 0.0}
    assert dist.scaler.growth_tracker == 1


def test_clipping_sees_the_unscaled_gradient():
    w = torch.nn.Parameter(torch.tensor([0.0, 0.0]))
    dist, optimizer = _fp16_dist(w)
    dist.backward((w * torch.tensor([3.0, 4.0])).sum())
    assert dist.clip_and_step(optimizer, [w], max_norm=1.0) == 5.0
    torch.testing.assert_close(w.detach(), torch.tensor([-0.6, -0.8]))  # clipped to norm 1, not 1/65536


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_gradient_skips_the_step_and_halves_the_scale(bad: float):
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    dist, optimizer = _fp16_dist(w)
    dist.scaler.growth_tracker = 7
    dist.backward((w * torch.tensor([bad, 1.0])).sum())
    norm = dist.clip_and_step(optimizer, [w], max_norm=1.0)
    assert norm != norm or norm == float("inf")  # the step reports the non-finite norm
    assert w.tolist() == [1.0, 2.0] and w.grad is None  # unchanged, gradients cleared for the next step
    assert dist.loss_scale_metrics() == {"loss_scale": 2.0**15, "skipped_steps": 1.0}
    assert dist.scaler.growth_tracker == 0
    dist.backward((w * torch.tensor([1.0, 1.0])).sum())  # the next clean step trains at the new scale
    assert w.grad.tolist() == [2.0**15, 2.0**15]
    dist.clip_and_step(optimizer, [w], max_norm=float("inf"))
    assert w.tolist() == [0.0, 1.0]


def test_the_scale_grows_after_growth_interval_clean_steps_in_a_row():
    scaler = LossScaler(growth_interval=3)
    for finite in (True, True, False, True, True):  # an overflow restarts the count
        scaler.update(finite)
    assert (scaler.scale, scaler.growth_tracker) == (2.0**15, 2)
    scaler.update(True)
    assert (scaler.scale, scaler.growth_tracker, scaler.skipped_steps) == (2.0**16, 0, 1)
    assert LossScaler().growth_interval == 2000 and LossScaler().scale == INIT_SCALE == 2.0**16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bf16_and_fp32_have_no_scaler_and_unchanged_checkpoints(dtype: str):
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    dist, optimizer = LocalDist(CPU), torch.optim.AdamW([w], lr=0.1)
    dist.prepare(None, optimizer, max_grad_norm=1.0, micro_batch_size=1, compute_dtype=dtype)
    dist.backward((w * torch.tensor([3.0, -4.0])).sum())
    assert w.grad.tolist() == [3.0, -4.0]
    dist.clip_and_step(optimizer, [w], 1.0)
    assert dist.loss_scale_metrics() == {}
    state = dist.optimizer_state(optimizer, Path("unused"))
    assert SCALER_KEY not in state and state.keys() == optimizer.state_dict().keys()


def test_fp16_compute_needs_fp32_trained_weights_and_a_known_dtype():
    half = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    with pytest.raises(RuntimeError, match=r"fp32 trained weights; these are \['torch.float16'\]"):
        _fp16_dist(half)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        LocalDist(CPU).prepare(None, optimizer, max_grad_norm=1.0, micro_batch_size=1, compute_dtype="fp16")


def _through_a_checkpoint(state: dict) -> dict:
    """What resume reads back: the trainer state as torch.save wrote it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_the_scaler_state_is_saved_and_restored_with_the_optimizer(caplog):
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    dist, optimizer = _fp16_dist(w)
    dist.scaler.scale, dist.scaler.growth_tracker, dist.scaler.skipped_steps = 2.0**9, 11, 3
    saved = _through_a_checkpoint(dist.optimizer_state(optimizer, Path("unused")))
    assert saved[SCALER_KEY] == {
        "scale": 2.0**9,
        "growth_tracker": 11,
        "skipped_steps": 3,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
    }

    resumed, resumed_optimizer = _fp16_dist(torch.nn.Parameter(torch.tensor([1.0, 2.0])))
    resumed.load_optimizer_state(resumed_optimizer, saved, Path("unused"))
    assert resumed.scaler == dist.scaler
    assert resumed_optimizer.state_dict() == optimizer.state_dict()

    # a checkpoint written without scaling (bf16, or before rlgen scaled): the scale starts afresh, loudly
    plain = {k: v for k, v in saved.items() if k != SCALER_KEY}
    fresh, fresh_optimizer = _fp16_dist(torch.nn.Parameter(torch.tensor([1.0, 2.0])))
    with caplog.at_level(logging.WARNING, logger="rlgen_cli.training.distributed.dist"):
        fresh.load_optimizer_state(fresh_optimizer, plain, Path("unused"))
    assert fresh.scaler == LossScaler() and "written without fp16 loss scaling" in caplog.text


def test_a_foreign_scaler_state_is_refused():
    with pytest.raises(ValueError, match=r"unknown keys \['scale_factor'\]"):
        LossScaler().load_state_dict({"scale_factor": 2.0})


def _tiny_sd3(dtype: str):
    """The tiny SD3 policy in ``dtype`` (frozen weights in it, LoRA fp32) and one fixed velocity input."""
    from rlgen_cli.models import build_policy
    from tests.models.helpers import model_cfg

    torch.manual_seed(0)
    policy = build_policy(replace(model_cfg("tiny_sd3"), dtype=dtype), CPU)
    with torch.no_grad():
        cond = policy.encode(["a red square", "a blue circle"])
    return policy, cond, policy.noise(2, torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def fp16_sd3():
    return _tiny_sd3("float16")


def _lora_b_gradients(sd3, compute_dtype: str) -> dict[str, torch.Tensor]:
    """The unscaled gradient of every LoRA B after one backward of a small loss through ``sd3``."""
    policy, cond, x = sd3
    dist, optimizer = LocalDist(CPU), torch.optim.SGD(policy.trainable.parameters(), lr=1.0)
    dist.prepare(policy, optimizer, max_grad_norm=0.0, micro_batch_size=2, compute_dtype=compute_dtype)
    velocity = policy.velocity(x, torch.full((2,), 0.7), cond)
    # a loss as small as a policy-gradient loss on a few samples
    dist.backward(1e-3 * velocity.float().square().mean())
    if dist.scaler is not None:
        dist.scaler.unscale_(policy.trainable.parameters())
    grads = {n: p.grad.clone() for n, p in policy.trainable.named() if "lora_B" in n}
    optimizer.zero_grad(set_to_none=True)
    return grads


def _relative_errors(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> list[float]:
    return [((grads[n] - g).norm() / g.norm()).item() for n, g in reference.items()]


def test_fp16_loss_scaling_gives_every_lora_tensor_its_fp32_gradient(fp16_sd3):
    reference = _lora_b_gradients(_tiny_sd3("float32"), "float32")  # same weights, fp32 throughout
    assert len(reference) == 6 and all(g.any() for g in reference.values())
    scaled = _lora_b_gradients(fp16_sd3, "float16")
    assert max(_relative_errors(scaled, reference)) < 1e-2  # measured ≤ 1.8e-3: fp16's rounding
    # the same fp16 model without a scaler (what fp16 training did before): gradients through fp16
    # activations flush to 0, every B but the output projection's gets none (measured: 5 of 6)
    unscaled = _lora_b_gradients(fp16_sd3, "float32")
    assert sum(not g.any() for g in unscaled.values()) >= 3
    assert max(_relative_errors(unscaled, reference)) > 0.5


def test_one_fp16_step_moves_every_lora_tensor(fp16_sd3):
    policy, cond, x = fp16_sd3
    params = policy.trainable.parameters()
    before = [p.detach().clone() for p in params]
    dist, optimizer = _fp16_dist(*params, lr=1e-2)
    velocity = policy.velocity(x, torch.full((2,), 0.7), cond)
    dist.backward(1e-3 * velocity.float().square().mean())
    assert dist.clip_and_step(optimizer, params, max_norm=1.0) > 0
    # LoRA B starts at 0, so the first step moves B only (A's gradient is B·… = 0)
    moved = [not torch.equal(b, p) for b, p in zip(before, params)]
    zero_init = [not b.any() for b in before]
    assert [m for m, z in zip(moved, zero_init) if z] == [True] * sum(zero_init) and sum(zero_init) == 6
    with torch.no_grad():
        for p, b in zip(params, before):  # the fixture's policy is shared
            p.copy_(b)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {
        f"{f.name}/{k}": t for f in sorted(checkpoint.rglob("*.safetensors")) for k, t in load_file(f).items()
    }


@pytest.mark.slow
def test_fp16_resume_restores_the_scale_and_equals_an_uninterrupted_run(tmp_path: Path, monkeypatch):
    from tests.conftest import TINY_RUN, run_cli

    # the scale doubles after every clean step, so a scale the resume failed to restore shows
    monkeypatch.setattr(dist_module, "LossScaler", functools.partial(LossScaler, growth_interval=1))
    run = [
        "model=tiny_sd3", *TINY_RUN, "model.dtype=float16", "eval_every=0", "images_every=0", "save_every=1",
        "keep_last=5",
    ]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    code, out = run_cli("train", *run, "epochs=2", f"hydra.run.dir={straight}")
    assert code == 0, out
    code, out = run_cli("train", *run, "epochs=1", f"hydra.run.dir={resumed}")
    assert code == 0, out
    saved = torch.load(resumed / "checkpoints" / "epoch_000001" / STATE_FILE, weights_only=True)
    scaler = saved[OPTIMIZER_KEY][SCALER_KEY]
    scale = scaler["scale"]
    assert scale > INIT_SCALE and scaler["skipped_steps"] == 0
    code, out = run_cli("train", *run, "epochs=2", "resume=auto", f"hydra.run.dir={resumed}")
    assert code == 0, out

    scales = [row["loss_scale"] for row in _metrics(straight)]
    assert scales[0] == scale and scales[1] > scale  # grew again in the second epoch
    assert [row["loss_scale"] for row in _metrics(resumed)] == scales
    straight_weights = _weights(straight / "checkpoints" / "epoch_000002" / "weights")
    resumed_weights = _weights(resumed / "checkpoints" / "epoch_000002" / "weights")
    assert straight_weights.keys() == resumed_weights.keys() and straight_weights
    for key, tensor in straight_weights.items():
        assert torch.equal(resumed_weights[key], tensor), key
