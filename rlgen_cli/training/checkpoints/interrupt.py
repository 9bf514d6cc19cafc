"""Ctrl-C during training: the final plot still drawn, and one line saying where the run stopped and
the command that resumes it.

A recipe runs its loop inside :func:`on_interrupt`; on ``KeyboardInterrupt`` rank 0 draws the plots
(what the run logged so far) and prints :func:`interrupted_line` whole, on one line (a command to copy),
and records it in ``run.log``; the interrupt then goes on up, and ``rlgen`` exits with code 130 (128 +
SIGINT, as a shell reports a Ctrl-C). ``resume=auto`` continues from the last checkpoint, so the line
names it, or says that none was written yet.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rlgen_cli.training.checkpoints.checkpoint import CHECKPOINTS_DIR, list_checkpoints
from rlgen_cli.training.reporting.labels import override_key, run_overrides

log = logging.getLogger(__name__)


def resume_command(run_dir: Path) -> str:
    """``rlgen train`` with the run's own overrides (``.hydra/overrides.yaml``; a sweep job's: its values),
    ``resume=auto`` and the run directory, quoted for a POSIX shell."""
    overrides = [o for o in run_overrides(run_dir) if override_key(o) != "resume"]
    args = ["rlgen", "train", *overrides, "resume=auto", f"hydra.run.dir={Path(run_dir).resolve()}"]
    return shlex.join(args)


def interrupted_line(run_dir: Path, completed: int, unit: str = "epoch") -> str:
    """Where the run stopped (``completed`` epochs, or R3's steps, done) and how to resume."""
    checkpoints = list_checkpoints(run_dir)
    where = f"interrupted in {unit} {completed + 1} ({completed} completed)"
    if not checkpoints:
        return f"{where}, before any checkpoint; to start it again run: {resume_command(run_dir)}"
    latest = checkpoints[-1].path
    return f"{where}; to resume from {CHECKPOINTS_DIR}/{latest.name} run: {resume_command(run_dir)}"


def announce(line: str) -> None:
    """``line`` on the shared console unwrapped (a log line would wrap it), and in ``run.log``."""
    from rlgen_cli.training.reporting.console import shared_console

    shared_console().print(line, soft_wrap=True, markup=False, highlight=False, style="bold yellow")
    record = log.makeRecord(log.name, logging.WARNING, __file__, 0, line, None, None)
    for handler in logging.getLogger("rlgen_cli").handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


@contextmanager
def on_interrupt(
    run_dir: Path, main: bool, completed: Callable[[], int], draw: Callable[[], object], unit: str = "epoch"
) -> Iterator[None]:
    """Run the block; on Ctrl-C, rank 0 (``main``) calls ``draw`` (the plots), then announces
    :func:`interrupted_line` for ``completed()`` epochs (steps) done; the interrupt is re-raised."""
    try:
        yield
    except KeyboardInterrupt:
        if main:
            try:
                draw()
            except Exception as err:  # a plot that fails must not hide where the run stopped
                log.warning("the final plot was not drawn: %s", err)
            announce(interrupted_line(run_dir, completed(), unit))
        raise
