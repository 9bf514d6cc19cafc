"""DGPO (``algo=dgpo``, ``recipes/flow_dgpo.py``) through the CLI on tiny SD3: one epoch trains; settings
it cannot train exit with code 2 before anything runs, naming the key and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlgen_cli.models.sd3 import LORA_WEIGHTS_NAME
from tests.conftest import TINY_RUN

RUN = [
    *TINY_RUN,
    "algo=dgpo",
    "algo.gradient_accumulation_steps=1",
    "eval_every=0",
    "images_every=0",
    "algo.forward.num_timesteps=2",
]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (  # a step of 3 × 2 = 6 samples splits a group of 4
            [
                "algo.group_size=4",
                "algo.train_batch_size=3",
                "algo.sample_batch_size=3",
                "algo.prompts_per_epoch=3",
                "algo.gradient_accumulation_steps=2",
            ],
            "algo.train_batch_size × algo.gradient_accumulation_steps = 6 samples, not a multiple of "
            "algo.group_size=4",
        ),
        (  # [0, int(3·0.67)] = [0, 2] holds 3 σ, not 4
            ["algo.forward.num_timesteps=4", "algo.forward.timestep_fraction=0.67"],
            "algo.forward.num_timesteps=4 distinct σ of the indices [0, int(T·fraction)] = [0, 2]",
        ),
        (["algo.forward.dgpo_reference=ema"], "algo.forward.dgpo_reference"),
        (["algo.forward.dgpo_beta=0"], "algo.forward.dgpo_beta"),
    ],
)
def test_settings_dgpo_cannot_train_exit_2_naming_the_key(
    cli, tmp_path: Path, capsys, overrides: list[str], message: str
):
    run = tmp_path / "run"
    code, out = cli("train", *RUN, *overrides, f"hydra.run.dir={run}")
    assert code == 2, out
    assert message in " ".join((out + capsys.readouterr().err).split())
    assert not (run / "metrics.jsonl").exists()


@pytest.mark.slow  # one tiny epoch: 2.5 min on two loaded cores
def test_one_epoch_changes_every_lora_tensor_and_logs_the_group_weights(cli, tmp_path: Path):
    """Two prompts × 2 samples in one step: whole groups; the weights move and the group weight is a
    probability (½ before the policy leaves the reference: at step 0 e_θ = e_ref)."""
    run = tmp_path / "run"
    code, out = cli("train", *RUN, "epochs=1", "save_every=1", "algo.lr=1e-2", f"hydra.run.dir={run}")
    assert code == 0, out
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["global_step"] == 1 and row["grad_norm"] > 0
    assert row["group_weight_mean"] == 0.5  # σ(0): the LoRA starts at zero, so e_θ = e_ref exactly
    trained = load_file(run / "checkpoints" / "epoch_000001" / "weights" / LORA_WEIGHTS_NAME)
    assert all(bool(t.abs().sum() > 0) for k, t in trained.items() if "lora_B" in k)
