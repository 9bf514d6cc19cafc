"""What FLUX.1-dev and FLUX.1-Kontext-dev share behind the flow-policy protocol.

FLUX.1 (Black Forest Labs, 2024; Labs et al. 2025, "FLUX.1 Kontext: Flow Matching for In-Context Image
Generation and Editing in Latent Space") is a rectified-flow MMDiT: double-stream blocks, then
single-stream blocks over the joint text + image sequence, with 3-axis RoPE position ids. Conventions
reproduced from diffusers' ``FluxPipeline`` (0.42):

* **Packing.** The VAE latent (B, C, h, w) is cut into 2×2 patches, so the policy's ``x`` is the packed
  token sequence (B, h/2·w/2, 4C); image ids are (0, row, col) per token, text ids are zeros.
* **Schedule.** ``linspace(1, 1/T, T)`` with the dynamic exponential shift μ linear in the image token
  count (docs/maths.md §1.3). ``model.shift > 0`` selects a static SD3-style shift of ``linspace(1, 0, T+1)``
  instead (DanceGRPO / MixGRPO use 3).
* **Timestep.** The transformer takes t = σ (diffusers passes ``timesteps / 1000`` with timesteps = σ·1000
  and multiplies by 1000 inside); the guidance-distilled models embed the guidance scale the same way.
  There is NO classifier-free-guidance branch: one transformer call per velocity.

Precision: FLUX must run in bf16 (fp16 overflows its activations; upstream Flow-GRPO uses bf16). The
frozen weights and the forward run in ``model.dtype`` under autocast, LoRA / fully trained weights are
fp32, latents are fp32 between steps and ``velocity`` returns fp32, so the SDE step and its log-prob are
computed in fp32 on both the sampling and the training path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlgen_cli.models.base import TORCH_DTYPES, Cond
from rlgen_cli.models.loading import pack, unpack
from rlgen_cli.models.tokenizers import tiny_clip_tokenizer, tiny_t5_tokenizer, vocab_size
from rlgen_cli.models.trainable import LORA_WEIGHTS_NAME as LORA_WEIGHTS_NAME  # re-exported
from rlgen_cli.models.trainable import TRANSFORMER_DIR as TRANSFORMER_DIR  # re-exported
from rlgen_cli.models.trainable import TrainableTransformer, autocast
from rlgen_cli.schema.errors import UserError
from rlgen_cli.schema.flow import ModelConfig
from rlgen_cli.sde.noise import randn_per_sample
from rlgen_cli.sde.schedule import calculate_mu, dynamic_shift_sigmas, shift_sigmas

FLUX_LORA_TARGETS = [
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
]
"""Flow-GRPO's FLUX.1-dev LoRA targets: attention (double and single blocks) and both feed-forwards."""


