"""Real-size models at random init (``model.weights=random_init``, models/real_size.py).

Parameter counts are checked on the meta device (nothing allocated) against the published figures; the
SD3.5-Medium pipeline is built through the family's own entry point on the meta device; the schema
refuses the settings that cannot go together; the slow test runs ``benchmarks/real_size.py`` on the CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import typing
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlgen_cli.errors import UserError
from rlgen_cli.models import real_size
from rlgen_cli.models.real_size import COMPONENT_PARAMS, VARIANTS, count_parameters, flow_components
from rlgen_cli.models.tiny import tiny_qwen_tokenizer
from rlgen_cli.schema.choices import RealSizeVariant
from rlgen_cli.schema.model import model_config, model_schema
from rlgen_cli.schema.run import REAL_SIZE_VARIANTS
from tests.models.helpers import model_cfg

ROOT = Path(__file__).resolve().parents[2]
META = torch.device("meta")
FLOW_VARIANTS = [name for name, v in VARIANTS.items() if v.transformer is not None]  # diffusers
VLM_VARIANTS = list(real_size.VL_CONFIGS)
TOLERANCE = 0.03


def within(count: int, published: float) -> bool:
    return abs(count / published - 1) <= TOLERANCE


@pytest.mark.parametrize("name", FLOW_VARIANTS)
def test_flow_transformer_parameters_match_the_published_figure(name):
    with torch.device(META):
        parts = flow_components(name, stand_in=True)
    count = count_parameters(parts["transformer"])
    assert within(count, VARIANTS[name].params), (
        f"{name}: {count / 1e9:.3f} B vs {VARIANTS[name].params / 1e9} B"
    )


@pytest.mark.parametrize("name", VLM_VARIANTS)
def test_vlm_parameters_match_the_published_figure(name):
    with torch.device(META):
        model = real_size.vlm_model(name, tiny_qwen_tokenizer())
    count = count_parameters(model)
    assert within(count, VARIANTS[name].params), (
        f"{name}: {count / 1e9:.3f} B vs {VARIANTS[name].params / 1e9} B"
    )


@pytest.mark.parametrize(
    ("name", "components"),
    [
        (
            "sd3_5_medium",
            {
                "text_encoder": "clip_l",
                "text_encoder_2": "clip_g",
                "text_encoder_3": "t5_xxl",
                "vae": "sd3_vae",
            },
        ),
        ("flux_1_dev", {"text_encoder_2": "t5_xxl", "vae": "sd3_vae"}),
        ("wan2_1_t2v_1_3b", {"text_encoder": "umt5_xxl", "vae": "wan_vae"}),
        ("qwen_image", {"text_encoder": "qwen2_5_vl_7b", "vae": "wan_vae"}),
    ],
)
def test_real_size_text_encoders_and_vaes_match_the_published_figures(name, components):
    with torch.device(META):
        parts = flow_components(name, stand_in=False)
    counts = {part: count_parameters(parts[part]) for part in components}
    wrong = {
        part: counts[part]
        for part, key in components.items()
        if not within(counts[part], COMPONENT_PARAMS[key])
    }
    assert not wrong, wrong


def test_stand_in_encoders_keep_the_output_widths_at_a_fraction_of_the_size():
    with torch.device(META):
        real, small = flow_components("sd3_5_medium", False), flow_components("sd3_5_medium", True)
    for part, width in (("text_encoder", 768), ("text_encoder_2", 1280)):
        assert small[part].config.hidden_size == real[part].config.hidden_size == width
        assert small[part].config.projection_dim == real[part].config.projection_dim == width
    assert small["text_encoder_3"].config.d_model == real["text_encoder_3"].config.d_model == 4096
    encoders = ("text_encoder", "text_encoder_2", "text_encoder_3")
    small_total = sum(count_parameters(small[p]) for p in encoders)
    assert small_total < 0.01 * sum(count_parameters(real[p]) for p in encoders)
    assert count_parameters(small["transformer"]) == count_parameters(real["transformer"])


def test_sd3_5_medium_builds_through_the_family_entry_point_on_the_meta_device():
    cfg = replace(model_cfg("sd3"), weights="random_init", text_encoders="stand_in", dtype="bfloat16")
    pipeline = real_size.flow_pipeline(cfg, META)
    transformer = pipeline.transformer
    assert type(pipeline).__name__ == "StableDiffusion3Pipeline"
    assert transformer.config.num_layers == 24 and transformer.config.num_attention_heads == 24
    # MMDiT-X: a second self-attention on the image tokens in blocks 0–12 only
    dual = [i for i, block in enumerate(transformer.transformer_blocks) if getattr(block, "attn2", None)]
    assert dual == list(range(13))
    assert transformer.pos_embed.proj.weight.device == META
    assert transformer.pos_embed.proj.weight.dtype == torch.bfloat16  # built in model.dtype, no fp32 pass
    assert pipeline.vae.config.latent_channels == 16 and pipeline.vae_scale_factor == 8


def test_the_construction_seed_decides_the_weights_and_leaves_the_callers_rng_alone():
    def drawn(seed: int) -> torch.Tensor:
        with real_size.constructing(torch.device("cpu"), torch.float32, seed):
            return torch.nn.Linear(4, 4).weight.detach()

    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = drawn(0)
    assert torch.equal(torch.rand(1), before)  # the caller's stream did not move
    torch.testing.assert_close(drawn(0), first)
    assert not torch.equal(drawn(1), first)
    assert torch.get_default_dtype() == torch.float32


def test_every_variant_choice_is_built_and_auto_is_the_family_conf_checkpoint():
    choices = set(typing.get_args(RealSizeVariant)) - {"auto"}
    assert choices == set(VARIANTS)
    assert {v for variants in REAL_SIZE_VARIANTS.values() for v in variants} == choices
    for family, variants in REAL_SIZE_VARIANTS.items():
        assert all(VARIANTS[v].family == family for v in variants)
        assert model_cfg(family).path == VARIANTS[variants[0]].checkpoint  # auto = what model=FAMILY loads
        cfg = replace(model_cfg(family), weights="random_init")
        assert real_size.variant_of(cfg) == variants[0]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"family": "sd3", "tiny": True}, "model.tiny=true and model.weights=random_init"),
        ({"family": "sd3", "variant": "flux_1_dev"}, "model.variant=flux_1_dev is not a sd3 checkpoint"),
    ],
)
def test_the_schema_refuses_random_init_settings_that_cannot_hold(changes, message):
    with pytest.raises(UserError, match=message):
        model_config(changes.pop("family"), path=None, weights="random_init", **changes)


def _keys(family: str) -> set[str]:
    return {f.name for f in dataclasses.fields(model_schema(family))}


def test_a_family_without_real_size_variants_has_no_random_init_keys():
    assert {"weights", "variant", "text_encoders"} <= _keys("sd3")
    assert not {"weights", "variant", "text_encoders"} & _keys("flux2")  # model.weights=… fails at compose


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"variant": "sd3_5_large"}, "model.variant=sd3_5_large .* model.weights=random_init"),
        ({"text_encoders": "stand_in"}, "model.text_encoders=stand_in .* model.weights=random_init"),
    ],
)
def test_real_size_options_without_random_init_are_refused_not_ignored(changes, message):
    with pytest.raises(UserError, match=message):
        model_config("sd3", path="some/checkpoint", **changes)


def test_random_init_needs_no_path_and_a_vlm_takes_no_stand_in_encoders():
    assert model_config("sd3", path=None, weights="random_init").variant == "auto"
    assert "weights" in _keys("qwen2_vl") and "text_encoders" not in _keys("qwen2_vl")  # no stand-in key


SHALLOW = {
    "sd3_5_medium": {"num_layers": 2, "dual_attention_layers": (0,)},
    "flux_1_dev": {"num_layers": 1, "num_single_layers": 1},
    "flux_1_kontext_dev": {"num_layers": 1, "num_single_layers": 1},
    "qwen_image": {"num_layers": 1},
    "qwen_image_edit": {"num_layers": 1},
    "wan2_1_t2v_1_3b": {"num_layers": 1},
}
"""Depth cuts that let every family's random-init pipeline run on a CPU: widths, VAE, processors and
tokenizers stay real size, only the transformer has fewer blocks."""


@pytest.mark.slow
@pytest.mark.parametrize("name", SHALLOW)
def test_each_family_encodes_denoises_and_decodes_with_its_real_size_components(name, monkeypatch):
    from rlgen_cli.models import build_policy

    variant = VARIANTS[name]
    monkeypatch.setitem(VARIANTS, name, replace(variant, transformer=variant.transformer | SHALLOW[name]))
    base = model_cfg(variant.family)
    geometry = (
        {"height": 64, "width": 64, "num_frames": 5} if variant.family == "wan2_1" else {"resolution": 64}
    )
    if not variant.family.startswith(
        "qwen_image"
    ):  # T5 pads to it; Qwen-Image's bound covers the source image
        geometry["max_sequence_length"] = 32
    cfg = replace(
        base,
        weights="random_init",
        variant=name,
        text_encoders="stand_in",
        dtype="bfloat16",
        lora=replace(base.lora, enabled=False),
        **geometry,
    )
    policy = build_policy(cfg, torch.device("cpu"))
    sources = torch.rand(1, 3, 64, 64) if variant.family in ("flux_kontext", "qwen_image_edit") else None
    cond = policy.encode(["a photo of a red circle"], sources)
    x = policy.noise(1, torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = policy.velocity(x, torch.tensor(0.5), cond)
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    images = policy.decode(x)
    assert images.shape[-2:] == (64, 64) and images.min() >= 0 and images.max() <= 1


@pytest.mark.slow
def test_a_random_init_vlm_policy_reads_an_image_through_the_published_patch_geometry():
    from PIL import Image

    from rlgen_cli.vlm.policy import build_vlm

    base = model_cfg("qwen2_vl")
    cfg = replace(base, weights="random_init", dtype="bfloat16", lora=replace(base.lora, enabled=True))
    policy = build_vlm(cfg, torch.device("cpu"))
    assert within(sum(p.numel() for n, p in policy.model.named_parameters() if "lora_" not in n), 2.21e9)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
    text = policy.processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = policy.processor(text=[text], images=[Image.new("RGB", (112, 56))], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 8]]  # 56×112 px in 14-px patches
    assert (
        inputs["input_ids"] == policy.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ).sum() == 8  # 2×2 merged
    with torch.no_grad():
        logits = policy.model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], 151936) and torch.isfinite(logits.float()).all()


@pytest.mark.slow
def test_the_benchmark_runs_one_epoch_of_sd3_5_medium_on_the_cpu():
    """One GRPO-Fast epoch of the 2.24 B SD3.5-Medium transformer at 64 px (≈ 4.5 min on two cores)."""
    command = [
        sys.executable, str(ROOT / "benchmarks" / "real_size.py"), "sd3_5_medium", "--resolution", "64",
        "--steps", "2", "--batch", "2", "--device", "cpu", "model.text_encoders=stand_in",
        "model.guidance_scale=1", "model.max_sequence_length=32",
    ]  # fmt: skip
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert within(result["parameters"]["transformer"], 2.24e9)
    # rank-32 LoRA on the 8 attention projections of 24 joint blocks (width 1536): 4 image-side + 4
    # context-side per block, the last block without to_add_out and its dead add_q_proj left out
    assert result["trainable_parameters"] == 32 * (1536 + 1536) * (23 * 8 + 6)
    assert result["flops_per_image"] == pytest.approx(2 * result["flops_per_forward"])  # 2 steps
    assert result["flops_per_forward"] > 1e11  # ≥ 2 FLOPs per weight for each of ~60 tokens
    assert result["peak_memory"]["host_rss_bytes"] > 2 * 2.24e9  # the bf16 transformer is resident
    assert result["peak_memory"]["device_bytes"] is None and result["mfu"] is None  # CPU
    for phase in ("build", "rollout", "reward", "update", "epoch"):
        assert result["seconds"][phase] >= 0
    assert result["seconds"]["rollout"] > 0 and result["seconds"]["update"] > 0
    # 2 samples × 2 steps sampled; at 2 steps the SDE window is 1 step, trained for both samples; the KL
    # probe after the update: 4 forwards of one sample (both samples, then the first twice more) × policy
    # and reference, counted with the update, not the rollout
    assert result["velocity_rows"] == {"sampling": 2 * 2, "training": 2 * 1, "probe": 4 * 2}


# -- BAGEL-7B-MoT ---------------------------------------------------------------------------------------
def bagel_release_count() -> int:
    """BAGEL-7B-MoT's weight file by hand from its published shapes (Qwen2.5-7B per expert: width 3584,
    MLP 18944, 28 query / 4 key-value heads of 128, vocabulary 152 064; SigLIP-so400m/14: width 1152, MLP
    4304, 27 layers of which BAGEL runs 26; the FLUX latent's 2×2 patches of 16 channels = 64)."""
    d, mlp, kv, vocab, layers = 3584, 18944, 4 * 128, 152064, 28
    attention = (d * d + d) + 2 * (d * kv + kv) + d * d + 2 * 128  # q, k, v (biased), o, q/k norms
    expert = attention + 3 * d * mlp + 2 * d  # + SwiGLU MLP, two layer norms
    language_model = 2 * vocab * d + layers * 2 * expert + 2 * d  # embeddings, untied head, final norm ×2
    v, v_mlp, patch = 1152, 4304, 14
    vit_layer = 4 * (v * v + v) + (v * v_mlp + v_mlp) + (v_mlp * v + v) + 2 * 2 * v
    vit = (3 * patch * patch * v + v) + 70 * 70 * v + 26 * vit_layer + 2 * v  # patches, positions, post norm
    glue = (256 * d + d) + (d * d + d)  # the timestep embedder's MLP
    glue += (64 * d + d) + (d * 64 + 64)  # vae2llm, llm2vae
    glue += (v * d + d) + (d * d + d)  # the ViT connector
    tables = 64 * 64 * d + 70 * 70 * d  # latent and ViT sin-cos tables, stored as frozen parameters
    return language_model + vit + glue + tables


