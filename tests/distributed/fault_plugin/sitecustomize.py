"""Faults for the launched-run tests, injected into every Python process of a run (the controller, the
launcher, each worker) by putting this folder first on ``PYTHONPATH``. Read only by those tests; nothing in
rlgen reads ``RLGEN_TEST_FAULT``.

* ``RLGEN_TEST_FAULT=enospc:N`` — the N-th checkpoint save of a process fails with ENOSPC while it writes
  the checkpoint's README (its weights and state already in the temporary folder), as a full disk would.
* ``RLGEN_TEST_FAULT=nan`` — registers the reward ``nan_from_call`` (scores 0 for ``from_call`` calls,
  then NaN), for ``+reward.weights.nan_from_call=…``.
"""

from __future__ import annotations

import os

_FAULT = os.environ.get("RLGEN_TEST_FAULT", "")


def _fill_the_disk_at_save(n: int) -> None:
    import errno

    from rlgen_cli.training.checkpoints import checkpoint

    readme, calls = checkpoint.write_checkpoint_readme, []

    def fills_the_disk(*args, **kwargs):
        calls.append(args)
        if len(calls) == n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return readme(*args, **kwargs)

    checkpoint.write_checkpoint_readme = fills_the_disk


def _register_nan_reward() -> None:
    import torch

    from rlgen_cli.rewards.base import RewardResult
    from rlgen_cli.rewards.registry import REWARDS

    class NanFromCall:
        """0 for the first ``from_call`` calls of this process, NaN after: call k is epoch k (0-based)."""

        def __init__(self, from_call: int) -> None:
            self.name, self.from_call, self.calls = "nan_from_call", from_call, 0

        def score(self, batch):
            failing = self.calls >= self.from_call
            self.calls += 1
            return RewardResult(scores=torch.full((len(batch),), float("nan") if failing else 0.0))

    REWARDS["nan_from_call"] = NanFromCall


if _FAULT.startswith("enospc:"):
    _fill_the_disk_at_save(int(_FAULT.split(":", 1)[1]))
elif _FAULT == "nan":
    _register_nan_reward()
