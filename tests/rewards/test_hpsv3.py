"""HPSv3 on a tiny random Qwen2-VL: checkpoint saved in HPSv3's file layout and read by the real loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards.hpsv3 import REWARD_TOKEN, HPSv3Kwargs, HPSv3Model, chat_texts, fixed_pixel_size

CONF = Path(__file__).resolve().parents[2] / "conf" / "reward"
HUB_FILE = "MizzenAI/HPSv3/HPSv3.safetensors"  # fetched only on the first score: building never downloads
PIXELS = 16 * 16  # the tiny processor's grid is 8 px (4-px patches, 2×2 merge): 4 visual tokens


def _upstream_layout(model: HPSv3Model, old: bool) -> dict[str, torch.Tensor]:
    """The model's tensors as an HPSv3 checkpoint names them (older or newer transformers layout)."""
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("backbone.visual."):
            key = ("" if old else "model.") + key.removeprefix("backbone.")
        elif key.startswith("backbone.language_model."):
            key = ("model." if old else "model.language_model.") + key.removeprefix(
                "backbone.language_model."
            )
        out[key] = value.clone()
    out["lm_head.weight"] = torch.zeros(3, 3)  # the generation head the score never uses
    return out


# A short stand-in (the byte-level tiny tokenizer keeps scoring fast); the edges check it is read verbatim.
INSTRUCTION = "\nRate this image for: {text_prompt}  \n\n"


