"""BAGEL's understanding encoder: a SigLIP vision transformer over NaViT-style flattened patches.

An image of any size (a multiple of the patch size) is cut into p×p patches flattened channel-last
(``(p, p, 3)`` per patch, what the reference's ``patchify`` gives); the patch embedding is the SigLIP
convolution as a linear map over that flattening (the release stores it so), plus a learned position
embedding indexed by ``row·(image_size/p) + col``. The encoder is SigLIP's pre-norm layers with
bidirectional attention inside one image (the reference packs several images with varlen attention: the
same per image), then the post layer norm. BAGEL runs the file's layers but the last.
"""

from __future__ import annotations

import torch.nn.functional as F
from diffusers.models.attention import AttentionModuleMixin
from torch import Tensor, nn

from rlgen_cli.models.bagel.config import ViTConfig


def activation(name: str) -> nn.Module:
    """The activations BAGEL's configs name."""
    table = {"silu": nn.SiLU, "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"), "gelu": nn.GELU}
    if name not in table:
        raise ValueError(f"activation {name!r} is not one BAGEL uses ({', '.join(table)})")
    return table[name]()


class ScaledDotProductAttention:
    """The attention processor of BAGEL's attention modules: softmax(QKᵀ/√d + mask)·V through ``scaled_dot_product_attention`` (q, k, v: (B, H, S, d))."""

    def __call__(
        self, attn: nn.Module, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None
    ) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def patchify(image: Tensor, patch: int) -> Tensor:
    """(3, H, W) → (H/p · W/p, p·p·3) patches, row-major, each flattened (p, p, channel)."""
    c, h, w = image.shape
    grid = image.reshape(c, h // patch, patch, w // patch, patch)
    return grid.permute(1, 3, 2, 4, 0).reshape(-1, patch * patch * c)


class SiglipAttention(nn.Module, AttentionModuleMixin):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.processor = ScaledDotProductAttention()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (
            proj(x).unflatten(-1, (self.num_heads, -1)).transpose(0, 1)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = self.processor(self, q[None], k[None], v[None])[0]
        return self.out_proj(out.transpose(0, 1).flatten(1))


class SiglipMLP(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_hidden_layers))


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Linear(config.num_channels * config.patch_size**2, config.hidden_size)
        self.position_embedding = nn.Embedding(
            (config.image_size // config.patch_size) ** 2, config.hidden_size
        )


class SiglipVisionTransformer(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class SiglipVisionModel(nn.Module):
    """``vit_model``: ``vision_model.{embeddings, encoder, post_layernorm}`` as the checkpoint names them."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.vision_model = SiglipVisionTransformer(config)

    def forward(self, patches: Tensor, position_ids: Tensor) -> Tensor:
        """Features (N, hidden) of one image's patches (N, 3·p²) at position ids (N,)."""
        vm = self.vision_model
        x = vm.embeddings.patch_embedding(patches) + vm.embeddings.position_embedding(position_ids)
        for layer in vm.encoder.layers:
            x = layer(x)
        return vm.post_layernorm(x)
