"""A tiny random CLIP saved with its processor, where ``CLIPModel.from_pretrained`` loads it like a real
checkpoint: what the CLIP-backed pieces (``reward=image_similarity``, GARDO's ``algo.gardo.feature_model``)
load in tests and on a machine that cannot download one. Its features are a fixed random projection of
the pixels, not a learnt embedding.

    python -m rlgen_cli.models.tiny.clip DIR [--image-size 32]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from rlgen_cli.models.tokenizers import tiny_clip_tokenizer

logger = logging.getLogger(__name__)


def save_tiny_clip(directory: Path, image_size: int = 16, seed: int = 0) -> Path:
    """Write a one-layer CLIP (width 32, 4-pixel patches, 24-d projection) for ``image_size``² inputs and
    its processor to ``directory``; deterministic in ``seed``. Returns ``directory``."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tokenizer = tiny_clip_tokenizer()
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1)  # fmt: skip
    vision = dict(image_size=image_size, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=24))
    model.save_pretrained(directory)
    images = CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--image-size", type=int, default=16, help="the input side the processor resizes to")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("saved a tiny CLIP to %s", save_tiny_clip(args.directory, args.image_size, args.seed))


if __name__ == "__main__":
    main()
