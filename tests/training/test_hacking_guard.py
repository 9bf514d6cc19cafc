"""The reward-hacking guard (``guard:``; rlgen_cli/training/guard.py, docs/guard.md).

The rule on hand-made curves (flag / no flag, the margin and window edges, the window's best against its
start, rollbacks and their cap, a state round trip), the noise estimate (standard errors by hand, a
change within its noise not flagged, non-finite scores skipped), the run-level pieces (held-out metric,
scaling, monitor checks, config checks), and tiny SD3 runs: a reward the monitor disagrees with is flagged and
rolled back to ``checkpoints/best_heldout`` with the learning rate halved; a monitor that agrees is not.

Curves use binary fractions (0.25, 0.5, 0.75, …) so the margin edges are exact in floating point. A
curve point (r, h) is an evaluation on which every prompt scored r and h: every prompt changes alike, the
standard errors are 0, and the margin alone decides; tests/training/test_guard_noise.py measures the
rule on noise.
"""

from __future__ import annotations

import io
import json
import logging
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlgen_cli.errors import UserError
from rlgen_cli.schema.hacking_guard import GuardConfig
from rlgen_cli.training.control.hacking_guard import (
    HackingGuard,
    RunGuard,
    change_standard_error,
    require_known_monitors,
)
from tests.conftest import TINY_RUN, run_cli, validated_train

PROMPTS = 4


def _observe(guard: HackingGuard, curve: list[tuple[float, float]], first_epoch: int = -1) -> list:
    """Feed ``(trained, heldout)`` pairs as evaluations ``first_epoch``, ``first_epoch + 1``, … on which
    every one of ``PROMPTS`` prompts scored the pair; the verdicts."""
    return [guard.observe(first_epoch + i, [r] * PROMPTS, [h] * PROMPTS) for i, (r, h) in enumerate(curve)]


def _events(verdicts: list) -> list[tuple[int, str] | None]:
    return [None if v.event is None else (v.event.epoch, v.event.action) for v in verdicts]


# -- the rule ------------------------------------------------------------------------------------------
def test_trained_reward_up_and_heldout_down_past_the_margin_is_flagged():
    guard = HackingGuard(window=2, margin=0.25)
    verdicts = _observe(guard, [(0.0, 0.75), (0.25, 0.625), (0.5, 0.375)])
    assert _events(verdicts) == [None, None, (1, "warn")]
    event = verdicts[-1].event
    assert event.train_rise == 0.5  # r_2 − r_0
    assert event.heldout_drop == 0.375  # max(0.75, 0.625, 0.375) − 0.375
    assert (event.best.epoch, event.best.heldout) == (-1, 0.75)


def test_a_drop_equal_to_the_margin_is_not_flagged_and_one_just_past_it_is():
    at_margin = _observe(HackingGuard(window=1, margin=0.25), [(0.0, 0.75), (0.5, 0.5)])
    past_it = _observe(HackingGuard(window=1, margin=0.25), [(0.0, 0.75), (0.5, 0.4375)])
    assert _events(at_margin) == [None, None]
    assert _events(past_it) == [None, (0, "warn")]


def test_no_flag_while_the_trained_reward_is_flat_or_falling():
    """Both metrics falling is a bad run, not a hacked reward; nor is a trained reward that stayed put."""
    for trained_end in (0.0, -0.25):
        verdicts = _observe(HackingGuard(window=1, margin=0.0625), [(0.0, 0.75), (trained_end, 0.0)])
        assert _events(verdicts) == [None, None], trained_end


def test_fewer_than_window_plus_one_evaluations_never_flag():
    guard = HackingGuard(window=3, margin=0.0625)
    curve = [(0.0, 1.0), (0.25, 0.0), (0.5, 0.0), (0.75, 0.0)]
    assert _events(_observe(guard, curve)) == [None, None, None, (2, "warn")]  # the 4th is the first judged


def test_the_drop_is_measured_from_the_best_of_the_window_not_its_start():
    """h rises then falls inside the window: 0 below its start but 0.25 below its best."""
    verdicts = _observe(HackingGuard(window=2, margin=0.125), [(0.0, 0.5), (0.25, 0.75), (0.5, 0.5)])
    assert _events(verdicts) == [None, None, (1, "warn")]
    assert verdicts[-1].event.heldout_drop == 0.25


