"""Process-count invariance of R3: the same config on 1, 2 and 4 processes, bit for bit.

The step is stated globally: ``r3.prompts_per_step=2`` prompts × ``r3.group_size=4`` branches = 8
branches, dealt in equal consecutive shares — one process holds both groups, two hold one group each,
four hold half a group each (a group spanning two processes, upstream's policy group) — so all three ways
a process can hold branches are compared. ``r3.micro_batch_size=2`` gives every process count the same
forwards. A text micro-batch samples under the seed of its first branch's global position, initial noise
and the SDE step are keyed by the group, rewards are gathered in global order before the group
statistics, each micro-batch's loss is weighted by its share of the step's branches over all processes,
and gradients are summed in float64 once per step (``recipes/r3.py``, ``launcher.exact_reduction``).
Two steps run both stages: reason (step 0) and refine (step 1, from the buffer step 0 filled). The text
policy is warm-started to write a closed plan or a bare one, so the text track has rewards and the refine
stage edits: text policy, generator and editor all train. The failing
arm: DDP's own float32 all-reduce (``launcher.exact_reduction=false``) gives the same samples but other
weights. The single-process runs compute with one thread, as launched workers do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_cli
from tests.distributed.test_process_invariance import one_thread
from tests.r3.conftest import TINY_R3, warm_text_overrides

GEOMETRY = ["epochs=2", "r3.prompts_per_step=2", "r3.group_size=4", "r3.micro_batch_size=2"]
WEIGHTS = {
    "text": "text/adapter_model.safetensors",
    "generator": "generator/pytorch_lora_weights.safetensors",
    "editor": "editor/pytorch_lora_weights.safetensors",
}
CHECKPOINT = Path("checkpoints") / "epoch_000002" / "weights"
SAMPLE_KEYS = ("step", "stage", "group", "position", "index", "prompt", "text", "sde_step", "noise_sum",
               "reward_image", "reward_text", "format")  # fmt: skip
METRIC_KEYS = ("stage", "reward/mean", "reward/std", "reward/text/mean", "reward/text/std",
               "advantage/text/abs_mean", "advantage/image/abs_mean", "buffer/size", "grad_norm",
               "global_step")  # fmt: skip


def _processes(n: int) -> list[str]:
    return [] if n == 1 else ["launcher=accelerate", f"launcher.num_processes={n}"]


def _train(run: Path, warm: Path, *overrides: str) -> Path:
    with one_thread():
        code, out = run_cli(
            "train", *TINY_R3, *warm_text_overrides(warm), *GEOMETRY, *overrides, f"hydra.run.dir={run}"
        )
    assert code == 0, out
    return run


def _samples(run: Path) -> list[dict]:
    """Every branch of every step, from all ranks' sample logs, in (step, global position) order."""
    rows = [json.loads(line) for path in (run / "samples").glob("rank_*.jsonl") for line in path.open()]
    return sorted(({k: r[k] for k in SAMPLE_KEYS} for r in rows), key=lambda r: (r["step"], r["position"]))


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return {
        f"{part}.{name}": tensor
        for part, file in WEIGHTS.items()
        for name, tensor in load_file(run / CHECKPOINT / file).items()
    }


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _assert_same_run(one: Path, other: Path) -> None:
    assert _samples(one) == _samples(other)  # texts, rewards, prompts, SDE steps, noise: identical
    for a, b in zip(_metrics(one), _metrics(other), strict=True):
        for key in METRIC_KEYS:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    first, second = _weights(one), _weights(other)
    assert all(torch.equal(first[k], second[k]) for k in first), _max_difference(first, second)


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> Path:
    """The tiny Qwen2.5-VL warm-started on a well-formed and a bare plan (``tests/r3/_warm_start.py``):
    its reason groups mix rewarded and unrewarded texts, and its bare reflections ask for edits."""
    from tests.r3._warm_start import PLAN, warm_started_text_policy

    return warm_started_text_policy(tmp_path_factory.mktemp("warm_text"), plans=(PLAN, "a cat"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warm: Path) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("r3_invariance")
    return {n: _train(root / str(n), warm, *_processes(n)) for n in (1, 2)}


@pytest.mark.slow  # ~60 s: the warm start, a run on one process and one on two
def test_two_processes_give_the_same_run_bit_for_bit(runs: dict[int, Path]):
    samples = _samples(runs[2])
    assert len(samples) == 16 and [r["stage"] for r in samples] == ["reason"] * 8 + ["refine"] * 8
    assert {r["group"] for r in samples} == {0, 1}  # two groups per step, one per process here
    assert any(r["reward_text"] != 0 for r in samples)  # the text track has a signal
    weights = _weights(runs[2])
    for part in WEIGHTS:  # every part trained: its LoRA B (zero at the start) moved
        assert any(
            v.abs().max() > 0 for k, v in weights.items() if k.startswith(f"{part}.") and "lora_B" in k
        )
    _assert_same_run(runs[1], runs[2])


@pytest.mark.slow  # ~30 s: four processes, each half a group
def test_four_processes_give_the_same_run_bit_for_bit(runs: dict[int, Path], tmp_path: Path, warm: Path):
    four = _train(tmp_path, warm, *_processes(4))
    assert {r["position"] for r in _samples(four) if r["step"] == 1} == set(range(8))
    _assert_same_run(runs[1], four)


@pytest.mark.slow  # ~25 s: the arm that shows the tests above can fail
def test_float32_all_reduce_breaks_bit_equality(runs: dict[int, Path], tmp_path: Path, warm: Path):
    inexact = _train(tmp_path, warm, *_processes(2), "launcher.exact_reduction=false")
    reason = [r for r in _samples(inexact) if r["step"] == 1]
    assert reason == [r for r in _samples(runs[1]) if r["step"] == 1]  # the same first rollout
    assert _max_difference(_weights(runs[1]), _weights(inexact)) > 0


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["launcher.num_processes=3"], "8 branches per step cannot be split over 3 processes"),
        (
            ["launcher.num_processes=2", "r3.prompts_per_step=3", "r3.group_size=2"],
            "mixing parts of different",
        ),
        (
            ["launcher.num_processes=4", "r3.micro_batch_size=4"],
            "r3.micro_batch_size (4) must divide the 2",
        ),
    ],
)
def test_an_impossible_split_stops_with_exit_code_2(overrides: list[str], message: str, tmp_path: Path):
    code, out = run_cli(
        "train", *TINY_R3, *GEOMETRY, "launcher=accelerate", *overrides, f"hydra.run.dir={tmp_path}"
    )
    assert code == 2 and message in " ".join(out.split()), out


