"""Every recipe × {1, 2} processes × {one, several} optimizer steps per epoch: the same run bit for bit —
weights and every logged number — or a refusal before anything runs, with the reason.

The configs state global quantities (docs/distributed.md): samples per epoch, micro-batches per step over
all processes. A process-count-invariant recipe deals whole rollout batches round-robin, keys every
sample's noise by its place in the global batch, puts gathered rewards back in global order, sums the
gradients in float64 once per step, and pools every logged statistic over processes before reducing it
(``common.reduce_over_ranks``). The one-process run computes with one thread, as launched workers do.

Geometries (8 samples per epoch, the tiny models): ``one`` step per epoch of 4 global micro-batches (2 per
process on 2); ``several``: 8 micro-batches in 2 steps of 4 (each process trains 2 of every step), the
geometry where dealing contiguous slices made step 0 cover other samples. Flow-DPO / SFT step once per
training σ: 1 or 2 of them, over the epoch's pairs (kept samples) in global micro-batches of 1. R3 steps
once per epoch; its geometries are one or two image / text micro-batches per process and group.

The whole matrix is slow (about 30 min on two cores); the default suite runs DiffusionNFT in the several-
steps geometry (the case that differed by 68 % in its first gradient norm) and every compose-time refusal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_cli
from tests.distributed.test_process_invariance import one_thread
from tests.distributed.test_r3_process_invariance import warm  # noqa: F401 (a fixture)
from tests.r3.conftest import TINY_R3, warm_text_overrides

FLOW = [
    "experiment=tiny_cpu", "model.num_steps=3", "algo.prompts_per_epoch=2", "algo.group_size=4", "epochs=1",
    "eval_every=0", "images_every=0", "progress=false",
]  # fmt: skip
FLOW_STEPS = {
    "one": ["algo.sample_batch_size=2", "algo.train_batch_size=2", "algo.gradient_accumulation_steps=4"],
    "several": ["algo.sample_batch_size=1", "algo.train_batch_size=1", "algo.gradient_accumulation_steps=4"],
}
PREF_STEPS = {  # one optimizer step per training σ, over 2 pairs (kept samples) in micro-batches of 1
    "one": ["algo.sample_batch_size=2", "algo.train_batch_size=1", "algo.pref.timesteps_per_sample=1"],
    "several": ["algo.sample_batch_size=2", "algo.train_batch_size=1", "algo.pref.timesteps_per_sample=2"],
}
VLM = ["model=tiny_qwen2_vl", "data=tiny_vlm", "reward=length", "progress=false", "eval_every=0", "epochs=1"]
TOKEN = [
    *VLM, "algo.prompts_per_epoch=2", "algo.group_size=4", "algo.token.max_completion_tokens=8",
    "algo.lr=1e-2",
]  # fmt: skip
VLM_SFT = [
    *VLM,
    "algo=vlm_sft",
    "data.train=builtin:tiny_sft.jsonl",
    "algo.token.sft_drop_markers=[]",
    "algo.lr=1e-2",
]
SFT_STEPS = {  # the 8 conversations of tiny_sft.jsonl
    "one": ["algo.train_batch_size=2", "algo.gradient_accumulation_steps=4"],
    "several": ["algo.train_batch_size=1", "algo.gradient_accumulation_steps=4"],
}
R3_STEPS = {  # one step per epoch (two epochs: a reason and a refine step), one or two micro-batches
    "one": ["epochs=2", "r3.prompts_per_step=2", "r3.group_size=4", "r3.micro_batch_size=4"],
    "several": ["epochs=2", "r3.prompts_per_step=2", "r3.group_size=4", "r3.micro_batch_size=2"],
}
GARDO = (  # two epochs, so the reference is refreshed once between them; the KL gated on rank disagreement
    *(o for o in FLOW if o != "epochs=1"), "epochs=2", "+reward.weights.brightness=0",
    "+reward.weights.jpeg_incompressibility=0", "algo.gardo.kl_gate=true", "algo.gardo.refresh_every=1",
    "algo.gardo.proxy_reward=jpeg_compressibility", "algo.gardo.auxiliary_rewards=[brightness,jpeg_incompressibility]",
)  # fmt: skip
KEEP_ZERO = ("algo.drop_zero_advantage=false",)  # the upstream default packs per process: not exact (below)
UNLOGGED = ("time/", "peak_memory_mb")  # wall-clock and memory: properties of the machine, not the run


@dataclass(frozen=True)
class Recipe:
    overrides: tuple[str, ...]
    geometries: dict[str, list[str]]
    weights: tuple[str, ...]  # the trained weights' files (by name) in the last checkpoint's weights/


LORA = ("pytorch_lora_weights.safetensors",)
ADAPTER = ("adapter_model.safetensors",)
RECIPES = {
    "grpo": Recipe((*FLOW, "algo=grpo", *KEEP_ZERO), FLOW_STEPS, LORA),
    "grpo_fast": Recipe((*FLOW, "algo=grpo_fast", "sampler=cps", *KEEP_ZERO), FLOW_STEPS, LORA),
    "mix_grpo": Recipe((*FLOW, "algo=mix_grpo", "algo.window.size=2"), FLOW_STEPS, LORA),
    "grpo_guard": Recipe((*FLOW, "algo=grpo_guard", *KEEP_ZERO), FLOW_STEPS, LORA),
    "dpo": Recipe((*FLOW, "algo=dpo"), PREF_STEPS, LORA),
    "sft": Recipe((*FLOW, "algo=sft"), PREF_STEPS, LORA),
    "nft": Recipe((*FLOW, "algo=nft"), FLOW_STEPS, LORA),
    "awm": Recipe((*FLOW, "algo=awm"), FLOW_STEPS, LORA),
    "dgpo": Recipe((*FLOW, "algo=dgpo", "algo.forward.num_timesteps=2"), FLOW_STEPS, LORA),
    "grpo_gardo": Recipe((*GARDO, "algo=grpo", *KEEP_ZERO), FLOW_STEPS, LORA),
    "nft_gardo": Recipe((*GARDO, "algo=nft", "algo.kl_weight=0.01"), FLOW_STEPS, LORA),
    "token_grpo": Recipe((*TOKEN, "algo=token_grpo"), FLOW_STEPS, ADAPTER),
    "step_grpo": Recipe((*TOKEN, "algo=step_grpo"), FLOW_STEPS, ADAPTER),
    "vlm_sft": Recipe(tuple(VLM_SFT), SFT_STEPS, ADAPTER),
}
# combinations refused before anything runs, and the reason the refusal names
REFUSED = {
    "dance": ((*FLOW, "algo=dance", *FLOW_STEPS["one"]), "algo.window.kind=random_subset and algo.best_of_n are single-process"),
    "grpo (drop_zero_advantage, exactness insisted on)": (
        (*FLOW, "algo=grpo", *FLOW_STEPS["one"], "launcher.exact_reduction=true"), "algo.drop_zero_advantage=true packs each process",
    ),
    "grpo (per-process shuffle, exactness insisted on)": (
        (*FLOW, "algo=grpo", *KEEP_ZERO, *FLOW_STEPS["one"], "algo.shuffle_samples=per_process", "launcher.exact_reduction=true"),
        "algo.shuffle_samples=per_process permutes each process's own samples",
    ),
    "token_grpo (a step smaller than whole rollout batches)": (
        (*TOKEN, "algo=token_grpo", "algo.prompts_per_epoch=4", "algo.sample_batch_size=8", "algo.train_batch_size=1",
         "algo.gradient_accumulation_steps=8"),
        "cannot be split over 2 processes in whole rollout batches",
    ),
}  # fmt: skip
PAIR = ("launcher=accelerate", "launcher.num_processes=2")


def _train(run: Path, *overrides: str) -> Path:
    with one_thread():
        code, out = run_cli("train", *overrides, f"hydra.run.dir={run}")
    assert code == 0, out
    return run


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(UNLOGGED)} for row in rows]


def _last_weights(run: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    last = sorted((run / "checkpoints").glob("epoch_*"))[-1]
    return {
        f"{path.parent.name}/{key}": tensor
        for name in names
        for path in sorted((last / "weights").rglob(name))
        for key, tensor in load_file(path).items()
    }


def assert_same_run(one: Path, two: Path, weights: tuple[str, ...]) -> None:
    """Every logged number and every trained weight equal, bit for bit."""
    rows_one, rows_two = _metrics(one), _metrics(two)
    assert len(rows_one) == len(rows_two) >= 1
    for a, b in zip(rows_one, rows_two, strict=True):
        assert a.keys() == b.keys(), a.keys() ^ b.keys()
        differ = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
        assert not differ, (a.get("step"), differ)
    first, second = _last_weights(one, weights), _last_weights(two, weights)
    assert first and first.keys() == second.keys()
    moved = {
        k: (first[k] - second[k]).abs().max().item() for k in first if not torch.equal(first[k], second[k])
    }
    assert not moved, moved


def _compare(tmp_path: Path, recipe: Recipe, geometry: str) -> tuple[Path, Path]:
    overrides = (*recipe.overrides, *recipe.geometries[geometry])
    one = _train(tmp_path / "one", *overrides)
    two = _train(tmp_path / "two", *overrides, *PAIR)
    assert_same_run(one, two, recipe.weights)
    return one, two


@pytest.mark.slow  # about 1 min per case on two cores
@pytest.mark.parametrize("geometry", ["one", "several"])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_two_processes_give_the_same_run(tmp_path: Path, name: str, geometry: str):
    one, _ = _compare(tmp_path, RECIPES[name], geometry)
    steps = _metrics(one)[-1]["global_step"]
    assert steps == (2 if geometry == "several" else 1) * len(_metrics(one)), steps


@pytest.mark.slow  # about 1.5 min per geometry: the text policy's warm start, then the two runs
@pytest.mark.parametrize("geometry", ["one", "several"])
def test_r3_on_two_processes_gives_the_same_run(tmp_path: Path, warm: Path, geometry: str):  # noqa: F811
    """Text policy, generator and editor (a reason and a refine step)."""
    recipe = Recipe((*TINY_R3, *warm_text_overrides(warm)), R3_STEPS, (*ADAPTER, *LORA))
    one, _ = _compare(tmp_path, recipe, geometry)
    assert len(_metrics(one)) == 2  # a reason and a refine step


def test_nft_with_several_steps_per_epoch_is_process_count_invariant(tmp_path: Path):
    """The default suite's representative: two micro-batches per process in each of two steps per epoch."""
    one, _ = _compare(tmp_path, RECIPES["nft"], "several")
    (row,) = _metrics(one)
    assert row["global_step"] == 2 and row["grad_norm"] > 0


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_combination_without_an_exact_run_is_refused_before_it_runs(tmp_path: Path, name: str):
    overrides, reason = REFUSED[name]
    run = tmp_path / "run"
    code, out = run_cli("train", *overrides, *PAIR, f"hydra.run.dir={run}")
    assert code == 2 and reason in " ".join(out.split()), out
    assert not (run / "metrics.jsonl").exists()
