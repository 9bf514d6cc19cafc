"""Reading the reward models' reference packages (``hpsv2``, ``hpsv3``, ``image-reward``) in the parity tests.

``make install-dev`` installs them from requirements/reference.txt without their dependencies: they pin
versions this project cannot use (transformers 4.45, timm 0.6, pytest 7), and their package ``__init__``
files import training stacks (trl, datasets, …) that scoring never touches. So the tests read a
reference's file by its path inside the installed package, run only the code that scores, and skip with
the reason when a reference is absent.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Sequence
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
    loaded = sys.modules.get(package)
    if loaded is not None and getattr(loaded, "__path__", None):  # e.g. emptied by import_past_inits
        return Path(loaded.__path__[0])
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


def import_past_inits(module: str, packages: Sequence[str]) -> ModuleType:
    """Import ``module`` with the ``__init__`` of each of ``packages`` (outermost first) replaced by an
    empty package, so its relative imports work while those files' imports of training code never run;
    skips with the import error when the module itself needs something not installed."""
    for name in packages:
        if name in sys.modules:  # emptied by an earlier call (or really imported): either serves
            continue
        parent, _, leaf = name.rpartition(".")
        folder = Path(sys.modules[parent].__path__[0]) / leaf if parent else package_dir(name)
        bare = ModuleType(name)
        bare.__path__ = [str(folder)]
        sys.modules[name] = bare
    try:
        return importlib.import_module(module)
    except ImportError as err:
        pytest.skip(f"{module} cannot be imported here: {err}")


def load_file_except(package: str, relative: str, name: str, skipped: Sequence[str]) -> ModuleType:
    """``package/relative`` executed as module ``name`` less its top-level assignments to ``skipped`` (e.g.
    a module-level object built from a data file the published package lacks); the file's own relative
    imports must already resolve (see :func:`import_past_inits`)."""
    path = package_dir(package.split(".")[0]) / relative
    tree = ast.parse(path.read_text(encoding="utf-8"))
    tree.body = [
        node
        for node in tree.body
        if not (isinstance(node, ast.Assign) and any(getattr(t, "id", None) in skipped for t in node.targets))
    ]
    module = ModuleType(name)
    module.__file__ = str(path)
    exec(compile(tree, str(path), "exec"), module.__dict__)  # noqa: S102 - the installed reference's own file
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
