"""``rlgen plan``'s table: the rows in one unit, folded where they repeat, the verdict and the smallest common
device that holds one process."""

from __future__ import annotations

import functools
from typing import Any


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f}"


def table_unit(report: dict[str, Any]) -> tuple[str, int]:
    """The table's unit: GiB, or MiB for a run under 1 GiB (a tiny model's rows all read 0.00 GiB)."""
    return ("GiB", 2**30) if report["total_bytes"] >= 2**30 else ("MiB", 2**20)


def folded_rows(rows: list[dict[str, Any]], unit: int) -> list[dict[str, Any]]:
    """``rows`` with those that print as 0.00 in ``unit`` (an encoder's int64 position ids, …) folded into
    one "other" row after the rest, naming them; the JSON keeps every row."""
    small = [row for row in rows if round(row["bytes"] / unit, 2) == 0]
    kept = [row for row in rows if row not in small]
    if len(small) < 2:
        return rows
    names = ", ".join(row["what"] for row in small)
    return [
        *kept,
        {"what": f"other ({len(small)} rows)", "bytes": sum(r["bytes"] for r in small), "note": names},
    ]


def _in_unit(nbytes: int, unit: int) -> str:
    return f"{nbytes / unit:.2f}"


def smallest_device_line(report: dict[str, Any]) -> str:
    """Which of the common devices (24 / 40 / 48 / 80 / 141 GB) is the smallest that holds one process of
    the run, with which settings, and each larger one that needs fewer changes."""
    from rlgen_cli.training.memory.plan import COMMON_DEVICES_GB

    sizes = " / ".join(map(str, COMMON_DEVICES_GB))
    if not report["devices"]:
        return f"smallest common device ({sizes} GB): none holds one process of this run; it needs more processes"
    kept_free = 100 * (1 - report["usable_bytes"] / report["device_bytes"])
    fits = [
        f"{d['device_gb']} GB {'as configured' if not d['how'] else 'with ' + ' '.join(d['how'])} "
        f"({_gib(d['total_bytes'])} GiB)"
        for d in report["devices"]
    ]
    return f"smallest common device ({sizes} GB, {kept_free:.0f} % kept free): " + "; or ".join(fits)


def print_report(report: dict[str, Any]) -> None:
    """The plan as a rich table, whether it fits, the smallest common device that holds it, and the
    change that makes it fit."""
    from rich.table import Table

    from rlgen_cli.training.reporting.console import new_console

    height, width, frames = report["resolution"]
    title = (
        f"{report['model']} · {report['recipe']} · launcher={report['launcher']} × {report['processes']} · "
        f"micro-batch {report['micro_batch']}"
        + (f" {report['micro_batch_unit']}" if report.get("micro_batch_unit", "samples") != "samples" else "")
        + (f" × {report['timesteps_per_pass']} steps per pass" if report["recipe"] == "flow_grpo" else "")
        + f" · sample batch {report['sample_batch']} · {height}×{width}"
        + (f"×{frames} frames" if frames > 1 else "")
    )
    name, unit = table_unit(report)
    amount = functools.partial(_in_unit, unit=unit)
    table = Table(title=f"memory per process — {title}", title_justify="left")
    table.add_column("what")
    table.add_column(name, justify="right")
    table.add_column("note", style="dim")
    for row in folded_rows(report["rows"], unit):
        table.add_row(row["what"], amount(row["bytes"]), row["note"])
    table.add_section()
    largest = max(report["peaks"], key=lambda row: row["bytes"])
    for row in report["peaks"]:
        counted = row is largest
        note = ("the larger phase: counted; " if counted else "the smaller phase; ") + row["note"]
        table.add_row(row["what"], amount(row["bytes"]), note, style=None if counted else "dim")
    table.add_section()
    table.add_row(
        "total",
        amount(report["total_bytes"]),
        f"device {_gib(report['device_bytes'])} GiB, usable {_gib(report['usable_bytes'])} GiB",
        style="bold",
    )
    console = new_console()
    console.print(table)
    for line in report["notes"]:
        console.print(f"[yellow]note[/]: {line}", highlight=False)
    console.print(smallest_device_line(report), highlight=False, markup=False)
    if report["fits"]:
        console.print(
            f"[bold green]fits[/]: {_gib(report['total_bytes'])} of {_gib(report['usable_bytes'])} GiB"
        )
        return
    console.print(
        f"[bold red]does not fit[/]: {_gib(report['total_bytes'])} GiB > {_gib(report['usable_bytes'])} GiB"
    )
    fix = report["fix"]
    verdict = "fits" if fix["fits"] else "still does not fit"
    console.print(
        f"smallest change: {' + '.join(fix['changes'])} → {_gib(fix['total_bytes'])} GiB ({verdict})"
    )
    console.print(f"  {' '.join(fix['how'])}", markup=False, highlight=False)
