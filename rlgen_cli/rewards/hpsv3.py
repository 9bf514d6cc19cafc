"""HPSv3 (Ma et al. 2025, "HPSv3: Towards Wide-Spectrum Human Preference Score"): Qwen2-VL-7B with an
uncertainty-aware reward head.

The model reads a chat turn holding the image and a rating instruction around the prompt, ending in a
special ``<|Reward|>`` token. Its last hidden state at that token goes through a float32 MLP
(``hidden → 1024 → ReLU → dropout → 16 → ReLU → 2``) that gives ``(μ, σ)``: the preference score and
its uncertainty (trained with a probabilistic ranking loss). The reward is ``μ`` (unbounded; higher
is preferred); ``details["sigma"]`` logs ``σ``.

Instruction: rlgen does not ship it. ``instruction_path`` names a text file the user supplies, holding the
exact value of the ``INSTRUCTION`` constant in ``hpsv3/dataset/data_collator_qwen.py`` of
https://github.com/MizzenAI/HPSv3 (also in the ``hpsv3`` package on PyPI; ``hpsv3/inference.py`` formats it
with each prompt). The file is read verbatim (its leading newline, trailing spaces and closing blank lines
are part of the trained text) and must keep the ``{text_prompt}`` placeholder, where each prompt goes. The
checkpoint was trained with that text and scores well only with it: another instruction gives numbers not
comparable with HPSv3's. docs/rewards.md shows how to extract it exactly.

Weights: ``HPSv3.safetensors`` (the full fine-tuned model plus the head, with the embedding grown by one
row for ``<|Reward|>``) on top of the base ``Qwen/Qwen2-VL-7B-Instruct`` config and processor. The
backbone is transformers' ``Qwen2VLModel`` (no LM head: the score never decodes); the checkpoint's keys
in either layout (``visual.*`` + ``model.layers.*`` of older transformers, or ``model.visual.*`` +
``model.language_model.*``) are renamed to it, ``lm_head.*`` is dropped. Images are resized (bicubic)
to exactly ``image_pixels`` pixels on the processor's patch grid (HPSv3 uses 256·28·28, 256 visual tokens),
keeping the aspect ratio, as HPSv3's own preprocessing does.

Positions: HPSv3's model calls its Qwen2-VL decoder with ``position_ids=None`` under the transformers it
pins (4.45), where the decoder numbers the tokens ``0 … L−1`` on all three rotary axes — plain 1-D
positions, image tokens included; Qwen2-VL's multimodal (M-RoPE) positions are computed only by the
generation wrapper HPSv3 bypasses. ``positions="sequential"`` (the default) passes exactly those positions;
``positions="mrope"`` lets transformers compute M-RoPE positions as Qwen2-VL's own chat model does (scores
then differ from HPSv3's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor, nn

from rlgen_cli.rewards.base import RewardBatch, RewardResult
from rlgen_cli.rewards.checkpoint_reward import CheckpointReward
from rlgen_cli.rewards.checkpoints import check_image_batch, typed_kwargs
from rlgen_cli.rewards.clip import to_pil_images
from rlgen_cli.rewards.registry import register
from rlgen_cli.rewards.requirements import ModelSource, kwargs_sources

__all__ = [
    "HPSV3_BASE", "HPSV3_CHECKPOINT", "INSTRUCTION_SOURCE", "PLACEHOLDER", "POSITIONS", "REWARD_TOKEN",
    "HPSv3Kwargs", "HPSv3Model", "HPSv3Reward", "chat_texts", "fixed_pixel_size", "hpsv3", "hpsv3_state_dict",
    "read_instruction", "sequential_position_ids",
]  # fmt: skip

HPSV3_CHECKPOINT = "MizzenAI/HPSv3/HPSv3.safetensors"
HPSV3_BASE = "Qwen/Qwen2-VL-7B-Instruct"
REWARD_TOKEN = "<|Reward|>"
HPSV3_PIXELS = 256 * 28 * 28
POSITIONS = ("sequential", "mrope")
_DOWNLOAD_HINT = (
    "download HPSv3.safetensors from https://huggingface.co/MizzenAI/HPSv3 "
    "and set model_path to the local file"
)
INSTRUCTION_SOURCE = (
    "the value of INSTRUCTION in hpsv3/dataset/data_collator_qwen.py of github.com/MizzenAI/HPSv3 "
    "(the text hpsv3/inference.py wraps around each prompt)"
)
PLACEHOLDER = "{text_prompt}"
# Closes every user turn: the score is read at the reward token, and the checkpoint saw this exact line after
# the instruction in training (another wording shifts every hidden state before the token).
HPSV3_SUFFIX = f"\nPlease provide the overall ratings of this image: {REWARD_TOKEN}\n\nEND\n"
# Checkpoint key prefixes (either transformers layout) -> this module's; the order matters.
_RENAMES = (
    ("model.visual.", "backbone.visual."),
    ("model.language_model.", "backbone.language_model."),
    ("visual.", "backbone.visual."),
    ("model.", "backbone.language_model."),
    ("rm_head.", "rm_head."),
)


def check_positions(positions: str) -> None:
    """Raise a ValueError naming the choices for an unknown ``positions``."""
    if positions not in POSITIONS:
        raise ValueError(
            f"reward.kwargs.hpsv3.positions={positions!r}; choose 'sequential' (HPSv3's scores: 0 … L−1 "
            "on every rotary axis) or 'mrope' (Qwen2-VL's multimodal positions)."
        )


def fixed_pixel_size(height: int, width: int, factor: int, pixels: int) -> tuple[int, int]:
    """``(h, w)``: multiples of ``factor`` near ``height × width``'s aspect, ``h·w ≈ pixels``.

    Rounds each side to the grid, then rescales by ``sqrt(h·w / pixels)`` (down with floor, up with
    ceil) when the area misses ``pixels`` — Qwen2-VL's ``smart_resize`` with ``min = max = pixels``.

    Raises:
        ValueError: If the aspect ratio exceeds 200 (the processor rejects such images).
    """
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio {height}x{width} exceeds 200; HPSv3 cannot score it.")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > pixels:
        beta = math.sqrt(height * width / pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < pixels:
        beta = math.sqrt(pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def hpsv3_state_dict(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename an HPSv3 checkpoint to :class:`HPSv3Model` keys; the LM head is dropped.

    Raises:
        ValueError: If a tensor belongs to neither the backbone nor the head.
    """
    out: dict[str, Tensor] = {}
    unknown: list[str] = []
    for key, value in state_dict.items():
        if key.startswith("lm_head."):
            continue
        renamed = next((new + key[len(old) :] for old, new in _RENAMES if key.startswith(old)), None)
        if renamed is None:
            unknown.append(key)
        else:
            out[renamed] = value
    if unknown:
        raise ValueError(f"not an HPSv3 checkpoint: no place for {unknown[:5]} ({len(unknown)} keys).")
    return out


