"""The package's import layers (pyproject.toml, ``[tool.importlinter]``) hold, and the contracts can fail.

``make lint`` runs ``lint-imports`` too; this keeps a layering regression failing the test suite on its
own. The two perturbation tests copy the package, add one forbidden import, and expect the linter to
name it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint_imports(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} is missing: install the dev tools (pip install -e '.[dev]')")
    env = dict(os.environ, PYTHONPATH=str(pythonpath)) if pythonpath else None
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def _package_copy(tmp_path: Path) -> Path:
    """The package's Python files and pyproject.toml under ``tmp_path`` (which goes first on PYTHONPATH)."""
    shutil.copytree(
        ROOT / "rlgen_cli",
        tmp_path / "rlgen_cli",
        ignore=lambda _, names: [n for n in names if n.endswith((".yaml", ".json", ".txt", ".png", ".pt"))],
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def _add_line(path: Path, line: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + f"\n{line}\n", encoding="utf-8")


def test_the_package_keeps_its_layers():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_upward_import_breaks_the_layers(tmp_path):
    copy = _package_copy(tmp_path)
    _add_line(copy / "rlgen_cli" / "sde" / "noise.py", "import rlgen_cli.recipes.flow_run  # noqa")
    result = _lint_imports(copy, pythonpath=copy)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rlgen_cli.sde is not allowed to import rlgen_cli.recipes" in result.stdout


def test_a_cycle_between_siblings_breaks_the_contract(tmp_path):
    copy = _package_copy(tmp_path)
    _add_line(copy / "rlgen_cli" / "data" / "paths.py", "import rlgen_cli.training.reporting.run_dir  # noqa")
    _add_line(
        copy / "rlgen_cli" / "training" / "reporting" / "run_dir.py", "import rlgen_cli.data.paths  # noqa"
    )
    result = _lint_imports(copy, pythonpath=copy)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "No cycles are allowed in rlgen_cli" in result.stdout
    assert "- .training -> .data" in result.stdout or "- .data -> .training" in result.stdout
