"""Shared pieces of the R3 tests: a tiny run's overrides, config composition, a warm-started text policy."""

from __future__ import annotations

from pathlib import Path

import pytest

# tiny_r3 already has 4 branches, 8 text tokens and 3 + 3 flow steps; no bars, no periodic eval
TINY_R3 = ["model=tiny_r3", "progress=false", "eval_every=0", "images_every=0"]


def compose_r3(name: str, overrides: list[str], run_dir: Path | str = "/tmp/unused"):
    """(typed, raw) config of primary config ``name``, as the tasks receive them."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from rlgen_cli._hydra import conf_dir
    from rlgen_cli.schema.store import register_schemas
    from rlgen_cli.tasks.common import validated

    register_schemas()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        raw = compose(config_name=name, overrides=overrides)
    OmegaConf.set_struct(raw, False)
    raw.run_dir = str(run_dir)
    return validated(raw), raw


@pytest.fixture(scope="session")
def warm_text_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2.5-VL fine-tuned to write ``<think>a cat</think>`` (see ``_warm_start.py``)."""
    from tests.r3._warm_start import warm_started_text_policy

    return warm_started_text_policy(tmp_path_factory.mktemp("warm_text"))


def warm_text_overrides(directory: Path) -> list[str]:
    """Overrides that load the warm-started text policy from ``directory`` (a saved model, not tiny)."""
    return [
        "r3.policy.text.tiny=false", f"r3.policy.text.path={directory}", "r3.policy.text.local_files_only=true",
        "r3.max_output_token_n_gen=16",
    ]  # fmt: skip
