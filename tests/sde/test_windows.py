"""Window policies step by step: Fast's random window, MixGRPO's sliding window, DanceGRPO's subset, R3's single."""

from __future__ import annotations

import inspect
import math
from typing import get_args

import pytest
import torch

from rlgen_cli.schema.algo import WINDOW_OPTIONS
from rlgen_cli.schema.choices import WindowKind
from rlgen_cli.sde import WINDOWS, WindowPlan, last_sde_step, plan_window


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _start(plan: WindowPlan) -> int:
    return plan.sde_steps[0]


def test_registry_lists_every_kind_of_the_schema_with_the_options_it_reads():
    assert tuple(WINDOWS) == get_args(WindowKind) == tuple(WINDOW_OPTIONS)
    for kind, policy in WINDOWS.items():
        params = inspect.signature(policy).parameters.values()
        assert [p.name for p in params if p.kind is p.KEYWORD_ONLY] == list(WINDOW_OPTIONS[kind]), kind


# ----------------------------------------------------------------------------------------- random_window


def test_random_window_is_consecutive_and_trains_only_the_window():
    for seed in range(20):
        plan = plan_window("random_window", 10, size=3, range=(0, 5), generator=_gen(seed))
        start = _start(plan)
        assert 0 <= start <= 2  # start ∈ [lo, hi − size]
        assert plan.sde_steps == plan.train_steps == (start, start + 1, start + 2)
        assert plan.train_mask is None and last_sde_step(plan) == start + 2


def test_random_window_start_is_uniform_over_its_range():
    starts = [
        _start(plan_window("random_window", 10, size=2, range=(1, 5), generator=_gen(s))) for s in range(300)
    ]
    counts = [starts.count(k) for k in (1, 2, 3)]  # start ∈ [1, 3]
    assert set(starts) == {1, 2, 3} and min(counts) > 60


def test_random_window_range_is_clipped_to_the_schedule_and_defaults_to_all_but_last():
    plan = plan_window("random_window", 6, size=6, range=(-3, 99), generator=_gen())
    assert plan.sde_steps == tuple(range(6))
    starts = {_start(plan_window("random_window", 6, size=2, generator=_gen(s))) for s in range(60)}
    assert starts == {0, 1, 2, 3}  # default range (0, T − 1): the last step never enters the window


@pytest.mark.parametrize("num_steps", [2, 3, 7, 10, 25])
def test_random_window_size_zero_equals_all_with_all_but_last(num_steps):
    plan = plan_window("random_window", num_steps, size=0)
    assert plan == plan_window("all", num_steps, timestep_fraction=(num_steps - 1) / num_steps)
    assert plan.train_steps == tuple(range(num_steps - 1))


def test_random_window_is_deterministic_per_seed_and_varies_across_seeds():
    a = [plan_window("random_window", 25, size=4, range=(0, 20), generator=_gen(s)) for s in range(8)]
    b = [plan_window("random_window", 25, size=4, range=(0, 20), generator=_gen(s)) for s in range(8)]
    assert a == b and len({_start(p) for p in a}) > 1


def test_random_window_needs_a_generator():
    with pytest.raises(AssertionError, match="draws its steps at random"):
        plan_window("random_window", 10, size=2)


# ----------------------------------------------------------------------------------------------- sliding


def test_sliding_progressive_moves_one_step_every_shift_every_iterations():
    # MixGRPO: w = 4 of T = 25, stride 1, τ = 25: iterations 0–24 start 0, 25–49 start 1, …
    def start(epoch: int) -> int:
        return _start(plan_window("sliding", 25, size=4, stride=1, shift_every=25, epoch=epoch))

    assert [start(e) for e in (0, 24, 25, 49, 50, 74, 75)] == [0, 0, 1, 1, 2, 2, 3]
    assert start(21 * 25) == 21 and start(21 * 25 + 1000) == 21  # reaches T − w and stays
    plan = plan_window("sliding", 25, size=4, shift_every=25, epoch=60)
    assert plan.sde_steps == plan.train_steps == (2, 3, 4, 5) and last_sde_step(plan) == 5


