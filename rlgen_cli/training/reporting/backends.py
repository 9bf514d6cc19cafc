"""Optional metric backends behind :class:`~rlgen_cli.training.reporting.metrics.MetricLogger`: TensorBoard and
Weights & Biases. Each imports its package only when enabled and says how to install it when missing.
W&B's ``offline`` mode writes runs under ``run_dir/wandb`` with no network (``wandb sync`` uploads later).

Both take ``metrics.jsonl``'s step unchanged: epochs completed, the evaluation before training at 0
(:mod:`rlgen_cli.training.reporting.metrics`). It never decreases within a run, as W&B requires.

Both get the image grids too: ``train/images`` (the first 16 rollouts every ``images_every`` epochs) and
``eval/images`` / ``eval_heldout/images`` (the first 16 samples of each evaluation, at its step). A video
batch is logged by its first frames, as still images.

A W&B run is named after its experiment and overrides (``shapes_grpo_fast algo.lr=3e-4``; not its
``logging.*`` switches) unless ``logging.wandb.name`` is set, and the jobs of one ``-m`` sweep share a
group: their sweep directory.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from rlgen_cli.errors import UserError
from rlgen_cli.training.reporting.images import to_pil


def still_images(images: Tensor) -> Tensor:
    """(B, 3, H, W) as given; a video batch (B, 3, F, H, W) as its first frames (B, 3, H, W)."""
    if images.ndim == 5:
        return images[:, :, 0]
    if images.ndim != 4:
        raise ValueError(f"images must be (B, 3, H, W) or (B, 3, F, H, W), got shape {tuple(images.shape)}")
    return images


class TensorBoardLogger:
    """Scalars (and image grids) to ``run_dir/tensorboard``."""

    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise UserError(
                "logging.tensorboard=true needs the tensorboard package: pip install tensorboard"
            ) from err
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            if value is not None:
                self.writer.add_scalar(key, float(value), step)
        self.writer.flush()

    def log_images(self, key: str, images: Tensor, step: int) -> None:
        """(B, 3, H, W) in [0, 1] (a video batch: its first frames)."""
        self.writer.add_images(key, still_images(images).detach().float().cpu(), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A W&B run (``online``, ``offline`` or ``disabled``) carrying the resolved config, named after the
    run's experiment and overrides (unless ``name``) and grouped by its sweep directory."""

    def __init__(
        self, run_dir: Path, project: str, mode: str, config: dict[str, Any], name: str | None = None
    ) -> None:
        try:
            import wandb
        except ImportError as err:
            raise UserError("logging.wandb.enabled=true needs the wandb package: pip install wandb") from err
        from rlgen_cli.training.reporting.labels import run_name, sweep_group

        self._wandb = wandb
        self.run = wandb.init(
            project=project,
            mode=mode,
            dir=str(run_dir),
            config=config,
            name=name or run_name(run_dir),
            group=sweep_group(run_dir),
            reinit="create_new",
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def log_images(self, key: str, images: Tensor, step: int) -> None:
        """(B, 3, H, W) in [0, 1] (a video batch: its first frames)."""
        # as 8-bit RGB: W&B stores a float array's values as they are (1.0 → level 1, near black)
        frames = [self._wandb.Image(to_pil(img)) for img in still_images(images)]
        self.run.log({key: frames}, step=step)

    def close(self) -> None:
        self.run.finish()
