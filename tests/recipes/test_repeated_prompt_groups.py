"""A prompt drawn twice in one epoch (an epoch straddling two passes over the prompts, or more prompts per
epoch than the file holds) makes two groups of K, each normalised on its own: groups are draws
(``GroupSampler.group_keys``: position // K), not dataset indices, in GRPO's advantages, DPO's pairs and
the VLM recipe's. Flow-GRPO's own sampler (``algo.prompts_per_draw``) keeps upstream's per-prompt pooling."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlgen_cli.data.sampler import GroupSampler
from tests.conftest import TINY_RUN

TWICE_EACH = ["algo.prompts_per_epoch=32", "algo.group_size=2", "algo.sample_batch_size=8", "algo.train_batch_size=8",
              "epochs=1", "eval_every=0", "images_every=0"]  # fmt: skip
"""32 draws from the 16 tiny prompts: each prompt in two groups of the epoch."""


def _last_row(run: Path) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])


def test_groups_are_draws_and_upstream_draws_pool_by_prompt():
    sampler = GroupSampler(dataset_size=3, prompts_per_step=4, group_size=2, seed=0)
    indices = torch.tensor(sampler.global_indices_for_epoch(0))
    positions = torch.arange(len(indices))
    assert len(set(indices.tolist())) < 4  # the epoch draws a prompt twice
    assert sampler.group_keys(positions, indices).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    upstream = GroupSampler(dataset_size=3, prompts_per_step=4, group_size=2, seed=0, prompts_per_draw=2)
    assert torch.equal(upstream.group_keys(positions, indices), indices)


def test_grpo_normalises_each_draw_of_a_prompt_as_its_own_group(cli, tmp_path: Path):
    code, out = cli("train", *TINY_RUN, *TWICE_EACH, f"hydra.run.dir={tmp_path}")
    assert code == 0, out
    assert _last_row(tmp_path)["num_groups"] == 32


def test_dpo_pairs_each_draw_of_a_prompt(cli, tmp_path: Path):
    dpo = ["algo=dpo", "algo.pref.timesteps_per_sample=1"]
    code, out = cli("train", *TINY_RUN, *dpo, *TWICE_EACH, f"hydra.run.dir={tmp_path}")
    assert code == 0, out
    row = _last_row(tmp_path)
    assert row["pairs"] + row["skipped_groups"] == 32


def test_the_vlm_recipe_normalises_each_draw_of_a_prompt_as_its_own_group(cli, tmp_path: Path):
    vlm = [
        "model=tiny_qwen2_vl",
        "algo=token_grpo",
        "data=tiny_vlm",
        "reward=length",
        "progress=false",
        "epochs=1",
        "eval_every=0",
        "algo.prompts_per_epoch=16",
        "algo.group_size=2",
        "algo.sample_batch_size=8",
        "algo.train_batch_size=8",
    ]  # fmt: skip  (8 prompts in tiny_vlm)
    code, out = cli("train", *vlm, f"hydra.run.dir={tmp_path}")
    assert code == 0, out
    assert _last_row(tmp_path)["num_groups"] == 16
