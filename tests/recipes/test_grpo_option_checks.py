"""Flow-GRPO options that trained nothing, or trained against another quantity than they name, are right
or refused: best-of-N must leave whole optimizer steps, the steps must draw noise, GRPO-Guard's ratio needs
the per-element-mean Gaussian log-probability, and ``sampler.logprob_reduce=sum`` sums the KL too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlgen_cli.errors import UserError
from tests.conftest import TINY_RUN, validated_train


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["algo.prompts_per_epoch=1", "algo.group_size=4", "algo.sample_batch_size=4", "algo.train_batch_size=2",
             "algo.gradient_accumulation_steps=2", "algo.best_of_n=1"],
            r"algo.best_of_n=1 keeps 2·k of each group: 2 samples, 1 micro-batches .* "
            r"algo.gradient_accumulation_steps=2 does not divide",
        ),
        (["sampler.noise_level=0"], r"sampler.kind=flow_sde at noise level 0.0 .* draws every step deterministically"),
        (
            ["algo=grpo_guard", "sampler.logprob_reduce=sum"],
            r"algo.objective=grpo_guard normalises its ratio .* sampler.logprob_reduce=sum",
        ),
        (
            ["algo=grpo_guard", "sampler=cps", "sampler.logprob_form=upstream"],
            r"sampler.logprob_form=upstream gives another",
        ),
    ],
)  # fmt: skip
def test_a_grpo_run_that_would_train_nothing_or_the_wrong_ratio_is_refused(overrides, message):
    with pytest.raises(UserError, match=message):
        validated_train(*overrides)


def test_their_working_neighbours_pass():
    validated_train("algo.prompts_per_epoch=1", "algo.group_size=4", "algo.sample_batch_size=4", "algo.train_batch_size=1",
                    "algo.gradient_accumulation_steps=2", "algo.best_of_n=1")  # fmt: skip
    validated_train("algo=dpo", "sampler.noise_level=0")  # DPO's samples differ by their initial noise
    validated_train("algo=grpo_guard")


def test_a_summed_log_probability_sums_the_kl_too(cli, tmp_path: Path):
    """Two micro-batches: the second one's KL (after one step) is over the same samples; summed over the
    latent's elements it is orders of magnitude above the per-element mean (they were equal)."""
    kl = {}
    for reduce in ("mean", "sum"):
        run = tmp_path / reduce
        overrides = ["algo.kl_weight=0.5", "algo.train_batch_size=2", "algo.gradient_accumulation_steps=1"]
        code, out = cli("train", *TINY_RUN, *overrides, f"sampler.logprob_reduce={reduce}", "epochs=1",
                        "eval_every=0", "images_every=0", f"hydra.run.dir={run}")  # fmt: skip
        assert code == 0, out
        kl[reduce] = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["kl_loss"]
    assert kl["mean"] > 0 and kl["sum"] > 100 * kl["mean"]
