"""``launcher.mixed_precision``: applied, or refused where it would do nothing.

accelerate's autocast wraps the model it prepares: DDP over several processes, or an engine (DeepSpeed,
FSDP). One process without an engine trains unwrapped (``make_dist`` → ``LocalDist``), so bf16 there
was bit-identical to fp32: refused, as for launcher=local. fp16 on CPUs is a no-op in accelerate (no fp16
autocast there): refused before any worker starts. Under DDP on GPUs accelerate's fp16 autocast applies
but its GradScaler never acts (rlgen calls the backward and steps torch's optimizer itself): rlgen's own
loss scaler scales instead.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from rlgen_cli.errors import UserError
from rlgen_cli.schema.run import LauncherConfig
from rlgen_cli.training.distributed import dist as dist_module
from rlgen_cli.training.distributed.dist import AccelerateDist, require_autocast_device
from rlgen_cli.training.distributed.loss_scale import LossScaler
from tests.distributed.test_ddp_equivalence import GEOMETRY


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["accelerate", "multinode"])
def test_mixed_precision_with_one_process_and_no_engine_is_refused(name: str, precision: str):
    with pytest.raises(
        UserError, match=f"launcher.mixed_precision={precision} is accelerate's autocast"
    ) as err:
        LauncherConfig(name=name, num_processes=1, mixed_precision=precision)
    assert "model.dtype" in str(err.value) and "launcher.num_processes=2" in str(err.value)


def test_mixed_precision_is_kept_where_accelerate_applies_it(tmp_path: Path):
    LauncherConfig(name="accelerate", num_processes=2, mixed_precision="bf16")  # DDP wraps the model
    for engine in ("deepspeed_zero2", "deepspeed_zero3", "fsdp"):  # an engine, also for one process
        LauncherConfig(name=engine, num_processes=1, mixed_precision="bf16")
    deepspeed = tmp_path / "ds.json"
    deepspeed.write_text('{"zero_optimization": {"stage": 2}}')
    LauncherConfig(name="accelerate", num_processes=1, mixed_precision="bf16", config_file=str(deepspeed))
    ddp = tmp_path / "ddp.yaml"
    ddp.write_text("distributed_type: MULTI_GPU\nnum_processes: 1\n")
    with pytest.raises(UserError, match="trains it unwrapped"):  # a file without an engine: still DDP
        LauncherConfig(name="accelerate", num_processes=1, mixed_precision="bf16", config_file=str(ddp))


def test_the_local_refusal_no_longer_suggests_one_accelerate_process():
    with pytest.raises(UserError) as err:
        LauncherConfig(name="local", mixed_precision="bf16")
    assert "launcher.num_processes=1" not in str(err.value)
    assert "launcher=accelerate launcher.num_processes=2 launcher.mixed_precision=bf16" in str(err.value)


def test_fp16_on_cpus_is_refused_in_the_worker_before_accelerate_starts(monkeypatch: pytest.MonkeyPatch):
    require_autocast_device("fp16", cpu=False)
    require_autocast_device("bf16", cpu=True)  # CPU autocast has bf16
    with pytest.raises(UserError, match="fp16 does nothing on CPUs"):
        require_autocast_device("fp16", cpu=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    monkeypatch.setattr(dist_module, "AccelerateDist", lambda cpu: pytest.fail("accelerate started"))
    with pytest.raises(UserError, match="fp16 does nothing on CPUs"):
        dist_module.make_dist("cpu")


def test_fp16_on_cpus_stops_the_cli_with_exit_2_before_any_worker(cli, tmp_path: Path):
    code, out = cli(
        "train",
        *GEOMETRY,
        "device=cpu",
        "launcher=accelerate",
        "launcher.num_processes=2",
        "launcher.mixed_precision=fp16",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert code == 2 and "launcher.mixed_precision=fp16 does nothing on CPUs" in " ".join(out.split()), out
    assert not (tmp_path / "run" / "run.log").exists()  # no worker started


class _Policy:
    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def distribute(self, wrap) -> None:
        self.module = wrap(self.module)


def _ddp_dist(accelerate_scaler: object | None) -> AccelerateDist:
    """An AccelerateDist as DDP builds it (no engine), around a stand-in accelerator whose fp16 autocast
    is on when it has a GradScaler (as accelerate's on a GPU)."""
    dist = object.__new__(AccelerateDist)
    dist.engine, dist.world_size, dist.scaler, dist.exact = None, 2, None, None
    dist.accelerator = types.SimpleNamespace(
        scaler=accelerate_scaler,
        mixed_precision="fp16" if accelerate_scaler is not None else "no",
        prepare_model=lambda module: module,  # DDP's wrapper (and accelerate's autocast) left out
    )
    return dist


def test_ddp_fp16_autocast_scales_the_loss_with_rlgens_scaler():
    """accelerate's GradScaler only acts in accelerator.backward and its prepared optimizer, which DDP here
    never calls: without rlgen's scaler the fp16 gradients would go unscaled."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    optimizer = torch.optim.SGD([w], lr=1.0)
    dist = _ddp_dist(accelerate_scaler=object())
    dist.prepare(_Policy(torch.nn.Linear(1, 1)), optimizer, max_grad_norm=1.0, micro_batch_size=1)
    assert isinstance(dist.scaler, LossScaler)
    dist.backward((w * torch.tensor([3.0, -4.0])).sum())
    assert w.grad.tolist() == [3.0 * 2**16, -4.0 * 2**16]  # scaled
    assert dist.clip_and_step(optimizer, [w], max_norm=float("inf")) == 5.0  # unscaled before the step
    assert w.tolist() == [-2.0, 6.0]
    assert dist.loss_scale_metrics() == {"loss_scale": 2.0**16, "skipped_steps": 0.0}
    fp32 = _ddp_dist(accelerate_scaler=None)
    fp32.prepare(_Policy(torch.nn.Linear(1, 1)), optimizer, max_grad_norm=1.0, micro_batch_size=1)
    assert fp32.scaler is None  # fp32 / bf16: no scaler, as before
