"""The family table (``schema/families.py``) agrees with the registries, the model YAMLs and the policies,
is read without torch, and ``model.family`` is a closed choice checked before any model is built."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from PIL import Image

from rlgen_cli.errors import UserError
from rlgen_cli.models import FAMILIES, build_policy
from rlgen_cli.schema.families import FAMILY_NAMES, FAMILY_TABLE, families
from rlgen_cli.schema.r3 import R3_FAMILIES
from rlgen_cli.schema.ranges import check_settings
from rlgen_cli.schema.run import ModelConfig
from rlgen_cli.schema.vlm import VLM_FAMILIES
from rlgen_cli.tasks.common import require_data
from tests.models.helpers import CPU, model_cfg

CONF_MODEL = Path(__file__).resolve().parents[2] / "conf" / "model"


def _families_named_in(node: object) -> set[str]:
    """Every value of a ``family`` key anywhere in a parsed YAML (R3's nest theirs under ``r3.policy``)."""
    if isinstance(node, dict):
        own = {v for k, v in node.items() if k == "family" or str(k).startswith("/model_schema@")}
        return own.union(*(_families_named_in(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(_families_named_in(value) for value in node))
    return set()


def test_every_registered_family_has_a_row_and_every_row_a_builder():
    assert {*FAMILIES, *VLM_FAMILIES, *R3_FAMILIES} == set(FAMILY_NAMES)
    for row in FAMILY_TABLE.values():
        assert importlib.util.find_spec(row.module) is not None, f"{row.name}: no module {row.module}"


def test_every_family_of_conf_model_is_in_the_table_and_every_row_has_a_yaml():
    named = set().union(
        *(_families_named_in(yaml.safe_load(f.read_text())) for f in CONF_MODEL.glob("*.yaml"))
    )
    assert named <= set(FAMILY_NAMES), (
        f"conf/model names families outside the table: {named - set(FAMILY_NAMES)}"
    )
    assert set(FAMILY_NAMES) <= named, f"families without a conf/model YAML: {set(FAMILY_NAMES) - named}"


def test_the_columns_are_consistent():
    for row in FAMILY_TABLE.values():
        assert not (row.editing and row.edits_on_request), row.name
        assert row.kind == "flow" or not (row.editing or row.video or row.diffusers_pipeline), row.name
    assert len(set(v for row in FAMILY_TABLE.values() for v in row.real_size_variants)) == sum(
        len(row.real_size_variants) for row in FAMILY_TABLE.values()
    ), "a real-size variant belongs to one family"


def test_reading_the_table_and_the_config_schema_imports_no_torch():
    code = (
        "import sys, rlgen_cli.schema.families, rlgen_cli.schema.choices, rlgen_cli.schema.run; "
        "sys.exit(3 if 'torch' in sys.modules else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr or "importing the family table imported torch"


def test_an_unknown_family_is_refused_with_the_valid_ones_and_the_closest():
    cfg = OmegaConf.structured(ModelConfig)
    cfg.family = "qwen_imag"
    with pytest.raises(
        UserError, match=r"model\.family='qwen_imag' is not valid \(did you mean qwen_image\?\)"
    ) as e:
        check_settings(cfg, prefix="model.")
    assert all(name in str(e.value) for name in FAMILY_NAMES)


def test_a_known_family_passes_the_check():
    cfg = OmegaConf.structured(ModelConfig)
    cfg.family = "wan2_2_i2v"
    check_settings(cfg, prefix="model.")


def test_a_text_conditioned_family_given_source_images_errors():
    policy = build_policy(dataclasses.replace(model_cfg("tiny_sd3"), guidance_scale=1.0), CPU)
    images = torch.rand(2, 3, policy.cfg.resolution, policy.cfg.resolution)
    with pytest.raises(UserError, match="model.family=sd3 is text-conditioned: it takes no source images"):
        policy.encode(["a red circle", "a blue square"], images)
    assert len(policy.encode(["a red circle", "a blue square"])) == 2


def test_the_guard_is_driven_by_the_table():
    """Exactly the families that neither edit nor edit on request refuse source images."""
    refusing = {
        row.name for row in FAMILY_TABLE.values() if row.kind == "flow" and not row.takes_source_images
    }
    assert refusing == set(families("flow", editing=False, edits_on_request=False))
    assert "sd3" in refusing and "bagel" not in refusing and "qwen_image_edit" not in refusing


def _data_cfg(family: str, prompts: Path) -> SimpleNamespace:
    data = SimpleNamespace(train=str(prompts), test=str(prompts))
    return SimpleNamespace(recipe="flow_grpo", data=data, model=SimpleNamespace(family=family))


def test_a_text_conditioned_family_given_an_editing_set_stops_before_loading(tmp_path):
    """The data check reads the ``editing`` column: a set whose rows carry source images is refused for a
    family that would drop them, accepted for an editing one."""
    Image.new("RGB", (8, 8)).save(tmp_path / "src.png")
    prompts = tmp_path / "edit.jsonl"
    prompts.write_text(json.dumps({"prompt": "make it red", "image": "src.png"}) + "\n")
    with pytest.raises(UserError, match=r"data\.train: example 0 .* model\.family=sd3 does not edit"):
        require_data(_data_cfg("sd3", prompts), tmp_path)
    require_data(_data_cfg("flux_kontext", prompts), tmp_path)
    text_only = tmp_path / "text.jsonl"
    text_only.write_text(json.dumps({"prompt": "a red circle"}) + "\n")
    require_data(_data_cfg("sd3", text_only), tmp_path)
