"""``accelerate launch`` that leaves out its own traceback when a worker refused the run.

python -m rlgen_cli.launch.accelerate_quietly ACCELERATE-LAUNCH-ARGS… -m rlgen_cli.launch.worker RUN/resolved.yaml

A worker that stops with exit code 2 (a full disk, a non-finite reward, a wrong world size) leaves its one
line in the run directory (``launch/world.py``) for the controller to print. accelerate's launcher would
add a ``ChildFailedError`` traceback (torchrun) or a ``CalledProcessError`` one (one process) that says
only that a worker failed; with the reason on record it exits 1 without it. A worker that crashed without
refusing keeps the launcher's traceback and its failure summary.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rlgen_cli.launch.world import REFUSAL_FILE


def main(argv: list[str]) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(argv)
    try:
        launch_command(args)
    except (ChildFailedError, subprocess.CalledProcessError):
        if not _refused(args.training_script_args):
            raise
        return 1  # the controller prints the worker's refusal
    return 0


def _refused(worker_args: list[str]) -> bool:
    """A worker left its refusal next to the ``resolved.yaml`` it was given."""
    return bool(worker_args) and (Path(worker_args[-1]).parent / REFUSAL_FILE).is_file()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
