"""The memory planner's arithmetic against hand-computed values, and its suggestions.

Every expected number below is worked out in the comment above it from the module docstring's table of
``training/memory_plan.py``; a perturbation arm shows each test can fail.
"""

from __future__ import annotations

import pytest

from rlgen_cli.training.memory_plan import (
    GIB,
    Activations,
    Launch,
    ParamGroup,
    Training,
    plan_memory,
    smallest_fix,
)

BILLION = 1_000_000_000
NO_ACTIVATIONS = Activations(0, 0, 0, 0)


def _rows(plan) -> dict[str, int]:
    return {row.what.split(" (")[0]: row.nbytes for row in plan.rows}


def _full_ft_1b() -> list[ParamGroup]:
    return [ParamGroup("transformer", "float32", BILLION, trainable=True)]


def test_1b_full_fine_tuning_with_adamw_under_zero2_on_4_processes():
    # weights 4 GB whole; gradients 4 GB / 4 = 1 GB; AdamW 8 GB / 4 = 2 GB; fp32 master 4 GB / 4 = 1 GB;
    # reduce bucket min(1e9, 5e8) × 4 B = 2 GB; KL reference 4 GB (full FT): 4 + 1 + 2 + 1 + 2 + 4 = 14 GB
    plan = plan_memory(_full_ft_1b(), NO_ACTIVATIONS, Launch("zero2", 4), Training(1, full_reference=True))
    rows = _rows(plan)
    assert rows["trainable weights"] == 4 * BILLION
    assert rows["gradients"] == BILLION
    assert rows["optimizer states"] == 2 * BILLION
    assert rows["fp32 master copy"] == BILLION
    assert rows["DeepSpeed reduce bucket"] == 2 * BILLION
    assert rows["KL reference copy"] == 4 * BILLION
    assert plan.total == 14 * BILLION


def test_the_same_run_under_ddp_keeps_everything_whole_plus_buckets():
    # 4 weights + 4 gradients + 4 DDP buckets + 8 AdamW + 4 reference = 24 GB
    plan = plan_memory(_full_ft_1b(), NO_ACTIVATIONS, Launch("ddp", 4), Training(1, full_reference=True))
    assert plan.total == 24 * BILLION
    # one process: no buckets (no all-reduce), 20 GB
    alone = plan_memory(_full_ft_1b(), NO_ACTIVATIONS, Launch("local", 1), Training(1, full_reference=True))
    assert alone.total == 20 * BILLION


def test_zero3_shards_the_trained_model_but_not_the_text_encoder():
    # LoRA on a 2e9-parameter bf16 transformer (4 GB) with a 1e9 bf16 text encoder (2 GB), 1e8 LoRA params
    groups = [
        ParamGroup("transformer", "bfloat16", 2 * BILLION),
        ParamGroup("transformer", "float32", 100_000_000, trainable=True, lora=True),
        ParamGroup("text_encoder", "bfloat16", BILLION),
    ]
    training = Training(1, trained=("transformer",), largest_block_bytes=100_000_000)
    rows = _rows(plan_memory(groups, NO_ACTIVATIONS, Launch("zero3", 8), training))
    assert rows["transformer weights"] == 4 * BILLION // 8
    assert rows["text_encoder weights"] == 2 * BILLION
    assert rows["LoRA weights"] == 400_000_000 // 8
    assert rows["optimizer states"] == 800_000_000 // 8
    assert rows["gathered blocks"] == 200_000_000
    assert "KL reference copy" not in rows  # LoRA: the reference is the adapter switched off


