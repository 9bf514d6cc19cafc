"""``launcher.config_file=``: a user's accelerate YAML or DeepSpeed JSON goes to ``accelerate launch`` as
with ``accelerate launch --config_file``; rlgen's launcher settings stay in charge, and a file value that
disagrees stops the run with exit code 2 naming both values (nothing is overridden silently)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlgen_cli.errors import UserError
from rlgen_cli.launch.commands import launch_command, launch_file_conflicts, read_launch_file
from rlgen_cli.schema.run import LauncherConfig

# what `accelerate config` writes for two processes on one machine (gloo ranks on CPU)
TWO_PROCESSES = {
    "compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_machines": 1,
    "num_processes": 2, "mixed_precision": "no", "machine_rank": 0, "rdzv_backend": "static",
    "same_network": True, "use_cpu": False,
}  # fmt: skip
ALGO = {"train_batch_size": 4, "max_grad_norm": 1.0}


def _yaml(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump({**TWO_PROCESSES, **changes}))
    return path


def _json(tmp_path: Path, settings: dict) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(settings))
    return path


def _launcher(path: Path, **changes) -> LauncherConfig:
    return LauncherConfig(name="accelerate", num_processes=2, config_file=str(path), **changes)


def test_an_accelerate_yaml_that_agrees_is_passed_as_config_file(tmp_path: Path):
    path = _yaml(tmp_path)
    launcher = _launcher(path)
    assert launch_file_conflicts(launcher, read_launch_file(str(path)), ALGO) == []
    argv = launch_command(launcher, tmp_path / "resolved.yaml")
    assert argv[argv.index("--config_file") + 1] == str(path.resolve())
    assert argv[argv.index("--num_processes") + 1] == "2"
    assert "--multi_gpu" not in argv and "--cpu" not in argv  # the file's distributed_type decides


@pytest.mark.parametrize(
    ("changes", "launcher_changes", "expected"),
    [
        (
            {"num_processes": 8},
            {},
            "sets num_processes: 8 but launcher.num_processes × launcher.num_machines is 2: "
            "pass launcher.num_processes=8",
        ),
        ({"num_processes": 8, "num_machines": 2}, {"num_machines": 2}, "is 4: pass launcher.num_processes=4"),
        (
            {"mixed_precision": "bf16"},
            {},
            "sets mixed_precision: bf16 but launcher.mixed_precision is fp32: "
            "pass launcher.mixed_precision=bf16",
        ),
        (
            {"main_process_port": 29501},
            {"main_process_port": 29600},
            "sets main_process_port: 29501 but launcher.main_process_port is 29600",
        ),
    ],
)
def test_a_yaml_value_that_differs_from_the_launcher_is_a_conflict(
    tmp_path, changes, launcher_changes, expected
):
    path = _yaml(tmp_path, **changes)
    (conflict,) = launch_file_conflicts(
        _launcher(path, **launcher_changes), read_launch_file(str(path)), ALGO
    )
    assert expected in conflict, conflict


def test_address_and_port_come_from_the_file_unless_the_launcher_sets_them(tmp_path: Path):
    path = _yaml(tmp_path, main_process_ip="10.0.0.7", main_process_port=29501)
    argv = launch_command(_launcher(path), tmp_path / "resolved.yaml")
    assert (
        "--main_process_ip" not in argv and "--main_process_port" not in argv
    )  # accelerate reads the file's
    argv = launch_command(_launcher(path, main_process_port=29501), tmp_path / "resolved.yaml")
    assert argv[argv.index("--main_process_port") + 1] == "29501"


def test_a_deepspeed_json_turns_deepspeed_on_with_its_file(tmp_path: Path):
    path = _json(tmp_path, {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"})
    launcher = _launcher(path)
    user = read_launch_file(str(path))
    assert user.kind == "deepspeed" and user.uses_deepspeed
    assert launch_file_conflicts(launcher, user, ALGO) == []
    argv = launch_command(launcher, tmp_path / "resolved.yaml")
    assert (
        argv[argv.index("--deepspeed_config_file") + 1] == str(path.resolve()) and "--use_deepspeed" in argv
    )


def test_deepspeed_settings_rlgen_owns_must_agree(tmp_path: Path):
    path = _json(
        tmp_path,
        {
            "optimizer": {"type": "AdamW"},
            "gradient_accumulation_steps": 4,
            "train_micro_batch_size_per_gpu": 8,
            "train_batch_size": 8,
            "gradient_clipping": 0.5,
            "bf16": {"enabled": True},
        },
    )
    conflicts = launch_file_conflicts(_launcher(path), read_launch_file(str(path)), ALGO)
    expected = [  # train_batch_size 8 = algo.train_batch_size 4 × 2 processes agrees
        'has a DeepSpeed "optimizer" section', "sets gradient_accumulation_steps: 4",
        "sets train_micro_batch_size_per_gpu: 8 but algo.train_batch_size is 4",
        "sets gradient_clipping: 0.5 but algo.max_grad_norm is 1.0",
        "sets bf16.enabled: true but launcher.mixed_precision is fp32",
    ]  # fmt: skip
    assert len(conflicts) == len(expected) and all(e in c for e, c in zip(expected, conflicts)), conflicts


def test_an_accelerate_yaml_naming_a_deepspeed_json_checks_that_json(tmp_path: Path):
    ds = _json(tmp_path, {"gradient_accumulation_steps": 2})
    path = _yaml(tmp_path, distributed_type="DEEPSPEED", deepspeed_config={"deepspeed_config_file": str(ds)})
    user = read_launch_file(str(path))
    assert user.uses_deepspeed
    (conflict,) = launch_file_conflicts(_launcher(path), user, ALGO)
    assert "gradient_accumulation_steps: 2" in conflict


def test_unreadable_or_missing_files_are_user_errors(tmp_path: Path):
    with pytest.raises(UserError, match="no such file"):
        read_launch_file(str(tmp_path / "missing.yaml"))
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(UserError, match="must hold a mapping"):
        read_launch_file(str(tmp_path / "list.yaml"))
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(UserError, match="not readable JSON"):
        read_launch_file(str(tmp_path / "bad.json"))


def test_launcher_local_refuses_a_config_file():
    with pytest.raises(UserError, match="add launcher=accelerate"):
        LauncherConfig(name="local", config_file="accelerate.yaml")


def test_a_conflicting_file_stops_the_cli_with_exit_2_before_any_worker(cli, tmp_path: Path):
    path = _yaml(tmp_path, num_processes=4)
    code, out = cli(
        "train",
        "launcher=accelerate",
        "launcher.num_processes=2",
        f"launcher.config_file={path}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert code == 2 and "sets num_processes: 4" in out and "launcher.num_processes=4" in out, out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    code, out = cli("train", f"launcher.config_file={path}", f"hydra.run.dir={tmp_path / 'local'}")
    assert code == 2 and "add launcher=accelerate" in out, out


@pytest.mark.slow
def test_a_two_process_accelerate_yaml_trains_one_epoch(cli, tmp_path: Path):
    from tests.distributed.test_ddp_equivalence import GEOMETRY

    path = _yaml(tmp_path)
    run = tmp_path / "run"
    code, out = cli(
        "train",
        *GEOMETRY,
        "launcher=accelerate",
        "launcher.num_processes=2",
        f"launcher.config_file={path}",
        f"hydra.run.dir={run}",
    )
    assert code == 0, out
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["num_groups"] == 2  # both ranks' groups were gathered: two processes ran
    assert (run / "checkpoints" / "epoch_000001" / "weights").is_dir()


# -- an accelerate config's own deepspeed_config section, YAML booleans, engines and exact reduction -----


def _deepspeed_yaml(tmp_path: Path, **section) -> Path:
    """An accelerate config running DeepSpeed from its own ``deepspeed_config`` section (no JSON)."""
    inline = {"zero_stage": 2, "offload_optimizer_device": "none", "zero3_init_flag": False, **section}
    return _yaml(tmp_path, distributed_type="DEEPSPEED", deepspeed_config=inline)


def test_an_accelerate_yamls_own_deepspeed_settings_are_checked_as_a_jsons(tmp_path: Path):
    """accelerate hands ``deepspeed_config.gradient_accumulation_steps`` / ``gradient_clipping`` to the
    engine (the audit saw the engine accumulate 4 backwards per step, unasked): refused as in a JSON."""
    path = _deepspeed_yaml(tmp_path, gradient_accumulation_steps=4, gradient_clipping=100.0)
    conflicts = launch_file_conflicts(_launcher(path), read_launch_file(str(path)), ALGO)
    expected = [
        "deepspeed_config sets gradient_accumulation_steps: 4; rlgen accumulates micro-batches itself",
        "deepspeed_config sets gradient_clipping: 100.0 but algo.max_grad_norm is 1.0: remove it from "
        "deepspeed_config",
    ]
    assert len(conflicts) == len(expected) and all(e in c for e, c in zip(expected, conflicts)), conflicts
    agrees = _deepspeed_yaml(tmp_path, gradient_accumulation_steps=1, gradient_clipping=1.0)
    assert launch_file_conflicts(_launcher(agrees), read_launch_file(str(agrees)), ALGO) == []


def test_unquoted_mixed_precision_no_is_fp32(tmp_path: Path):
    """``mixed_precision: no`` unquoted is YAML's false: accelerate's "no", i.e. launcher.mixed_precision=fp32
    (the fix it names is a value rlgen takes, never ``launcher.mixed_precision=False``)."""
    path = tmp_path / "accelerate.yaml"
    path.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: no\n")
    assert read_launch_file(str(path)).settings["mixed_precision"] is False
    assert launch_file_conflicts(_launcher(path), read_launch_file(str(path)), ALGO) == []
    (conflict,) = launch_file_conflicts(
        _launcher(path, mixed_precision="bf16"), read_launch_file(str(path)), ALGO
    )
    assert "sets mixed_precision: fp32" in conflict and "pass launcher.mixed_precision=fp32" in conflict
    assert "False" not in conflict, conflict


def test_an_engine_file_turns_the_default_exact_reduction_off_and_refuses_it_set(tmp_path: Path):
    """launcher.exact_reduction=null resolves to off under an engine the file names (DeepSpeed reduces the
    gradients itself), so the default launch is not stopped for a setting the user never made; =true is a
    conflict of the file, before any worker starts."""
    deepspeed = _json(tmp_path, {"zero_optimization": {"stage": 2}})
    fsdp = tmp_path / "fsdp.yaml"
    fsdp.write_text(yaml.safe_dump({**TWO_PROCESSES, "distributed_type": "FSDP"}))
    ddp = _yaml(tmp_path)
    assert _launcher(deepspeed).engine == "deepspeed" and not _launcher(deepspeed).reduces_exactly
    assert _launcher(fsdp).engine == "fsdp" and not _launcher(fsdp).reduces_exactly
    assert _launcher(ddp).engine is None and _launcher(ddp).reduces_exactly
    assert not LauncherConfig(name="deepspeed_zero2", num_processes=2).reduces_exactly
    (conflict,) = launch_file_conflicts(
        _launcher(deepspeed, exact_reduction=True), read_launch_file(str(deepspeed)), ALGO
    )
    assert "runs deepspeed" in conflict and "launcher.exact_reduction=false" in conflict, conflict
    assert launch_file_conflicts(_launcher(deepspeed), read_launch_file(str(deepspeed)), ALGO) == []


def test_an_inline_deepspeed_conflict_stops_the_cli_with_exit_2_before_any_worker(cli, tmp_path: Path):
    path = _deepspeed_yaml(tmp_path, gradient_accumulation_steps=4)
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "num_processes": 1}))
    code, out = cli(
        "train",
        "launcher=accelerate",
        "launcher.num_processes=1",
        f"launcher.config_file={path}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    flat = " ".join(out.split())
    assert code == 2 and "deepspeed_config sets gradient_accumulation_steps: 4" in flat, out
    assert "num_processes" not in flat, out  # the one conflict, named alone
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
