"""``algo.prompts_per_draw``: Flow-GRPO's prompt sampler (a fresh random set of prompts per sampling batch)
next to rlgen's passes without replacement (``data/sampler.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlgen_cli.data.sampler import GroupSampler
from rlgen_cli.errors import UserError
from tests.conftest import TINY_RUN


def upstream_batches(
    dataset_size: int, per_batch: int, batches: int, seed: int, epoch: int
) -> list[list[int]]:
    """Flow-GRPO's DistributedKRepeatSampler as its scripts drive it: before batch i of an epoch,
    ``set_epoch(epoch · num_batches_per_epoch + i)``; the batch's prompts are the first m of
    ``randperm(len(dataset))`` from a generator seeded ``seed + that epoch``."""
    out = []
    for i in range(batches):
        generator = torch.Generator()
        generator.manual_seed(seed + epoch * batches + i)
        out.append(torch.randperm(dataset_size, generator=generator)[:per_batch].tolist())
    return out


@pytest.mark.parametrize("epoch", [0, 3])
def test_an_epoch_draws_upstreams_prompt_sets_batch_by_batch(epoch: int):
    sampler = GroupSampler(10, 6, 4, seed=7, prompts_per_draw=2)
    expected = [i for batch in upstream_batches(10, 2, 3, seed=7, epoch=epoch) for i in batch]
    assert sampler.prompt_indices_for_epoch(epoch) == expected
    # each prompt's group: K = 4 samples in a row, as with passes
    assert sampler.global_indices_for_epoch(epoch) == [i for i in expected for _ in range(4)]


def test_a_prompt_can_come_twice_in_an_epoch_and_passes_never_repeat_one():
    drawn = GroupSampler(5, 4, 2, seed=0, prompts_per_draw=2)
    passes = GroupSampler(8, 4, 2, seed=0)  # 8 prompts: every epoch inside one pass
    repeats = [e for e in range(20) if len(set(drawn.prompt_indices_for_epoch(e))) < 4]
    assert repeats, "4 prompts in 2 draws of 2 out of 5: some epoch of 20 must repeat a prompt"
    assert all(len(set(passes.prompt_indices_for_epoch(e))) == 4 for e in range(20))


def test_the_draws_do_not_depend_on_the_process_count():
    one = GroupSampler(12, 4, 4, seed=3, prompts_per_draw=2)
    ranks = [GroupSampler(12, 4, 4, seed=3, num_replicas=2, rank=r, prompts_per_draw=2) for r in range(2)]
    for epoch in range(3):
        dealt = sorted(
            (p, i) for s in ranks for p, i in zip(s.positions(4), s.indices_for_epoch(epoch, 4), strict=True)
        )
        assert [i for _, i in dealt] == one.global_indices_for_epoch(epoch)


def test_a_draw_that_cannot_cut_the_epoch_is_refused():
    with pytest.raises(ValueError, match="must divide prompts_per_step = 6"):
        GroupSampler(10, 6, 4, prompts_per_draw=4)


def test_a_draw_larger_than_the_dataset_says_how_to_fix_it():
    with pytest.raises(UserError, match="data.train has 10; set algo.prompts_per_draw to a divisor"):
        GroupSampler(10, 12, 4, prompts_per_draw=12)


@pytest.mark.slow  # the refusal comes once the data and the tiny model are loaded: ~20 s
def test_the_cli_refuses_a_draw_larger_than_the_dataset_with_exit_2(cli, tmp_path: Path, capsys):
    code, out = cli(
        "train",
        *TINY_RUN,
        "algo.prompts_per_epoch=32",
        "algo.prompts_per_draw=32",
        "epochs=1",
        f"hydra.run.dir={tmp_path}",
    )
    assert code == 2, out
    assert (
        "algo.prompts_per_draw=32 draws that many distinct prompts per sampling batch, but data.train has 16"
        in (" ".join((out + capsys.readouterr().err).split()))
    )


def test_resume_checks_the_draw_and_reads_old_checkpoints_as_passes():
    drawn = GroupSampler(10, 6, 4, prompts_per_draw=2)
    drawn.set_epoch(5)
    again = GroupSampler(10, 6, 4, prompts_per_draw=2)
    again.load_state_dict(drawn.state_dict())
    assert again.epoch == 5
    old = {k: v for k, v in GroupSampler(10, 6, 4).state_dict().items() if k != "prompts_per_draw"}
    GroupSampler(10, 6, 4).load_state_dict(old)  # a checkpoint from before the option: passes
    with pytest.raises(ValueError, match="prompts_per_draw"):
        drawn.load_state_dict(old)


def test_the_config_refuses_a_draw_that_does_not_divide_the_epoch(cli, tmp_path: Path, capsys):
    code, out = cli(
        "train",
        "experiment=tiny_cpu",
        "algo.prompts_per_epoch=2",
        "algo.prompts_per_draw=3",
        f"hydra.run.dir={tmp_path}",
    )
    assert code == 2, out
    assert (
        "algo.prompts_per_draw=3 must be null or a positive divisor of algo.prompts_per_epoch (2)"
        in " ".join((out + capsys.readouterr().err).split())
    )


@pytest.mark.slow  # two tiny epochs, ~30 s on two cores
def test_a_prompt_drawn_twice_trains_as_one_group(cli, tmp_path: Path):
    """Seed 1, 16 tiny prompts, two draws of one: epoch 0 draws two prompts, epoch 1 the same one twice,
    whose 8 samples form one group (upstream groups by prompt too)."""
    sampler = GroupSampler(16, 2, 4, seed=1, prompts_per_draw=1)
    assert [len(set(sampler.prompt_indices_for_epoch(e))) for e in (0, 1)] == [2, 1]
    code, out = cli(
        "train",
        *TINY_RUN,
        "seed=1",
        "algo.prompts_per_draw=1",
        "algo.group_size=4",
        "epochs=2",
        "eval_every=0",
        "images_every=0",
        "algo.gradient_accumulation_steps=2",
        f"hydra.run.dir={tmp_path}",
    )
    assert code == 0, out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["num_groups"] for row in rows] == [2, 1]