def test_a_peak_older_than_the_window_does_not_flag_a_run_that_holds_steady():
    guard = HackingGuard(window=1, margin=0.125)
    verdicts = _observe(guard, [(0.0, 1.0), (0.25, 0.5), (0.5, 0.5), (0.75, 0.5)])
    assert _events(verdicts) == [None, (0, "warn"), None, None]  # 0.5 below the run's best, not the window's
    assert guard.best.heldout == 1.0


def test_new_best_only_on_a_strict_improvement():
    guard = HackingGuard(window=2, margin=0.5)
    verdicts = _observe(guard, [(0.0, 0.5), (0.0, 0.5), (0.0, 0.75), (0.0, 0.25)])
    assert [v.new_best for v in verdicts] == [True, False, True, False]
    assert (guard.best.epoch, guard.best.heldout) == (1, 0.75)


def test_rollback_restarts_the_window_from_the_best_and_stops_after_max_rollbacks():
    guard = HackingGuard(window=1, margin=0.125, action="rollback", max_rollbacks=1)
    first = _observe(guard, [(0.0, 0.75), (0.25, 0.5)])
    assert _events(first) == [None, (0, "rollback")]
    assert guard.rollbacks == 1
    assert [(e.epoch, e.heldout) for e in guard.history] == [(-1, 0.75)]  # the restored state opens it
    # the next evaluation is judged against the restored best (r 0.0, h 0.75): flagged again, now capped
    second = _observe(guard, [(0.5, 0.5)], first_epoch=1)
    assert _events(second) == [(1, "stop")]
    assert guard.rollbacks == 1


def test_a_rollback_is_followed_by_a_fresh_window():
    guard = HackingGuard(window=2, margin=0.125, action="rollback")
    verdicts = _observe(guard, [(0.0, 0.75), (0.25, 0.625), (0.5, 0.5), (0.75, 0.25), (1.0, 0.25)])
    # rollback at epoch 1; epoch 2 is only the second entry of the new window ([best, epoch 2]): no flag
    assert _events(verdicts) == [None, None, (1, "rollback"), None, (3, "rollback")]


# -- the noise estimate -----------------------------------------------------------------------------------
def test_standard_error_of_a_change_by_hand():
    # changes d = after − before = [1, 0, 0, −1]: mean 0, Σ(d − 0)² = 2, / (n − 1) = 2/3, se = √(2/3) / √4
    assert change_standard_error([0, 1, 0, 1], [1, 1, 0, 0]) == pytest.approx(math.sqrt(2 / 3) / 2)
    # d = [1, 1, 0, 0]: mean 0.5, Σ(d − 0.5)² = 1, / 3, se = √(1/3) / 2; binomially b = 2 up, c = 0 down:
    # √((b + c − (b − c)² / n) / (n − 1)) / √n = √((2 − 1) / 3) / 2, the same
    assert change_standard_error([0, 0, 1, 1], [1, 1, 1, 1]) == pytest.approx(math.sqrt(1 / 3) / 2)
    assert change_standard_error([0.25, 0.5, 0.75, 1.0], [0.0, 0.25, 0.5, 0.75]) == 0.0  # every prompt alike


# every prompt's trained reward up 0.25 (no spread); the held-out metric down 0.25 on average, as
# d = [−1, 0.5, −0.5, 0] (deviations ±0.75, ±0.25: Σ = 1.25, / 3, se = √(1.25 / 3) / 2 = 0.3227) or as
# d = −0.25 on every prompt (se 0)
FLAT, RISEN = [0.0] * 4, [0.25] * 4
HELDOUT_BEFORE = [0.5] * 4
SPREAD_DROP, EVEN_DROP = [-0.5, 1.0, 0.0, 0.5], [0.25] * 4
SPREAD_DROP_SE = math.sqrt(1.25 / 3) / 2


def test_a_drop_within_its_noise_is_not_flagged_and_the_same_mean_drop_on_every_prompt_is():
    within = HackingGuard(window=1, margin=0.125, noise_k=3.0)
    verdicts = [within.observe(-1, FLAT, HELDOUT_BEFORE), within.observe(0, RISEN, SPREAD_DROP)]
    assert verdicts[1].event is None  # 0.25 < 3 · 0.3227
    assert verdicts[1].change.heldout_drop == 0.25
    assert verdicts[1].change.heldout_drop_se == pytest.approx(SPREAD_DROP_SE)
    assert (verdicts[1].change.train_rise, verdicts[1].change.train_rise_se) == (0.25, 0.0)

    even = HackingGuard(window=1, margin=0.125, noise_k=3.0)
    even.observe(-1, FLAT, HELDOUT_BEFORE)
    assert even.observe(0, RISEN, EVEN_DROP).event is not None
    # k = 0.7 puts the spread drop's threshold at 0.7 · 0.3227 = 0.226 < 0.25; k = 0 is the bare rule
    for noise_k in (0.7, 0.0):
        looser = HackingGuard(window=1, margin=0.125, noise_k=noise_k)
        looser.observe(-1, FLAT, HELDOUT_BEFORE)
        assert looser.observe(0, RISEN, SPREAD_DROP).event is not None, noise_k


