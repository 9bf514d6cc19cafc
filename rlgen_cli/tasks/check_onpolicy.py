"""``rlgen check-onpolicy``: prove that the training path reproduces the log-probabilities the rollout
recorded while sampling.

Rolls out one epoch, then recomputes what was recorded with the exact training code (no update, no
accumulation) and exits 1 when the two disagree beyond the tolerance: the sampler and the trainer
disagree, and PPO's clip would be silently eating that error. Every track compares two computations:

* **flow models** — each trained step's log-prob stored by the rollout vs its recompute on the training
  path, per step and σ (``check.tolerance``);
* **VLMs** — the sampler's per-token log-probs (``generate``'s raw logits / vLLM's log-probs) vs the
  training forward (``check.text_tolerance``; ``vlm/onpolicy.py``);
* **unified policies (R3)** — both tracks in both stages (``r3/onpolicy.py``).

``check.perturb_weights`` adds noise to the trainable weights between the rollout and the recompute:
the check must then fail, which is how the tests show that it can. The check runs in this one process
(``launcher=local``; ``schema/check.py`` refuses a launcher, whose workers it would not start).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Sequence

import torch
from omegaconf import DictConfig

from rlgen_cli.errors import UserError
from rlgen_cli.recipes.registry import check_of
from rlgen_cli.sde.noise import Stream
from rlgen_cli.tasks.common import run_dir_of, user_errors, validated

log = logging.getLogger(__name__)
EXIT_MISMATCH = 1


def perturb_weights(params: Sequence[torch.nn.Parameter], std: float, seed: int) -> None:
    """Add N(0, std²) noise, drawn on the CPU from ``seed``, to every tensor of ``params`` in place (std 0:
    nothing). The check that follows must fail: this is ``check.perturb_weights``.

    Raises:
        UserError: When asked to perturb a model with no trainable weights (nothing could change).
    """
    if std == 0:
        return
    if not params:
        raise UserError("check.perturb_weights is set but the model has no trainable weights to perturb")
    generator = torch.Generator().manual_seed(seed + Stream.ONPOLICY_PERTURB)
    with torch.no_grad():
        for param in params:
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.add_(noise.to(device=param.device, dtype=param.dtype), alpha=std)
    log.warning(
        "check.perturb_weights=%g: noise added to %d trainable tensors after the rollout; the check "
        "must fail",
        std,
        len(params),
    )


@user_errors
def check_onpolicy_task(cfg: DictConfig) -> float:
    typed = validated(cfg)
    from rlgen_cli.training.reporting.run_dir import prepare_run_dir, setup_logging

    perturb = functools.partial(perturb_weights, std=typed.check.perturb_weights, seed=typed.seed)
    check, splits = check_of(typed)
    run_dir = prepare_run_dir(run_dir_of(typed), cfg)
    setup_logging(run_dir)
    require_prerequisites(typed, run_dir, splits)
    worst, passed = check(typed, cfg, perturb)
    if not passed:
        sys.exit(EXIT_MISMATCH)
    return worst


def require_prerequisites(cfg, run_dir, splits: tuple[str, ...]) -> None:
    """The prompt files it rolls out and the weights of every model it builds, all reported together
    with exit code 2 before any model is built (``tasks/prerequisites.py``, as ``rlgen train`` does).
    Rewards are not checked: the check scores nothing."""
    from rlgen_cli.tasks.prerequisites import Prerequisites, data_problems, model_problems

    Prerequisites().add(data_problems(cfg, run_dir, splits)).add(model_problems(cfg)).require()