def test_sliding_progressive_roll_back_restarts_at_zero():
    # T = 10, size 4, stride 2, shift_every 3: starts 0, 2, 4, 6 (6 = T − size), then back to 0
    seq = [
        _start(plan_window("sliding", 10, size=4, stride=2, shift_every=3, roll_back=True, epoch=e))
        for e in range(15)
    ]
    assert seq == [0] * 3 + [2] * 3 + [4] * 3 + [6] * 3 + [0] * 3
    stay = [
        _start(plan_window("sliding", 10, size=4, stride=2, shift_every=3, epoch=e)) for e in range(12, 15)
    ]
    assert stay == [6, 6, 6]


def test_sliding_last_move_is_clipped_to_the_end():
    # T = 9, size 4, stride 2: starts 0, 2, 4, then 5 = T − size (a shorter last move)
    seq = [_start(plan_window("sliding", 9, size=4, stride=2, shift_every=1, epoch=e)) for e in range(6)]
    assert seq == [0, 2, 4, 5, 5, 5]
    rolled = [
        _start(plan_window("sliding", 9, size=4, stride=2, shift_every=1, roll_back=True, epoch=e))
        for e in range(6)
    ]
    assert rolled == [0, 2, 4, 5, 0, 2]


def test_sliding_end_offset_keeps_the_last_steps_out():
    # end_offset 2 of T = 25: the window lies before step 23; full windows only, so it stops at start 19
    plan = plan_window("sliding", 25, size=4, shift_every=1, end_offset=2, epoch=10_000)
    assert plan.sde_steps == (19, 20, 21, 22)


# MixGRPO's schedule, derived by hand from its GRPOTrainingStates: the window of iteration τ is
# range(cur, min(cur + size, T − 2)); after each iteration the counter rises and, once it reaches the
# position's interval, cur += stride (size without prog_overlap); cur > T − 2 rolls back to 0 (or clips).
MIXGRPO = {"size": 4, "stride": 1, "shift_every": 25, "end_offset": 2, "shrink_at_end": True}


def _windows(num_steps: int, epochs, **options) -> list[tuple[int, ...]]:
    return [plan_window("sliding", num_steps, epoch=e, **options).train_steps for e in epochs]


def test_mixgrpo_progressive_shrinks_at_the_end_and_rolls_back():
    # T = 25, w = 4, τ = 25, end 23: start p during iterations 25p … 25p + 24, for p = 0 … 22
    got = _windows(
        25, [0, 24, 25, 49, 50, 19 * 25, 20 * 25, 21 * 25, 22 * 25, 22 * 25 + 24], roll_back=True, **MIXGRPO
    )
    assert got == [
        (0, 1, 2, 3),
        (0, 1, 2, 3),
        (1, 2, 3, 4),
        (1, 2, 3, 4),
        (2, 3, 4, 5),
        (19, 20, 21, 22),
        (20, 21, 22),
        (21, 22),
        (22,),
        (22,),
    ]
    # 23 positions × 25 iterations = 575 per cycle; then back to the first window
    assert _windows(25, [575, 600, 575 + 22 * 25], roll_back=True, **MIXGRPO) == [
        (0, 1, 2, 3),
        (1, 2, 3, 4),
        (22,),
    ]
    # no roll-back: the window keeps its last, one-step position
    assert _windows(25, [22 * 25, 10_000], roll_back=False, **MIXGRPO) == [(22,), (22,)]
    assert all(
        23 not in w and 24 not in w for w in _windows(25, range(0, 1200, 7), roll_back=True, **MIXGRPO)
    )


def test_mixgrpo_without_overlap_moves_by_the_window_size():
    # prog_overlap off: cur += size. T = 10, end 8, w = 3: starts 0, 3, 6 (window cut to (6, 7)), then 0
    opts = {
        "size": 3,
        "stride": 3,
        "shift_every": 2,
        "end_offset": 2,
        "shrink_at_end": True,
        "roll_back": True,
    }
    assert (
        _windows(10, range(8), **opts) == [(0, 1, 2)] * 2 + [(3, 4, 5)] * 2 + [(6, 7)] * 2 + [(0, 1, 2)] * 2
    )
    # rlgen's clamp instead: the last move lands on end − size = 5, every window full
    clamp = {**opts, "shrink_at_end": False}
    assert _windows(10, range(0, 8, 2), **clamp) == [(0, 1, 2), (3, 4, 5), (5, 6, 7), (0, 1, 2)]