def test_a_trained_reward_rise_within_its_noise_is_not_flagged():
    """The held-out metric fell on every prompt; the trained reward rose 0.25 on average, as the spread
    changes [1, −0.5, 0.5, 0] (se 0.3227 as above): within one standard error, past 0.7 of one."""
    spread_rise = [1.0, -0.5, 0.5, 0.0]
    guard = HackingGuard(window=1, margin=0.125, rise_k=1.0)
    guard.observe(-1, FLAT, HELDOUT_BEFORE)
    verdict = guard.observe(0, spread_rise, EVEN_DROP)
    assert verdict.event is None
    assert verdict.change.train_rise_se == pytest.approx(SPREAD_DROP_SE)
    looser = HackingGuard(window=1, margin=0.125, rise_k=0.7)
    looser.observe(-1, FLAT, HELDOUT_BEFORE)
    assert looser.observe(0, spread_rise, EVEN_DROP).event is not None


def test_a_non_finite_evaluation_is_skipped_and_does_not_hide_the_next_drop(caplog):
    """W = 1: the evaluation after the skipped one is judged against the one before it."""
    guard = HackingGuard(window=1, margin=0.125)
    first = guard.observe(-1, FLAT, [0.75] * 4)
    with caplog.at_level(logging.WARNING, logger="rlgen_cli.training.control.hacking_guard"):
        skipped = guard.observe(0, [0.25] * 4, [0.5, math.nan, 0.5, 0.5])
    assert "after epoch 1 has non-finite scores (trained 0 of 4, held-out 1 of 4): skipped" in caplog.text
    assert (skipped.skipped, skipped.new_best, skipped.event) == (True, False, None)
    flagged = guard.observe(1, [0.5] * 4, [0.25] * 4)
    assert _events([first, skipped, flagged]) == [None, None, (1, "warn")]
    assert flagged.change.heldout_drop == 0.5  # from 0.75, before the skipped evaluation


def test_a_non_finite_evaluation_flags_alike_wherever_it_falls_in_the_window():
    """W = 2: a NaN evaluation first, in the middle or last-but-one of the history gives the same verdict
    on the last evaluation, and never becomes the best."""
    nan = ([math.nan] * 4, [math.nan] * 4)
    finite = [(FLAT, [0.75] * 4), ([0.25] * 4, [0.5] * 4), ([0.5] * 4, [0.25] * 4)]
    for at in range(3):
        evaluations = [*finite[:at], nan, *finite[at:]]
        guard = HackingGuard(window=2, margin=0.125)
        verdicts = [guard.observe(i - 1, r, h) for i, (r, h) in enumerate(evaluations)]
        assert verdicts[-1].event is not None, at
        assert (verdicts[-1].change.train_rise, verdicts[-1].change.heldout_drop) == (0.5, 0.5), at
        assert guard.best.heldout == 0.75, at


def test_too_few_prompts_or_a_changed_prompt_count_are_refused():
    with pytest.raises(UserError, match="has 1: evaluate at least 2"):
        HackingGuard(window=1, margin=0.0).observe(-1, [0.5], [0.5])
    guard = HackingGuard(window=1, margin=0.0)
    guard.observe(-1, FLAT, FLAT)
    with pytest.raises(UserError, match="recorded on 4 evaluation prompts and this evaluation has 3"):
        guard.observe(0, [0.0] * 3, [0.0] * 3)


