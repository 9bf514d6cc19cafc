"""Shared pieces of the R3 tests: a tiny run's overrides, config composition, a warm-started text policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vlm.conftest import compose_config

# tiny_r3 already has 4 branches, 8 text tokens and 3 + 3 flow steps; no bars, no periodic eval
TINY_R3 = ["model=tiny_r3", "progress=false", "eval_every=0"]  # R3 saves no rollout grids: no images_every


compose_r3 = compose_config  # the VLM tests' composer: (typed, raw) as the tasks receive them


@pytest.fixture(scope="session")
def warm_text_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2.5-VL fine-tuned to write ``<think>a cat</think>`` (see ``_warm_start.py``)."""
    from tests.r3._warm_start import warm_started_text_policy

    return warm_started_text_policy(tmp_path_factory.mktemp("warm_text"))


def warm_text_overrides(directory: Path) -> list[str]:
    """Overrides that load the warm-started text policy from ``directory`` (a saved model, not tiny)."""
    return [
        "r3.policy.text.tiny=false",
        f"r3.policy.text.path={directory}",
        "r3.policy.text.local_files_only=true",
        "r3.max_output_token_n_gen=16",
    ]
