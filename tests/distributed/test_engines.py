"""DeepSpeed ZeRO-2/3 and FSDP2 runs with two CPU (gloo) processes complete an epoch through the CLI —
rollout, update, evaluation and checkpoint — and train what one process trains.

Same geometry as ``test_ddp_equivalence``: one process × 8 samples with two accumulated micro-batches
against two processes × 4, where the engine reduces the gradients, clips and steps. ZeRO-3 and FSDP shard
the weights, so every rank evaluates and the checkpoint's weights are gathered from the shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.errors import UserError
from rlgen_cli.launch.commands import CONFIGS, launch_command, require_engine
from rlgen_cli.models.sd3 import LORA_WEIGHTS_NAME
from rlgen_cli.recipes.flow_run import require_ema_engine
from rlgen_cli.schema.algo import FlowGrpoAlgoConfig
from rlgen_cli.schema.choices import Launcher
from rlgen_cli.schema.run import LauncherConfig
from rlgen_cli.training.distributed.dist import LocalDist
from tests.conftest import run_cli

GEOMETRY = [
    "algo.prompts_per_epoch=2", "algo.group_size=4", "algo.sample_batch_size=4", "algo.train_batch_size=4",
    "model.num_steps=3", "model.eval_num_steps=3", "data.eval_num_prompts=2", "epochs=1", "eval_every=1",
    "images_every=0", "progress=false",
]  # fmt: skip
ENGINES = ("deepspeed_zero2", "deepspeed_zero3", "fsdp")


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / "epoch_000001" / "weights" / LORA_WEIGHTS_NAME)


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The one-process reference run (two accumulated micro-batches of 4)."""
    run = tmp_path_factory.mktemp("single")
    code, out = run_cli("train", *GEOMETRY, "algo.gradient_accumulation_steps=2", f"hydra.run.dir={run}")
    assert code == 0, out
    return run


def _two_process_epoch(launcher: str, single: Path, run: Path) -> None:
    code, out = run_cli(
        "train", *GEOMETRY, f"launcher={launcher}", "launcher.num_processes=2", f"hydra.run.dir={run}"
    )
    assert code == 0, out
    one, two = _metrics(single), _metrics(run)
    assert one["num_groups"] == two["num_groups"] == 2  # the groups were gathered across ranks
    for key in ("reward/mean", "reward/std", "trained_samples", "policy_loss", "eval/reward/mean"):
        assert abs(one[key] - two[key]) <= 1e-9 * max(1.0, abs(one[key])), key
    assert abs(one["grad_norm"] - two["grad_norm"]) <= 1e-6 * one["grad_norm"]  # the engine's reduced norm
    a, b = _weights(single), _weights(run)  # gathered from the shards under ZeRO-3 / FSDP
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_deepspeed_zero2_epoch_through_cli(single: Path, tmp_path: Path):
    pytest.importorskip("deepspeed")
    _two_process_epoch("deepspeed_zero2", single, tmp_path / "zero2")


def test_fsdp_epoch_through_cli(single: Path, tmp_path: Path):
    _two_process_epoch("fsdp", single, tmp_path / "fsdp")


@pytest.mark.slow
def test_deepspeed_zero3_epoch_through_cli(single: Path, tmp_path: Path):
    pytest.importorskip("deepspeed")
    _two_process_epoch("deepspeed_zero3", single, tmp_path / "zero3")


# -- the pieces, without processes ------------------------------------------------------------------
@pytest.mark.parametrize("name", ENGINES)
def test_engine_launchers_use_their_packaged_config(name: str, tmp_path: Path):
    assert name in get_args(Launcher)
    argv = launch_command(LauncherConfig(name=name, num_processes=2), tmp_path / "resolved.yaml")
    assert argv[argv.index("--config_file") + 1] == str(CONFIGS / f"{name}.yaml")
    assert "--multi_gpu" not in argv and "--cpu" not in argv  # the config names the engine
    assert argv[argv.index("--num_processes") + 1] == "2"


def test_packaged_configs_name_their_engine():
    from omegaconf import OmegaConf

    for name, kind in [("deepspeed_zero2", "DEEPSPEED"), ("deepspeed_zero3", "DEEPSPEED"), ("fsdp", "FSDP")]:
        config = OmegaConf.load(CONFIGS / f"{name}.yaml")
        assert config.distributed_type == kind
    assert OmegaConf.load(CONFIGS / "deepspeed_zero2.yaml").deepspeed_config.zero_stage == 2
    assert OmegaConf.load(CONFIGS / "deepspeed_zero3.yaml").deepspeed_config.zero_stage == 3
    assert OmegaConf.load(CONFIGS / "fsdp.yaml").fsdp_config.fsdp_version == 2


def test_missing_engine_is_a_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a)
    )
    with pytest.raises(UserError, match="needs deepspeed"):
        require_engine(LauncherConfig(name="deepspeed_zero2", num_processes=2))
    require_engine(LauncherConfig(name="fsdp", num_processes=2))  # torch's own


def test_fsdp_refuses_ema():
    require_ema_engine(True, fsdp=False)  # DDP / ZeRO-2 keep whole weights; ZeRO-3 gathers them for the EMA
    require_ema_engine(False, fsdp=True)
    with pytest.raises(UserError, match="ema is not supported with launcher=fsdp"):
        require_ema_engine(True, fsdp=True)


@pytest.mark.parametrize("change", ["window", "best_of_n"])
def test_several_processes_refuse_per_sample_step_counts(change):
    algo = FlowGrpoAlgoConfig()
    algo.require_rank_symmetric(several_ranks=True)  # every sample trains the same steps
    if change == "window":
        algo.window.kind = "random_subset"
    else:
        algo.best_of_n = 1
    with pytest.raises(UserError, match="single-process for now"):
        algo.require_rank_symmetric(several_ranks=True)


def test_local_clip_and_step_is_torch_arithmetic():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = torch.optim.AdamW(a.parameters(), lr=0.1), torch.optim.AdamW(b.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    dist = LocalDist(torch.device("cpu"))
    assert dist.prepare(None, opt_a, max_grad_norm=0.01, micro_batch_size=5) is opt_a
    dist.backward(a(x).square().mean(), sync=False)
    dist.backward(a(2 * x).square().mean())
    norm = dist.clip_and_step(opt_a, list(a.parameters()), 0.01)
    (b(x).square().mean()).backward()
    (b(2 * x).square().mean()).backward()
    assert norm == torch.nn.utils.clip_grad_norm_(b.parameters(), 0.01).item()
    opt_b.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert all(p.grad is None for p in a.parameters())


@pytest.mark.slow
def test_fsdp_resume_is_exact(tmp_path: Path):
    """FSDP's checkpoint holds torch's full optimizer state: epoch 1, resume, epoch 2 == two epochs."""
    fsdp = [*GEOMETRY, "eval_every=0", "save_every=1", "launcher=fsdp", "launcher.num_processes=2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_cli("train", *fsdp, "epochs=2", f"hydra.run.dir={straight}")[0] == 0
    assert run_cli("train", *fsdp, "epochs=1", f"hydra.run.dir={resumed}")[0] == 0
    assert run_cli("train", *fsdp, "epochs=2", "resume=auto", f"hydra.run.dir={resumed}")[0] == 0
    a, b = (
        load_file(run / "checkpoints" / "epoch_000002" / "weights" / LORA_WEIGHTS_NAME)
        for run in (straight, resumed)
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
