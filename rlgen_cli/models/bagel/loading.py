"""BAGEL checkpoints in the release layout: read (``model.path=``) and written (the tiny model, tests).

A checkpoint directory holds ``llm_config.json`` and ``vit_config.json`` (:mod:`.config`), the network's
weights and ``ae.safetensors`` (the FLUX autoencoder in its original names, :mod:`.vae`) and the Qwen2
tokenizer files. The network's weights are read from the first of

* ``ema.safetensors`` — the EMA weights, what the release's inference loads;
* ``ema.safetensors.index.json`` / ``model.safetensors.index.json`` — the same, sharded (a
  ``weight_map`` from parameter name to shard file);
* ``model.safetensors``

that exists. Every parameter of the network must be there and nothing else, except the two frozen sin-cos
position tables, which are rebuilt when a file leaves them out. The ViT's patch embedding is accepted as
the linear map the release stores or as SigLIP's original convolution. The network is built on the meta
device and the tensors are assigned in ``model.dtype`` as they are read, so a 14 B-parameter checkpoint
never sits in memory twice.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlgen_cli.errors import UserError
from rlgen_cli.models.bagel.config import AE_WEIGHTS, BAGEL_7B_MOT, BagelConfig, from_directory, to_json_files
from rlgen_cli.models.bagel.modeling import Bagel, sincos_2d
from rlgen_cli.models.bagel.vae import build_vae, flux_layout_state_dict, load_flux_layout

WEIGHT_FILES = (
    "ema.safetensors",
    "ema.safetensors.index.json",
    "model.safetensors.index.json",
    "model.safetensors",
)
MARKER_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
"""Prompt start / end and image start / end: the reference adds those a tokenizer lacks."""
PATCH_EMBED = "vit_model.vision_model.embeddings.patch_embedding.weight"
POSITION_TABLES = ("latent_pos_embed.pos_embed", "vit_pos_embed.pos_embed")


def weight_source(directory: Path) -> Path:
    """The weights file (or shard index) this checkpoint is read from (module docstring: the order)."""
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return directory / name
    raise UserError(
        f"{directory} holds none of {', '.join(WEIGHT_FILES)}: model.path must be a BAGEL checkpoint "
        "directory as released (e.g. a download of ByteDance-Seed/BAGEL-7B-MoT)"
    )


def read_weights(source: Path, dtype: torch.dtype) -> dict[str, Tensor]:
    """Every tensor of a safetensors file or of the shards a ``*.index.json`` names, cast to ``dtype``."""
    from safetensors.torch import load_file

    if source.suffix == ".json":
        shards = sorted(set(json.loads(source.read_text())["weight_map"].values()))
        files = [source.parent / shard for shard in shards]
    else:
        files = [source]
    state: dict[str, Tensor] = {}
    for file in files:
        if not file.is_file():
            raise UserError(f"{file} is missing: {source.name} names it as a shard of the checkpoint")
        state |= {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(file).items()}
    return state


def _fit_release_tensors(state: dict[str, Tensor], config: BagelConfig) -> dict[str, Tensor]:
    """The convolution form of the ViT patch embedding → the linear form; missing sin-cos tables rebuilt."""
    weight = state.get(PATCH_EMBED)
    if weight is not None and weight.dim() == 4:  # (D, 3, p, p) → (D, p·p·3), the patchify order
        state[PATCH_EMBED] = weight.permute(0, 2, 3, 1).reshape(weight.shape[0], -1)
    dtype = next(iter(state.values())).dtype
    d = config.llm.hidden_size
    state.setdefault(POSITION_TABLES[0], sincos_2d(d, config.max_latent_size).to(dtype))
    state.setdefault(POSITION_TABLES[1], sincos_2d(d, config.vit_max_num_patch_per_side).to(dtype))
    return state


def load_network(directory: Path, dtype: torch.dtype, config: BagelConfig) -> Bagel:
    """The BAGEL network of ``directory`` in ``dtype`` (strict; see the module docstring)."""
    with torch.device("meta"):
        model = Bagel(config)
    state = _fit_release_tensors(read_weights(weight_source(directory), dtype), config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise UserError(
            f"the weights in {directory} do not fit BAGEL with its llm_config.json / vit_config.json: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})"
        )
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:  # shapes that disagree with the config files
        raise UserError(f"the weights in {directory} do not fit its config files: {err}") from err
    return model.eval()


def load_vae(directory: Path, config: BagelConfig) -> Any:
    """The FLUX autoencoder of ``ae.safetensors`` in fp32."""
    from safetensors.torch import load_file

    path = directory / AE_WEIGHTS
    if not path.is_file():
        raise UserError(f"{path} is missing: a BAGEL checkpoint ships its autoencoder as {AE_WEIGHTS}")
    vae = build_vae(config.vae)
    try:
        load_flux_layout(vae, load_file(path))
    except ValueError as err:
        raise UserError(f"{path}: {err}") from err
    return vae.eval()


def load_tokenizer(directory: Path) -> tuple[Any, dict[str, int]]:
    """The checkpoint's tokenizer and the ids of :data:`MARKER_TOKENS` (added when missing, as the
    reference does; a real Qwen2.5 tokenizer has them all)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(f"no tokenizer could be read from {directory}: {err}") from err
    tokenizer.add_tokens([t for t in MARKER_TOKENS if t not in tokenizer.get_vocab()])
    return tokenizer, {token: tokenizer.convert_tokens_to_ids(token) for token in MARKER_TOKENS}


