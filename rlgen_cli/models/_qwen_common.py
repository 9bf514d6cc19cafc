"""What Qwen-Image and Qwen-Image-Edit share behind the flow-policy protocol.

Qwen-Image (Wu et al. 2025, "Qwen-Image Technical Report") is a 20 B double-stream MMDiT conditioned on
the last hidden state of a Qwen2.5-VL-7B encoder, over a 16-channel causal video VAE (8× downsampling).
Conventions reproduced from diffusers' ``QwenImagePipeline`` / ``QwenImageEditPipeline`` (0.42):

* **Packing.** The VAE latent (B, C, h, w) is cut into 2×2 patches, so the policy's ``x`` is the packed
  token sequence (B, h/2·w/2, 4C); RoPE positions come from ``img_shapes`` [(frame, h/2, w/2), ...].
* **Text.** The prompt goes through the pipeline's chat template; hidden states after the template
  prefix are the tokens, with a padding mask. rlgen pads every batch to ``model.max_sequence_length``
  (so conditionings of different batches join with ``Cond.cat``) and ``velocity`` trims the batch to its
  longest valid prompt, as upstream Flow-GRPO does; masked tokens never reach the image tokens.
* **Schedule.** ``linspace(1, 1/T, T)`` with the exponential dynamic shift μ linear in the image token
  count (scheduler config: 256…8192 tokens, shift 0.5…0.9), then stretched so the last non-zero σ is
  ``shift_terminal`` (0.02), exactly as ``FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas, mu)``.
* **True CFG.** Both branches run in one batched call; the combination u + g·(c − u) is rescaled per token
  to the conditional prediction's norm (``QwenImagePipeline.__call__``). Guidance 1 runs no negative branch.
* **Timestep.** The transformer takes t = σ (diffusers passes ``timesteps / 1000``).

Precision: the frozen transformer and text encoder run in ``model.dtype`` (bf16 upstream) under
autocast; the VAE runs in fp32 (as upstream Flow-GRPO); LoRA / fully trained weights are fp32. Latents
are fp32 between steps and ``velocity`` upcasts both branches to fp32 before the CFG combination and the
norm rescale (upstream casts latents to bf16 between steps and combines in bf16; storing fp32 is what
makes the recomputed log-prob equal the sampled one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlgen_cli.models.base import TORCH_DTYPES, Cond, cfg_combine, uncond_takes_grad
from rlgen_cli.models.loading import pack, unpack
from rlgen_cli.models.trainable import LORA_WEIGHTS_NAME as LORA_WEIGHTS_NAME  # re-exported
from rlgen_cli.models.trainable import TRANSFORMER_DIR as TRANSFORMER_DIR  # re-exported
from rlgen_cli.models.trainable import TrainableTransformer, autocast
from rlgen_cli.schema.errors import UserError
from rlgen_cli.schema.flow import ModelConfig
from rlgen_cli.sde.noise import randn_per_sample
from rlgen_cli.sde.schedule import calculate_mu, dynamic_shift_sigmas, shift_sigmas

QWEN_LORA_TARGETS = [
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
]
"""Flow-GRPO's Qwen-Image LoRA targets (``scripts/train_qwenimage.py``): both attention streams and MLPs."""

QWEN_SCHEDULER = dict(
    base_image_seq_len=256, max_image_seq_len=8192, base_shift=0.5, max_shift=0.9, shift=1.0,
    shift_terminal=0.02, use_dynamic_shifting=True, time_shift_type="exponential",
)  # fmt: skip
"""The scheduler config Qwen/Qwen-Image ships; the tiny variants use it too."""