def test_state_round_trip_through_torch_save_continues_as_uninterrupted():
    curve = [(0.0, 0.75), (0.25, 0.5), (0.5, 0.75), (0.625, 0.625), (0.75, 0.5), (1.0, 0.25)]
    straight = HackingGuard(window=2, margin=0.125, action="rollback")
    expected = _observe(straight, curve)
    assert any(v.event is not None for v in expected[3:]), "the tail must flag, or the test proves nothing"

    half = HackingGuard(window=2, margin=0.125, action="rollback")
    _observe(half, curve[:3])
    buffer = io.BytesIO()
    torch.save(half.state_dict(), buffer)  # as a checkpoint's trainer state holds it
    buffer.seek(0)
    resumed = HackingGuard(window=2, margin=0.125, action="rollback")
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert _observe(resumed, curve[3:], first_epoch=2) == expected[3:]
    assert resumed.state_dict() == straight.state_dict()

    fresh = HackingGuard(window=2, margin=0.125, action="rollback")  # without the state: another answer
    assert _observe(fresh, curve[3:], first_epoch=2) != expected[3:]


def test_a_state_without_per_prompt_scores_is_refused():
    old = {"history": [[-1, 0.0, 0.75]], "best": [-1, 0.0, 0.75], "rollbacks": 0}
    with pytest.raises(UserError, match="has no per-prompt scores"):
        HackingGuard(window=1, margin=0.0).load_state_dict(old)


# -- the run-level guard -------------------------------------------------------------------------------
class _OneProcess:
    is_main, sharded, shards_optimizer, engine = True, False, False, None

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _run_guard(**settings) -> RunGuard:
    cfg = GuardConfig(**{"monitors": {"brightness": -2.0}, **settings})
    algo = SimpleNamespace(lr=1e-3, kl_weight=0.04)
    return RunGuard.build(cfg, _OneProcess(), algo, state=None)


def test_heldout_metric_is_the_weighted_sum_of_monitor_means_and_is_kept_per_prompt():
    guard = _run_guard()  # brightness, weight −2
    trained = torch.tensor([0.0, 1.0, 1.0, 1.0])
    metrics = guard.score_evaluation(trained, {"brightness": torch.tensor([0.25, 0.75, 0.5, 0.5])}, 2)
    assert metrics == {"guard/heldout": -1.0, "guard/reward/brightness/mean": 0.5}
    # 2 images a prompt: trained (0 + 1) / 2, (1 + 1) / 2; held-out −2 · (0.25 + 0.75) / 2, −2 · (0.5 + 0.5) / 2
    assert [t.tolist() for t in guard.pending] == [[0.5, 1.0], [-1.0, -1.0]]


def _decide(guard: RunGuard, epoch: int, trained: float, heldout: float):
    """An evaluation of 2 prompts that scored ``trained`` and ``heldout`` (weight −2: brightness −h/2)."""
    guard.score_evaluation(torch.full((2,), trained), {"brightness": torch.full((2,), -heldout / 2)}, 1)
    return guard.decide(_OneProcess(), epoch)


def test_decide_stops_and_reports_best():
    guard = _run_guard(window=1, margin=0.125, action="stop")
    first = _decide(guard, -1, trained=0.0, heldout=0.5)
    assert (first.new_best, first.action, guard.stop_requested) == (True, None, False)
    assert guard.status_metrics() == {"guard/best": 0.5, "guard/best_step": 0.0}  # the window is not full
    second = _decide(guard, 0, trained=0.25, heldout=0.25)
    assert (second.new_best, second.action, guard.stop_requested) == (False, "stop", True)
    assert second.event.metrics() == {"guard/event/stop": 1.0}
    assert guard.status_metrics() == {
        "guard/best": 0.5,
        "guard/best_step": 0.0,
        "guard/train_rise": 0.25,
        "guard/train_rise_se": 0.0,
        "guard/heldout_drop": 0.25,
        "guard/heldout_drop_se": 0.0,
    }
    assert "rose +0.25 (no spread) over 1 evaluation while the held-out metric fell 0.25 (no spread)" in (
        second.event.describe(1, 0.125)
    )


def test_rollback_scales_the_optimizer_lr_and_the_config_each_time():
    guard = _run_guard(action="rollback", rollback_lr_scale=0.5, rollback_kl_scale=2.0)
    algo = SimpleNamespace(lr=1e-3, kl_weight=0.04)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    optimizer.param_groups[0]["lr"] = 7e-4  # what the best checkpoint's optimizer state brought back
    scales = guard.rescale_after_rollback(algo, optimizer, lrs=[8e-4])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(4e-4)  # the pre-rollback lr × 0.5
    assert (algo.lr, algo.kl_weight) == (pytest.approx(5e-4), pytest.approx(0.08))
    assert scales == {"guard/lr_scale": 0.5, "guard/kl_scale": 2.0}
    assert guard.rescale_after_rollback(algo, optimizer, lrs=[4e-4])["guard/lr_scale"] == 0.25