def read_instruction(path: str | None) -> str:
    """The rating instruction in ``path``, verbatim (whitespace included: it is part of the trained text).

    Raises:
        ValueError: If ``path`` is unset or unreadable, or the text lacks the ``{text_prompt}`` placeholder.
    """
    key = "reward.kwargs.hpsv3.instruction_path"
    where = f"a UTF-8 text file holding {INSTRUCTION_SOURCE}, with its {PLACEHOLDER} placeholder"
    if not path:
        raise ValueError(
            f"reward 'hpsv3' needs {key}: {where}; the checkpoint scores well only with that text."
        )
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{key}={path!r} cannot be read ({err}); point it at {where}.") from None
    if PLACEHOLDER not in text:
        raise ValueError(
            f"{key}={path!r} has no {PLACEHOLDER} placeholder, so the prompt would never reach the model; "
            f"the file must hold {INSTRUCTION_SOURCE}."
        )
    return text


def chat_texts(processor: Any, prompts: list[str], instruction: str) -> list[str]:
    """One user turn per prompt: the image, then ``instruction`` with each ``{text_prompt}`` replaced by
    the prompt (braces in the prompt stay literal), then the reward-token line; the assistant turn is
    opened (generation prompt)."""
    texts = []
    for prompt in prompts:
        text = instruction.replace(PLACEHOLDER, prompt) + HPSV3_SUFFIX
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        texts.append(processor.apply_chat_template(turn, tokenize=False, add_generation_prompt=True))
    return texts


