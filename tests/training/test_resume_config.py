"""A resume whose config differs from the checkpoint's in what training computes is refused, naming each
difference; what a run observes or where it runs may change, and a change made on purpose is named in
``resume_changes`` (except what a resume cannot honour)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlgen_cli.errors import UserError
from rlgen_cli.training.checkpoints.resume_config import check_resume_config, config_differences
from tests.conftest import TINY_RUN

SAVED = {
    "seed": 42,
    "epochs": 10,
    "eval_every": 5,
    "resume": None,
    "resume_changes": [],
    "algo": {
        "lr": 1e-2,
        "lr_schedule": "constant",
        "gradient_accumulation_steps": None,
        "ema": {"enabled": False},
    },
    "model": {"path": "/data/a", "lora": {"rank": 4, "alpha": 16}},
    "reward": {"kwargs": {"remote": {"endpoints": "http://a:1", "nan_value": float("nan")}}},
    "launcher": {"name": "accelerate", "num_processes": 2, "num_machines": 1},
    "logging": {"tensorboard": False},
}


def _with(**changes: object) -> OmegaConf:
    """SAVED with dotted-key ``changes`` (``algo__lr`` for ``algo.lr``)."""
    config = OmegaConf.create(SAVED)
    for key, value in changes.items():
        OmegaConf.update(config, key.replace("__", "."), value, force_add=True)
    return config


def _check(current, schedule_uses_length: bool = False) -> None:
    check_resume_config(
        Path("/runs/r/checkpoints/epoch_000001"), OmegaConf.create(SAVED), current, schedule_uses_length
    )


def test_differences_are_leaf_keys_with_nan_equal_to_itself_and_one_sided_keys_left_out():
    current = _with(algo__lr=1e-3, model__lora__alpha=32, added_since=1)
    del current.reward.kwargs.remote.endpoints  # a key the current config no longer has
    assert config_differences(OmegaConf.create(SAVED), current) == [
        ("algo.lr", 1e-2, 1e-3),
        ("model.lora.alpha", 16, 32),
    ]


def test_null_accumulation_is_compared_as_one_micro_batch_per_process():
    saved = OmegaConf.create(SAVED)  # null on 2 processes: 2 micro-batches per step
    on_one = _with(launcher__num_processes=1)
    assert config_differences(saved, on_one) == [
        ("algo.gradient_accumulation_steps", 2, 1),
        ("launcher.num_processes", 2, 1),
    ]
    with pytest.raises(UserError, match="null means one per process"):
        _check(on_one)
    _check(_with(launcher__num_processes=1, algo__gradient_accumulation_steps=2))  # the same steps


def test_what_a_run_observes_or_where_it_runs_may_change():
    _check(
        _with(
            eval_every=1,
            resume="auto",
            model__path="/mnt/a",
            logging__tensorboard=True,
            launcher__name="fsdp",
        )
    )


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"algo__lr": 1e-3}, "algo.lr: 0.01 → 0.001"),
        ({"model__lora__alpha": 64}, "model.lora.alpha: 16 → 64"),
        ({"algo__ema__enabled": True}, "algo.ema.enabled: False → True"),
        ({"seed": 7}, "seed: 42 → 7"),
        ({"reward__kwargs__remote__endpoints": "http://b:1"}, "reward.kwargs.remote.endpoints"),
    ],
)
def test_a_change_of_what_training_computes_is_refused_by_name(changes, named):
    with pytest.raises(UserError, match="differs from the checkpoint's") as err:
        _check(_with(**changes))
    assert named in str(err.value) and "/runs/r/checkpoints/epoch_000001/config.yaml" in str(err.value)


def test_epochs_may_change_only_where_the_schedule_does_not_span_them():
    _check(_with(epochs=20), schedule_uses_length=False)
    with pytest.raises(UserError, match="the learning-rate schedule spans epochs"):
        _check(_with(epochs=20), schedule_uses_length=True)


def test_a_change_named_in_resume_changes_is_taken():
    _check(_with(reward__kwargs__remote__endpoints="http://b:1", resume_changes=["reward.kwargs.remote"]))
    with pytest.raises(UserError, match="algo.lr"):  # naming one change does not open the others
        _check(_with(algo__lr=1e-3, seed=42, resume_changes=["reward.kwargs.remote"]))


@pytest.mark.parametrize("named", ["algo.lr", "model.lora.alpha", "algo", "recipe"])
def test_what_a_resume_cannot_honour_is_refused_even_when_named(named):
    with pytest.raises(UserError, match="which a resume cannot honour"):
        _check(_with(resume_changes=[named]))


def _train(run_dir: Path, *overrides: str) -> tuple[int, str]:
    from tests.conftest import run_cli

    return run_cli("train", *TINY_RUN, "eval_every=0", "save_every=1", f"hydra.run.dir={run_dir}", *overrides)


def test_a_resume_under_another_lora_scale_or_algorithm_stops_before_loading(tmp_path):
    run = tmp_path / "run"
    code, out = _train(run, "epochs=1")
    assert code == 0, out
    code, out = _train(run, "epochs=2", "resume=auto", "model.lora.alpha=64")
    assert code == 2 and "model.lora.alpha: " in out and "Traceback" not in out, out
    code, out = _train(run, "epochs=2", "resume=auto", "algo=dpo")
    assert code == 2 and "recipe: 'flow_grpo' → 'flow_pref'" in out, out
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1  # nothing trained by the refusals
    code, out = _train(run, "epochs=2", "resume=auto", "eval_every=1")
    assert code == 0, out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]


def test_a_run_its_time_limit_ended_stays_ended_on_resume(tmp_path, caplog):
    """A requeue loop passing resume=auto must not train one more epoch per attempt past a spent budget;
    a raised limit (here: none) trains on."""
    run = tmp_path / "run"
    limited = ["epochs=3", "time_limit_minutes=0.0001"]  # used up by the first epoch
    assert _train(run, *limited)[0] == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    code, out = _train(run, *limited, "resume=auto")
    assert code == 0, out
    assert "already used up by the 1 epochs this run resumed from" in out + caplog.text
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    code, out = _train(run, "epochs=3", "time_limit_minutes=0", "resume=auto")
    assert code == 0, out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