def test_ema_is_whole_on_every_process_and_offload_empties_the_optimizer():
    groups = [ParamGroup("transformer", "float32", 1000, trainable=True, lora=True)]
    rows = _rows(
        plan_memory(groups, NO_ACTIVATIONS, Launch("zero2", 4, offload_optimizer=True), Training(1, ema=True))
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
    plain = plan_memory(groups, acts, Launch("local"), Training(8))
    checkpointed = plan_memory(groups, acts, Launch("local"), Training(8, gradient_checkpointing=True))
    assert plain.total - checkpointed.total == (100 + 50 * 8) - (40 + 10 * 8)


def _lora_run(activation_per_sample: int) -> tuple[list[ParamGroup], Activations]:
    groups = [
        ParamGroup("transformer", "bfloat16", 4 * BILLION),  # 8 GB frozen
        ParamGroup("transformer", "float32", 50_000_000, trainable=True, lora=True),  # 0.2 GB
    ]
    return groups, Activations(0, activation_per_sample, 0, activation_per_sample // 10)


def test_a_run_that_fits_needs_no_change():
    groups, acts = _lora_run(GIB)
    assert smallest_fix(groups, acts, Launch("local"), Training(4), 80 * GIB, 0.1) is None


def test_checkpointing_is_tried_before_a_smaller_micro_batch():
    # 8 GB + 0.2 + 0.2 grads + 0.4 AdamW ≈ 8.8 GB of state; 8 samples × 10 GiB = 80 GiB of activations:
    # checkpointing keeps 8 GiB of them, which fits 40 GiB with 10 % headroom
    groups, acts = _lora_run(10 * GIB)
    fix = smallest_fix(groups, acts, Launch("local"), Training(8), 40 * GIB, 0.1)
    assert fix is not None and fix.fits
    assert fix.how == ("model.gradient_checkpointing=true",)
    # already checkpointed: the largest micro-batch that fits, with the accumulation keeping the batch
    fix = smallest_fix(groups, Activations(0, 10 * GIB, 0, 10 * GIB), Launch("local"),
                       Training(8, accumulation=2), 40 * GIB, 0.1)  # fmt: skip
    assert fix is not None and fix.fits
    assert fix.how == ("algo.train_batch_size=2", "algo.gradient_accumulation_steps=8")


def test_several_processes_take_the_first_change_that_fits_in_order_of_cost():
    # full FT of 1e9 params under DDP on 2 processes: 4 weights + 4 grads + 4 buckets + 8 AdamW + 4 reference
    # = 24e9 B > 14.4 GiB usable of 16. ZeRO-2: 4 + 2 + 2 bucket + 4 + 2 master + 4 = 18e9 (16.8 GiB), no;
    # no activations to checkpoint, micro-batch 1 already; ZeRO-3: 2 + 2 + 2 + 4 + 2 + 4 = 16e9 (14.9 GiB),
    # no; offload under ZeRO-2: 4 + 2 + 2 + 0 + 0 + 4 = 12e9 (11.2 GiB): fits
    fix = smallest_fix(_full_ft_1b(), NO_ACTIVATIONS, Launch("ddp", 2), Training(1, full_reference=True),
                       16 * GIB, 0.1)  # fmt: skip
    assert fix is not None and fix.fits
    assert fix.plan.launch == Launch("zero2", 2, offload_optimizer=True)
    assert fix.plan.total == 12 * BILLION
    # with 20 GiB, ZeRO-2 alone (18e9 B = 16.8 GiB ≤ 18 GiB usable) is the cheapest
    fix = smallest_fix(_full_ft_1b(), NO_ACTIVATIONS, Launch("ddp", 2), Training(1, full_reference=True),
                       20 * GIB, 0.1)  # fmt: skip
    assert fix is not None and fix.how == ("launcher=deepspeed_zero2",)
    assert fix.plan.total == 18 * BILLION


@pytest.mark.parametrize("device_gib", [1, 4])
def test_nothing_fits_a_too_small_device_and_says_so(device_gib):
    groups, acts = _lora_run(GIB)
    fix = smallest_fix(groups, acts, Launch("local"), Training(4), device_gib * GIB, 0.1)
    # 8 GB of frozen weights on one process: only more processes (with ZeRO-3) can help
    assert fix is not None
    assert any("processes" in change for change in fix.changes)
    assert fix.plan.launch.processes > 1
    assert fix.fits == (fix.plan.total <= device_gib * GIB * 0.9)
