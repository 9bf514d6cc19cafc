"""A checkpoint saved with one model section for every family (every key, read or not) loads under its
family's own schema: the keys the family reads keep their saved values, the others are dropped."""

from __future__ import annotations

from omegaconf import OmegaConf

from rlgen_cli.schema.model import model_schema, typed_model_section
from rlgen_cli.schema.r3 import R3CompositePolicy, typed_policy

CATCH_ALL = {  # a section as the one schema for every family saved it
    "family": "sd3", "path": None, "tiny": True, "tiny_seed": 3, "weights": "pretrained", "variant": "auto",
    "text_encoders": "real_size", "local_files_only": False, "revision": None, "dtype": "float32",
    "frozen_dtype": None, "vae_dtype": None, "resolution": 64, "height": None, "width": None, "num_frames": 1,
    "guidance_scale": 4.5, "image_guidance_scale": 1.0, "negative_prompt": "", "shift": 3.0, "num_steps": 6,
    "eval_num_steps": 8, "noise_level": 0.7, "max_sequence_length": 32, "prompt_cache_mb": 256.0,
    "gradient_checkpointing": False, "attention": "sdpa", "compile": False,
    "lora": {"enabled": True, "rank": 4, "alpha": 8, "target_modules": ["attn.to_q"], "init": "gaussian"},
    "vlm": {"min_pixels": 3136, "max_pixels": 400000, "max_context": 4096, "completion_cap": None},
    "experts": {"train": "both", "guidance_scale_2": None},
}  # fmt: skip


def test_a_saved_catch_all_section_loads_under_its_familys_schema():
    typed = typed_model_section(OmegaConf.create(CATCH_ALL))
    assert OmegaConf.get_type(typed) is model_schema("sd3")
    assert "vlm" not in typed and "experts" not in typed and "num_frames" not in typed
    section = OmegaConf.to_object(typed)
    assert (section.resolution, section.num_steps, section.tiny_seed, section.lora.rank) == (64, 6, 3, 4)


def test_a_saved_policy_holding_both_r3_families_parts_loads_as_the_composite():
    part = dict(CATCH_ALL)
    saved = OmegaConf.create(
        {
            "text": {**part, "family": "qwen2_5_vl"},
            "generator": {**part, "family": "qwen_image"},
            "editor": {**part, "family": "qwen_image_edit"},
            "share_text_encoder": False,
            "bagel": {**part, "family": "bagel"},
            "think": True,
        }
    )
    policy = OmegaConf.to_object(typed_policy("r3_composite", saved))
    assert type(policy) is R3CompositePolicy and not hasattr(policy, "think")
    assert type(policy.text) is model_schema("qwen2_5_vl") and policy.text.lora.rank == 4
    assert type(policy.editor) is model_schema("qwen_image_edit") and policy.editor.resolution == 64
