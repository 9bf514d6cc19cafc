"""Each algorithm of the family trains two epochs on tiny SD3 through the CLI and changes every LoRA tensor.

Weight decay is off: AdamW's decay alone would move every non-zero tensor, so a tensor that never gets a
gradient (a dead adapter) could not be told from a trained one.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.models.sd3 import LORA_WEIGHTS_NAME
from tests.conftest import TINY_RUN

GEOMETRY = [
    "algo.group_size=2",
    "algo.prompts_per_epoch=2",
    "algo.sample_batch_size=4",
    "algo.train_batch_size=4",
    "algo.weight_decay=0.0",
]


@pytest.mark.parametrize(
    "algo,extra",
    [
        ("grpo_fast", ["algo.branch=shared_prefix", "sampler=cps"]),
        ("mix_grpo", ["algo.window.shift_every=1", "algo.window.size=2"]),
        ("mix_grpo_flash", ["algo.window.size=2"]),
        ("dance", ["sampler=dance", "algo.group_size=4", "algo.prompts_per_epoch=1", "algo.best_of_n=1"]),
        ("grpo_guard", ["algo.ema.enabled=true", "algo.ema.update_every=1"]),
        ("dpo", ["algo.pref.ref_update_step=1"]),
        ("dpo", []),
        ("sft", ["algo.pref.anchor_weight=0.1"]),
    ],
)
def test_algorithm_trains_two_epochs(cli, tmp_path, algo, extra):
    run = tmp_path / algo
    code, out = cli(
        "train",
        *TINY_RUN,
        *GEOMETRY,
        f"algo={algo}",
        *extra,
        "algo.lr=1e-2",
        "model.num_steps=4",
        "epochs=2",
        "save_every=1",
        "eval_every=0",
        "images_every=2",
        f"hydra.run.dir={run}",
    )
    assert code == 0, out
    # every flow recipe saves the epoch's samples every images_every epochs: epoch 0, not epoch 1
    assert sorted(p.name for p in (run / "images").glob("train_epoch_*.png")) == ["train_epoch_000001.png"]
    first = load_file(run / "checkpoints" / "epoch_000001" / "weights" / LORA_WEIGHTS_NAME)
    second = load_file(run / "checkpoints" / "epoch_000002" / "weights" / LORA_WEIGHTS_NAME)
    assert first.keys() == second.keys() and len(first) > 0
    # LoRA B starts at 0, so the first step moves only B; from the second on, A and B both get gradients
    unchanged = [k for k in first if torch.equal(first[k], second[k])]
    assert unchanged == [], f"{algo}: {len(unchanged)} of {len(first)} unchanged, e.g. {unchanged[:3]}"
