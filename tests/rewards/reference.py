"""Reading the reward models' reference packages (``hpsv2``, ``hpsv3``, ``image-reward``) in the parity tests.

``make install-dev`` installs them from requirements/reference.txt without their dependencies: they pin
versions this project cannot use (transformers 4.45, timm 0.6, pytest 7), and their package ``__init__``
files import training stacks (trl, datasets, …) that scoring never touches. So the tests read a
reference's file by its path inside the installed package, run only the code that scores, and skip with
the reason when a reference is absent.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

INSTALL_HINT = "make install-dev installs it (requirements/reference.txt, --no-deps)"
SAMPLE_PROMPTS = [
    "a photo of a cat sitting on a red chair",
    "don’t panic – it’s “fine”",  # curly quotes and an en dash
    "salt &amp; pepper on a white plate",  # an HTML entity
    "a ﬁeld of ﬂowers",  # ligatures
    "Ｆｕｌｌ－ｗｉｄｔｈ ＡＢＣ ｌｅｔｔｅｒｓ",  # full-width letters
    "  spaced   out\tprompt \n",  # runs of whitespace
    "café crème brûlée",
]
# (height, width): square, the odd 300×524 of the ImageReward centre crop, and tall odd sizes.
ODD_SIZES = [(224, 224), (300, 524), (517, 333), (97, 131)]


def package_dir(package: str) -> Path:
    """Folder of an installed top-level ``package`` (its ``__init__`` is not run); skips when absent."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"reference package {package!r} is not installed; {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations)))


def load_file(package: str, relative: str, name: str) -> ModuleType:
    """Execute ``package/relative`` as a standalone module called ``name`` (the package ``__init__`` is
    skipped); skips with the import error when the file needs something not installed."""
    path = package_dir(package) / relative
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except ImportError as err:
        sys.modules.pop(name, None)
        pytest.skip(f"{package}/{relative} cannot be imported here: {err}")
    return module


def literal_constants(package: str, relative: str) -> dict[str, Any]:
    """The module-level ``NAME = <literal>`` assignments of ``package/relative``, read without running it."""
    tree = ast.parse((package_dir(package) / relative).read_text(encoding="utf-8"))
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return out


def class_from_file(package: str, relative: str, class_name: str, namespace: dict[str, Any]) -> type:
    """Class ``class_name`` of ``package/relative``, its source executed alone in ``namespace`` (which
    supplies the names it uses: a stand-in base class, ``torch``, …), so the rest of the file — imports
    of training code included — never runs."""
    path = package_dir(package) / relative
    tree = ast.parse(path.read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec")
    exec(code, namespace)  # noqa: S102 - the installed reference package's own class
    return namespace[class_name]