def test_mixgrpo_window_longer_than_its_end_is_cut():
    # T = 4, end 2, w = 4 (a tiny model under algo=mix_grpo): range(0, min(4, 2)) = (0, 1), then (1,)
    opts = {**MIXGRPO, "shift_every": 1, "roll_back": True}
    assert _windows(4, range(4), **opts) == [(0, 1), (1,), (0, 1), (1,)]
    with pytest.raises(AssertionError):  # a random start needs the whole window before the end
        plan_window("sliding", 4, epoch=1, generator=_gen(), **{**opts, "strategy": "random"})


def test_mixgrpo_flash_star_window_never_moves():
    # MixGRPO-Flash*: prog_overlap_step 0 keeps the window on the first 4 steps
    assert set(_windows(25, range(0, 2000, 37), **{**MIXGRPO, "stride": 0, "roll_back": True})) == {
        (0, 1, 2, 3)
    }


def test_mixgrpo_decay_between_its_script_bounds():
    # max 10, min 1, end 23: stay(p) = max(1, int(10·(1 − p/23) + p/23)) = int(10 − 9p/23)
    # p = 0: 10; 1: int(9.61) = 9; 2: int(9.22) = 9; 3: int(8.83) = 8; 4: int(8.43) = 8; 5: int(8.04) = 8;
    # 6: int(7.65) = 7; 22: int(1.39) = 1
    opts = {**MIXGRPO, "strategy": "decay", "max_shift_every": 10, "min_shift_every": 1}
    stays = [10, 9, 9, 8, 8, 8, 7]
    firsts = [sum(stays[:p]) for p in range(len(stays))]  # 0, 10, 19, 28, 36, 44, 52
    assert firsts == [0, 10, 19, 28, 36, 44, 52]
    starts = [w[0] for w in _windows(25, range(60), **opts)]  # p = 6 stays 52 … 58, p = 7 from 59
    assert starts == [p for p, n in enumerate(stays) for _ in range(n)] + [7]
    # without max_shift_every the ceiling is shift_every (25) and the floor max(1, 25 // 4) = 6
    default = [w[0] for w in _windows(25, [24, 25], **{**MIXGRPO, "strategy": "decay"})]
    assert default == [0, 1]


def test_mixgrpo_exp_decay_with_its_defaults():
    # k = 0.1 from start 13, τ = 25: stay 25 up to p = 13, then ceil(25·e^−0.1) = ceil(22.62) = 23 at p = 14,
    # ceil(25·e^−0.2) = ceil(20.47) = 21 at p = 15, ceil(25·e^−0.3) = ceil(18.52) = 19 at p = 16
    opts = {**MIXGRPO, "strategy": "exp_decay", "exp_decay_rate": 0.1, "exp_decay_start": 13}
    at = {
        e: w[0]
        for e, w in zip(
            [349, 350, 372, 373, 393, 394, 412, 413],
            _windows(25, [349, 350, 372, 373, 393, 394, 412, 413], **opts),
        )
    }
    assert at == {349: 13, 350: 14, 372: 14, 373: 15, 393: 15, 394: 16, 412: 16, 413: 17}


def test_mixgrpo_random_starts_at_zero_then_draws_full_windows():
    # iteration 0 uses the initial window; later starts are uniform in [0, T − 2 − w] = [0, 19]
    opts = {**MIXGRPO, "strategy": "random"}
    assert plan_window("sliding", 25, epoch=0, generator=_gen(5), **opts).train_steps == (0, 1, 2, 3)
    starts = [plan_window("sliding", 25, epoch=1, generator=_gen(s), **opts).sde_steps[0] for s in range(600)]
    assert set(starts) == set(range(20))


