"""``kl_to_ref``: the measured divergence to the reference, logged with ``algo.kl_weight`` 0 too (where
``kl_loss`` is 0 by construction). It is 0 exactly while the policy has not moved (the LoRA's B matrices
start at 0, so the adapter changes nothing), and positive once an update has moved it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlgen_cli.recipes import flow_forward, flow_grpo
from tests.conftest import TINY_RUN

ONE_EPOCH = ["epochs=1", "eval_every=0", "save_every=0", "images_every=0"]
NFT = ["algo=nft", "algo.gradient_accumulation_steps=1"]


def _row(cli, tmp_path: Path, *args: str) -> dict[str, float]:
    code, out = cli("train", *TINY_RUN, *ONE_EPOCH, *args, f"hydra.run.dir={tmp_path}")
    assert code == 0, out
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return row


@pytest.mark.parametrize(
    ("recipe", "update", "extra"),
    [
        (flow_grpo, "update_values", ["algo.kl_weight=0", "algo.lr=3e-2"]),
        (flow_forward, "update", [*NFT, "algo.kl_weight=0", "algo.lr=3e-2"]),
    ],
    ids=["grpo", "nft"],
)
@pytest.mark.slow  # ≈ 25 s per recipe: four one-epoch tiny trainings
def test_without_a_kl_term_the_divergence_is_measured_zero_until_the_policy_moves(
    cli, tmp_path: Path, monkeypatch, recipe, update, extra
):
    moved = _row(cli, tmp_path / "moved", *extra)
    assert moved["kl_loss"] == 0.0  # no KL term: kl_loss says nothing
    assert moved["kl_to_ref"] > 0.0, moved
    still_update = lambda *args, **kwargs: {"policy_loss": [0.0]}  # noqa: E731  (an update that moves nothing)
    monkeypatch.setattr(recipe, update, still_update)
    still = _row(cli, tmp_path / "still", *extra)
    assert still["kl_to_ref"] == 0.0, still  # the same weights as the reference: no divergence at all
