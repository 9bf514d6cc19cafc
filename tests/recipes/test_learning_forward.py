"""DiffusionNFT and AWM learn: trained for brightness, the tiny SD3 draws brighter images; trained with the
reward negated, darker ones. The task, geometry and measure are ``test_learning_flow.py``'s (tiny SD3 at
16 px, 3 denoising steps, 2 prompts × 4 samples, one on-policy optimizer step per epoch, lr 3e-2, 8
epochs, the ODE evaluation before and after); each algorithm keeps its own defaults otherwise (EMA off,
as there).

Measured (brightness after − before, same on every rerun on CPU): at seed 42, trained and negated; the
worst trained gain over seeds 0, 2, 3, 42; the margin asserted, about half that worst gain:

    algorithm        trained   negated   worst    margin
    nft              +0.0405   −0.0743   +0.0405  0.02
    awm              +0.0356   −0.0661   +0.0356  0.015     (2 σ strata: AWM's 6 assume 14 rollout steps)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.recipes.test_learning_flow import brightness_change

ALGORITHMS = {  # algorithm: (its overrides, margin)
    "nft": (["algo=nft"], 0.02),
    "awm": (["algo=awm", "algo.forward.num_timesteps=2"], 0.015),
}


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_training_raises_the_reward_and_the_negated_reward_lowers_it(tmp_path: Path, algo: str):
    overrides, margin = ALGORITHMS[algo]
    trained = brightness_change(tmp_path / "trained", overrides, 1.0)
    negated = brightness_change(tmp_path / "negated", overrides, -1.0)
    assert trained >= margin, f"{algo}: brightness rose by {trained:+.4f}, expected ≥ {margin}"
    assert negated <= 0.0, f"{algo}: trained to lower brightness, it rose by {negated:+.4f}"