def test_a_resumed_guard_applies_its_scales_to_the_config_again():
    guard = _run_guard(action="rollback", rollback_kl_scale=2.0)
    guard.rescale_after_rollback(
        SimpleNamespace(lr=1.0, kl_weight=1.0), torch.optim.SGD([torch.zeros(1)], lr=1), [1.0]
    )
    algo = SimpleNamespace(lr=1e-3, kl_weight=0.04)
    RunGuard.build(guard.cfg, _OneProcess(), algo, state=guard.state_dict())
    assert (algo.lr, algo.kl_weight) == (pytest.approx(5e-4), pytest.approx(0.08))


class _DeepSpeed(_OneProcess):
    shards_optimizer, engine = True, "deepspeed"


def test_a_best_checkpoint_the_guard_did_not_choose_is_refused():
    """A crashed attempt can leave a later best_heldout than the resumed guard's best."""
    guard = _run_guard(action="rollback")
    _decide(guard, 4, trained=0.0, heldout=0.5)  # best: after 5 epochs
    guard.require_best_state(5)
    with pytest.raises(
        UserError, match="holds the state after 9 epochs, but the guard's best is the state after 5"
    ):
        guard.require_best_state(9)


def test_rollback_under_a_sharding_engine_is_refused():
    dist = _DeepSpeed()
    with pytest.raises(
        UserError, match="rollback reloads weights and optimizer state mid-run, which the deepspeed"
    ):
        RunGuard.build(GuardConfig(monitors={"brightness": 1.0}, action="rollback"), dist, None, None)


def test_no_monitors_no_guard():
    assert RunGuard.build(GuardConfig(), _OneProcess(), None, None) is None


def test_unknown_monitors_and_bad_monitor_kwargs_are_named():
    with pytest.raises(UserError, match="guard.monitors names unknown reward 'clipscroe'; known rewards: "):
        require_known_monitors(GuardConfig(monitors={"clipscroe": 1.0}))
    bad = GuardConfig(monitors={"shapes_geneval": 1.0}, kwargs={"shapes_geneval": {"modee": "strict"}})
    with pytest.raises(UserError, match=r"guard.kwargs.shapes_geneval.modee: .* did you mean mode\?"):
        require_known_monitors(bad)
    require_known_monitors(
        GuardConfig(monitors={"shapes_geneval": 1.0}, kwargs={"shapes_geneval": {"mode": "strict"}})
    )


# -- the config boundary -------------------------------------------------------------------------------
def _validate(*overrides: str):
    return validated_train(*overrides)


