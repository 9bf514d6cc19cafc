"""The SFT warm-up's global batch is train_batch_size × gradient_accumulation_steps over a pass of the data
file: R1-VL's 4 × 32 composes (the flow recipes' rule that prompts_per_epoch × group_size split into whole
optimizer steps does not apply to an epoch that is a pass over ``data.train``), and an epoch with fewer
micro-batches than one step's accumulation takes one, shorter, step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlgen_cli.errors import UserError
from rlgen_cli.schema.algo import AlgoConfig, VlmSftAlgoConfig
from tests.vlm.conftest import TINY_VLM, compose_config

R1VL_BATCH = {"train_batch_size": 4, "gradient_accumulation_steps": 32}  # docs/vlm.md: global batch 128


def test_r1vl_sft_batch_composes_while_a_sampled_epoch_still_needs_whole_steps():
    assert VlmSftAlgoConfig(**R1VL_BATCH).gradient_accumulation_steps == 32
    # 2 prompts × 8 samples = 16 samples = 4 micro-batches of 4: not 32 per step
    with pytest.raises(UserError, match=r"4 training micro-batches per epoch are not divisible"):
        AlgoConfig(**R1VL_BATCH)


@pytest.mark.slow  # a tiny VLM's two SFT epochs: ~12 s on two busy cores
def test_an_epoch_shorter_than_one_step_takes_one_step(tmp_path: Path):
    """7 kept conversations = 2 micro-batches of 4 per epoch, accumulation 32: one optimizer step an epoch."""
    from rlgen_cli.recipes.vlm_sft import VLMSFTRecipe

    rollout_only = (  # SFT generates no rollouts (and refuses these settings of them)
        "algo.token.max_completion_tokens", "algo.group_size", "algo.prompts_per_epoch", "algo.sample_batch_size",
    )  # fmt: skip
    tiny = [o for o in TINY_VLM if not o.startswith(rollout_only)]
    overrides = [*tiny, "algo=vlm_sft", "reward=length", "data.train=builtin:tiny_sft.jsonl", "epochs=2",
                 "save_every=0", "algo.train_batch_size=4", "algo.gradient_accumulation_steps=32"]  # fmt: skip
    typed, raw = compose_config("train", overrides, run_dir=tmp_path)
    recipe = VLMSFTRecipe(typed, raw)
    recipe.setup()
    try:
        recipe.train()
    finally:
        recipe.cleanup()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in rows] == [1, 2], rows