def test_each_process_holds_consecutive_whole_groups_or_part_of_one():
    from rlgen_cli.recipes.r3 import local_groups
    from rlgen_cli.schema.r3 import R3Config, r3_geometry

    r3 = R3Config(prompts_per_step=2, group_size=4)
    split = {n: [local_groups(r3_geometry(r3, n), rank) for rank in range(n)] for n in (1, 2, 4)}
    layout = {
        n: [[(g.group, g.rows, g.positions) for g in rank] for rank in ranks] for n, ranks in split.items()
    }
    assert layout[1] == [[(0, slice(0, 4), [0, 1, 2, 3]), (1, slice(4, 8), [4, 5, 6, 7])]]  # both groups
    assert layout[2] == [[(0, slice(0, 4), [0, 1, 2, 3])], [(1, slice(0, 4), [4, 5, 6, 7])]]  # one each
    assert layout[4] == [  # half a group each: group 0 over processes 0 and 1, group 1 over 2 and 3
        [(0, slice(0, 2), [0, 1])],
        [(0, slice(0, 2), [2, 3])],
        [(1, slice(0, 2), [4, 5])],
        [(1, slice(0, 2), [6, 7])],
    ]
    geometry = r3_geometry(r3, 4)
    shape = (geometry.per_process, geometry.group_share, geometry.ranks_per_group, geometry.micro_batch)
    assert shape == (2, 2, 2, 2)  # micro-batch null = a process's part of a group


def test_a_null_micro_batch_over_a_split_group_warns_or_is_refused(caplog):
    """Null micro-batches hold a process's part of a group: 2 branches per forward on 4 processes, 4 on
    one, so the run is not the one-process run. A warning under the default exact_reduction (null), a
    refusal naming the micro-batch that fixes it under true; whole groups per process say nothing."""
    from rlgen_cli.errors import UserError
    from rlgen_cli.schema.r3 import R3Config, r3_geometry, require_same_forwards

    split = r3_geometry(R3Config(prompts_per_step=2, group_size=4), 4)
    with caplog.at_level("WARNING", logger="rlgen_cli.schema.r3"):
        require_same_forwards(split, None)
    assert "Set r3.micro_batch_size=2 for the same run" in caplog.text
    with pytest.raises(UserError, match="Set r3.micro_batch_size=2 for the same run"):
        require_same_forwards(split, True)
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlgen_cli.schema.r3"):
        require_same_forwards(
            r3_geometry(R3Config(prompts_per_step=2, group_size=4), 2), True
        )  # whole groups
        require_same_forwards(
            r3_geometry(R3Config(prompts_per_step=2, group_size=4, micro_batch_size=2), 4), True
        )
    assert caplog.text == ""
