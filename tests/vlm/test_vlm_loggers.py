"""The VLM recipes honour ``logging.*``: ``logging.tensorboard=true`` writes TensorBoard event files under
run_dir/tensorboard, as the flow recipes and R3 do (``training/reporting/metrics.py: build_loggers``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.vlm.conftest import TINY_VLM

pytest.importorskip("torch.utils.tensorboard")

TOKEN_GRPO = [*TINY_VLM, "algo=step_grpo", "reward=length", "epochs=1", "save_every=0"]
ROLLOUT_ONLY = ("algo.token.max_completion_tokens", "algo.group_size", "algo.prompts_per_epoch",
                "algo.sample_batch_size")  # fmt: skip
"""Settings of TINY_VLM that SFT (no rollouts: one pass over data.train an epoch) refuses."""
SFT = [
    *(o for o in TINY_VLM if not o.startswith(ROLLOUT_ONLY)),
    "algo=vlm_sft", "reward=length", "data.train=builtin:tiny_sft.jsonl", "epochs=1", "save_every=0",
]  # fmt: skip


def _event_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def _scalar_tags(run_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return set(events.Tags()["scalars"])


def test_vlm_rl_writes_tensorboard_events(tmp_path: Path):
    run_dir = tmp_path / "run"
    code, out = run_cli("train", *TOKEN_GRPO, "logging.tensorboard=true", f"hydra.run.dir={run_dir}")
    assert code == 0, out
    assert _event_files(run_dir), f"no TensorBoard event files under {run_dir / 'tensorboard'}"
    assert {"reward/mean", "policy_loss"} <= _scalar_tags(run_dir)
    assert (run_dir / "metrics.jsonl").is_file()  # the metrics log is still written


@pytest.mark.slow  # a second tiny run (~5 s); the loggers are built by the same TrainerRun code
def test_vlm_sft_writes_tensorboard_events(tmp_path: Path):
    run_dir = tmp_path / "run"
    code, out = run_cli("train", *SFT, "logging.tensorboard=true", f"hydra.run.dir={run_dir}")
    assert code == 0, out
    assert _event_files(run_dir), f"no TensorBoard event files under {run_dir / 'tensorboard'}"
    assert "loss" in _scalar_tags(run_dir)


def test_without_tensorboard_no_event_files_are_written(tmp_path: Path):
    run_dir = tmp_path / "run"
    code, out = run_cli("train", *TOKEN_GRPO, f"hydra.run.dir={run_dir}")
    assert code == 0, out
    assert not (run_dir / "tensorboard").exists()
