"""DGPO learns: trained for brightness, the tiny SD3 draws brighter images; trained with the reward negated,
darker ones. Task, geometry and measure are ``test_learning_flow.py``'s (tiny SD3 at 16 px, 3 denoising
steps, 2 prompts × 4 samples, one optimizer step per epoch — whole groups —, lr 3e-2, 8 epochs, the ODE
evaluation before and after, EMA off, no KL); DGPO keeps its own defaults otherwise (β 100, the base model
as reference, the clip 1e-2 against the old policy), with 2 σ per group from the indices [0, int(3·0.67)]
= [0, 2] (its 4 of [0, 6] assume 10 rollout steps).

Measured (brightness after − before): seed 42 (the default) trained +0.0127, negated
−0.0620; trained at seeds 0, 2, 3: +0.0584, +0.0430, +0.0662. The margin asserted is about half the
worst trained gain (seed 42's). With the policy term's sign flipped (−A) the trained arm falls by −0.0736
(the test fails). Two runs of a minute or more each: slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.recipes.test_learning_flow import brightness_change

DGPO = ["algo=dgpo", "algo.forward.timestep_fraction=0.67", "algo.forward.num_timesteps=2"]
MARGIN = 0.006


@pytest.mark.slow
def test_dgpo_raises_the_reward_and_the_negated_reward_lowers_it(tmp_path: Path):
    trained = brightness_change(tmp_path / "trained", DGPO, 1.0)
    negated = brightness_change(tmp_path / "negated", DGPO, -1.0)
    assert trained >= MARGIN, f"dgpo: brightness rose by {trained:+.4f}, expected ≥ {MARGIN}"
    assert negated <= 0.0, f"dgpo: trained to lower brightness, it rose by {negated:+.4f}"
