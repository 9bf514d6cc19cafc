"""DiffusionNFT and AWM (``recipes/flow_forward.py``) through the CLI on tiny SD3: two epochs change every
LoRA tensor and write their metrics; a resumed run carries the old policy and ends where an uninterrupted
one does; settings the recipe cannot use exit with code 2 naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.models.sd3 import LORA_WEIGHTS_NAME
from tests.conftest import TINY_RUN

RUN = [
    *TINY_RUN, "algo.gradient_accumulation_steps=1", "algo.weight_decay=0.0", "algo.lr=1e-2", "eval_every=0",
    "images_every=0", "save_every=1", "keep_last=5",
]  # fmt: skip
AWM_FITS_3_STEPS = ["algo.forward.num_timesteps=2"]  # its 6 strata assume 14 rollout steps


def _weights(run: Path, epoch: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"epoch_{epoch:06d}" / "weights" / LORA_WEIGHTS_NAME)


@pytest.mark.parametrize("algo,extra", [("nft", []), ("awm", AWM_FITS_3_STEPS)])
def test_two_epochs_change_every_lora_tensor_and_log_the_loss(
    cli, tmp_path: Path, algo: str, extra: list[str]
):
    run = tmp_path / algo
    code, out = cli("train", *RUN, f"algo={algo}", *extra, "epochs=2", f"hydra.run.dir={run}")
    assert code == 0, out
    first, second = _weights(run, 1), _weights(run, 2)
    assert first.keys() == second.keys() and len(first) > 0
    unchanged = [k for k in first if torch.equal(first[k], second[k])]
    assert unchanged == [], f"{algo}: {len(unchanged)} of {len(first)} unchanged, e.g. {unchanged[:3]}"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert {"reward/mean", "policy_loss", "grad_norm", "old_decay", "trained_samples"} <= row.keys()
    # the old policy's decay min(1e-3·step, max) after one and two optimizer steps
    assert [row["old_decay"] for row in rows] == pytest.approx([1e-3, 2e-3])
    assert [row["global_step"] for row in rows] == [1, 2]


def test_resume_restores_the_old_policy_and_ends_where_an_uninterrupted_run_does(cli, tmp_path: Path):
    """DiffusionNFT samples from its old policy, so a resumed run that rebuilt it from the current weights
    would roll out differently; with β < 1 its loss depends on it too."""
    nft = [
        *RUN,
        "algo=nft",
        "algo.forward.nft_beta=0.5",
        "algo.forward.old.rate=0.3",
        "algo.forward.old.max_decay=0.9",
    ]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert cli("train", *nft, "epochs=2", f"hydra.run.dir={whole}")[0] == 0
    assert cli("train", *nft, "epochs=1", f"hydra.run.dir={resumed}")[0] == 0
    # after one step the old policy is 0.3·θ₀ + 0.7·θ₁, not θ₁: the second epoch samples from it
    code, out = cli("train", *nft, "epochs=2", "resume=auto", f"hydra.run.dir={resumed}")
    assert code == 0, out
    expected, got = _weights(whole, 2), _weights(resumed, 2)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["algo=nft", "algo.forward.loss=ppo"],
            "algo.forward.loss='ppo' is not valid; choose one of nft, awm",
        ),
        (
            ["algo=awm", "model.num_steps=2", "algo.forward.timestep_fraction=0.4"],
            "algo.forward.timestep_sampling=stratified draws from",
        ),
        (["algo=nft", "algo.adv_clip_max=0"], "algo.adv_clip_max=0.0: recipe=flow_forward maps"),
    ],
)
def test_settings_the_recipe_cannot_use_exit_2_naming_the_key(
    cli, tmp_path: Path, capsys, overrides: list[str], message: str
):
    code, out = cli("train", *RUN, *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2, out
    assert message in " ".join((out + capsys.readouterr().err).split())