def test_sliding_decay_shortens_the_stay_linearly():
    # shift_every 8 (max), min 2, end T = 10, size 2: stay(p) = max(2, int(8·(1 − p/10) + 2·p/10))
    stays = [max(2, int(8 * (1 - p / 10) + 2 * p / 10)) for p in range(9)]
    expected = [p for p, n in enumerate(stays) for _ in range(n)]
    got = [
        _start(
            plan_window("sliding", 10, size=2, strategy="decay", shift_every=8, min_shift_every=2, epoch=e)
        )
        for e in range(len(expected))
    ]
    assert stays[:3] == [8, 7, 6] and got == expected


def test_sliding_decay_default_floor_is_a_quarter():
    # min_shift_every defaults to max(1, shift_every // 4) = 2: at p = 8 of end 10 the stay is int(3.2) = 3
    stays = [max(2, int(8 * (1 - p / 10) + 2 * p / 10)) for p in range(9)]
    epoch = sum(stays[:8])
    assert _start(plan_window("sliding", 10, size=2, strategy="decay", shift_every=8, epoch=epoch)) == 8


def test_sliding_exp_decay_follows_mixgrpo():
    # stay(p) = ceil(shift_every · exp(−k · max(0, p − start)))
    stays = [math.ceil(10 * math.exp(-0.5 * max(0, p - 2))) for p in range(7)]
    assert stays == [10, 10, 10, 7, 4, 3, 2]
    expected = [p for p, n in enumerate(stays) for _ in range(n)]
    opts = {
        "size": 4,
        "strategy": "exp_decay",
        "shift_every": 10,
        "exp_decay_rate": 0.5,
        "exp_decay_start": 2,
    }
    got = [_start(plan_window("sliding", 10, epoch=e, **opts)) for e in range(len(expected) + 5)]
    assert got == expected + [6] * 5


def test_sliding_random_is_uniform_and_seeded():
    starts = [
        _start(plan_window("sliding", 8, size=5, strategy="random", epoch=1, generator=_gen(s)))
        for s in range(200)
    ]
    assert set(starts) == {0, 1, 2, 3}
    again = [
        _start(plan_window("sliding", 8, size=5, strategy="random", epoch=1, generator=_gen(s)))
        for s in range(200)
    ]
    assert starts == again
    with pytest.raises(AssertionError, match="generator"):
        plan_window("sliding", 8, size=5, strategy="random", epoch=1)


@pytest.mark.parametrize("strategy", ["progressive", "decay", "exp_decay"])
@pytest.mark.parametrize("epoch", [0, 7, 1000])
def test_sliding_over_every_step_equals_all(strategy, epoch):
    plan = plan_window("sliding", 12, size=12, strategy=strategy, epoch=epoch)
    assert plan == plan_window("all", 12, timestep_fraction=1.0)


# ----------------------------------------------------------------------------------------- random_subset


def _trained(plan: WindowPlan) -> list[set[int]]:
    """The step indices each sample trains."""
    return [{plan.train_steps[j] for j in row.nonzero().flatten().tolist()} for row in plan.train_mask]


def test_random_subset_every_step_sde_and_a_per_sample_mask():
    plan = plan_window("random_subset", 10, timestep_fraction=0.6, batch_size=5, generator=_gen(1))
    assert plan.sde_steps == tuple(range(10))  # every step stochastic, the last one included
    assert plan.train_steps == tuple(range(9))  # the step onto σ′ = 0 is not even stored
    mask = plan.train_mask
    assert mask is not None and mask.dtype == torch.bool and mask.shape == (5, 9)
    assert mask.sum(dim=1).tolist() == [5] * 5  # int(9 · 0.6) = int(5.4) trained steps per sample
    assert len({tuple(row.tolist()) for row in mask}) > 1  # samples draw their own subsets


@pytest.mark.parametrize("num_steps", [2, 3, 12, 16, 25])
def test_random_subset_never_trains_the_last_step(num_steps):
    for seed in range(100):
        plan = plan_window(
            "random_subset", num_steps, timestep_fraction=1.0, batch_size=3, generator=_gen(seed)
        )
        assert all(num_steps - 1 not in steps for steps in _trained(plan))
        assert all(steps == set(range(num_steps - 1)) for steps in _trained(plan))  # fraction 1: all others


