"""Qwen-Image-Edit-Plus: N source images per example. Sampling equals ``QwenImageEditPlusPipeline``'s own
call per prompt (two sources, with and without true CFG), the (N, h/2, w/2) RoPE block equals N separate
source shapes, editing sets carry N paths per example, and wrong counts or shapes are clear errors."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlgen_cli.data.images import require_source_images, source_images
from rlgen_cli.data.prompts import PromptExample
from rlgen_cli.errors import UserError
from rlgen_cli.models.qwen_image_edit import to_pil
from rlgen_cli.models.qwen_image_edit_plus import QwenImageEditPlusPolicy, as_source_stack
from rlgen_cli.models.tiny import tiny_qwen_image_edit_plus_pipeline
from tests.conftest import TINY_RUN
from tests.models.helpers import CPU, as_loaded, base_policy, initial_noise_generators, model_cfg, ode_samples

PROMPTS = ["put the circle of picture 1 next to picture 2", "swap the colours of the two pictures"]
STEPS, SEED = 4, 3


def _sources(n: int = 2) -> torch.Tensor:
    """(2, n, 3, 32, 32) sources with 8-bit values (PIL round trips them exactly)."""
    return torch.randint(0, 256, (2, n, 3, 32, 32), generator=torch.Generator().manual_seed(11)) / 255.0


def _pipeline_samples(guidance: float, sources: torch.Tensor, monkeypatch) -> torch.Tensor:
    """The pipeline's own call, one prompt at a time (it takes batch size 1), each with its generator."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as module

    # the pipeline VAE-encodes sources at ≈ 1 MP; rlgen at the model resolution (the recipe resizes them)
    monkeypatch.setattr(module, "VAE_IMAGE_SIZE", 32 * 32)
    pipe = as_loaded(tiny_qwen_image_edit_plus_pipeline(0))
    gens = initial_noise_generators(SEED, len(PROMPTS))
    return torch.cat(
        [
            pipe(
                image=to_pil(sources[i]),
                prompt=[PROMPTS[i]],
                negative_prompt=[" "] if guidance > 1 else None,
                true_cfg_scale=guidance,
                height=32,
                width=32,
                num_inference_steps=STEPS,
                generator=[gens[i]],
                output_type="pt",
            ).images
            for i in range(len(PROMPTS))
        ]
    )


@pytest.mark.parametrize("guidance", [1.0, 4.0], ids=["no_cfg", "true_cfg"])
def test_two_source_sampling_equals_the_pipelines_own_call(guidance: float, monkeypatch):
    """max |rlgen − pipeline| ≤ 1e-5 over decoded pixels (measured ≤ 2.4e-6); swapping the two sources
    misses by far more, so the order of the sources reaches the model."""
    policy = base_policy("tiny_qwen_image_edit_plus", guidance_scale=guidance)
    sources = _sources()
    with torch.no_grad():
        expected = _pipeline_samples(guidance, sources, monkeypatch)
        got = ode_samples(policy, PROMPTS, STEPS, SEED, sources)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        swapped = ode_samples(policy, PROMPTS, STEPS, SEED, sources.flip(1))
    assert (swapped - expected).abs().max() > 1e-3


def test_source_block_equals_separate_source_shapes():
    """Tokens of N same-size sources under one (N, h, w) shape get the RoPE of N (1, h, w) shapes."""
    policy = base_policy("tiny_qwen_image_edit_plus", guidance_scale=1.0)
    x = policy.noise(2, torch.Generator().manual_seed(0))
    cond = policy.encode(PROMPTS, _sources(3))
    assert cond.tensors["source_shape"][0].tolist() == [3, 4, 4]
    assert cond.tensors["source_latents"].shape[:2] == (2, 3 * 16)
    hidden = torch.cat([x, cond.tensors["source_latents"]], dim=1)
    separate = [[(1, 4, 4)] * 4] * 2  # the target and three sources, as the pipeline passes them
    embeds, mask = cond.tensors["prompt_embeds"], cond.tensors["prompt_mask"]
    keep = int(mask.sum(1).max())
    with torch.no_grad():
        by_pipeline = policy.transformer(
            hidden_states=hidden,
            timestep=torch.full((2,), 0.6),
            encoder_hidden_states=embeds[:, :keep],
            encoder_hidden_states_mask=mask[:, :keep],
            img_shapes=separate,
            return_dict=False,
        )[0][:, :16]
        torch.testing.assert_close(policy.velocity(x, torch.tensor(0.6), cond), by_pipeline)


