"""Rich progress bars behind a tiny interface, with a null version when bars are off (tests, CI logs)."""

from __future__ import annotations

from types import TracebackType

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


class Progress:
    """``with Progress(enabled) as p: t = p.task("rollout", total=n); p.advance(t); p.remove(t)``."""

    def __init__(self, enabled: bool = True) -> None:
        self._bars = (
            RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                transient=False,
            )  # fmt: skip
            if enabled
            else None
        )

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
        return self._bars.add_task(description, total=total, completed=completed)

    def advance(self, task: int, amount: int = 1, description: str | None = None) -> None:
        if self._bars is not None:
            self._bars.update(task, advance=amount, description=description)

    def remove(self, task: int) -> None:
        if self._bars is not None:
            self._bars.remove_task(task)