@pytest.mark.parametrize("num_steps,fraction", [(16, 0.6), (12, 0.6), (25, 0.5), (4, 1.0)])
def test_random_subset_is_dancegrpos_selection(num_steps, fraction):
    # DanceGRPO: perms = one torch.randperm(T − 1) per sample (rows of its stored steps 0 … T − 2), and
    # sample i trains perms[i][:int((T − 1)·fraction)]; the same draws from a generator in the same state
    for seed in range(5):
        torch.manual_seed(seed)
        perms = torch.stack([torch.randperm(num_steps - 1) for _ in range(6)])
        expected = [set(row[: int((num_steps - 1) * fraction)].tolist()) for row in perms]
        plan = plan_window(
            "random_subset", num_steps, timestep_fraction=fraction, batch_size=6, generator=_gen(seed)
        )
        assert _trained(plan) == expected


def test_random_subset_over_all_steps_when_asked():
    # skip_last_step=false: candidates are all T steps, int(T·fraction) of them, the last one included
    plans = [
        plan_window(
            "random_subset", 5, timestep_fraction=0.6, skip_last_step=False, batch_size=4, generator=_gen(s)
        )
        for s in range(50)
    ]
    assert all(
        p.train_steps == tuple(range(5)) and p.train_mask.sum(dim=1).tolist() == [3] * 4 for p in plans
    )
    assert any(4 in steps for p in plans for steps in _trained(p))


def test_random_subset_is_seeded_and_uniform_over_steps():
    a = plan_window("random_subset", 8, timestep_fraction=0.5, batch_size=400, generator=_gen(2))
    b = plan_window("random_subset", 8, timestep_fraction=0.5, batch_size=400, generator=_gen(2))
    assert a == b
    per_step = a.train_mask.float().mean(dim=0)  # (7,) ≈ int(7 · 0.5) / 7 = 3/7 each
    assert (per_step - 3 / 7).abs().max() < 0.1


def test_random_subset_defaults_to_dancegrpo_fraction():
    plan = plan_window("random_subset", 20, batch_size=2, generator=_gen())
    assert plan.train_mask.sum(dim=1).tolist() == [11, 11]  # int(19 · 0.6) = int(11.4)


def test_train_mask_must_fit_the_train_steps():
    with pytest.raises(ValueError, match=r"\(B, S=3\) bool tensor"):
        WindowPlan(3, (0, 1, 2), (0, 1, 2), train_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool tensor"):
        WindowPlan(3, (0, 1, 2), (0, 1, 2), train_mask=torch.ones(2, 3))


# ------------------------------------------------------------------------------------------------ single


def test_single_picks_one_step_shared_by_the_batch():
    plans = [plan_window("single", 20, max_index=2, generator=_gen(s)) for s in range(40)]
    assert {p.sde_steps for p in plans} == {(0,), (1,)}  # one of the first two (R3 editing)
    assert all(p.sde_steps == p.train_steps and p.train_mask is None for p in plans)
    anywhere = {_start(plan_window("single", 6, generator=_gen(s))) for s in range(120)}
    assert anywhere == set(range(6))  # generation: any step
    assert plan_window("single", 6, generator=_gen(9)) == plan_window("single", 6, generator=_gen(9))


def test_single_needs_a_generator():
    with pytest.raises(AssertionError, match="'single' draws its steps at random"):
        plan_window("single", 6)


# ------------------------------------------------------------------------------------- common behaviour


def test_all_still_takes_timestep_fraction_and_ignores_context():
    plan = plan_window("all", 10, timestep_fraction=0.99, epoch=5, generator=_gen(), batch_size=3)
    assert plan == plan_window("all", 10, timestep_fraction=0.99)
    with pytest.raises(TypeError, match="timestep_fraction"):  # a programming error: Python names it
        plan_window("all", 10)


def test_deterministic_policies_draw_nothing_from_the_generator():
    gen = _gen(4)
    state = gen.get_state()
    plan_window("sliding", 10, size=3, epoch=4, generator=gen)
    plan_window("all", 10, timestep_fraction=0.5, generator=gen)
    assert torch.equal(gen.get_state(), state)


def test_last_sde_step_of_an_empty_plan_is_none():
    assert last_sde_step(WindowPlan(4, (), ())) is None
    assert last_sde_step(plan_window("all", 4, timestep_fraction=0.5)) == 3