def test_bad_source_tensors_are_user_errors():
    with pytest.raises(UserError, match="needs source images"):
        as_source_stack(None, 2)
    with pytest.raises(UserError, match="B = 2 prompts"):
        as_source_stack(torch.zeros(3, 2, 3, 8, 8), 2)
    assert as_source_stack(torch.zeros(2, 3, 8, 8), 2).shape == (2, 1, 3, 8, 8)  # one source each


def test_editing_sets_carry_n_sources_and_counts_must_agree(tmp_path: Path):
    from PIL import Image

    for name, red in (("a.png", 10), ("b.png", 200), ("c.png", 90)):
        Image.new("RGB", (8, 8), (red, 0, 0)).save(tmp_path / name)
    source = str(tmp_path / "set.jsonl")
    two = [
        PromptExample(0, "edit", {"image": ["a.png", "b.png"]}),
        PromptExample(1, "e", {"image": ["c.png", "a.png"]}),
    ]
    dataset = type("Set", (), {"source": source})()
    stacked = source_images(two, dataset, 4, 4)
    assert stacked.shape == (2, 2, 3, 4, 4)
    assert [round(float(stacked[i, j, 0].mean()) * 255) for i in range(2) for j in range(2)] == [
        10,
        200,
        90,
        10,
    ]
    assert source_images(two[:1], dataset, 4, 4).ndim == 5  # a list of paths keeps its source axis
    single = [PromptExample(0, "edit", {"image": "a.png"})]
    assert source_images(single, dataset, 4, 4).shape == (1, 3, 4, 4)  # the one-source layout is unchanged
    mixed = [two[0], PromptExample(1, "edit", {"image": ["c.png"]})]
    with pytest.raises(UserError, match="example 1 .* has 1 source images but example 0 has 2"):
        require_source_images(mixed, source, "data.train")
    missing = [PromptExample(0, "edit", {"image": ["a.png", "nope.png"]})]
    with pytest.raises(UserError, match="nope.png, which does not exist"):
        require_source_images(missing, source, "data.train")


def test_a_batch_mixing_source_counts_is_a_user_error():
    policy = QwenImageEditPlusPolicy(
        tiny_qwen_image_edit_plus_pipeline(0),
        replace(model_cfg("tiny_qwen_image_edit_plus"), guidance_scale=1.0),
        CPU,
    )
    x, cond = policy.noise(2), policy.encode(PROMPTS, _sources(2))
    cond.tensors["source_shape"][1, 0] = 1  # as if the second example had one source
    with pytest.raises(UserError, match="mixes source images"):
        policy.velocity(x, torch.tensor(0.5), cond)


def test_check_onpolicy_passes(tmp_path: Path, cli):
    code, out = cli(
        "check-onpolicy", "model=tiny_qwen_image_edit_plus", *TINY_RUN, f"hydra.run.dir={tmp_path}"
    )
    assert code == 0, out


# -- training with two sources per example, and the source-comparing reward's rule -------------------
@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> Path:
    """A tiny random CLIP and its processor saved in one directory (what ``image_similarity`` loads)."""
    from rlgen_cli.models.tiny.clip import save_tiny_clip

    return save_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


