"""Run a command under a pseudo-terminal and replay its output as a terminal would show it.

:func:`run_in_pty` gives a child a real terminal of a chosen size (so rich draws live bars, as for a
person) and returns the raw bytes it wrote. :func:`screen_lines` replays them on a minimal terminal
(cursor moves, line erases, carriage returns, auto-wrap) and returns every line that ends up on screen
or in the scrollback — what a person scrolling back would read.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from collections.abc import Sequence

_CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")
_OSC = re.compile(r"\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")


def run_in_pty(
    argv: Sequence[str], columns: int = 100, rows: int = 30, timeout: float = 120.0, env: dict | None = None
) -> tuple[int, str]:
    """Run ``argv`` with a pseudo-terminal of ``columns`` × ``rows`` as stdin/stdout/stderr; returns
    (exit code, everything it wrote, decoded)."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    process = subprocess.Popen(
        list(argv), stdin=child, stdout=child, stderr=child, env=env, close_fds=True, start_new_session=True
    )
    os.close(child)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 0.2)
        if ready:
            try:
                data = os.read(main, 65536)
            except OSError:  # EIO: the child side closed
                break
            if not data:
                break
            chunks.append(data)
        elif process.poll() is not None:
            break
    else:
        process.kill()
    os.close(main)
    code = process.wait(timeout=10)
    return code, b"".join(chunks).decode("utf-8", errors="replace")


def screen_lines(raw: str, columns: int = 100) -> list[str]:
    """The lines a terminal of ``columns`` columns shows after receiving ``raw`` (scrollback included)."""
    lines: list[list[str]] = [[]]
    row = col = 0
    raw = _OSC.sub("", raw)
    i = 0
    while i < len(raw):
        char = raw[i]
        if char == "\x1b":
            match = _CSI.match(raw, i)
            if match is None:  # a lone escape (or one this emulator does not know): skip it
                i += 1
                continue
            params, command = match.groups()
            count = int(params) if params.isdigit() else 1
            if command == "A":
                row = max(0, row - count)
            elif command == "B":
                row += count
            elif command == "C":
                col += count
            elif command == "D":
                col = max(0, col - count)
            elif command == "G":
                col = count - 1
            elif command == "K":
                _ensure(lines, row)
                line = lines[row]
                if params in ("", "0"):
                    del line[col:]
                elif params == "1":
                    line[: col + 1] = [" "] * min(col + 1, len(line))
                else:
                    line.clear()
            i = match.end()
            continue
        if char == "\r":
            col = 0
        elif char == "\n":  # the pty turns "\n" into "\r\n" (ONLCR)
            row, col = row + 1, 0
        elif char == "\b":
            col = max(0, col - 1)
        elif char >= " " or char == "\t":
            if col >= columns:  # auto-wrap
                row, col = row + 1, 0
            _ensure(lines, row)
            line = lines[row]
            line.extend(" " * (col + 1 - len(line)))
            line[col] = char
            col += 1
        i += 1
    return ["".join(line).rstrip() for line in lines]


def _ensure(lines: list[list[str]], row: int) -> None:
    while len(lines) <= row:
        lines.append([])