@pytest.fixture(scope="module")
def instruction_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hpsv3_instruction") / "instruction.txt"
    path.write_text(INSTRUCTION, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, base dir, old-layout file, new-layout file): vocabulary grown by the reward token."""
    from transformers import AutoConfig

    from rlgen_cli.models.tiny import save_tiny_vlm

    root = tmp_path_factory.mktemp("tiny_hpsv3")
    base = save_tiny_vlm(root / "base", kind="qwen2_vl")
    config = AutoConfig.from_pretrained(base, local_files_only=True)
    config.text_config.vocab_size += 1  # <|Reward|>
    torch.manual_seed(0)
    model = HPSv3Model(config).eval()
    with torch.no_grad():
        model.rm_head[-1].bias.copy_(torch.tensor([5.0, 1.0]))  # a μ offset the test can see
    save_file(_upstream_layout(model, old=True), str(root / "HPSv3_old.safetensors"))
    save_file(_upstream_layout(model, old=False), str(root / "HPSv3_new.safetensors"))
    return model, base, root / "HPSv3_old.safetensors", root / "HPSv3_new.safetensors"


def _reward(tiny, instruction_file: Path, new_layout: bool = False):
    _, base, old_file, new_file = tiny
    path = new_file if new_layout else old_file
    return build_reward(
        "hpsv3",
        instruction_path=str(instruction_file),
        model_path=str(path),
        base_path=str(base),
        image_pixels=PIXELS,
        device="cpu",
        dtype="float32",
        local_files_only=True,
    )


def _images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, 20, 28, generator=torch.Generator().manual_seed(seed))


def test_mu_is_the_head_at_the_reward_token(tiny, instruction_file):
    model, *_ = tiny
    reward = _reward(tiny, instruction_file)
    prompts, images = ["a cat", "a long prompt about a red bicycle"], _images(2)
    result = reward.score(RewardBatch(prompts=prompts, images=images))
    assert result.scores.shape == (2,) and result.scores.dtype == torch.float32
    assert result.details["sigma"].shape == (2,) and torch.isfinite(result.scores).all()
    # By hand: the original model's last hidden state at each row's single reward token, through the head,
    # with HPSv3's positions 0 … L−1 on every rotary axis.
    inputs = reward.inputs(prompts, images)
    token = reward.reward_token_id
    assert (inputs["input_ids"] == token).sum(-1).tolist() == [1, 1]
    length = inputs["input_ids"].shape[1]
    positions = torch.arange(length).expand(3, 2, length)
    with torch.no_grad():
        hidden = model.backbone(**inputs, position_ids=positions, use_cache=False).last_hidden_state
        expected = model.rm_head(hidden[inputs["input_ids"] == token])
    torch.testing.assert_close(result.scores, expected[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.details["sigma"], expected[:, 1], atol=1e-5, rtol=1e-5)


def test_each_score_is_independent_of_its_batch(tiny, instruction_file):
    # Right padding must not reach a sample: alone or next to a longer prompt, the same score.
    reward = _reward(tiny, instruction_file)
    image = _images(1, seed=3)
    alone = reward.score(RewardBatch(prompts=["a cat"], images=image)).scores
    both = reward.score(
        RewardBatch(prompts=["a cat", "x " * 40], images=torch.cat([image, _images(1)]))
    ).scores
    assert both[0] == pytest.approx(float(alone[0]), abs=1e-4)
    twins = reward.score(RewardBatch(prompts=["a cat", "a cat"], images=image.repeat(2, 1, 1, 1))).scores
    assert twins[0] == pytest.approx(float(twins[1]), abs=1e-5)


def test_both_checkpoint_layouts_load_the_same_weights(tiny, instruction_file):
    batch = RewardBatch(prompts=["a dog"], images=_images(1, seed=5))
    old = _reward(tiny, instruction_file).score(batch).scores
    new = _reward(tiny, instruction_file, new_layout=True).score(batch).scores
    torch.testing.assert_close(old, new)


def test_chat_text_wraps_the_prompt_in_the_supplied_instruction(tiny, instruction_file):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny[1], local_files_only=True)
    instruction = _reward(tiny, instruction_file).instruction
    assert instruction == INSTRUCTION  # verbatim: leading newline, trailing spaces and blank lines kept
    (text,) = chat_texts(processor, ["a {weird} prompt"], instruction)
    filled = "\nRate this image for: a {weird} prompt  \n\n"
    suffix = f"\nPlease provide the overall ratings of this image: {REWARD_TOKEN}\n\nEND\n"
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    assert text == f"<|im_start|>user\n{image}{filled}{suffix}<|im_end|>\n<|im_start|>assistant\n"


def test_fixed_pixel_size_by_hand():
    assert fixed_pixel_size(512, 512, 28, 200704) == (448, 448)  # 256 tokens of 28×28
    # 1024×768: grid 1036×756 is too large; β = sqrt(1024·768/200704) ≈ 1.979 → floor to 504×364.
    assert fixed_pixel_size(1024, 768, 28, 200704) == (504, 364)
    # 100×100: grid 112×112 too small; β = sqrt(200704/10⁴) ≈ 4.48 → ceil to 448×448.
    assert fixed_pixel_size(100, 100, 28, 200704) == (448, 448)
    with pytest.raises(ValueError, match="aspect ratio"):
        fixed_pixel_size(1, 300, 28, 200704)


def test_errors_name_the_key_and_the_fix(tiny, instruction_file, tmp_path):
    with pytest.raises(ValueError, match=r"model_path=.*HPSv3\.safetensors.*huggingface\.co/MizzenAI/HPSv3"):
        build_reward("hpsv3", model_path=str(tmp_path / "HPSv3.safetensors"))
    with pytest.raises(ValueError, match="image_pixels"):
        build_reward("hpsv3", instruction_path=str(instruction_file), model_path=str(tiny[2]), image_pixels=0)
    with pytest.raises(ValueError, match=r"exactly one <\|Reward\|>"):
        _reward(tiny, instruction_file).score(
            RewardBatch(prompts=[f"a {REWARD_TOKEN} cat"], images=_images(1))
        )
    with pytest.raises(ValueError, match="not an HPSv3 checkpoint"):
        save_file({"text_encoder.weight": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
        _, base, *_ = tiny
        other = build_reward(
            "hpsv3",
            instruction_path=str(instruction_file),
            model_path=str(tmp_path / "other.safetensors"),
            base_path=str(base),
            device="cpu",
            local_files_only=True,
        )
        other.score(RewardBatch(prompts=["a"], images=_images(1)))


def test_an_unset_or_unreadable_instruction_names_the_key_and_the_source(tmp_path):
    source = r"INSTRUCTION in hpsv3/dataset/data_collator_qwen\.py of github\.com/MizzenAI/HPSv3"
    with pytest.raises(
        ValueError, match=rf"needs reward\.kwargs\.hpsv3\.instruction_path: .*{source}.*\{{text_prompt\}}"
    ):
        build_reward("hpsv3", model_path=HUB_FILE)
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(ValueError, match=rf"instruction_path='{missing}' cannot be read.*{source}"):
        build_reward("hpsv3", model_path=HUB_FILE, instruction_path=str(missing))


def test_an_instruction_without_the_placeholder_is_refused(tmp_path):
    no_slot = tmp_path / "instruction.txt"
    no_slot.write_text("Rate this image for: {prompt}\n", encoding="utf-8")  # a near miss
    with pytest.raises(ValueError, match=r"has no \{text_prompt\} placeholder.*data_collator_qwen\.py"):
        build_reward("hpsv3", model_path=HUB_FILE, instruction_path=str(no_slot))


def test_config_kwargs_are_valid():
    cfg = OmegaConf.to_container(OmegaConf.load(CONF / "hpsv3.yaml"))
    assert cfg["weights"] == {"hpsv3": 1.0}
    kwargs = HPSv3Kwargs(**cfg["kwargs"]["hpsv3"])
    assert kwargs.image_pixels == 256 * 28 * 28 and kwargs.base_path == "Qwen/Qwen2-VL-7B-Instruct"
    # The instruction is the user's to supply: the preset leaves it unset, and building says so.
    assert kwargs.instruction_path is None
    with pytest.raises(ValueError, match=r"reward\.kwargs\.hpsv3\.instruction_path"):
        build_reward("hpsv3", **cfg["kwargs"]["hpsv3"])  # the hub path is only fetched on the first score