MONITOR = "+guard.monitors.brightness=1.0"
ONLINE_DPO_ROLLBACK = r"not online DPO's reference copy \(algo.pref.ref_update_step=2\)"
GARDO_REFRESH_ROLLBACK = "not the reference that algo.gardo.refresh_every=2 refreshes"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([MONITOR, "eval_every=0"], "eval_every=0 never evaluates: set eval_every=N"),
        (
            [MONITOR, "guard.action=undo"],
            "guard.action='undo' is not valid; choose one of warn, stop, rollback",
        ),
        ([MONITOR, "guard.margin=-0.1"], "guard.margin must be ≥ 0, got -0.1"),
        ([MONITOR, "guard.window=0"], "guard.window must be ≥ 1, got 0"),
        ([MONITOR, "guard.noise_k=-1"], "guard.noise_k must be ≥ 0, got -1"),
        ([MONITOR, "guard.rise_k=-0.5"], "guard.rise_k must be ≥ 0, got -0.5"),
        (
            [MONITOR, "data.eval_num_prompts=1"],
            "data.eval_num_prompts=1 evaluates one: set data.eval_num_prompts ≥ 2",
        ),
        ([MONITOR, "guard.rollback_lr_scale=2"], r"guard.rollback_lr_scale must be in \(0, 1\], got 2"),
        (
            [MONITOR, "+guard.kwargs.jpeg_compressibility={quality: 90}"],
            r"guard.kwargs names rewards not in guard.monitors: \['jpeg_compressibility'\]",
        ),
        (["+guard.monitors.clipscroe=1.0"], "guard.monitors names unknown reward 'clipscroe'"),
        (
            [
                MONITOR,
                "guard.action=rollback",
                "launcher=deepspeed_zero2",
                "launcher.num_processes=2",
                "algo.sample_batch_size=2",
                "algo.train_batch_size=2",
            ],
            "which launcher=deepspeed_zero2 shards",
        ),
        (
            [MONITOR, "guard.action=rollback", "guard.rollback_kl_scale=2", "algo.kl_weight=0"],
            "algo.kl_weight=0.0 does not train with",
        ),
        ([MONITOR, "guard.action=rollback", "algo=nft"], "not recipe=flow_forward's old policy"),
        (
            [MONITOR, "guard.action=rollback", "algo=dpo", "algo.pref.ref_update_step=2"],
            ONLINE_DPO_ROLLBACK,
        ),
        (
            [MONITOR, "guard.action=rollback", "algo.kl_weight=0.01", "algo.gardo.refresh_every=2"],
            GARDO_REFRESH_ROLLBACK,
        ),
    ],
)
def test_bad_guard_settings_are_named_at_the_boundary(overrides: list[str], message: str):
    with pytest.raises(UserError, match=message):
        _validate(*overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo=dpo", "algo.pref.ref_update_step=2"], ONLINE_DPO_ROLLBACK),
        (["algo.kl_weight=0.01", "algo.gardo.refresh_every=2"], GARDO_REFRESH_ROLLBACK),
    ],
)
def test_rollback_of_a_recipe_state_it_cannot_restore_exits_2(tmp_path: Path, overrides, message):
    """A rollback restores weights, EMA and optimizer, not a reference the recipe refreshes from them:
    refused before any model loads, naming what and how to fix it."""
    code, out = run_cli(
        "train", *TINY_RUN, MONITOR, "guard.action=rollback", *overrides, f"hydra.run.dir={tmp_path / 'run'}"
    )
    assert code == 2, out
    assert re.search(message, out), out
    assert "use guard.action=warn or stop" in out, out


def test_rollback_is_allowed_where_no_refreshed_reference_is_left_behind():
    """Offline DPO's reference is the base model and SFT has none: nothing a rollback leaves behind."""
    for overrides in (["algo=dpo", "algo.pref.ref_update_step=0"], ["algo=sft"]):
        assert _validate(MONITOR, "guard.action=rollback", *overrides).guard.action == "rollback"


def test_good_guard_settings_pass():
    typed = _validate(
        "+guard.monitors.brightness=-1.0",
        "+guard.monitors.jpeg_incompressibility=0.5",
        "guard.action=rollback",
        "guard.rollback_kl_scale=2",
        "algo.kl_weight=0.01",
    )
    assert dict(typed.guard.monitors) == {"brightness": -1.0, "jpeg_incompressibility": 0.5}
    assert typed.guard.enabled and not _validate().guard.enabled


# -- tiny SD3 runs -------------------------------------------------------------------------------------
# the brightness task of tests/recipes/test_learning_flow.py (a random tiny SD3 climbs it), evaluated
# after every epoch; the monitor is darkness (weight −1 on brightness): it falls exactly as much as the
# trained reward rises, so the margin alone decides which evaluation is flagged. Measured (same on every
# rerun on CPU): brightness on the 4 test prompts 0.53110 before training, 0.53144 after epoch 0,
# 0.53428 after epoch 1; rolled back there (lr halved), 0.53199 after epoch 2.
GUARDED_RUN = [
    "experiment=tiny_cpu", "reward=brightness", "model.resolution=16", "model.num_steps=3",
    "model.eval_num_steps=3", "model.guidance_scale=1.0", "data.eval_num_prompts=4", "progress=false",
    "eval_before=true", "eval_every=1", "save_every=1", "keep_last=10", "images_every=0",
    "algo.prompts_per_epoch=2", "algo.group_size=4", "algo.sample_batch_size=8", "algo.train_batch_size=8",
    "algo.lr_schedule=constant", "algo.kl_weight=0.0", "algo.ema.enabled=false", "algo.lr=3e-2",
    "+guard.monitors.brightness=-1.0", "guard.window=1", "guard.action=rollback",
]  # fmt: skip
AGREEING = "guard.monitors.brightness=1.0"  # replaces the darkness monitor


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from rlgen_cli.models.sd3 import LORA_WEIGHTS_NAME

    return load_file(checkpoint / "weights" / LORA_WEIGHTS_NAME)