def sequential_position_ids(input_ids: Tensor) -> Tensor:
    """``(3, B, L)`` positions ``0 … L−1`` on every rotary axis: what HPSv3's decoder call uses."""
    batch, length = input_ids.shape
    return torch.arange(length, device=input_ids.device).view(1, 1, length).expand(3, batch, length)


class HPSv3Model(nn.Module):
    """Qwen2-VL backbone + HPSv3's ``(μ, σ)`` head at the reward token."""

    def __init__(self, config: Any, positions: str = "sequential") -> None:
        """Build the backbone (``transformers.Qwen2VLModel``) and the float32 head for ``config``.

        ``positions``: ``"sequential"`` (HPSv3's) or ``"mrope"`` rotary positions (module docstring).
        """
        from transformers import Qwen2VLModel

        super().__init__()
        check_positions(positions)
        self.positions = positions
        self.backbone = Qwen2VLModel(config)
        width = int(config.text_config.hidden_size)
        self.rm_head = nn.Sequential(
            nn.Linear(width, 1024),
            nn.ReLU(),
            nn.Dropout(0.05),
            nn.Linear(1024, 16),
            nn.ReLU(),
            nn.Linear(16, 2),
        )

    def forward(self, inputs: dict[str, Tensor], reward_token_id: int) -> Tensor:
        """``(B, 2)`` float32 ``(μ, σ)`` from processor ``inputs`` holding one reward token per row.

        Raises:
            ValueError: If a row does not hold exactly one reward token (a prompt that spells it).
        """
        at_token = inputs["input_ids"] == reward_token_id
        if not bool((at_token.sum(-1) == 1).all()):
            raise ValueError(
                f"every HPSv3 input needs exactly one {REWARD_TOKEN} token, got {at_token.sum(-1).tolist()}; "
                f"remove {REWARD_TOKEN} from the prompts."
            )
        if self.positions == "sequential":
            inputs = inputs | {"position_ids": sequential_position_ids(inputs["input_ids"])}
        hidden = self.backbone(**inputs, use_cache=False).last_hidden_state
        return self.rm_head.float()(hidden[at_token].float())


@dataclass(frozen=True)
class HPSv3Kwargs:
    """``reward.kwargs.hpsv3``.

    Attributes:
        instruction_path: Text file holding HPSv3's rating instruction (see the module docstring); required.
        model_path: ``HPSv3.safetensors``: a local file or ``owner/repo/filename`` on the hub.
        base_path: The Qwen2-VL checkpoint HPSv3 was fine-tuned from (its config and processor).
        image_pixels: Pixels each image is resized to (HPSv3: 256·28·28).
        device: ``None`` = CUDA when available, else CPU.
        dtype: Backbone dtype (HPSv3 runs in bfloat16; the head is always float32).
        local_files_only: Never reach the hub.
        positions: Rotary positions: ``"sequential"`` as HPSv3 runs, or ``"mrope"`` (module docstring).
    """

    instruction_path: str | None = None
    model_path: str = HPSV3_CHECKPOINT
    base_path: str = HPSV3_BASE
    image_pixels: int = HPSV3_PIXELS
    device: str | None = None
    dtype: str = "bfloat16"
    local_files_only: bool = False
    positions: str = "sequential"


