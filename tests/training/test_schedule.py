"""Per-epoch learning-rate schedules of the flow RL loop: hand-computed values, optimizer updates."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlgen_cli.training.control.schedule import apply_lr_schedule, epoch_lr


def test_constant_is_the_base_rate_every_epoch():
    assert [epoch_lr(2e-5, "constant", e, 10, 0.5, 0.1) for e in range(10)] == [2e-5] * 10


def test_linear_decays_from_base_at_the_first_epoch_to_min_at_the_last():
    # 5 epochs, no hold, to 0: base · (1 − e/4)
    got = [epoch_lr(1.0, "linear", e, 5, 0.0, 0.0) for e in range(5)]
    assert got == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_cosine_holds_then_decays_to_the_min_ratio():
    # 10 epochs, hold until floor(0.4·10) = epoch 4, cosine over epochs 4..9 down to 0.1
    got = [epoch_lr(1.0, "cosine", e, 10, 0.4, 0.1) for e in range(10)]
    assert got[:5] == pytest.approx([1.0] * 5)
    for e in range(5, 10):
        progress = (e - 4) / 5
        assert got[e] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    assert got[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(got[4:], got[5:]))


def test_epochs_past_the_configured_end_stay_at_the_minimum():
    assert epoch_lr(1.0, "linear", 20, 5, 0.0, 0.2) == pytest.approx(0.2)


def test_apply_sets_every_param_group_and_constant_leaves_them_alone():
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 7.0}], lr=1.0)
    algo = SimpleNamespace(
        lr=1.0, lr_schedule="linear", lr_decay_start=0.0, lr_min_ratio=0.0, lr_warmup_epochs=0
    )
    assert apply_lr_schedule(optimizer, algo, 1, 3) == pytest.approx(0.5)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.5, 0.5])
    optimizer.param_groups[1]["lr"] = 7.0  # e.g. a recipe's own per-step schedule
    algo.lr_schedule = "constant"
    assert apply_lr_schedule(optimizer, algo, 2, 3) == 1.0
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.5, 7.0])


def test_warmup_ramps_linearly_then_hands_over_to_the_schedule():
    # 3 warm-up epochs: (e + 1)/3 of the rate; then constant at base, or cosine held to floor(0.5·10)
    assert [epoch_lr(3.0, "constant", e, 10, 0.0, 0.0, warmup_epochs=3) for e in range(5)] == pytest.approx(
        [1.0, 2.0, 3.0, 3.0, 3.0]
    )
    cosine = [epoch_lr(1.0, "cosine", e, 10, 0.5, 0.0, warmup_epochs=2) for e in range(10)]
    assert cosine[:6] == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert cosine[6:] == pytest.approx([epoch_lr(1.0, "cosine", e, 10, 0.5, 0.0) for e in range(6, 10)])


def test_a_constant_schedule_with_warmup_sets_the_optimizer():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1.0)
    algo = SimpleNamespace(
        lr=1.0, lr_schedule="constant", lr_decay_start=0.0, lr_min_ratio=0.0, lr_warmup_epochs=4
    )
    got = []
    for epoch in range(6):
        apply_lr_schedule(optimizer, algo, epoch, 6)
        got.append(optimizer.param_groups[0]["lr"])
    assert got == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
