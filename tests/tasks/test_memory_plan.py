"""The memory planner's arithmetic against hand-computed values, and its suggestions.

Every expected number below is worked out in the comment above it from the module docstring's table of
``training/memory/plan.py``; a perturbation arm shows each test can fail.
"""

from __future__ import annotations

import pytest

from rlgen_cli.training.memory.plan import (
    COMMON_DEVICES_GB,
    GIB,
    Activations,
    Epoch,
    Launch,
    ParamGroup,
    Training,
    device_fits,
    plan_memory,
    smallest_device,
    smallest_fix,
)

BILLION = 1_000_000_000
NO_ACTIVATIONS = Activations(0, 0, 0, 0)
NO_EPOCH = Epoch.of_activations(NO_ACTIVATIONS)


def _rows(plan) -> dict[str, int]:
    return {row.what.split(" (")[0]: row.nbytes for row in plan.rows}


def _full_ft_1b() -> list[ParamGroup]:
    return [ParamGroup("transformer", "float32", BILLION, trainable=True)]


def test_1b_full_fine_tuning_with_adamw_under_zero2_on_4_processes():
    # weights 4 GB whole; gradients 4 GB / 4 = 1 GB; AdamW 8 GB / 4 = 2 GB; fp32 master 4 GB / 4 = 1 GB;
    # reduce bucket min(1e9, 5e8) × 4 B = 2 GB; KL reference 4 GB (full FT): 4 + 1 + 2 + 1 + 2 + 4 = 14 GB
    plan = plan_memory(
        _full_ft_1b(), NO_ACTIVATIONS, Launch("zero2", 4), Training(1, full_reference=True), NO_EPOCH
    )
    rows = _rows(plan)
    assert rows["trainable weights"] == 4 * BILLION
    assert rows["gradients"] == BILLION
    assert rows["optimizer states"] == 2 * BILLION
    assert rows["fp32 master copy"] == BILLION
    assert rows["DeepSpeed reduce bucket"] == 2 * BILLION
    assert rows["KL reference copy"] == 4 * BILLION
    assert plan.total == 14 * BILLION


def test_the_same_run_under_ddp_keeps_everything_whole_plus_buckets():
    # 4 weights + 4 DDP buckets + 8 AdamW + 4 reference = 20 GB between steps (the gradients live in the
    # step, whose peak this epoch leaves at 0)
    full_ft = Training(1, full_reference=True)
    plan = plan_memory(_full_ft_1b(), NO_ACTIVATIONS, Launch("ddp", 4), full_ft, NO_EPOCH)
    assert plan.total == 20 * BILLION
    assert "gradients" not in _rows(plan)
    # one process: no buckets (no all-reduce), 16 GB
    alone = plan_memory(_full_ft_1b(), NO_ACTIVATIONS, Launch("local", 1), full_ft, NO_EPOCH)
    assert alone.total == 16 * BILLION
    # float64 gradient sums over 3 tensors: 8 B × (1e9 + 3) more
    exact = plan_memory(
        _full_ft_1b(),
        NO_ACTIVATIONS,
        Launch("local", 1),
        Training(1, full_reference=True, exact_sum_tensors=3),
        NO_EPOCH,
    )
    assert _rows(exact)["float64 gradient sums"] == 8 * (BILLION + 3)
    assert exact.total == 24 * BILLION + 24


def test_zero3_shards_the_trained_model_but_not_the_text_encoder():
    # LoRA on a 2e9-parameter bf16 transformer (4 GB) with a 1e9 bf16 text encoder (2 GB), 1e8 LoRA params
    groups = [
        ParamGroup("transformer", "bfloat16", 2 * BILLION),
        ParamGroup("transformer", "float32", 100_000_000, trainable=True, lora=True),
        ParamGroup("text_encoder", "bfloat16", BILLION),
    ]
    training = Training(1, trained=("transformer",), largest_block_bytes=100_000_000)
    rows = _rows(plan_memory(groups, NO_ACTIVATIONS, Launch("zero3", 8), training, NO_EPOCH))
    assert rows["transformer weights"] == 4 * BILLION // 8
    assert rows["text_encoder weights"] == 2 * BILLION
    assert rows["LoRA weights"] == 400_000_000 // 8
    assert rows["optimizer states"] == 800_000_000 // 8
    assert rows["gathered blocks"] == 200_000_000
    assert "KL reference copy" not in rows  # LoRA: the reference is the adapter switched off


