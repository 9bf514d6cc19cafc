"""The one rich console of a process: log lines and progress bars go through it together.

Rich redraws live bars in place and prints anything else above them only when both use the same
console; a second console writes into the middle of the bars' region (a log line glued to a bar, bars
left behind in the scrollback). :func:`setup_logging <rlgen_cli.training.run.setup_logging>` installs
the log handler on :func:`shared_console` and :class:`~rlgen_cli.training.progress.Progress` draws on it.
"""

from __future__ import annotations

import sys

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
