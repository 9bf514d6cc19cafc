"""TRL's ``use_bias_correction_kl`` (``algo.token.use_bias_correction_kl``): the per-token k3 KL weighted by
the importance ratio r, not detached. Hand-computed: on policy the value is unchanged and the KL's gradient
becomes β·(log π_θ − log π_ref), the reverse KL's score-function gradient; off policy the value scales by r."""

from __future__ import annotations

import math

import pytest
import torch

from rlgen_cli.algos.token_grpo import token_grpo_loss
from tests.vlm.conftest import compose_config

BETA = 0.04
# two sequences, the second one token long; log π_θ, and the reference's log-probs
LOGP = torch.log(torch.tensor([[0.5, 0.2], [0.1, 0.7]]))
REF = torch.log(torch.tensor([[0.25, 0.4], [0.1, 0.3]]))
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
NO_ADVANTAGE = torch.zeros(2)  # the policy term's gradient is 0: only the KL moves log π_θ


def _kl_gradient(old: torch.Tensor, corrected: bool, level: str = "token") -> tuple[float, torch.Tensor]:
    logp = LOGP.clone().requires_grad_(True)
    out = token_grpo_loss(
        logp,
        old,
        NO_ADVANTAGE,
        MASK,
        loss_type="bnpo",
        importance_level=level,
        kl_weight=BETA,
        ref_logp=REF,
        bias_correction_kl=corrected,
    )
    out.loss.backward()
    return out.loss.item(), logp.grad


def test_on_policy_the_value_stays_and_the_gradient_is_beta_times_the_log_ratio():
    # k3 = e^Δ − Δ − 1 with Δ = log π_ref − log π_θ: Δ = log 0.5, log 2, 0 → k3 = 0.193147, 0.306853, 0
    k3 = [0.5 + math.log(2) - 1, 2 - math.log(2) - 1, 0.0]
    expected_value = BETA * sum(k3) / 3  # bnpo: over the 3 completion tokens
    plain_value, plain = _kl_gradient(LOGP.clone(), corrected=False)
    value, grad = _kl_gradient(LOGP.clone(), corrected=True)
    assert plain_value == pytest.approx(expected_value, rel=1e-6)
    assert value == pytest.approx(expected_value, rel=1e-6)
    # plain: ∂k3/∂log π_θ = 1 − e^Δ → 1 − 0.5, 1 − 2, 0; corrected: ∂(r·k3)/∂log π_θ at r = 1 is k3 + 1 − e^Δ = −Δ
    plain_expected = torch.tensor([[0.5, -1.0], [0.0, 0.0]]) * BETA / 3
    corrected_expected = torch.tensor([[math.log(2), -math.log(2)], [0.0, 0.0]]) * BETA / 3
    torch.testing.assert_close(plain, plain_expected, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(grad, corrected_expected, rtol=1e-6, atol=1e-9)


def test_off_policy_the_kl_is_weighted_by_the_ratio():
    old = LOGP - torch.log(
        torch.tensor([[2.0, 0.5], [4.0, 1.0]])
    )  # r = 2, 0.5, 4 (the padded r is never used)
    k3 = torch.tensor([0.5 + math.log(2) - 1, 2 - math.log(2) - 1, 0.0])
    value, _ = _kl_gradient(old, corrected=True)
    assert value == pytest.approx(BETA * float((torch.tensor([2.0, 0.5, 4.0]) * k3).sum()) / 3, rel=1e-6)


def test_sequence_level_weights_every_token_by_its_sequence_ratio():
    old = LOGP - torch.log(torch.tensor([[2.0, 8.0], [3.0, 1.0]]))  # sequence 0: exp(mean(log 2, log 8)) = 4
    k3 = [0.5 + math.log(2) - 1, 2 - math.log(2) - 1]
    value, _ = _kl_gradient(old, corrected=True, level="sequence")
    assert value == pytest.approx(BETA * 4.0 * sum(k3) / 3, rel=1e-6)


def test_token_grpo_follows_trl_and_step_grpo_r1vl():
    vlm = ["model=tiny_qwen2_vl", "data=tiny_vlm", "reward=length"]
    token = compose_config("train", [*vlm, "algo=token_grpo"])[0].algo.token
    step = compose_config("train", [*vlm, "algo=step_grpo"])[0].algo.token
    assert token.use_bias_correction_kl is True and token.max_completion_tokens == 512  # TRL 1.16's defaults
    assert step.use_bias_correction_kl is False  # trl 0.14: the k3 KL alone
