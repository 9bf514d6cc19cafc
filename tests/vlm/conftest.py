"""Shared pieces of the VLM tests: composing configs like the CLI does, one tiny policy per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# A tiny StepGRPO run: 2 prompts × 2 completions of ≤ 12 tokens, one micro-batch per optimizer step, no
# periodic eval (step_grpo's own geometry is R1-VL's 64 completions per step).
TINY_VLM = [
    "model=tiny_qwen2_vl", "data=tiny_vlm", "progress=false", "eval_every=0", "algo.prompts_per_epoch=2",
    "algo.group_size=2", "algo.sample_batch_size=4", "algo.train_batch_size=4",
    "algo.gradient_accumulation_steps=1", "algo.token.max_completion_tokens=12",
]  # fmt: skip


def compose_config(name: str, overrides: list[str], run_dir: Path | str = "/tmp/unused"):
    """(typed, raw) config of primary config ``name`` with ``overrides``, as the tasks receive them."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from rlgen_cli._hydra import conf_dir, verb_overrides
    from rlgen_cli.schema.store import register_schemas
    from rlgen_cli.tasks.common import validated

    register_schemas(name)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        raw = compose(config_name=name, overrides=verb_overrides(name, overrides))
    OmegaConf.set_struct(raw, False)
    raw.run_dir = str(run_dir)
    return validated(raw), raw


@pytest.fixture(scope="session")
def tiny_vlm_policy():
    from rlgen_cli.vlm.policy import build_vlm

    typed, _ = compose_config("train", TINY_VLM + ["algo=step_grpo", "reward=length"])
    return build_vlm(typed.model, torch.device("cpu"))
