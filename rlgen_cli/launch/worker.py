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

from rlgen_cli.schema.recipes import TRAIN_SCHEMAS


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m rlgen_cli.launch.worker RUN_DIR/resolved.yaml\n")
        return 2
    resolved = Path(argv[0])
    raw = OmegaConf.load(resolved)
    schema = TRAIN_SCHEMAS[raw.recipe]  # the controller wrote the composed config of this recipe
    typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), raw))
    from rlgen_cli.training.dist import close_process_group
    from rlgen_cli.training.run import setup_logging

    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 alone talks to the console and writes run.log
        setup_logging(resolved.parent)
    else:
        setup_logging(None, level=logging.WARNING)
    recipe = importlib.import_module(f"rlgen_cli.recipes.{typed.recipe}")
    recipe.run(typed, raw)
    close_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
