"""Structure figures of a checkout, as JSON: files and lines per package, and the keys each tiny run composes.

    python scripts/structure_report.py [--no-keys] > figures.json

Run it from the checkout to measure (the composed keys come from that checkout's ``rlgen train --cfg job``);
the runs are those of ``scripts/behaviour_snapshot.py``, one per recipe. A composed key is a leaf of the
composed config (a value, a list or null); ``by_section`` splits them by top-level key.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from behaviour_snapshot import OFFLINE, RUNS  # noqa: E402 (the scripts folder is not a package)

PACKAGE = "rlgen_cli"


def package_sizes(root: Path) -> dict[str, dict[str, int]]:
    """Python files and lines per first-level package of rlgen_cli; modules at its root count as '(root)'."""
    sizes: dict[str, Counter] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root / PACKAGE).parts
        package = parts[0] if len(parts) > 1 else "(root)"
        size = sizes.setdefault(package, Counter())
        size["files"] += 1
        size["lines"] += len(path.read_text(encoding="utf-8").splitlines())
    total = sum(sizes.values(), Counter())
    return {name: dict(size) for name, size in sorted(sizes.items())} | {"(total)": dict(total)}


def leaves(node, prefix: str = "") -> list[str]:
    """The dotted paths of a composed config's leaves; an empty mapping has none."""
    if isinstance(node, dict):
        return [leaf for key, value in node.items() for leaf in leaves(value, f"{prefix}{key}.")]
    return [prefix.removesuffix(".")]


def composed_config(root: Path, overrides: tuple[str, ...]) -> dict:
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(root)}
    command = [sys.executable, "-m", "rlgen_cli.cli", "train", *overrides, "--cfg", "job"]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"rlgen train {' '.join(overrides)} --cfg job exited {done.returncode}:\n{done.stderr}"
        )
    return yaml.safe_load(done.stdout)


def composed_keys(root: Path) -> dict[str, dict]:
    figures = {}
    for name, overrides in RUNS.items():
        paths = leaves(composed_config(root, overrides))
        sections = Counter(path.split(".")[0] for path in paths)
        figures[name] = {"keys": len(paths), "by_section": dict(sorted(sections.items()))}
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-keys", action="store_true", help="skip the composed keys (one compose per run)")
    args = parser.parse_args()
    root = Path.cwd()
    if not (root / PACKAGE).is_dir():
        parser.error(f"run it from a checkout: no {PACKAGE}/ in {root}")
    report: dict = {"packages": package_sizes(root)}
    if not args.no_keys:
        report["composed_keys"] = composed_keys(root)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