def test_ema_is_whole_on_every_process_and_offload_empties_the_optimizer():
    groups = [ParamGroup("transformer", "float32", 1000, trainable=True, lora=True)]
    rows = _rows(
        plan_memory(
            groups,
            NO_ACTIVATIONS,
            Launch("zero2", 4, offload_optimizer=True),
            Training(1, ema=True),
            NO_EPOCH,
        )
    )
    assert rows["EMA shadows"] == 4000
    assert rows["optimizer states"] == 0
    assert rows["fp32 master copy"] == 0
    assert rows["gradients"] == 1000


def test_activations_follow_the_micro_batch_and_checkpointing():
    # traced: 100 + 50·b plain, 40 + 10·b checkpointed
    acts = Activations.from_two(1, (150, 50), 4, (300, 80))
    assert (acts.fixed, acts.per_sample, acts.checkpointed_fixed, acts.checkpointed_per_sample) == (
        100,
        50,
        40,
        10,
    )
    groups = [ParamGroup("transformer", "float32", 10, trainable=True)]
    epoch = Epoch.of_activations(acts)
    plain = plan_memory(groups, acts, Launch("local"), Training(8), epoch)
    checkpointed = plan_memory(groups, acts, Launch("local"), Training(8, gradient_checkpointing=True), epoch)
    assert plain.total - checkpointed.total == (100 + 50 * 8) - (40 + 10 * 8)


def test_the_epoch_peaks_at_the_larger_of_its_rollout_and_its_update():
    # 16 samples over 2 processes: 8 each, kept 100 B each; rollout batches of 4 peak at 1000 + 10·b,
    # a training step at 50·B. Rollout: max((8 − 4)·100 + 1040, 2·8·100) = 1600 (the concatenation);
    # update: 2·8·100 + 50·2 = 1700. State: 40 B of LoRA + 80 B of AdamW + 40 B of DDP buckets
    groups = [ParamGroup("transformer", "float32", 10, trainable=True, lora=True)]
    epoch = Epoch(16, 100, lambda b: 1000 + 10 * b, lambda b, ckpt: 50 * b)
    plan = plan_memory(groups, NO_ACTIVATIONS, Launch("ddp", 2), Training(2, sample_batch=4), epoch)
    rollout, update = (row.nbytes for row in plan.peaks)
    assert (rollout, update) == (1600, 1700)
    assert plan.state == 40 + 80 + 40
    assert plan.total == plan.state + 1700 and plan.peak.what.startswith("training step")
    # one process, batches of 8: rollout max((16 − 8)·100 + 1080, 2·16·100) = 3200, update 3200 + 100 = 3300
    alone = plan_memory(groups, NO_ACTIVATIONS, Launch("local"), Training(2, sample_batch=8), epoch)
    assert [row.nbytes for row in alone.peaks] == [3200, 3300]


def test_with_ema_an_evaluation_backs_the_live_weights_up_while_it_samples():
    # 10 trainable fp32 parameters: the backup is 40 B; a rollout batch of 4 peaks at 1040 B: 1080 B
    groups = [ParamGroup("transformer", "float32", 10, trainable=True, lora=True)]
    epoch = Epoch(16, 100, lambda b: 1000 + 10 * b, lambda b, ckpt: 50 * b)
    plan = plan_memory(groups, NO_ACTIVATIONS, Launch("local"), Training(2, sample_batch=4, ema=True), epoch)
    assert [row.nbytes for row in plan.peaks][2] == 40 + 1040
    # perturbation arm: without EMA there is no third phase
    assert (
        len(plan_memory(groups, NO_ACTIVATIONS, Launch("local"), Training(2, sample_batch=4), epoch).peaks)
        == 2
    )


