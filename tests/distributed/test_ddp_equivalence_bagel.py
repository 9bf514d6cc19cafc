"""Plain Flow-GRPO on the tiny BAGEL: one process and two gloo processes give the same rewards,
statistics and LoRA after one epoch.

The tiny BAGEL is a Mixture-of-Transformers network with text CFG 4 active in the trained steps and a
LoRA on its generation expert. The geometry is ``test_ddp_equivalence.py``'s (a global config: the pair
deals the micro-batches between its ranks), so the per-sample noise streams, the gathered group statistics
and the reduced gradients must agree.

The policy's training passes reach the network through ``Bagel.forward(method, …)``, the one call a
``DistributedDataParallel`` wrapper makes: calling the pass on the wrapper itself fails with an
``AttributeError`` in the two-process run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_ddp_equivalence import GEOMETRY, _metrics, _weights

BAGEL = ["model=tiny_bagel", "algo=grpo", "reward=jpeg_compressibility", "data=tiny", *GEOMETRY]


@pytest.mark.slow
def test_two_processes_equal_one_for_tiny_bagel(cli, tmp_path: Path):
    single, pair = tmp_path / "single", tmp_path / "pair"
    code, out = cli("train", *BAGEL, f"hydra.run.dir={single}")
    assert code == 0, out
    code, out = cli(
        "train", *BAGEL, "launcher=accelerate", "launcher.num_processes=2", f"hydra.run.dir={pair}"
    )
    assert code == 0, out
    one, two = _metrics(single), _metrics(pair)
    assert one["num_groups"] == two["num_groups"] == 2  # the groups were gathered across ranks
    assert one["trained_samples"] == two["trained_samples"] > 0
    for key in ("reward/mean", "reward/std", "zero_std_ratio", "policy_loss"):
        assert abs(one[key] - two[key]) <= 1e-9 * max(1.0, abs(one[key])), key
    assert one["grad_norm"] > 0
    assert abs(one["grad_norm"] - two["grad_norm"]) <= 1e-6 * one["grad_norm"]
    a, b = _weights(single), _weights(pair)
    assert a.keys() == b.keys() and all("moe_gen" in k for k in a)  # the generation expert's adapter
    # LoRA's B starts at zero: the update moved it, so the runs agree on a trained adapter, not on its init
    assert max(a[k].abs().max().item() for k in a if "lora_B" in k) > 1e-6
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
