"""Export a VLM checkpoint of ``rlgen train`` as a merged Hugging Face model directory.

The checkpoint's own config rebuilds the base model, its trained weights (LoRA adapter or full weights)
are loaded and, for LoRA, merged; the result is ``save_pretrained`` together with the processor, so
VLMEvalKit, lmms-eval, vLLM or ``from_pretrained`` load it as-is (R1-VL evaluates with VLMEvalKit).

    python -m rlgen_cli.vlm.export RUN_DIR/checkpoints/epoch_000010 OUT_DIR
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from rlgen_cli.vlm.policy import export_merged, load_vlm

__all__ = ["export_checkpoint"]


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, device: str = "cpu") -> Path:
    """Load ``checkpoint`` (its saved model config + weights) and write the merged model to ``out_dir``."""
    policy = load_vlm(None, str(checkpoint), torch.device(device))
    return export_merged(policy, out_dir)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="a checkpoint directory of rlgen train (VLM recipes)")
    parser.add_argument("out_dir", help="where to write the merged Hugging Face model directory")
    parser.add_argument("--device", default="cpu", help="device used for loading and merging")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    return export_checkpoint(args.checkpoint, args.out_dir, args.device)


if __name__ == "__main__":
    main()
