"""Log lines and progress bars share one console: in a real terminal (a pseudo-terminal here) every log
line starts at column 0 on its own line, no stale bar stays in the scrollback, the epoch bar shows a time
left from its first epoch on and inner bars from their first step on; piped output holds no escape codes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlgen_cli.training.reporting.progress import UNKNOWN, seconds_left
from tests.cli.terminal import run_in_pty, screen_lines

COLUMNS = 100
# a training loop's shape: an epoch bar, an inner bar per epoch (removed when done), a log line per epoch
LOOP = """
import logging, time
from rlgen_cli.training.reporting.progress import Progress
from rlgen_cli.training.reporting.run_dir import setup_logging

setup_logging(None)
log = logging.getLogger("rlgen_cli.loop")
with Progress(True) as bars:
    epochs = bars.task("epochs", total=3)
    for epoch in range(3):
        inner = bars.task("sampling", total=4)
        for _ in range(4):
            time.sleep(0.12)
            bars.advance(inner)
        bars.remove(inner)
        log.info("epoch %d  reward +0.5  a line a bar could cut", epoch + 1)
        bars.advance(epochs, description=f"epoch {epoch + 1}: reward +0.5")
"""
LOG_LINE = re.compile(r"^(\[[^\]]+\]|\s+) INFO +epoch (\d) {2}reward \+0\.5 {2}a line a bar could cut$")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _rendered(raw: str, pattern: str) -> list[str]:
    """Every distinct render of a bar matching ``pattern`` (escape codes removed), in any frame."""
    return sorted(set(re.findall(pattern, ANSI.sub("", raw))))


def test_time_left_is_the_mean_pace_times_the_steps_left():
    assert seconds_left(None, 0, 10) is None  # nothing done yet
    assert seconds_left(12.0, 0, 10) is None
    assert seconds_left(12.0, 1, 9) == pytest.approx(108.0)  # one 12 s epoch done, 9 to go
    assert seconds_left(12.0, 2, 3, since=4.0) == pytest.approx(14.0)  # 6 s each, 4 s into the next
    assert seconds_left(12.0, 2, 1, since=9.0) == 0.0  # running late: never negative


def test_log_lines_and_bars_share_one_console_in_a_terminal():
    code, raw = run_in_pty([sys.executable, "-c", LOOP], columns=COLUMNS, timeout=60)
    assert code == 0, raw
    lines = [line for line in screen_lines(raw, COLUMNS) if line]
    logged = [line for line in lines if "INFO" in line]
    assert len(logged) == 3, "\n".join(lines)
    for epoch, line in enumerate(logged, start=1):  # at column 0, whole, nothing glued in front
        match = LOG_LINE.match(line)
        assert match and match.group(2) == str(epoch), "\n".join(lines)
    bars = [line for line in lines if "━" in line]
    assert bars == [lines[-1]] and lines[-1].startswith("epoch 3: reward +0.5"), "\n".join(lines)
    epoch_one = _rendered(raw, r"epoch 1: reward \+0\.5 [━╸╺ ]+ 1/3 \S+ (\S+)")
    assert epoch_one and all(left != UNKNOWN for left in epoch_one), epoch_one  # time left after epoch 1
    first_step = _rendered(raw, r"sampling +[━╸╺ ]+ 1/4 \S+ (\S+)")
    assert first_step and all(left != UNKNOWN for left in first_step), first_step


def test_piped_output_has_one_plain_line_per_log_and_no_escape_codes():
    out = subprocess.run(
        [sys.executable, "-c", LOOP],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parents[2],
    )
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout
    logged = [line for line in out.stdout.splitlines() if "INFO" in line]
    assert [LOG_LINE.match(line.rstrip()).group(2) for line in logged] == ["1", "2", "3"], out.stdout


@pytest.mark.slow
def test_a_tiny_training_in_a_terminal_keeps_log_lines_and_bars_apart(tmp_path: Path):
    from tests.conftest import TINY_RUN

    columns = 160  # wide enough that the epoch log line is not wrapped by the log handler itself
    overrides = [a for a in TINY_RUN if a != "progress=false"]
    argv = [sys.executable, "-m", "rlgen_cli.cli", "train", *overrides, "epochs=3", "eval_every=1",
            f"hydra.run.dir={tmp_path}"]  # fmt: skip
    code, raw = run_in_pty(argv, columns=columns, timeout=300)
    assert code == 0, raw
    lines = [line for line in screen_lines(raw, columns) if line]
    transcript = "\n".join(lines)
    epoch_lines = [line for line in lines if re.search(r"INFO +epoch \d  reward", line)]
    assert len(epoch_lines) == 3, transcript
    assert all(
        re.match(r"^(\[[^\]]+\]|\s+) INFO +epoch \d  reward \S+ eval", line) for line in epoch_lines
    ), transcript
    assert [line for line in lines if "━" in line] == [lines[-1]], transcript  # only the final epoch bar
    after_first = _rendered(raw, r"epoch 1: reward \S+ [━╸╺ ]+ 1/3 \S+ (\S+)")
    assert after_first and all(left != UNKNOWN for left in after_first), after_first


def test_a_sweep_job_opens_with_a_header_naming_its_overrides(cli, tmp_path: Path):
    from rlgen_cli.training.reporting.console import job_header

    assert job_header(1, "multirun/x/1", ["algo.lr=3e-4"]) == "sweep job 1 → multirun/x/1: algo.lr=3e-4"
    # the job fails its data check at once: the header has already said which overrides it ran
    code, out = cli(
        "train",
        "-m",
        "algo.lr=1e-3,3e-3",
        "experiment=tiny_cpu",
        "data.train=/nonexistent.txt",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert code == 2, out
    header = next(line for line in out.splitlines() if "sweep job" in line)
    assert (
        f"sweep job 0 → {tmp_path / '0'}: algo.lr=0.001 experiment=tiny_cpu data.train=/nonexistent.txt"
        in header
    )
