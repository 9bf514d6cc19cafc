"""Work an epoch does not need, removed with results unchanged: the prompt-embedding cache (bit-identical
to a fresh encode, bounded, keyed by every encoder setting; a training run with it equals one without)
and the unconditional CFG branch run without autograd under ``algo.cfg_grad=conditional``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rlgen_cli._hydra import conf_dir, verb_overrides
from rlgen_cli.models import build_policy, cfg_gradient
from rlgen_cli.models.base import Cond
from rlgen_cli.models.prompt_cache import PromptCache
from rlgen_cli.recipes import flow_grpo, flow_run
from rlgen_cli.schema.store import register_schemas
from rlgen_cli.tasks.common import validated
from rlgen_cli.training.reporting.progress import Progress
from tests.conftest import TINY_RUN

CPU = torch.device("cpu")
GUIDANCE = 4.5
BATCH = ["a red circle"] * 4  # one prompt's group, as a rollout batch holds it
OTHER = ["two blue squares", "a cat", "a dog"]


@pytest.fixture(scope="module")
def guided_cfg(tiny_model_cfg):
    return dataclasses.replace(tiny_model_cfg, guidance_scale=GUIDANCE)


def _pipeline_encode(policy, prompts: list[str], negative: str = "") -> dict[str, torch.Tensor]:
    """What the diffusers pipeline gives in one call, negative branch included (no rlgen code)."""
    embeds, neg, pooled, neg_pooled = policy.pipeline.encode_prompt(
        prompt=prompts,
        prompt_2=None,
        prompt_3=None,
        device=CPU,
        do_classifier_free_guidance=True,
        negative_prompt=[negative] * len(prompts),
        max_sequence_length=policy.cfg.max_sequence_length,
    )
    return {"prompt_embeds": embeds, "pooled": pooled, "neg_prompt_embeds": neg, "neg_pooled": neg_pooled}


def _assert_bit_identical(got: Cond, expected: dict[str, torch.Tensor]) -> None:
    assert got.tensors.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got.tensors[key], value), key


def test_cached_conditioning_is_bit_identical_to_a_fresh_encode(guided_cfg):
    cached = build_policy(guided_cfg, CPU)
    fresh = build_policy(dataclasses.replace(guided_cfg, prompt_cache_mb=0), CPU)  # same seed: same weights
    assert not hasattr(fresh.encode, "cache")
    first = cached.encode(BATCH)
    cached.encode(OTHER)
    again = cached.encode(BATCH)
    cache = cached.encode.cache
    assert (cache.hits, cache.misses, len(cache)) == (1, 2, 2)
    expected = _pipeline_encode(fresh, BATCH)
    _assert_bit_identical(again, expected)
    _assert_bit_identical(first, expected)
    _assert_bit_identical(fresh.encode(BATCH), expected)  # the negative encoded on its own: same bits


def test_cache_is_a_bounded_lru():
    encoded: list[str] = []

    def encoder(key: str, rows: int = 4):  # 4 rows × 8 fp32 = 128 bytes
        def encode() -> Cond:
            encoded.append(key)
            return Cond({"e": torch.full((rows, 8), float(len(encoded)))})

        return encode

    cache = PromptCache(max_bytes=256)  # room for two entries
    a = cache.get("a", encoder("a"))
    cache.get("b", encoder("b"))
    assert torch.equal(cache.get("a", encoder("a")).tensors["e"], a.tensors["e"])  # hit: "a" most recent
    cache.get("c", encoder("c"))  # evicts "b", the least recently used
    assert (len(cache), cache.bytes) == (2, 256)
    cache.get("a", encoder("a"))
    cache.get("b", encoder("b"))  # encoded again
    assert encoded == ["a", "b", "c", "b"]
    big = cache.get("big", encoder("big", rows=16))  # 512 bytes: returned, never kept
    assert big.tensors["e"].shape == (16, 8) and len(cache) == 2 and cache.bytes == 256
    cache.get("big", encoder("big", rows=16))
    assert encoded[-2:] == ["big", "big"]
    with pytest.raises(ValueError, match="positive size"):
        PromptCache(0)


def test_a_changed_encoder_setting_is_a_new_entry(guided_cfg):
    policy = build_policy(guided_cfg, CPU)
    cache = policy.encode.cache
    guided = policy.encode(BATCH)
    policy.guidance_scale = 1.0  # what flow_pretrain does: no negative branch
    assert set(policy.encode(BATCH).tensors) == {"prompt_embeds", "pooled"}
    policy.guidance_scale = GUIDANCE
    policy.cfg = dataclasses.replace(policy.cfg, negative_prompt="blurry")
    negative = policy.encode(BATCH)
    assert not torch.equal(negative.tensors["neg_prompt_embeds"], guided.tensors["neg_prompt_embeds"])
    _assert_bit_identical(negative, _pipeline_encode(policy, BATCH, negative="blurry"))
    policy.cfg = dataclasses.replace(policy.cfg, negative_prompt="", max_sequence_length=8)
    shorter = policy.encode(BATCH)
    assert shorter.tensors["prompt_embeds"].shape[1] == guided.tensors["prompt_embeds"].shape[1] - 24
    assert (cache.hits, cache.misses) == (0, 4)
    policy.cfg = dataclasses.replace(policy.cfg, max_sequence_length=guided_cfg.max_sequence_length)
    policy.encode(BATCH)
    assert (cache.hits, cache.misses) == (1, 4)


def test_a_trainable_text_encoder_bypasses_the_cache(guided_cfg):
    policy = build_policy(guided_cfg, CPU)
    policy.pipeline.text_encoder_3.requires_grad_(True)
    policy.encode(BATCH)
    policy.encode(BATCH)
    assert (policy.encode.cache.hits, policy.encode.cache.misses, len(policy.encode.cache)) == (0, 0, 0)


def test_bad_cache_size_is_a_config_error():
    from rlgen_cli.errors import UserError
    from tests.schema.test_compose import _compose

    with pytest.raises(UserError, match="model.prompt_cache_mb must be ≥ 0"):
        validated(_compose("train", ["model.prompt_cache_mb=-1"]))


def test_conditional_cfg_runs_the_unconditional_branch_without_autograd(guided_cfg):
    policy = build_policy(guided_cfg, CPU)
    passes: list[tuple[int, bool]] = []  # (batch, autograd on) of every transformer call
    policy.transformer.register_forward_pre_hook(
        lambda _, args, kwargs: passes.append((kwargs["hidden_states"].shape[0], torch.is_grad_enabled())),
        with_kwargs=True,
    )
    x = policy.noise(4, torch.Generator().manual_seed(0))
    sigma, cond = torch.tensor(0.6), policy.encode(BATCH)
    v_both = policy.velocity(x, sigma, cond)
    assert passes == [(8, True)]  # cfg_grad=both: one batch of both branches, differentiated
    with cfg_gradient("conditional"):
        v_train = policy.velocity(x, sigma, cond)
        with torch.no_grad():
            v_sample = policy.velocity(x, sigma, cond)
    assert passes[1:] == [(4, False), (4, True), (4, False), (4, False)]
    assert torch.equal(v_train, v_sample)  # the rollout's values are the training forward's, bit for bit
    torch.testing.assert_close(v_train, v_both, rtol=1e-5, atol=1e-6)  # batch-shape rounding only


def _recipe(run_dir, overrides: list[str]) -> flow_run.FlowRun:
    register_schemas()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="train", overrides=verb_overrides("train", [*TINY_RUN, *overrides]))
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = str(run_dir)
    return flow_run.setup(validated(cfg), cfg)


@pytest.mark.parametrize("cfg_grad", ["both", "conditional"])
def test_training_with_the_cache_equals_training_without(tmp_path, cfg_grad):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")  # one prompt: every epoch's rollout batch is the same group
    common = [
        f"data.train={prompts}", "algo.prompts_per_epoch=1", "algo.group_size=4", f"algo.cfg_grad={cfg_grad}",
        f"model.guidance_scale={GUIDANCE}", "algo.drop_zero_advantage=false",
    ]  # fmt: skip
    cached = _recipe(tmp_path / "cached", common)
    uncached = _recipe(tmp_path / "uncached", [*common, "model.prompt_cache_mb=0"])
    untrained = [p.detach().clone() for p in uncached.policy.trainable.parameters()]
    with Progress(enabled=False) as progress:
        for recipe in (cached, uncached):
            for epoch in range(2):
                flow_grpo.grpo_epoch(recipe, epoch, progress)
            recipe.logger.close()
    assert cached.policy.encode.cache.hits == 1  # epoch 1 took epoch 0's conditioning
    for a, b in zip(
        cached.policy.trainable.parameters(), uncached.policy.trainable.parameters(), strict=True
    ):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(uncached.policy.trainable.parameters(), untrained))