def template_tokenizer(template: str, drop_idx: int) -> Any:
    """``tiny_vlm``'s byte-level Qwen tokenizer, plus added tokens that make the pipeline's template
    prefix (through ``user\\n``) exactly ``drop_idx`` tokens long, as with the real tokenizer.

    The pipeline drops its first ``drop_idx`` hidden states; with one token per byte it would keep most of
    the system prompt (≈ 120 tokens). Cutting the system text into ``drop_idx − 9`` added pieces makes the
    kept tokens start at the user's prompt, as for the real model, and keeps the tiny sequences short.
    """
    from tokenizers import AddedToken

    from rlgen_cli.rewards.tiny_vlm import tiny_qwen_tokenizer

    tokenizer = tiny_qwen_tokenizer()
    head = template[: template.index("user\n") + len("user\n")]
    system = head[len("<|im_start|>") : head.index("<|im_end|>")]
    pieces = drop_idx - len(tokenizer(head.replace(system, "")).input_ids)
    bounds = [round(i * len(system) / pieces) for i in range(pieces + 1)]
    chunks = [system[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    tokenizer.add_tokens([AddedToken(c, normalized=False, special=False) for c in chunks])
    if len(tokenizer(head).input_ids) != drop_idx:
        raise RuntimeError(f"the tiny tokenizer splits the template prefix into other than {drop_idx} tokens")
    return tokenizer


def tiny_qwen_pipeline(pipeline_cls: type, seed: int = 0) -> Any:
    """A tiny ``pipeline_cls`` (``QwenImagePipeline`` or ``QwenImageEditPipeline``), deterministic in ``seed``.

    The Qwen2.5-VL encoder (hidden 32) and 4-px-patch processor are ``rewards/tiny_vlm``'s, with the
    tokenizer of :func:`template_tokenizer`; the VAE has z_dim 4 and scale factor 4, so a 32 px image is
    an 8×8 latent: 16 packed tokens of 16 channels (the transformer's ``in_channels``).
    """
    import inspect

    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    from rlgen_cli.rewards.tiny_vlm import tiny_vlm, tiny_vlm_processor

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
        )  # fmt: skip
        vae = AutoencoderKLQwenImage(
            base_dim=4, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 1.0],
        )  # fmt: skip
        parts = {"scheduler": FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER), "vae": vae,
                 "transformer": transformer, "text_encoder": None, "tokenizer": None}  # fmt: skip
        if "processor" in inspect.signature(pipeline_cls.__init__).parameters:
            parts["processor"] = None
        probe = pipeline_cls(**parts)  # only to read its prompt template
        processor = tiny_vlm_processor(max_pixels=32 * 32)
        processor.tokenizer = template_tokenizer(
            probe.prompt_template_encode, probe.prompt_template_encode_start_idx
        )
        parts |= {
            "tokenizer": processor.tokenizer,
            "text_encoder": tiny_vlm(processor, hidden_size=32, seed=seed),
        }
    if "processor" in parts:
        parts["processor"] = processor
    return pipeline_cls(**parts)


def pad_text(embeds: Tensor, mask: Tensor | None, length: int) -> tuple[Tensor, Tensor]:
    """Right-pad (B, S, D) embeddings and their (B, S) mask (None = all valid) to ``length`` tokens."""
    batch, seq = embeds.shape[:2]
    if seq > length:
        raise UserError(
            f"the encoded prompt has {seq} tokens but model.max_sequence_length={length}; raise "
            "model.max_sequence_length (Qwen-Image accepts up to 1024) or shorten the prompts"
        )
    if mask is None:
        mask = torch.ones(batch, seq, dtype=torch.bool, device=embeds.device)
    return F.pad(embeds, (0, 0, 0, length - seq)), F.pad(mask.bool(), (0, length - seq), value=False)


def true_cfg(cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
    """u + g·(c − u), rescaled per token (last dim) to the norm of the conditional prediction c."""
    combined = cfg_combine(uncond, cond, scale)
    return combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


def qwen_sigmas(num_steps: int, image_seq_len: int, config: Any, shift: float = 0.0) -> Tensor:
    """(T+1,) sigmas ending at 0, equal to the pipeline's scheduler: dynamic exponential shift μ(tokens)
    and the ``shift_terminal`` stretch; ``shift > 0`` selects a static SD3 shift of linspace(1, 0, T+1)."""
    if shift > 0:
        return shift_sigmas(torch.linspace(1.0, 0.0, num_steps + 1), shift)
    if not config.get("use_dynamic_shifting", False) or config.get("time_shift_type") != "exponential":
        raise UserError(
            "the pipeline's scheduler does not use the exponential dynamic shift Qwen-Image ships; use the "
            "original scheduler config or set model.shift > 0 for a static shift"
        )
    mu = calculate_mu(
        image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5), config.get("max_shift", 1.15),
    )  # fmt: skip
    sigmas = dynamic_shift_sigmas(num_steps, mu)
    terminal = config.get("shift_terminal")
    if terminal:
        one_minus = 1.0 - sigmas[:-1].double()
        stretched = 1.0 - one_minus / (one_minus[-1] / (1.0 - terminal))
        sigmas = torch.cat([stretched.float(), sigmas.new_zeros(1)])
    return sigmas


