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
    code, out = cli(
        "check-onpolicy",
        *TINY_RUN,
        "check.train_batch_size=1",
        "check.tolerance=1e-5",
        f"hydra.run.dir={tmp_path}",
    )
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


# -- the check can fail: weights that move between the rollout and the recompute -----------------------
def test_check_onpolicy_fails_when_weights_change_after_the_rollout(cli, tmp_path):
    # the tiny SD3's LoRA starts at B = 0: noise of 1e-2 moves its step log-probs by ≈ 5e-5 (1e-3: ≈ 4e-6)
    code, out = cli("check-onpolicy", *TINY_RUN, "check.perturb_weights=1e-2", f"hydra.run.dir={tmp_path}")
    assert code == 1, out
    assert "FAIL max error" in out and "perturb_weights" in out


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("check.perturb_weights=-1e-3", "check.perturb_weights"),
        ("check.text_tolerance=0", "check.text_tolerance"),
        ("check.tolerance=-1", "check.tolerance"),
    ],
)
def test_bad_check_settings_exit_2_naming_the_key(cli, tmp_path, override, key):
    code, out = cli("check-onpolicy", *TINY_RUN, override, f"hydra.run.dir={tmp_path}")
    assert code == 2 and key in out, out


def test_perturb_weights_adds_seeded_noise_of_the_given_std():
    import torch

    from rlgen_cli.errors import UserError
    from rlgen_cli.tasks.check_onpolicy import perturb_weights

    params = [torch.nn.Parameter(torch.ones(200, 100)), torch.nn.Parameter(torch.zeros(50))]
    again = [torch.nn.Parameter(p.detach().clone()) for p in params]
    perturb_weights(params, std=0.0, seed=3)
    assert torch.equal(params[0], torch.ones(200, 100)) and torch.equal(params[1], torch.zeros(50))
    perturb_weights(params, std=1e-3, seed=3)
    noise = params[0].detach() - 1
    assert abs(noise.std().item() - 1e-3) < 5e-5 and abs(noise.mean().item()) < 1e-4  # 20 000 draws
    assert params[1].detach().abs().max() > 0
    perturb_weights(again, std=1e-3, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(params, again, strict=True))  # seeded: reproducible
    with pytest.raises(UserError, match="no trainable weights"):
        perturb_weights([], std=1e-3, seed=0)


# -- ShapesEval: the default model ---------------------------------------------------------------------
# `rlgen check-onpolicy model=shapes_base data=shapes reward=shapes_geneval`, one small epoch
SHAPES = [
    "model=shapes_base", "data=shapes", "reward=shapes_geneval", "algo.prompts_per_epoch=2", "algo.group_size=2",
    "algo.sample_batch_size=4", "algo.train_batch_size=4", "algo.gradient_accumulation_steps=1", "progress=false",
]  # fmt: skip


@pytest.mark.parametrize("algo", ["grpo_tiny", "grpo_fast_shapes"])
def test_shapes_base_is_exactly_on_policy(cli, tmp_path, algo):
    # grpo_fast_shapes: what `rlgen train` trains (shared ODE prefix, a 2-step SDE window)
    code, out = cli("check-onpolicy", *SHAPES, f"algo={algo}", f"hydra.run.dir={tmp_path}")
    assert code == 0, out
    assert "PASS max error 0.000e+00" in out


def test_shapes_base_check_fails_with_perturbed_weights(cli, tmp_path):
    overrides = [*SHAPES, "algo=grpo_fast_shapes", "check.perturb_weights=1e-3", f"hydra.run.dir={tmp_path}"]
    code, out = cli("check-onpolicy", *overrides)
    assert code == 1, out
    assert "FAIL max error" in out