class HPSv3Reward(CheckpointReward):
    """HPSv3 ``μ`` per (prompt, image); the model loads on the first :meth:`score`.

    Attributes:
        name: ``"hpsv3"``.
    """

    name = "hpsv3"
    download_hint = _DOWNLOAD_HINT

    def __init__(self, kwargs: HPSv3Kwargs) -> None:
        super().__init__(kwargs)
        if kwargs.image_pixels <= 0:
            raise ValueError(f"reward.kwargs.hpsv3.image_pixels={kwargs.image_pixels}; use a positive count.")
        check_positions(kwargs.positions)
        self.instruction = read_instruction(kwargs.instruction_path)
        self._processor: Any = None

    def requirements(self) -> list[ModelSource]:
        """The checkpoint and the base Qwen2-VL :meth:`load` reads (``rewards/requirements.py``)."""
        return kwargs_sources(self.name, self.kwargs, files=("model_path",), dirs=("base_path",))

    def _load_processor(self) -> Any:
        """The base processor with ``<|Reward|>`` added as HPSv3's training did; right padding."""
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(
            self.kwargs.base_path, local_files_only=self.kwargs.local_files_only
        )
        processor.tokenizer.padding_side = "right"
        processor.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        return processor

    def load(self) -> HPSv3Model:
        """Load the processor, then the checkpoint onto the base config (once)."""
        if self._model is None:
            from transformers import AutoConfig

            self._processor = self._load_processor()
            path, state = self.read_checkpoint(hpsv3_state_dict)
            config = AutoConfig.from_pretrained(
                self.kwargs.base_path, local_files_only=self.kwargs.local_files_only
            )
            embed = state.get("backbone.language_model.embed_tokens.weight")
            if embed is not None:  # the checkpoint grew the vocabulary by the reward token
                config.text_config.vocab_size = int(embed.shape[0])
            model = self.place(lambda: HPSv3Model(config, self.kwargs.positions), state, path)
            model.rm_head.float()
            self._model = model
        return self._model

    @property
    def reward_token_id(self) -> int:
        """Id of ``<|Reward|>`` in the loaded tokenizer."""
        self.load()
        return int(self._processor.tokenizer.convert_tokens_to_ids(REWARD_TOKEN))

    def _resized(self, images: Tensor) -> list[Image.Image]:
        """RGB PIL images resized (bicubic) to ``image_pixels`` on the processor's patch grid."""
        processor = self._processor.image_processor
        factor = int(processor.patch_size) * int(processor.merge_size)
        pils = to_pil_images(images)
        sizes = [fixed_pixel_size(im.height, im.width, factor, self.kwargs.image_pixels) for im in pils]
        return [im.resize((w, h), Image.Resampling.BICUBIC) for im, (h, w) in zip(pils, sizes)]

    def inputs(self, prompts: list[str], images: Tensor) -> dict[str, Tensor]:
        """Processor inputs: one user turn (image, then instruction + prompt + reward token) per sample."""
        self.load()
        texts = chat_texts(self._processor, prompts, self.instruction)
        batch = self._processor(text=texts, images=self._resized(images), padding=True, return_tensors="pt")
        return {k: v.to(self.device) for k, v in batch.items() if isinstance(v, Tensor)}

    @torch.no_grad()
    def score(self, batch: RewardBatch) -> RewardResult:
        """``μ`` per sample (float32, CPU); ``details["sigma"]`` = the head's ``σ``.

        Raises:
            ValueError: If images are missing or not ``(B, 3, H, W)``, or a prompt holds the reward token.
        """
        images = check_image_batch(batch.images, self.name)
        model = self.load()
        inputs = self.inputs(list(batch.prompts), images)
        inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        mu_sigma = model(inputs, self.reward_token_id).cpu()
        return RewardResult(
            scores=mu_sigma[:, 0].contiguous(), details={"sigma": mu_sigma[:, 1].contiguous()}
        )


@register("hpsv3", kwargs=HPSv3Kwargs)
def hpsv3(**kwargs: Any) -> HPSv3Reward:
    """HPSv3; kwargs as :class:`HPSv3Kwargs`.

    Raises:
        ValueError: On an unknown kwarg, a missing local checkpoint or a missing/placeholder-less instruction.
    """
    return HPSv3Reward(typed_kwargs(HPSv3Kwargs, "hpsv3", kwargs))