def dead_text_outputs(transformer: nn.Module) -> list[str]:
    """LoRA modules that can never get a gradient: the model returns only the image stream, so the last
    block's text-stream outputs (its text queries, ``to_add_out`` and ``txt_mlp``) are discarded."""
    last = f"transformer_blocks.{len(transformer.transformer_blocks) - 1}"
    return [f"{last}.attn.add_q_proj", f"{last}.attn.to_add_out", f"{last}.txt_mlp.net.0.proj",
            f"{last}.txt_mlp.net.2"]  # fmt: skip


class QwenFamilyPolicy:
    """Qwen-Image behind the flow-policy protocol; ``x`` is the packed latent (B, L, D) in fp32.

    Subclasses provide ``encode`` and may append context tokens (Edit's source image) through
    :meth:`context`; everything else is shared.
    """

    family = "qwen_image"
    takes_source_images = False
    pipeline_class = "QwenImagePipeline"

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = TORCH_DTYPES[cfg.dtype]
        self.guidance_scale = cfg.guidance_scale
        self.height, self.width = cfg.height or cfg.resolution, cfg.width or cfg.resolution
        pipeline.to(device)
        pipeline.vae.float()  # upstream keeps the VAE in fp32
        pipeline.set_progress_bar_config(disable=True)
        pipeline.vae.requires_grad_(False).eval()
        pipeline.text_encoder.requires_grad_(False).eval()
        self.pipeline = pipeline
        self.latent_hw = (self.latent_side(self.height, "height"), self.latent_side(self.width, "width"))
        # Gradient checkpointing: upstream trains the 20 B transformer with activation checkpointing too.
        self._train = TrainableTransformer(
            pipeline, cfg, pipeline_class=self.pipeline_class, transformer_class="QwenImageTransformer2DModel",
            exclude=dead_text_outputs(pipeline.transformer) if cfg.lora.enabled else (),
            gradient_checkpointing=True,
        )  # fmt: skip

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    def latent_side(self, pixels: int, name: str) -> int:
        """Latent size of an image side; it must split into 2×2 patches of the downsampled latent."""
        multiple = self.pipeline.vae_scale_factor * 2
        if pixels % multiple:
            raise UserError(
                f"image {name} {pixels} px is not a multiple of {multiple}: Qwen-Image packs 2×2 patches of "
                f"the {self.pipeline.vae_scale_factor}× downsampled latent; set model.resolution (or "
                f"model.{name}) to a multiple of {multiple}"
            )
        return pixels // self.pipeline.vae_scale_factor

    # -- conditioning -------------------------------------------------------------------------
    def text_branches(self, encode_one: Any, prompts: Sequence[str]) -> dict[str, Tensor]:
        """Padded embeddings + masks of the prompts and, when CFG is on, of ``model.negative_prompt``.

        ``encode_one(list_of_prompts)`` returns the pipeline's (embeds, mask or None).
        """
        length = self.cfg.max_sequence_length
        embeds, mask = pad_text(*encode_one(list(prompts)), length)
        tensors = {"prompt_embeds": embeds, "prompt_mask": mask}
        if self.guidance_scale > 1.0:
            neg, neg_mask = pad_text(*encode_one([self.cfg.negative_prompt] * len(prompts)), length)
            tensors |= {"neg_prompt_embeds": neg, "neg_prompt_mask": neg_mask}
        return tensors

    def context(self, cond: Cond) -> tuple[Tensor, tuple[int, int, int]] | None:
        """Extra (B, L', D) tokens appended after the target tokens and their (frame, h/2, w/2) shape."""
        return None

    # -- sampling geometry --------------------------------------------------------------------
    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        """x_1 ~ N(0, I) drawn in the latent shape (n, C, h, w), then packed: fp32 (n, L, 4C)."""
        shape = (self.transformer.config.in_channels // 4, *self.latent_hw)
        if generator is None or isinstance(generator, torch.Generator):
            latents = torch.randn((n, *shape), generator=generator, device=self.device)
        else:
            latents = randn_per_sample(shape, generator[:n], self.device)
        return pack(latents)

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        """(T+1,) sigmas ending at 0 for the image tokens of ``x`` (see :func:`qwen_sigmas`)."""
        return qwen_sigmas(num_steps, x.shape[1], self.pipeline.scheduler.config, self.cfg.shift).to(
            self.device
        )

    # -- the one transformer call -------------------------------------------------------------
    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """v(x, σ) for packed x (B, L, D) fp32, sigma 0-d or (B,); true CFG folded in; fp32 (B, L, D)."""
        batch, length = x.shape[:2]
        timestep = sigma.float().reshape(-1).expand(batch).to(self.device)  # t = σ = timesteps / 1000
        shapes = [(1, self.latent_hw[0] // 2, self.latent_hw[1] // 2)]
        hidden = x
        extra = self.context(cond)
        if extra is not None:
            hidden, shapes = torch.cat([x, extra[0].to(x.dtype)], dim=1), [*shapes, extra[1]]
        embeds, mask = cond.tensors["prompt_embeds"], cond.tensors["prompt_mask"]
        if self.guidance_scale <= 1.0:
            return self._forward(hidden, timestep, embeds, mask, shapes)[:, :length]
        neg_embeds, neg_mask = cond.tensors["neg_prompt_embeds"], cond.tensors["neg_prompt_mask"]
        if not uncond_takes_grad():  # a separate no-grad unconditional pass (see SD3Policy.velocity)
            with torch.no_grad():
                uncond_v = self._forward(hidden, timestep, neg_embeds, neg_mask, shapes)[:, :length]
            cond_v = self._forward(hidden, timestep, embeds, mask, shapes)[:, :length]
            return true_cfg(cond_v, uncond_v, self.guidance_scale)
        out = self._forward(
            torch.cat([hidden, hidden]), torch.cat([timestep, timestep]), torch.cat([embeds, neg_embeds]),
            torch.cat([mask, neg_mask]), shapes,
        )[:, :length]  # fmt: skip
        cond_v, uncond_v = out.chunk(2)
        return true_cfg(cond_v, uncond_v, self.guidance_scale)

    def _forward(
        self, hidden: Tensor, timestep: Tensor, embeds: Tensor, mask: Tensor, shapes: list
    ) -> Tensor:
        """One transformer pass in the model dtype, fp32 out, over the text tokens some prompt of the
        batch uses (the padding every prompt shares is dropped)."""
        keep = max(int(mask.sum(dim=1).max()), 1)
        with autocast(self.device, self.dtype):
            out = self._train.forward_module()(
                hidden_states=hidden.to(self.dtype), timestep=timestep, encoder_hidden_states=embeds[:, :keep],
                encoder_hidden_states_mask=mask[:, :keep], img_shapes=[shapes] * hidden.shape[0],
                return_dict=False,
            )[0]  # fmt: skip
        return out.float()

    def _latent_stats(self) -> tuple[Tensor, Tensor]:
        """The VAE's per-channel latent mean and std, shaped (1, C, 1, 1, 1)."""
        config = self.pipeline.vae.config
        mean = torch.tensor(config.latents_mean, device=self.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(config.latents_std, device=self.device).view(1, -1, 1, 1, 1)
        return mean, std

    @torch.no_grad()
    def decode(self, x0: Tensor) -> Tensor:
        """Packed latents (B, L, D) → images (B, 3, H, W) in [0, 1], fp32."""
        vae = self.pipeline.vae
        mean, std = self._latent_stats()
        latents = unpack(x0.float(), *self.latent_hw).unsqueeze(2) / (1.0 / std) + mean  # (B, C, 1, h, w)
        images = vae.decode(latents.to(vae.dtype), return_dict=False)[0][:, :, 0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    # -- training surface (delegated to the shared component) ---------------------------------
    def trainable_parameters(self) -> list[nn.Parameter]:
        return self._train.parameters

    def distribute(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        """Route gradient-carrying forwards through ``wrap(transformer)`` (DDP: averaged gradients)."""
        self._train.distribute(wrap)

    def reference(self) -> contextlib.AbstractContextManager[None]:
        """Within this context ``velocity`` runs the frozen reference (LoRA disabled or a frozen copy)."""
        return self._train.reference()

    def save_trainable(self, directory: Path) -> None:
        """LoRA → ``pytorch_lora_weights.safetensors`` (what ``load_lora_weights`` reads); full FT →
        ``transformer/``."""
        self._train.save(directory)

    def load_trainable(self, directory: Path) -> None:
        """Load what ``save_trainable`` wrote into the live modules (shapes must match)."""
        self._train.load(directory)