@pytest.fixture
def cheap_tables(monkeypatch):
    """BAGEL's sin-cos position tables as zeros of their shape: their size is what these tests count, and
    computing them in numpy takes seconds."""
    from rlgen_cli.models.bagel import modeling

    monkeypatch.setattr(modeling, "sincos_2d", lambda dim, side: torch.zeros(side * side, dim))


def test_bagel_7b_mot_has_the_release_parameter_count_on_the_meta_device(cheap_tables):
    from rlgen_cli.models.bagel.loading import random_init_network

    with torch.device(META):
        network = random_init_network("bagel_7b_mot")
    built = count_parameters(network) + sum(b.numel() for b in network.buffers())
    assert built == bagel_release_count() == 14_607_260_128
    assert within(built, VARIANTS["bagel_7b_mot"].params)
    # perturbation arm: one MoT layer fewer is 466 M parameters fewer, which the count sees
    shallower = real_size.with_layers(VARIANTS["bagel_7b_mot"], 27)
    with torch.device(META), pytest.MonkeyPatch.context() as patch:
        patch.setitem(VARIANTS, "bagel_7b_mot", shallower)
        assert count_parameters(random_init_network("bagel_7b_mot")) == built - 466_116_096 - 32_241_664


def test_bagel_builds_through_the_family_entry_point_on_the_meta_device_in_the_model_dtype(cheap_tables):
    from rlgen_cli.models import build_policy

    base = model_cfg("bagel")
    assert base.path == VARIANTS["bagel_7b_mot"].checkpoint  # model.variant=auto: what model=bagel loads
    cfg = replace(base, weights="random_init")
    # two of the 28 layers, so peft attaches 14 adapters rather than 196 (the full count is tested above)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(VARIANTS, "bagel_7b_mot", real_size.with_layers(VARIANTS["bagel_7b_mot"], 2))
        policy = build_policy(cfg, META)
    network = policy.transformer
    frozen = [t for n, t in [*network.named_parameters(), *network.named_buffers()] if "lora_" not in n]
    assert {t.device for t in frozen} == {META} and {t.dtype for t in frozen} == {torch.bfloat16}
    assert {p.dtype for p in policy.vae.parameters()} == {torch.float32}  # the VAE runs in fp32
    assert count_parameters(policy.vae) == 83_819_683  # the FLUX autoencoder
    # rank-64 LoRA on the generation expert (conf/model/bagel.yaml): q, o (3584 → 3584), k, v (3584 → 512),
    # gate, up (3584 → 18944), down (18944 → 3584), in each layer
    lora = sum(p.numel() for n, p in network.named_parameters() if "lora_" in n)
    assert lora == 2 * 64 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944))
    assert all("moe_gen" in n for n, p in network.named_parameters() if p.requires_grad)
    # the stand-in tokenizer has BAGEL's four markers; the embeddings keep the published vocabulary
    assert len(set(policy.markers.values())) == 4
    assert network.language_model.model.embed_tokens.weight.shape == (152064, 3584)
    assert policy.latent_hw == (128, 128)  # 1024 px, FLUX's 8× down


def test_bagel_random_init_takes_no_stand_in_encoders():
    assert "weights" in _keys("bagel") and "text_encoders" not in _keys("bagel")  # reads its own prompt


@pytest.mark.slow
def test_a_one_layer_real_width_bagel_samples_a_velocity_on_the_cpu():
    """Every width as published, one MoT layer (2.0 B parameters, 4 GB in bf16), a 64 px image."""
    from rlgen_cli.models import build_policy

    shallower = real_size.with_layers(VARIANTS["bagel_7b_mot"], 1)
    base = model_cfg("bagel")
    cfg = replace(base, weights="random_init", resolution=64, max_sequence_length=32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(VARIANTS, "bagel_7b_mot", shallower)
        policy = build_policy(cfg, torch.device("cpu"))
    cond = policy.encode(["a photo of a red circle"])
    x = policy.noise(1, torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = policy.velocity(x, torch.tensor(0.5), cond)  # in the CFG interval: both branches
    assert v.shape == x.shape == (1, 16, 8, 8) and torch.isfinite(v).all()
    images = policy.decode(x)
    assert images.shape == (1, 3, 64, 64) and images.min() >= 0 and images.max() <= 1
