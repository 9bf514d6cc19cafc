"""A worker process of a launched run: reads ``resolved.yaml`` and runs the recipe (never Hydra).

python -m rlgen_cli.launch.worker RUN_DIR/resolved.yaml     # what the controller's launch runs
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from rlgen_cli.schema.r3 import R3TrainConfig, train_recipe


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m rlgen_cli.launch.worker RUN_DIR/resolved.yaml\n")
        return 2
    resolved = Path(argv[0])
    raw = OmegaConf.load(resolved)
    typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(R3TrainConfig), raw))
    from rlgen_cli.training.run import setup_logging

    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 alone talks to the console and writes run.log
        setup_logging(resolved.parent)
    else:
        setup_logging(None, level=logging.WARNING)
    recipe = importlib.import_module(f"rlgen_cli.recipes.{train_recipe(typed)}")
    recipe.run(typed, raw)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
