"""AWM's σ draw (``algo.forward.timestep_draw``): ``per_microbatch`` gives the micro-batch's first draw to
every sample (AWM's script draws its strata once per micro-batch), ``per_sample`` keeps each sample's own;
the recipe trains every sample of a micro-batch on the shared σ, and ``algo=awm`` defaults to upstream's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlgen_cli.algos.awm import micro_batch_timestep_indices
from rlgen_cli.recipes import flow_forward
from tests.conftest import TINY_RUN

REAL_FORWARD_LOSS = flow_forward.forward_loss
# three samples' own draws of K = 2 σ positions
PER_SAMPLE = torch.tensor([[1, 6], [3, 5], [2, 8]])


def test_per_sample_keeps_every_draw():
    assert torch.equal(micro_batch_timestep_indices(PER_SAMPLE, "per_sample"), PER_SAMPLE)


def test_per_microbatch_gives_the_first_draw_to_every_sample():
    shared = micro_batch_timestep_indices(PER_SAMPLE, "per_microbatch")
    assert torch.equal(shared, torch.tensor([[1, 6], [1, 6], [1, 6]]))


def test_an_unknown_draw_is_refused():
    with pytest.raises(AssertionError, match="per_sample"):
        micro_batch_timestep_indices(PER_SAMPLE, "per_epoch")


# 10 rollout steps, 2 strata of [1, int(10·0.9)] = [1, 9]: σ indices [1, 5) and [5, 9), 4 choices each
AWM_RUN = [
    *TINY_RUN, "algo=awm", "model.num_steps=10", "algo.forward.num_timesteps=2", "algo.sample_batch_size=2",
    "algo.train_batch_size=2", "algo.gradient_accumulation_steps=2", "epochs=1", "eval_every=0", "images_every=0",
]  # fmt: skip


def _trained_sigmas(cli, monkeypatch, run: Path, *overrides: str) -> list[torch.Tensor]:
    """The (B,) σ of every loss the recipe computes (the real loss runs; its σ are recorded)."""
    seen: list[torch.Tensor] = []

    def recording(run_, old, x0, noise, sigma, *rest):
        seen.append(sigma.detach().clone())
        return REAL_FORWARD_LOSS(run_, old, x0, noise, sigma, *rest)

    monkeypatch.setattr(flow_forward, "forward_loss", recording)
    code, out = cli("train", *AWM_RUN, *overrides, f"hydra.run.dir={run}")
    assert code == 0, out
    return seen


@pytest.mark.slow  # two tiny runs, ~90 s on two cores
def test_the_recipe_trains_a_micro_batch_on_one_draw_or_on_each_samples_own(cli, monkeypatch, tmp_path: Path):
    shared = _trained_sigmas(cli, monkeypatch, tmp_path / "shared")  # algo=awm's default: upstream's
    own = _trained_sigmas(cli, monkeypatch, tmp_path / "own", "algo.forward.timestep_draw=per_sample")
    # 4 samples in 2 micro-batches of 2, 2 σ each: 4 losses of 2 samples
    assert len(shared) == len(own) == 4 and all(s.shape == (2,) for s in shared + own)
    assert all(s[0] == s[1] for s in shared)
    assert any(s[0] != s[1] for s in own)  # 2 strata × 2 micro-batches: some pair of draws differs