def load_checkpoint(
    directory: Path, dtype: torch.dtype, base: BagelConfig = BAGEL_7B_MOT
) -> tuple[Bagel, Any, Any, dict[str, int]]:
    """Network, autoencoder, tokenizer and marker ids of the release-layout checkpoint in ``directory``;
    ``base`` gives what the JSON files do not (the VAE, latent and ViT table sizes: BAGEL-7B-MoT's)."""
    if not directory.is_dir():
        raise UserError(
            f"model.path={str(directory)!r} is not a directory: BAGEL loads a local checkpoint in the release "
            "layout; download it (huggingface-cli download ByteDance-Seed/BAGEL-7B-MoT --local-dir DIR) and "
            "set model.path=DIR"
        )
    config = from_directory(directory, base)
    tokenizer, markers = load_tokenizer(directory)
    return load_network(directory, dtype, config), load_vae(directory, config), tokenizer, markers


RANDOM_INIT_CONFIGS = {"bagel_7b_mot": BAGEL_7B_MOT}
"""``model.variant`` → the released config ``model.weights=random_init`` builds (``models/real_size.py``)."""


def random_init_network(variant: str) -> Bagel:
    """The network of real-size ``variant`` (``model.variant``; its depth as ``real_size.VARIANTS`` says)
    on the current default device and dtype, random weights."""
    from rlgen_cli.models.real_size import VARIANTS

    config = RANDOM_INIT_CONFIGS[variant]
    layers = VARIANTS[variant].layers
    if layers is not None:
        config = replace(config, llm=replace(config.llm, num_hidden_layers=layers))
    return Bagel(config)


def random_init_checkpoint(cfg: Any, device: torch.device) -> tuple[Bagel, Any, Any, dict[str, int]]:
    """What :func:`load_checkpoint` returns, for ``cfg.variant`` at random init on ``device``: the network
    built in ``model.dtype`` (never in fp32; seed ``model.tiny_seed``), the FLUX VAE in fp32 (seed + 1),
    the byte-level Qwen2 stand-in tokenizer (it has the four marker tokens; the embeddings keep the
    published 152 064 rows) and the marker ids."""
    from rlgen_cli.models.base import TORCH_DTYPES
    from rlgen_cli.models.loading import cast_as_loaded
    from rlgen_cli.models.real_size import constructing, variant_of
    from rlgen_cli.models.tiny import tiny_qwen_tokenizer

    variant, dtype = variant_of(cfg), TORCH_DTYPES[cfg.dtype]
    with constructing(device, dtype, cfg.tiny_seed):
        network = random_init_network(variant)
    cast_as_loaded(
        network, TORCH_DTYPES[cfg.frozen_dtype or cfg.dtype]
    )  # the sin-cos tables are computed on the CPU in fp32
    network.to(device)
    with constructing(device, torch.float32, cfg.tiny_seed + 1):
        vae = build_vae(RANDOM_INIT_CONFIGS[variant].vae)
    tokenizer = tiny_qwen_tokenizer()
    markers = {token: tokenizer.convert_tokens_to_ids(token) for token in MARKER_TOKENS}
    return network.eval(), vae.eval(), tokenizer, markers


def save_checkpoint(
    model: Bagel, vae: Any, tokenizer: Any, directory: Path, *, shards: int = 1, ema: bool = True
) -> None:
    """Write ``model``, ``vae`` and ``tokenizer`` in the release layout (``shards > 1``: sharded files
    with a ``*.safetensors.index.json``; ``ema=False``: ``model.*`` names instead of ``ema.*``)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    to_json_files(model.config, directory)
    stem = "ema" if ema else "model"
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if shards == 1:
        save_file(state, directory / f"{stem}.safetensors")
    else:
        names = list(state)
        weight_map = {}
        for i in range(shards):
            shard = f"{stem}-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]
            save_file({k: state[k] for k in part}, directory / shard)
            weight_map |= dict.fromkeys(part, shard)
        index = {"metadata": {}, "weight_map": weight_map}
        (directory / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    save_file(flux_layout_state_dict(vae), directory / AE_WEIGHTS)
    tokenizer.save_pretrained(directory)
