"""What every task does first: validate the composed config and turn user errors into exit code 2."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlgen_cli._hydra import EXIT_USER_ERROR
from rlgen_cli.schema.errors import UserError

T = TypeVar("T")


def validated(cfg: DictConfig) -> Any:
    """The typed config (``OmegaConf.to_object``): every key declared and every value in its range
    (``schema/ranges.py``) first, then every ``__post_init__`` cross-field check."""
    from rlgen_cli.schema.ranges import check_settings

    try:
        check_settings(cfg)
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise UserError(str(err).replace("\n", "; ")) from err


def user_errors(task: Callable[[DictConfig], T]) -> Callable[[DictConfig], T]:
    """Print a :class:`UserError` as one red line and exit 2 (``RLGEN_DEBUG=1`` keeps the traceback)."""

    @functools.wraps(task)
    def wrapper(cfg: DictConfig) -> T:
        try:
            return task(cfg)
        except UserError as err:
            if os.environ.get("RLGEN_DEBUG"):
                raise
            from rich.console import Console
            from rich.markup import escape

            Console(stderr=True, soft_wrap=True).print(
                f"[bold red]error:[/] {escape(str(err))}", highlight=False
            )
            sys.exit(EXIT_USER_ERROR)

    return wrapper


def run_dir_of(cfg: Any) -> Path:
    return Path(cfg.run_dir)


def require_data(cfg: Any, run_dir: Path, splits: tuple[str, ...] = ("train", "test")) -> None:
    """Every prompt file the run reads exists (builtin sets generated into ``run_dir``) and, for an editing
    model, names an existing source image per row: checked before any model is loaded, so a missing file
    costs seconds, not a model load."""
    from rlgen_cli.data.images import EDITING_FAMILIES, require_source_images
    from rlgen_cli.data.paths import BUILTIN_PREFIX, load_prompts, resolve_data_path
    from rlgen_cli.schema.r3 import is_r3
    from rlgen_cli.schema.vlm import VLM_FAMILIES

    if is_r3(cfg.model):  # R3 reads r3.train_data_path / val_data_path (or its offline stand-in)
        return
    for split in splits:
        spec, key = getattr(cfg.data, split), f"data.{split}"
        if cfg.model.family in VLM_FAMILIES:
            if not spec.startswith(BUILTIN_PREFIX):  # shipped VLM sets are resolved by the VLM loader
                resolve_data_path(spec, key, run_dir)
        elif cfg.model.family in EDITING_FAMILIES:
            dataset = load_prompts(spec, run_dir, key)
            require_source_images(list(dataset), dataset.source, key)
        else:
            resolve_data_path(spec, key, run_dir)
