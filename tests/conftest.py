"""Shared fixtures: one tiny SD3 per session, an in-process CLI runner, small-run overrides."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _default_threads() -> int:
    """Two threads, or the cores' share of one of ``pytest -n N``'s worker processes (N workers with two
    threads each on two cores would make every GEMM wait for a core)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    return max(1, min(2, (os.cpu_count() or 1) // workers))


# The thread count picks CPU kernels (GEMM blocking, reduction splits): OMP_NUM_THREADS, when set (as
# `make test-kernels` does), is honoured; otherwise `_default_threads()`.
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or _default_threads()))

# A run small enough for CI: the tiny SD3 demo, 2 prompts × 2 samples per epoch, 3 steps, no bars.
TINY_RUN = [
    "experiment=tiny_cpu", "algo.prompts_per_epoch=2", "algo.group_size=2", "algo.sample_batch_size=4", "algo.train_batch_size=4",
    "model.num_steps=3", "model.eval_num_steps=3", "data.eval_num_prompts=2", "progress=false",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(autouse=True)
def _a_free_rendezvous_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launched runs rendezvous at MASTER_PORT (launcher.main_process_port's fallback, else 29500): a free
    port per test, so two launches at once (``pytest -n 2``, or another suite on the machine) never meet."""
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown where it is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``pytest -n N --dist loadfile`` with tests/distributed as one file: its runs launch two processes
    each, and two launches at once on two cores hit their timeouts; every other file stays on one worker
    (its module fixtures are built once). Other --dist modes are xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class DistributedTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "tests/distributed" if path.startswith("tests/distributed/") else path

    return DistributedTogether(config, log)


def _trains_a_flow_model(args: list[str]) -> bool:
    """No model= choice, or one of a flow family (a VLM or R3 model picks its own recipe, which the tiny
    flow demo's algorithm choice would override)."""
    from rlgen_cli._hydra import conf_dir

    model = next((a.split("=", 1)[1] for a in args if a.startswith("model=")), None)
    return model is None or "override /recipe" not in (conf_dir() / "model" / f"{model}.yaml").read_text()


def run_cli(*args: str) -> tuple[int, str]:
    """Run ``rlgen ARGS`` in this process; returns (exit code, combined output)."""
    from typer.testing import CliRunner

    from rlgen_cli.cli import app

    args = list(args)
    chooses_experiment = any(a.startswith(("experiment=", "+experiment=")) for a in args)
    if args and args[0] == "train" and not chooses_experiment and _trains_a_flow_model(args):
        args.append("experiment=tiny_cpu")  # the tiny SD3 demo, not the default ShapesEval experiment
    result = CliRunner().invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def validated_train(*overrides: str, experiment: str | None = "experiment=tiny_cpu"):
    """The validated config ``rlgen train`` composes from ``overrides`` (on the tiny SD3 demo unless
    ``experiment`` is None), without a run directory: what the config boundary accepts or refuses."""
    from omegaconf import OmegaConf

    from rlgen_cli._hydra import compose_verb
    from rlgen_cli.tasks.common import validated

    cfg = compose_verb("train", [*([experiment] if experiment else []), *overrides])
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = "/tmp/unused"
    return validated(cfg)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def tiny_model_cfg():
    from omegaconf import OmegaConf

    from rlgen_cli._hydra import conf_dir
    from rlgen_cli.schema.model import option_section

    return OmegaConf.to_object(option_section(OmegaConf.load(conf_dir() / "model" / "tiny_sd3.yaml")))


@pytest.fixture(scope="session")
def tiny_policy(tiny_model_cfg):
    from rlgen_cli.models import build_policy

    return build_policy(tiny_model_cfg, torch.device("cpu"))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
