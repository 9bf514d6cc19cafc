"""Rich progress bars behind a tiny interface, with a null version when bars are off (tests, CI logs).

The bars draw on the console the log handler writes to (:mod:`rlgen_cli.training.reporting.console`), so a log
line lands above the bars instead of inside them. Their time left is the mean pace since the bar
started times the steps left: it shows as soon as one step is done (rich's own estimate looks at the
last 30 s only and stays blank while a step takes longer than that, e.g. every training epoch); between
steps it counts down.
"""

from __future__ import annotations

from datetime import timedelta
from types import TracebackType

from rich.progress import BarColumn, MofNCompleteColumn, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.text import Text

from rlgen_cli.training.reporting.console import shared_console

UNKNOWN = "-:--:--"
INITIAL_FIELD = "initial"  # the completed count a bar was created with (a resumed run's epochs)
PACED_FIELD = "paced_at"  # seconds from the bar's start to its latest step


def seconds_left(paced_at: float | None, done: float, left: float, since: float = 0.0) -> float | None:
    """Time left at the mean pace so far: ``done`` steps took ``paced_at`` seconds, ``left`` steps to go,
    ``since`` seconds already spent on the next one (never below 0). None before the first step."""
    if paced_at is None or done <= 0:
        return None
    return max(paced_at / done * max(left, 0.0) - since, 0.0)


class MeanPaceRemainingColumn(ProgressColumn):
    """``H:MM:SS`` left at the bar's mean pace since it started (see :func:`seconds_left`)."""

    def render(self, task: Task) -> Text:
        paced_at = task.fields.get(PACED_FIELD)
        left = None
        if task.total is not None and paced_at is not None:
            done = task.completed - task.fields.get(INITIAL_FIELD, 0)
            left = seconds_left(paced_at, done, task.total - task.completed, (task.elapsed or 0.0) - paced_at)
        text = UNKNOWN if left is None else str(timedelta(seconds=round(left)))
        return Text(text, style="progress.remaining")


class Progress:
    """``with Progress(enabled) as p: t = p.task("rollout", total=n); p.advance(t); p.remove(t)``."""

    def __init__(self, enabled: bool = True) -> None:
        self._bars = (
            RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                MeanPaceRemainingColumn(),
                console=shared_console(),
                transient=False,
            )
            if enabled
            else None
        )
        self._started: dict[int, float] = {}  # each bar's start on the bars' clock

    def __enter__(self) -> Progress:
        if self._bars is not None:
            self._bars.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self._bars is not None:
            self._bars.stop()

    def task(self, description: str, total: int, completed: int = 0) -> int:
        if self._bars is None:
            return 0
        task = self._bars.add_task(
            description, total=total, completed=completed, **{INITIAL_FIELD: completed}
        )
        self._started[task] = self._bars.get_time()
        return task

    def advance(self, task: int, amount: int = 1, description: str | None = None) -> None:
        if self._bars is not None:
            paced_at = self._bars.get_time() - self._started[task]
            self._bars.update(task, advance=amount, description=description, **{PACED_FIELD: paced_at})

    def remove(self, task: int) -> None:
        if self._bars is not None:
            self._bars.remove_task(task)
            del self._started[task]