def _guard_events(rows: list[dict]) -> dict[int, list[str]]:
    return {
        row["step"]: sorted(k.removeprefix("guard/event/") for k in row if k.startswith("guard/event/"))
        for row in rows
        if any(k.startswith("guard/event/") for k in row)
    }


def _state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / "trainer_state.pt", weights_only=True)


def _assert_same_weights(a: Path, b: Path) -> None:
    mine, theirs = _weights(a), _weights(b)
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key], value, rtol=0, atol=0)


def test_one_flagged_epoch_rolls_back_to_the_weights_before_training(tmp_path: Path):
    """Margin 0: any rise of the trained reward over one evaluation is flagged (epoch 0 raised it by
    0.00034); the checkpoint written after it holds best_heldout's weights and a halved learning rate."""
    run = tmp_path / "run"
    code, out = run_cli("train", *GUARDED_RUN, "epochs=1", "guard.margin=0", f"hydra.run.dir={run}")
    assert code == 0, out
    rows = _rows(run)
    assert _guard_events(rows) == {1: ["rollback"]}  # metrics.jsonl steps: epochs completed
    row = rows[-1]
    assert row["guard/train_rise"] > 0 and row["guard/heldout_drop"] == pytest.approx(row["guard/train_rise"])
    assert (row["guard/lr_scale"], row["guard/best_step"]) == (0.5, 0.0)
    checkpoints = run / "checkpoints"
    assert _state(checkpoints / "best_heldout")["counters"]["epoch"] == 0  # saved before training
    _assert_same_weights(checkpoints / "epoch_000001", checkpoints / "best_heldout")
    lrs = [g["lr"] for g in _state(checkpoints / "epoch_000001")["optimizer"]["param_groups"]]
    assert lrs == [pytest.approx(1.5e-2)]
    assert "guard: reward hacking suspected after epoch 1" in (run / "run.log").read_text()
    assert (run / "guard_curves.png").is_file()


@pytest.mark.slow
def test_a_disagreeing_monitor_is_flagged_rolled_back_then_stopped(tmp_path: Path):
    """Margin 0.0005: epoch 0 (+0.00034) passes, epoch 1 (+0.00284) rolls back to the weights before
    training with the lr halved, epoch 2 (+0.00089 over the restored state) is flagged again past
    ``max_rollbacks`` and stops the run after 3 of 4 epochs."""
    run = tmp_path / "run"
    code, out = run_cli(
        "train",
        *GUARDED_RUN,
        "epochs=4",
        "guard.margin=0.0005",
        "guard.max_rollbacks=1",
        f"hydra.run.dir={run}",
    )
    assert code == 0, out
    rows = _rows(run)
    assert _guard_events(rows) == {2: ["rollback"], 3: ["stop"]}  # metrics.jsonl steps: epochs completed
    by_step = {row["step"]: row for row in rows}
    assert max(by_step) == 3
    assert (by_step[2]["lr"], by_step[3]["lr"]) == (pytest.approx(3e-2), pytest.approx(1.5e-2))
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "best_heldout",
        "epoch_000001",
        "epoch_000002",
        "epoch_000003",
    ]
    # right after the rollback: best_heldout's weights, bit for bit; the epoch trained from there moved them
    _assert_same_weights(checkpoints / "epoch_000002", checkpoints / "best_heldout")
    moved, best = _weights(checkpoints / "epoch_000003"), _weights(checkpoints / "best_heldout")
    assert any(not torch.equal(moved[key], value) for key, value in best.items())
    log = (run / "run.log").read_text()
    assert "rolling back to checkpoints/best_heldout (before training" in log
    assert "stopping after this epoch" in log and "time limit" not in log


@pytest.mark.slow
def test_an_agreeing_monitor_is_never_flagged_and_keeps_its_best_evaluation(tmp_path: Path):
    run = tmp_path / "run"
    code, out = run_cli("train", *GUARDED_RUN, AGREEING, "epochs=3", "guard.margin=0", f"hydra.run.dir={run}")
    assert code == 0, out
    rows = _rows(run)
    assert _guard_events(rows) == {}
    assert max(row["step"] for row in rows) == 3  # every epoch ran
    heldout = {row["step"]: row["guard/heldout"] for row in rows}
    best_step = max(heldout, key=heldout.get)  # epochs completed, as the checkpoint names count
    assert best_step >= 1  # training raised it: the kept state is a trained one
    assert _state(run / "checkpoints" / "best_heldout")["counters"]["epoch"] == best_step
    _assert_same_weights(run / "checkpoints" / f"epoch_{best_step:06d}", run / "checkpoints" / "best_heldout")
    assert rows[-1]["guard/best_step"] == best_step