def tiny_flux_components(seed: int = 0) -> dict[str, Any]:
    """The modules of a tiny FLUX pipeline (diffusers' test-suite transformer), deterministic in ``seed``.

    The VAE has two levels (scale factor 2) and 2 latent channels, so the transformer's ``in_channels``
    8 is 4·latent_channels (2×2 packing); a 32 px image is a 16×16 latent and 64 image tokens.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tok, t5_tok = tiny_clip_tokenizer(77), tiny_t5_tokenizer(512)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip_config = CLIPTextConfig(
            vocab_size=vocab_size(clip_tok), hidden_size=32, intermediate_size=37, num_attention_heads=4,
            num_hidden_layers=2, projection_dim=32, max_position_embeddings=77,
            bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_act="gelu",
        )  # fmt: skip
        t5_config = T5Config(
            vocab_size=vocab_size(t5_tok), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, decoder_start_token_id=0,
        )  # fmt: skip
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
            guidance_embeds=True,
        )  # fmt: skip
        vae = AutoencoderKL(
            sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4, 4),
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
            layers_per_block=1, latent_channels=2, norm_num_groups=1, use_quant_conv=False,
            use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
        )  # fmt: skip
        text_encoder, text_encoder_2 = CLIPTextModel(clip_config), T5EncoderModel(t5_config)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096,
        base_shift=0.5, max_shift=1.15,
    )  # fmt: skip
    return {
        "scheduler": scheduler, "vae": vae, "text_encoder": text_encoder, "tokenizer": clip_tok,
        "text_encoder_2": text_encoder_2, "tokenizer_2": t5_tok, "transformer": transformer,
    }  # fmt: skip


def image_ids(h: int, w: int, index: int, device: torch.device) -> Tensor:
    """RoPE ids (h/2·w/2, 3) of a packed h×w latent: (index, row, col); index 1 marks Kontext's source."""
    ids = torch.zeros(h // 2, w // 2, 3, device=device)
    ids[..., 0] = index
    ids[..., 1] = torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(w // 2, device=device)[None, :]
    return ids.reshape(-1, 3)


def dead_context_outputs(transformer: nn.Module) -> list[str]:
    """LoRA modules that can never get a gradient: without single-stream blocks the last double block's
    text-stream outputs (``attn.to_add_out``, ``ff_context``) are discarded. Empty for real FLUX."""
    if len(transformer.single_transformer_blocks) > 0 or len(transformer.transformer_blocks) == 0:
        return []
    last = f"transformer_blocks.{len(transformer.transformer_blocks) - 1}"
    return [f"{last}.attn.to_add_out", f"{last}.ff_context.net.0.proj", f"{last}.ff_context.net.2"]


class FluxFamilyPolicy:
    """FLUX behind the flow-policy protocol; ``x`` is the packed latent (B, L, D) in fp32.

    Subclasses name the family and may add context tokens (Kontext's source image) through
    :meth:`context_tokens`; everything else is shared.
    """

    family = "flux"
    takes_source_images = False
    pipeline_class = "FluxPipeline"

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = TORCH_DTYPES[cfg.dtype]
        self.guidance_scale = cfg.guidance_scale
        self.height, self.width = cfg.height or cfg.resolution, cfg.width or cfg.resolution
        pipeline.to(device)
        pipeline.set_progress_bar_config(disable=True)
        for part in (pipeline.vae, pipeline.text_encoder, pipeline.text_encoder_2):
            part.requires_grad_(False).eval()
        self.pipeline = pipeline
        self.latent_hw = (self._latent_side(self.height, "height"), self._latent_side(self.width, "width"))
        self._train = TrainableTransformer(
            pipeline, cfg, pipeline_class=self.pipeline_class, transformer_class="FluxTransformer2DModel",
            exclude=dead_context_outputs(pipeline.transformer) if cfg.lora.enabled else (),
        )  # fmt: skip

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    def distribute(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        """Route gradient-carrying forwards through ``wrap(transformer)`` (DDP: averaged gradients)."""
        self._train.distribute(wrap)

    def _latent_side(self, pixels: int, name: str) -> int:
        multiple = self.pipeline.vae_scale_factor * 2
        if pixels % multiple:
            raise UserError(
                f"image {name} {pixels} px is not a multiple of {multiple}: FLUX packs 2×2 patches of the "
                f"{self.pipeline.vae_scale_factor}× downsampled latent; set model.resolution (or model.{name}) "
                f"to a multiple of {multiple}"
            )
        return pixels // self.pipeline.vae_scale_factor

    # -- conditioning -------------------------------------------------------------------------
    @torch.no_grad()
    def encode_text(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        """T5 token embeddings (B, S, 4096) and the pooled CLIP embedding (B, 768) (real sizes)."""
        embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=list(prompts), prompt_2=None, device=self.device, num_images_per_prompt=1,
            max_sequence_length=self.cfg.max_sequence_length,
        )  # fmt: skip
        return {"prompt_embeds": embeds, "pooled": pooled}

    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Text conditioning only (no negative branch: guidance is embedded)."""
        if images is not None:
            raise UserError(f"{self.family} is a text-to-image model: it takes no source images")
        return Cond(self.encode_text(prompts))

    def context_tokens(self, cond: Cond) -> tuple[Tensor, Tensor] | None:
        """Extra (B, L', D) tokens and their (L', 3) ids appended after the target tokens; none here."""
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
        """(T+1,) sigmas ending at 0: dynamic shift μ(image tokens of x), or a static ``model.shift > 0``."""
        if self.cfg.shift > 0:
            return shift_sigmas(torch.linspace(1.0, 0.0, num_steps + 1), self.cfg.shift).to(self.device)
        config = self.pipeline.scheduler.config
        mu = calculate_mu(
            x.shape[1], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5), config.get("max_shift", 1.15),
        )  # fmt: skip
        return dynamic_shift_sigmas(num_steps, mu).to(self.device)

    # -- the one transformer call -------------------------------------------------------------
    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """v(x, σ) for packed x (B, L, D) fp32, sigma 0-d or (B,); returns the target tokens' fp32 (B, L, D)."""
        batch, length = x.shape[:2]
        embeds, pooled = cond.tensors["prompt_embeds"], cond.tensors["pooled"]
        timestep = sigma.float().reshape(-1).expand(batch).to(self.device)  # t = σ = timesteps / 1000
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((batch,), self.guidance_scale, device=self.device, dtype=torch.float32)
        hidden, ids = x, image_ids(*self.latent_hw, index=0, device=self.device)
        extra = self.context_tokens(cond)
        if extra is not None:
            hidden, ids = torch.cat([x, extra[0].to(x.dtype)], dim=1), torch.cat([ids, extra[1]])
        text_ids = torch.zeros(embeds.shape[1], 3, device=self.device)
        with autocast(self.device, self.dtype):
            out = self._train.forward_module()(
                hidden_states=hidden.to(self.dtype), timestep=timestep, guidance=guidance,
                pooled_projections=pooled, encoder_hidden_states=embeds, txt_ids=text_ids, img_ids=ids,
                return_dict=False,
            )[0]  # fmt: skip
        return out[:, :length].float()

    @torch.no_grad()
    def decode(self, x0: Tensor) -> Tensor:
        """Packed latents (B, L, D) → images (B, 3, H, W) in [0, 1], fp32."""
        vae = self.pipeline.vae
        latents = unpack(x0, *self.latent_hw) / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    # -- training surface (delegated to the shared component) ---------------------------------
    def trainable_parameters(self) -> list[nn.Parameter]:
        return self._train.parameters

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