def test_image_similarity_averages_the_cosines_with_every_source(tiny_clip: Path):
    """With sources (a, b) the score is (cos(x, a) + cos(x, b)) / 2 per sample: scoring x = a gives
    (1 + cos(a, b)) / 2, far from the first source's 1 and the best match's 1 (the rules not chosen)."""
    from rlgen_cli.rewards import RewardBatch, build_reward
    from rlgen_cli.rewards import clip as clip_mod

    clip_mod.clear_model_cache()
    reward = build_reward("image_similarity", model_path=str(tiny_clip), device="cpu", local_files_only=True)
    gen = torch.Generator().manual_seed(5)
    a, b = (torch.randint(0, 256, (3, 3, 16, 16), generator=gen) / 255.0 for _ in range(2))

    def similarity(images: torch.Tensor, refs: torch.Tensor) -> torch.Tensor:
        return reward.score(RewardBatch(prompts=["edit"] * 3, images=images, ref_images=refs)).scores

    cos_ab = similarity(a, b)  # one source each: the plain cosine
    assert (cos_ab < 0.99).all()  # else averaging could not be told from scoring the first source only
    expected = (1 + cos_ab) / 2  # per sample: its own a and b, so a mixed-up source axis misses
    torch.testing.assert_close(similarity(a, torch.stack([a, b], dim=1)), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(similarity(a, torch.stack([b, a], dim=1)), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(similarity(a, torch.stack([a, a], dim=1)), torch.ones(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(similarity(b, a.unsqueeze(1)), cos_ab, atol=1e-5, rtol=0)  # N = 1
    with pytest.raises(ValueError, match=r"\(B, N, C, H, W\)"):
        similarity(a, a[:, 0])
    clip_mod.clear_model_cache()


def _two_source_set(root: Path) -> Path:
    """Two editing examples with two 40×48 sources each (resized to the model's 32 px)."""
    import json

    import numpy as np
    from PIL import Image

    (root / "src").mkdir(parents=True)
    rows = []
    for i, prompt in enumerate(
        ["Put the circle of picture 1 into picture 2.", "Swap the two pictures' colours."]
    ):
        names = [f"src/{i}_{j}.png" for j in range(2)]
        for j, name in enumerate(names):
            pixels = np.random.default_rng(10 * i + j).integers(0, 256, (40, 48, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name)
        rows.append(json.dumps({"prompt": prompt, "image": names, "tag": "composition"}))
    (root / "edit2.jsonl").write_text("\n".join(rows) + "\n")
    return root / "edit2.jsonl"


@pytest.mark.slow  # a 2-epoch CLI run
def test_cli_training_with_two_sources_per_example(tmp_path: Path, tiny_clip: Path, cli):
    """`rlgen train` on a two-source editing set, scored by image_similarity against both sources:
    every LoRA tensor moves and metrics.jsonl logs the reward of each epoch and evaluation."""
    import json

    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from rlgen_cli.models.trainable import LORA_WEIGHTS_NAME

    data, run = _two_source_set(tmp_path / "data"), tmp_path / "run"
    clip_kwargs = [
        f"reward.kwargs.image_similarity.{key}={value}"
        for key, value in (("model_path", tiny_clip), ("device", "cpu"), ("local_files_only", "true"))
    ]
    code, out = cli(
        "train",
        "model=tiny_qwen_image_edit_plus",
        *TINY_RUN,
        "reward=image_similarity",
        *clip_kwargs,
        f"data.train={data}",
        f"data.test={data}",
        "epochs=2",
        f"hydra.run.dir={run}",
    )
    assert code == 0, out
    torch.manual_seed(42)  # the recipe seeds torch with cfg.seed before building the adapter
    fresh = QwenImageEditPlusPolicy(
        tiny_qwen_image_edit_plus_pipeline(0), model_cfg("tiny_qwen_image_edit_plus"), CPU
    )
    initial = {f"transformer.{k}": v for k, v in get_peft_model_state_dict(fresh.transformer).items()}
    trained = load_file(run / "checkpoints" / "epoch_000002" / "weights" / LORA_WEIGHTS_NAME)
    assert trained.keys() == initial.keys() and len(trained) > 0
    assert [k for k in trained if torch.equal(trained[k], initial[k])] == []
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [line for line in lines if "reward/image_similarity/mean" in line]
    assert len(epochs) == 2
    for line in epochs:  # a cosine of unit vectors, averaged over the two sources
        assert -1 <= line["reward/image_similarity/mean"] <= 1 and "eval/reward/image_similarity/mean" in line


@pytest.mark.slow  # a CLI check on the two-source set
def test_check_onpolicy_passes_with_two_sources_per_example(tmp_path: Path, cli):
    data = _two_source_set(tmp_path / "data")
    code, out = cli(
        "check-onpolicy",
        "model=tiny_qwen_image_edit_plus",
        *TINY_RUN,
        f"data.train={data}",
        f"data.test={data}",
        f"hydra.run.dir={tmp_path / 'check'}",
    )
    assert code == 0 and "PASS" in out, out
