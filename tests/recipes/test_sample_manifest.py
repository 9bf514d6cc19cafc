"""``rlgen sample``'s manifest records what reproduces each image: the seed of the generator its initial
noise comes from (one stream per image, not ``seed`` itself). ``initial_noise`` returns exactly the noise
the image was sampled from, and plain diffusers given ``generator=noise_generator(row)`` draws the same
image."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rlgen_cli.models.sd3 import SD3Policy
from rlgen_cli.models.tiny import tiny_sd3_pipeline
from rlgen_cli.tasks.sample import initial_noise, noise_generator, noise_record
from tests.models.helpers import as_loaded

PROMPTS = ["a red circle", "a dog"]


@pytest.fixture(scope="module")
def sampled(tmp_path_factory) -> tuple[Path, list[dict], torch.Tensor]:
    """2 prompts × 2 images sampled in batches of 3: the run directory, its manifest rows and the initial
    noise each image was sampled from, as the sampler received it (recorded on the way, in image order)."""
    from tests.conftest import run_cli

    run = tmp_path_factory.mktemp("sample")
    drawn: list[torch.Tensor] = []
    noise = SD3Policy.noise

    def recorded(self, n, generator=None):
        x = noise(self, n, generator)
        drawn.append(x.detach().clone())
        return x

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SD3Policy, "noise", recorded)
        code, out = run_cli(
            "sample",
            "model=tiny_sd3",
            f"prompts=[{','.join(PROMPTS)}]",
            "images_per_prompt=2",
            "batch_size=3",
            "num_steps=2",
            "progress=false",
            f"hydra.run.dir={run}",
        )
    assert code == 0, out
    rows = [json.loads(line) for line in (run / "manifest.jsonl").read_text().splitlines()]
    return run, rows, torch.cat(drawn)


def test_each_manifest_row_reproduces_its_images_initial_noise(sampled, tiny_policy):
    _, rows, started_from = sampled
    assert len(rows) == len(started_from) == 4
    assert "seed" not in rows[0] and rows[0]["run_seed"] == 0 and rows[0]["noise_device"] == "cpu"
    assert len({row["noise_seed"] for row in rows}) == 4  # one stream per image, batch size aside
    assert "step_noise_seed" not in rows[0]  # the ODE sampler draws no step noise
    for row, x in zip(rows, started_from):
        assert torch.equal(initial_noise(tiny_policy, row)[0], x)
    assert not torch.equal(initial_noise(tiny_policy, rows[1])[0], started_from[0])


def test_plain_diffusers_redraws_the_image_from_the_rows_generator(sampled, tiny_policy):
    run, rows, _ = sampled
    cfg = tiny_policy.cfg
    pipe = as_loaded(tiny_sd3_pipeline(cfg.tiny_seed))
    for row in (rows[0], rows[3]):
        image = pipe(
            row["prompt"],
            negative_prompt=cfg.negative_prompt,
            height=cfg.resolution,
            width=cfg.resolution,
            num_inference_steps=row["num_steps"],
            guidance_scale=cfg.guidance_scale,
            generator=noise_generator(row),
            max_sequence_length=cfg.max_sequence_length,
            output_type="pt",
        ).images[0]
        saved = torch.from_numpy(np.array(Image.open(run / row["file"]))).permute(2, 0, 1) / 255.0
        assert (image - saved).abs().max() <= 0.5 / 255 + 1e-4  # the PNG's rounding, nothing else


def test_a_stochastic_sampler_also_records_its_step_noise_stream():
    ode, sde = noise_record(7, 3, "cpu", stochastic=False), noise_record(7, 3, "cpu", stochastic=True)
    assert "step_noise_seed" not in ode and sde["step_noise_seed"] != sde["noise_seed"]
    assert ode["noise_seed"] == sde["noise_seed"] and ode["index"] == 3 and ode["run_seed"] == 7
    assert noise_record(7, 4, "cpu", False)["noise_seed"] != ode["noise_seed"]
