"""What the rewards scored by one converted checkpoint share (HPSv3, ImageReward): the checkpoint path is
checked when the reward is built, read and converted on the first score, and the model placed on the
configured device in the configured dtype."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from torch import Tensor, nn

from rlgen_cli.rewards.checkpoints import (
    check_checkpoint_path,
    load_state_dict_file,
    materialise,
    resolve_checkpoint,
)
from rlgen_cli.rewards.clip import resolve_device, resolve_dtype


class CheckpointReward:
    """A reward whose model is ``kwargs.model_path`` (a local file or ``owner/repo/filename`` on the hub),
    on ``kwargs.device`` (None = CUDA when available) in ``kwargs.dtype``; loading waits for the first use.

    Subclasses set ``name`` and ``download_hint`` (what to do when the checkpoint is missing)."""

    name: ClassVar[str]
    download_hint: ClassVar[str]

    def __init__(self, kwargs: Any) -> None:
        check_checkpoint_path(kwargs.model_path, self.name, "model_path", self.download_hint)
        self.kwargs = kwargs
        self.device, self.dtype = resolve_device(kwargs.device), resolve_dtype(kwargs.dtype)
        self._model: Any = None

    def read_checkpoint(self, convert: Callable[[dict[str, Tensor]], dict[str, Tensor]]) -> tuple[Path, dict]:
        """The checkpoint's path (downloaded unless ``local_files_only``) and its state dict in this module's
        names (``convert``)."""
        kw = self.kwargs
        path = resolve_checkpoint(
            kw.model_path, self.name, "model_path", self.download_hint, kw.local_files_only
        )
        log = logging.getLogger(type(self).__module__)  # the reward's own logger
        log.info("loading %s from %s on %s (%s)", self.name, path, self.device, self.dtype)
        return path, convert(load_state_dict_file(path))

    def place(self, build: Callable[[], nn.Module], state: dict[str, Tensor], path: Path) -> nn.Module:
        """``build()``'s model with ``state`` loaded, on the reward's device in its dtype."""
        return materialise(build, state, self.dtype, self.device, str(path))
