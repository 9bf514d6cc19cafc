"""``rlgen check-onpolicy``: ratio == 1 on the training path, with and without CFG; a deliberate
sampling/training mismatch is caught (exit 1)."""

from __future__ import annotations

import pytest

from tests.conftest import TINY_RUN


@pytest.mark.parametrize("guidance", ["4.5", "1.0"])
def test_check_onpolicy_passes(cli, tmp_path, guidance):
    code, out = cli(
        "check-onpolicy", *TINY_RUN, f"model.guidance_scale={guidance}", f"hydra.run.dir={tmp_path}"
    )
    assert code == 0, out


@pytest.mark.parametrize("sampler", ["dance", "cps"])
def test_check_onpolicy_passes_for_other_samplers(cli, tmp_path, sampler):
    code, out = cli("check-onpolicy", *TINY_RUN, f"sampler={sampler}", f"hydra.run.dir={tmp_path}")
    assert code == 0, out


def test_check_onpolicy_fails_when_training_uses_another_noise_level(cli, tmp_path, capsys):
    code, out = cli("check-onpolicy", *TINY_RUN, "check.train_noise_level=0.8", f"hydra.run.dir={tmp_path}")
    assert code == 1
    assert "FAIL" in out + capsys.readouterr().out


def test_check_onpolicy_holds_at_another_training_batch_size(cli, tmp_path):
    # SD3's outputs depend slightly on batch size (GEMM blocking); fp32 keeps it well under 1e-5
    code, out = cli("check-onpolicy", *TINY_RUN, "check.train_batch_size=1", "check.tolerance=1e-5",
                    f"hydra.run.dir={tmp_path}")  # fmt: skip
    assert code == 0, out


ALGOS = ["grpo", "grpo_fast", "mix_grpo", "mix_grpo_flash", "dance", "grpo_guard"]


@pytest.mark.parametrize("algo", ALGOS)
def test_check_onpolicy_for_every_algorithm(cli, tmp_path, algo):
    extra = [
        "algo.group_size=2",
        "algo.prompts_per_epoch=2",
        "algo.sample_batch_size=4",
        "algo.train_batch_size=4",
    ]
    code, out = cli(
        "check-onpolicy", *TINY_RUN, f"algo={algo}", *extra, "model.num_steps=4", f"hydra.run.dir={tmp_path}"
    )
    assert code == 0, out