def test_a_rollout_that_does_not_fit_gets_a_smaller_sampling_batch():
    # kept samples cost nothing; a rollout batch of b peaks at b GiB, a training step at 1 GiB; 10 GiB with
    # 10 % headroom leaves 9 GiB: batches of 16 do not fit, of 8 they do (the largest divisor of 16 that fits)
    groups = [ParamGroup("transformer", "float32", 10, trainable=True, lora=True)]
    epoch = Epoch(16, 0, lambda b: b * GIB, lambda b, ckpt: GIB)
    fix = smallest_fix(
        groups, NO_ACTIVATIONS, Launch("local"), Training(1, sample_batch=16), epoch, 10 * GIB, 0.1
    )
    assert fix is not None and fix.fits
    assert fix.how == ("algo.sample_batch_size=8",)
    # perturbation arm: when the training step is what does not fit, the sampling batch is not offered
    heavy_step = Epoch(16, 0, lambda b: b * GIB // 4, lambda b, ckpt: 20 * GIB)
    fix = smallest_fix(
        groups, NO_ACTIVATIONS, Launch("local"), Training(1, sample_batch=16), heavy_step, 10 * GIB, 0.1
    )
    assert fix is not None and not any("sample_batch_size" in how for how in fix.how)


def _lora_run(activation_per_sample: int) -> tuple[list[ParamGroup], Activations]:
    groups = [
        ParamGroup("transformer", "bfloat16", 4 * BILLION),  # 8 GB frozen
        ParamGroup("transformer", "float32", 50_000_000, trainable=True, lora=True),  # 0.2 GB
    ]
    return groups, Activations(0, activation_per_sample, 0, activation_per_sample // 10)


def test_a_run_that_fits_needs_no_change():
    groups, acts = _lora_run(GIB)
    assert (
        smallest_fix(groups, acts, Launch("local"), Training(4), Epoch.of_activations(acts), 80 * GIB, 0.1)
        is None
    )


def test_checkpointing_is_tried_before_a_smaller_micro_batch():
    # 8 GB + 0.2 + 0.2 grads + 0.4 AdamW ≈ 8.8 GB of state; 8 samples × 10 GiB = 80 GiB of activations:
    # checkpointing keeps 8 GiB of them, which fits 40 GiB with 10 % headroom
    groups, acts = _lora_run(10 * GIB)
    fix = smallest_fix(groups, acts, Launch("local"), Training(8), Epoch.of_activations(acts), 40 * GIB, 0.1)
    assert fix is not None and fix.fits
    assert fix.how == ("model.gradient_checkpointing=true",)
    # already checkpointed: the largest micro-batch that fits, with the accumulation keeping the batch
    flat = Activations(0, 10 * GIB, 0, 10 * GIB)
    fix = smallest_fix(
        groups, flat, Launch("local"), Training(8, accumulation=2), Epoch.of_activations(flat), 40 * GIB, 0.1
    )
    assert fix is not None and fix.fits
    assert fix.how == ("algo.train_batch_size=2", "algo.gradient_accumulation_steps=8")


def test_several_processes_take_the_first_change_that_fits_in_order_of_cost():
    # full FT of 1e9 params under DDP on 2 processes: 4 weights + 4 buckets + 8 AdamW + 4 reference
    # = 20e9 B > 14.4 GiB usable of 16 (the gradients are the step's). ZeRO-2: 4 + 2 gradients (a partition
    # kept between steps) + 2 bucket + 4 + 2 master + 4 = 18e9 (16.8 GiB), no;
    # no activations to checkpoint, micro-batch 1 already; ZeRO-3: 2 + 2 + 2 + 4 + 2 + 4 = 16e9 (14.9 GiB),
    # no; offload under ZeRO-2: 4 + 2 + 2 + 0 + 0 + 4 = 12e9 (11.2 GiB): fits
    fix = smallest_fix(
        _full_ft_1b(),
        NO_ACTIVATIONS,
        Launch("ddp", 2),
        Training(1, full_reference=True),
        NO_EPOCH,
        16 * GIB,
        0.1,
    )
    assert fix is not None and fix.fits
    assert fix.plan.launch == Launch("zero2", 2, offload_optimizer=True)
    assert fix.plan.total == 12 * BILLION
    # with 20 GiB (18 usable): DDP's 20e9 B (18.6 GiB) does not fit, ZeRO-2 alone (16.8 GiB) does
    fix = smallest_fix(
        _full_ft_1b(),
        NO_ACTIVATIONS,
        Launch("ddp", 2),
        Training(1, full_reference=True),
        NO_EPOCH,
        20 * GIB,
        0.1,
    )
    assert fix is not None and fix.how == ("launcher=deepspeed_zero2",)
    assert fix.plan.total == 18 * BILLION


@pytest.mark.parametrize("device_gib", [1, 4])
def test_nothing_fits_a_too_small_device_and_says_so(device_gib):
    groups, acts = _lora_run(GIB)
    fix = smallest_fix(
        groups, acts, Launch("local"), Training(4), Epoch.of_activations(acts), device_gib * GIB, 0.1
    )
    # 8 GB of frozen weights on one process: only more processes (with ZeRO-3) can help
    assert fix is not None
    assert any("processes" in change for change in fix.changes)
    assert fix.plan.launch.processes > 1
    assert fix.fits == (fix.plan.total <= device_gib * GIB * 0.9)


# -- the smallest common device ------------------------------------------------------------------------
def _frozen_and_lora(frozen_gib: int) -> tuple[list[ParamGroup], Epoch]:
    """A frozen bf16 transformer of ``frozen_gib`` GiB and a ¼ GiB fp32 LoRA (AdamW ½ GiB); a step of 4
    samples keeps 2 GiB each, ¼ GiB with gradient checkpointing: 8 GiB plain, 1 GiB checkpointed."""
    groups = [
        ParamGroup("transformer", "bfloat16", frozen_gib * GIB // 2),
        ParamGroup("transformer", "float32", GIB // 16, trainable=True, lora=True),
    ]
    return groups, Epoch.of_activations(Activations(0, 2 * GIB, 0, GIB // 4))


@pytest.mark.parametrize(
    "frozen_gib, device_gb, how",
    [
        # 5 + ¼ + ½ + 8 = 13.75 GiB ≤ 0.9 × 24 = 21.6: as configured
        (5, 24, ()),
        # 15.75 + 8 = 23.75 > 21.6; checkpointed 15.75 + 1 = 16.75 ≤ 21.6
        (15, 24, ("model.gradient_checkpointing=true",)),
        # 30.75 + 1 = 31.75 > 21.6 (micro-batch 1: 31.0; offloading the ½ GiB of AdamW: 30.5), on 40 ≤ 36
        (30, 40, ("model.gradient_checkpointing=true",)),
        # 40.75 + 1 = 41.75 > 36, ≤ 43.2
        (40, 48, ("model.gradient_checkpointing=true",)),
    ],
)
def test_the_smallest_common_device_and_the_settings_it_takes(frozen_gib, device_gb, how):
    groups, epoch = _frozen_and_lora(frozen_gib)
    fit = smallest_device(groups, NO_ACTIVATIONS, Launch("local"), Training(4), epoch, headroom=0.1)
    assert (fit.device_gb, fit.how) == (device_gb, how)
    assert fit.plan.total <= 0.9 * device_gb * GIB


def test_no_common_device_holds_a_run_that_needs_more_processes():
    # 200 GiB of frozen weights: beyond 0.9 × 141 GiB whatever one process changes; more processes would
    # shard them, which is not the same run on one device
    groups, epoch = _frozen_and_lora(200)
    assert smallest_device(groups, NO_ACTIVATIONS, Launch("local"), Training(4), epoch, headroom=0.1) is None
    assert COMMON_DEVICES_GB == (24, 40, 48, 80, 141)


def test_a_larger_device_that_needs_fewer_changes_is_named_too():
    # 30.75 GiB of state and 8 GiB of step: nothing holds one process on 24 GB (checkpointed 31.75 > 21.6),
    # 40 GB with checkpointing (31.75 ≤ 36; plain 38.75 > 36), 48 GB as configured (38.75 ≤ 43.2)
    groups, epoch = _frozen_and_lora(30)
    fits = device_fits(groups, NO_ACTIVATIONS, Launch("local"), Training(4), epoch, headroom=0.1)
    assert [(fit.device_gb, fit.how) for fit in fits] == [
        (40, ("model.gradient_checkpointing=true",)),
        (48, ()),
    ]
