"""The LoRA file's adapter metadata names exactly the adapted modules, so diffusers' ``load_lora_weights``
loads it without peft's warnings (an ``exclude_modules`` that excluded nothing, target patterns that
match modules the file has no weights for)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

from rlgen_cli.models.sd3 import LORA_WEIGHTS_NAME, SD3Policy
from rlgen_cli.models.tiny import tiny_sd3_pipeline

CPU = torch.device("cpu")


def test_an_sd3_lora_loads_in_diffusers_without_peft_warnings(tmp_path: Path, tiny_model_cfg):
    policy = SD3Policy(tiny_sd3_pipeline(0), tiny_model_cfg, CPU)
    policy.trainable.save(tmp_path)
    with safe_open(str(tmp_path / LORA_WEIGHTS_NAME), "pt") as f:
        metadata = json.loads(f.metadata()["lora_adapter_metadata"])
        names = f.keys()
        adapted = sorted({key.removeprefix("transformer.").split(".lora_")[0] for key in names})
    assert "transformer.exclude_modules" not in metadata
    assert metadata["transformer.target_modules"] == adapted  # exactly the modules with weights
    assert metadata["transformer.r"] == tiny_model_cfg.lora.rank
    assert metadata["transformer.lora_alpha"] == tiny_model_cfg.lora.alpha

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_sd3_pipeline(0).load_lora_weights(tmp_path, weight_name=LORA_WEIGHTS_NAME)
    from_peft = [
        str(w.message) for w in caught if "exclude_modules" in str(w.message) or "PEFT" in str(w.message)
    ]
    assert from_peft == []
