"""A worker process of a launched run: reads ``resolved.yaml`` and runs the recipe (never Hydra).

python -m rlgen_cli.launch.worker RUN_DIR/resolved.yaml     # what the controller's launch runs

Before anything else it checks that the launch started the processes the config asked for
(``launch/world.py``). A refusal — that one, or a :class:`UserError` the recipe raises — ends the worker
with exit code 2 and leaves the reason in the run directory, where the controller reads it (the launcher
stops the other ranks when one exits). A rank whose collective breaks because another rank refused and
left exits with code 2 too, without a traceback: the refusal is the reason.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from rlgen_cli.errors import UserError
from rlgen_cli.launch.world import REFUSAL_FILE, world_mismatch, write_refusal
from rlgen_cli.schema.recipes import structured_run


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m rlgen_cli.launch.worker RUN_DIR/resolved.yaml\n")
        return 2
    resolved = Path(argv[0])
    try:
        return _run(resolved)
    except UserError as err:
        return _refuse(resolved.parent, str(err))
    except KeyboardInterrupt:  # rank 0's recipe already said where the run stopped; no traceback per rank
        return 130
    except Exception:
        if not peer_refused(resolved.parent):
            raise
        return 2  # a rank that refused left, and this one's collective broke: its line is the reason


def peer_refused(run_dir: Path) -> bool:
    """Another rank stopped the run with a refusal (written before it exited, so before this rank's
    collective with it could fail)."""
    return (run_dir / REFUSAL_FILE).is_file()


def _run(resolved: Path) -> int:
    raw = OmegaConf.load(resolved)
    typed = OmegaConf.to_object(structured_run(raw))  # the controller wrote the composed config
    mismatch = world_mismatch(typed.launcher, os.environ, resolved)
    if mismatch is not None:  # before the process group: a wrong world would hang or train silently
        return _refuse(resolved.parent, mismatch)
    from rlgen_cli.training.distributed.dist import close_process_group
    from rlgen_cli.training.reporting.run_dir import setup_logging

    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 alone talks to the console and writes run.log
        setup_logging(resolved.parent)
    else:
        setup_logging(None, level=logging.WARNING)
    logging.getLogger("rlgen_cli.launch.worker").info(  # __main__ under -m
        "worker rank %s of %d processes (%s)",
        os.environ.get("RANK", "0"),
        typed.launcher.world_size,
        resolved,
    )
    from rlgen_cli.recipes.registry import recipe_of
    from rlgen_cli.training.checkpoints.checkpoint import stop_cleanly

    with stop_cleanly(resolved.parent):  # a full disk or a non-finite reward: one line, exit code 2
        recipe_of(typed).run(typed, raw)
    close_process_group()
    return 0


def _refuse(run_dir: Path, message: str) -> int:
    """Exit code 2 with ``message`` on stderr and left for the controller."""
    sys.stderr.write(f"rlgen worker (rank {os.environ.get('RANK', '0')}): {message}\n")
    write_refusal(run_dir, message)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
