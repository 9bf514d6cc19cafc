"""The one rich console of a process: log lines and progress bars go through it together.

Rich redraws live bars in place and prints anything else above them only when both use the same
console; a second console writes into the middle of the bars' region (a log line glued to a bar, bars
left behind in the scrollback). :func:`setup_logging <rlgen_cli.training.reporting.run_dir.setup_logging>` installs
the log handler on :func:`shared_console` and :class:`~rlgen_cli.training.reporting.progress.Progress` draws on it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rich.console import Console

PIPED_WIDTH = 120
"""Columns when the output is piped or redirected (no terminal width): wide enough for the tables."""

_console: Console | None = None


def new_console() -> Console:
    """A fresh console on the current ``sys.stdout``, made the shared one (piped: :data:`PIPED_WIDTH`)."""
    global _console
    _console = Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)
    return _console


def shared_console() -> Console:
    """The console logs and bars share (made on first use)."""
    return _console if _console is not None else new_console()


def job_header(number: int, run_dir: str, overrides: Sequence[str]) -> str:
    """The line that opens a sweep job's output: its number, run directory and overrides."""
    return f"sweep job {number} → {run_dir}: {' '.join(overrides) or '(no overrides)'}"


def print_job_header() -> None:
    """In a ``-m`` sweep, a rule and :func:`job_header` (whole, however long) before the job's own output;
    nothing for a single run or outside Hydra."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    from rlgen_cli.training.reporting.labels import override_key

    hydra = HydraConfig.get()
    overrides = [o for o in hydra.overrides.task if not override_key(o).startswith(("hydra.", "hydra/"))]
    console = shared_console()
    console.rule()
    header = job_header(hydra.job.num, hydra.runtime.output_dir, overrides)
    console.print(header, style="bold", soft_wrap=True, markup=False, highlight=False)