@pytest.mark.slow
def test_a_resumed_guarded_run_equals_an_uninterrupted_one(tmp_path: Path):
    """Rolled back at epochs 1, 2 and 3 (logged at steps 2, 3 and 4: step s is the state after s epochs;
    margin 0.0005; the lr halved each time): stopped after 2 epochs and resumed, the run flags, rolls back
    and ends with the weights of one that never stopped (without the guard's state in the checkpoint the
    resumed run would take epoch 2 for its best and never flag)."""
    settings = [*GUARDED_RUN, "guard.margin=0.0005"]
    straight, parted = tmp_path / "straight", tmp_path / "parted"
    assert run_cli("train", *settings, "epochs=4", f"hydra.run.dir={straight}")[0] == 0
    assert run_cli("train", *settings, "epochs=2", f"hydra.run.dir={parted}")[0] == 0
    assert run_cli("train", *settings, "epochs=4", "resume=auto", f"hydra.run.dir={parted}")[0] == 0

    def guard_rows(run: Path) -> list[dict]:
        return [{k: v for k, v in row.items() if k.startswith("guard/") or k == "lr"} for row in _rows(run)]

    expected = guard_rows(straight)
    events = _guard_events(_rows(straight))
    assert events == {2: ["rollback"], 3: ["rollback"], 4: ["rollback"]}  # on both sides of the cut
    assert guard_rows(parted) == expected
    _assert_same_weights(parted / "checkpoints" / "epoch_000004", straight / "checkpoints" / "epoch_000004")


@pytest.mark.slow
def test_a_rollback_with_ema_restores_the_raw_weights_and_the_average(tmp_path: Path):
    """With an EMA, ``weights/`` holds the averaged weights and training goes on from the raw ones: the
    rollback brings back both, and the average's own state."""
    run = tmp_path / "run"
    ema = ["algo.ema.enabled=true", "algo.ema.decay=0.5", "algo.ema.update_every=1"]
    code, out = run_cli("train", *GUARDED_RUN, *ema, "epochs=1", "guard.margin=0", f"hydra.run.dir={run}")
    assert code == 0, out
    assert _guard_events(_rows(run)) == {1: ["rollback"]}  # after the first epoch (step 1)
    best, after = run / "checkpoints" / "best_heldout", run / "checkpoints" / "epoch_000001"
    _assert_same_weights(after, best)
    best_state, after_state = _state(best), _state(after)
    for raw_after, raw_best in zip(after_state["raw_trainable"], best_state["raw_trainable"], strict=True):
        torch.testing.assert_close(raw_after, raw_best, rtol=0, atol=0)
    for shadow_after, shadow_best in zip(
        after_state["ema"]["shadow"], best_state["ema"]["shadow"], strict=True
    ):
        torch.testing.assert_close(shadow_after, shadow_best, rtol=0, atol=0)
    assert after_state["ema"]["last_step"] == best_state["ema"]["last_step"] == 0
    assert after_state["counters"]["global_step"] == 1  # the clock is not rolled back


@pytest.mark.slow
def test_two_processes_share_the_decision_and_roll_back_together(tmp_path: Path):
    """DDP: rank 0 evaluates and decides; both ranks save best_heldout and roll back together (the
    samples do not depend on the process count, so the first epoch, step 1, is flagged as in one process)."""
    run = tmp_path / "run"
    ddp = [
        "launcher=accelerate",
        "launcher.num_processes=2",
        "algo.sample_batch_size=4",
        "algo.train_batch_size=4",
    ]
    code, out = run_cli("train", *GUARDED_RUN, *ddp, "epochs=2", "guard.margin=0", f"hydra.run.dir={run}")
    assert code == 0, out
    assert _guard_events(_rows(run)) == {1: ["rollback"], 2: ["rollback"]}
    checkpoints = run / "checkpoints"
    _assert_same_weights(checkpoints / "epoch_000001", checkpoints / "best_heldout")
    _assert_same_weights(checkpoints / "epoch_000002", checkpoints / "best_heldout")
    lrs = [g["lr"] for g in _state(checkpoints / "epoch_000002")["optimizer"]["param_groups"]]
    assert lrs == [pytest.approx(7.5e-3)]  # halved twice
