"""rlgen's token GRPO loss against TRL's own ``GRPOTrainer._compute_loss`` on the same log-probabilities:
equal loss and gradient for each aggregation, KL on (β = 0.04) with and without ``use_bias_correction_kl``,
token- and sequence-level ratios, off policy. Runs where TRL (≥ 1.16, which has the option) is installed."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rlgen_cli.algos.token_grpo import token_grpo_loss

grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
if "use_bias_correction_kl" not in grpo_trainer.GRPOConfig.__dataclass_fields__:
    pytest.skip("TRL before 1.16 has no use_bias_correction_kl", allow_module_level=True)

BETA = 0.04
EPS = (0.2, 0.28)  # ε and ε_high
TOKENS = 4


def _batch(seed: int) -> dict[str, torch.Tensor]:
    """Three completions of up to 4 tokens (float64: the two losses differ only by rounding)."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(3, TOKENS, generator=gen, dtype=torch.float64) * 2
    return {
        "logp": logp,
        "old": logp - 0.1 * torch.randn(3, TOKENS, generator=gen, dtype=torch.float64),  # off policy
        "ref": logp - 0.3 * torch.randn(3, TOKENS, generator=gen, dtype=torch.float64),
        "mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float64),
        "adv": torch.tensor([1.5, -0.5, -1.0], dtype=torch.float64),
    }


def _trl_loss(b: dict[str, torch.Tensor], logp: torch.Tensor, loss_type: str, level: str, corrected: bool):
    """TRL's ``_compute_loss`` on one process without accumulation, its model forward replaced by ``logp``."""
    accelerator = SimpleNamespace(
        num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x
    )
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=BETA,
        loss_type=loss_type,
        epsilon_low=EPS[0],
        epsilon_high=EPS[1],
        args=SimpleNamespace(use_bias_correction_kl=corrected, delta=None, steps_per_generation=1),
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=TOKENS,
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list)},
        accelerator=accelerator,
    )
    inputs = {
        "prompt_ids": torch.zeros(3, 1, dtype=torch.long), "prompt_mask": torch.ones(3, 1, dtype=torch.long),
        "completion_ids": torch.zeros(3, TOKENS, dtype=torch.long), "completion_mask": b["mask"],
        "advantages": b["adv"], "old_per_token_logps": b["old"], "ref_per_token_logps": b["ref"],
        "num_items_in_batch": b["mask"].sum(),
    }  # fmt: skip
    return grpo_trainer.GRPOTrainer._compute_loss(trainer, None, inputs)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("corrected", [True, False])
def test_loss_and_gradient_equal_trls(loss_type: str, level: str, corrected: bool):
    b = _batch(seed=3)
    ours_logp = b["logp"].clone().requires_grad_(True)
    ours = token_grpo_loss(
        ours_logp,
        b["old"],
        b["adv"],
        b["mask"],
        loss_type=loss_type,
        importance_level=level,
        epsilon=EPS[0],
        epsilon_high=EPS[1],
        kl_weight=BETA,
        ref_logp=b["ref"],
        max_completion_length=TOKENS,
        num_items=float(b["mask"].sum()),
        bias_correction_kl=corrected,
    ).loss
    # TRL reads log-probs at padded positions too: give it ours where the mask is 0 (its mask removes them)
    trl_logp = b["logp"].clone().requires_grad_(True)
    theirs = _trl_loss(b, trl_logp, loss_type, level, corrected)
    ours.backward()
    theirs.backward()
    tol = 1e-12  # float64 rounding of a few dozen operations
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(ours_logp.grad * b["mask"], trl_logp.grad * b["mask"], rtol=tol, atol=tol)
