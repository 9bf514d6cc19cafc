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
    """``OmegaConf.to_object``: the typed config with every ``__post_init__`` cross-field check run."""
    try:
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
