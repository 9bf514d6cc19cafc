"""Rollout engines (``algo.token.engine``): the HF engine is today's rollout; the vLLM engine's request
building, output parsing and weight sync against a stand-in ``vllm`` (CPU); selecting vLLM without it is a
clear exit 2; real vLLM on a GPU box (``-m gpu``)."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rlgen_cli.errors import UserError
from rlgen_cli.schema.ranges import check_settings
from rlgen_cli.schema.vlm import TokenGRPOOptions, vllm_installed
from rlgen_cli.vlm.data import load_vlm_examples, prompt_text
from rlgen_cli.vlm.engines import HFEngine, VLLMEngine, build_engine, group_runs, merged_named_weights
from rlgen_cli.vlm.rollout import SamplingOptions, check_context, encode_prompts, generate, load_image
from tests.conftest import run_cli
from tests.vlm.conftest import TINY_VLM, compose_config

STEP_GRPO = [*TINY_VLM, "algo=step_grpo", "reward=length"]
OPTIONS = SamplingOptions(temperature=1.2, top_p=1.0, top_k=0, max_new_tokens=8)


def _rows(policy, prompts: int = 2, group: int = 2):
    """``prompts`` examples × ``group`` consecutive copies, each copy's image loaded separately (as rollout)."""
    examples = [ex for ex in load_vlm_examples("builtin:tiny_r1vl.json")[:prompts] for _ in range(group)]
    vlm = policy.cfg.vlm
    texts = [prompt_text(policy.processor, ex, vlm.prompt_format, vlm.system_prompt) for ex in examples]
    return texts, [load_image(ex.image) for ex in examples], [f"#{i}" for i in range(len(examples))]


def test_hf_engine_is_todays_rollout(tiny_vlm_policy):
    prompts, images, labels = _rows(tiny_vlm_policy)
    engine = build_engine(tiny_vlm_policy, TokenGRPOOptions(), seed=0)
    assert isinstance(engine, HFEngine)
    done = engine.generate(prompts, images, OPTIONS, seed=11, labels=labels)
    encoded = encode_prompts(tiny_vlm_policy, prompts, images)
    check_context(tiny_vlm_policy, encoded, OPTIONS.max_new_tokens, labels)
    bare = generate(tiny_vlm_policy, encoded, OPTIONS, seed=11)
    assert done.truncated == bare.truncated
    assert all(torch.equal(a, b) for a, b in zip(done.ids, bare.ids, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(done.logprobs, bare.logprobs, strict=True))
    with pytest.raises(UserError, match="never truncated"):
        engine.generate(prompts, images, SamplingOptions(1.0, 1.0, 0, 10_000), seed=0, labels=labels)


# -- the vLLM engine against a stand-in vllm (CPU) --------------------------------------------------------
class FakeModel:
    def __init__(self) -> None:
        self.loads: list[dict[str, torch.Tensor]] = []

    def load_weights(self, weights):
        self.loads.append({name: tensor.clone() for name, tensor in weights})
        return set(self.loads[-1])


class FakeLLM:
    """Answers like ``vllm.LLM.generate``: even completions stop (EOS), odd ones run out of tokens."""

    def __init__(self, stop: int, token: int = 100) -> None:
        self.model, self.stop, self.token = FakeModel(), stop, token
        runner = SimpleNamespace(model=self.model)
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner))
        )
        self.calls: list[tuple[list, list]] = []
        self.resets = 0

    def reset_prefix_cache(self) -> None:
        self.resets += 1

    def generate(self, requests, params, use_tqdm=True):
        self.calls.append((requests, params))
        outputs = []
        for p in params:
            completions = []
            for c in range(p.n):
                stops = c % 2 == 0
                ids = [self.token] * 3 + [self.stop] if stops else [self.token] * p.max_tokens
                logprobs = [{t: SimpleNamespace(logprob=-0.5 - k)} for k, t in enumerate(ids)]
                completions.append(
                    SimpleNamespace(
                        token_ids=ids,
                        finish_reason="stop" if stops else "length",
                        stop_reason=None,
                        logprobs=logprobs,
                    )
                )
            outputs.append(SimpleNamespace(outputs=completions))
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


@pytest.fixture
def lora_policy(tiny_vlm_policy):
    """A copy of the tiny LoRA policy with non-zero adapters (so merged ≠ base)."""
    policy = dataclasses.replace(tiny_vlm_policy, model=copy.deepcopy(tiny_vlm_policy.model))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return policy


def test_vllm_engine_groups_rows_into_n_and_passes_every_option(fake_vllm, tiny_vlm_policy):
    policy = tiny_vlm_policy
    prompts, images, labels = _rows(policy)
    assert images[0] is not images[1] and group_runs(prompts, images) == [(0, 2), (2, 2)]
    llm = FakeLLM(stop=policy.stop_ids[0])
    engine = VLLMEngine(policy, 0.3, seed=0, llm=llm)
    done = engine.generate(prompts, images, OPTIONS, seed=5, labels=labels)
    ((requests, params),) = llm.calls
    assert [r["prompt"] for r in requests] == [prompts[0], prompts[2]]
    assert [r["multi_modal_data"]["image"] for r in requests] == [images[0], images[2]]
    for p in params:
        assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.logprobs) == (2, 1.2, 1.0, -1, 8, 0)
        assert p.stop_token_ids == policy.stop_ids and p.repetition_penalty == 1.0 and p.min_p == 0.0
        assert p.logit_bias == {i: -100.0 for i in policy.suppressed_ids} and p.logit_bias
    assert params[0].seed != params[1].seed
    assert done.truncated == [False, True, False, True]
    assert [len(i) for i in done.ids] == [4, 8, 4, 8] and int(done.ids[0][-1]) == policy.stop_ids[0]
    assert torch.allclose(done.logprobs[0], torch.tensor([-0.5, -1.5, -2.5, -3.5]))
    assert not engine.masks_suppressed and HFEngine.masks_suppressed  # raw log-probs: whole vocabulary
    greedy = engine.sampling_params(SamplingOptions(0.0, 0.5, 3, 4), 1, 0)
    assert (greedy.temperature, greedy.top_p, greedy.top_k) == (0.0, 1.0, -1)
    assert engine.sampling_params(SamplingOptions(1.0, 0.9, 5, 4), 1, 0).top_k == 5


def test_vllm_engine_checks_the_context_before_anything_else(fake_vllm, tiny_vlm_policy):
    prompts, images, labels = _rows(tiny_vlm_policy, 1, 1)
    llm = FakeLLM(stop=tiny_vlm_policy.stop_ids[0])
    engine = VLLMEngine(tiny_vlm_policy, 0.3, seed=0, llm=llm)
    with pytest.raises(UserError, match="sample #0: .*never truncated"):
        engine.generate(prompts, images, SamplingOptions(1.0, 1.0, 0, 10_000), seed=0, labels=labels)
    assert not llm.calls and not llm.model.loads


def test_vllm_engine_pushes_merged_weights_once_per_rollout_after_steps(fake_vllm, lora_policy):
    prompts, images, labels = _rows(lora_policy, 1, 2)
    llm = FakeLLM(stop=lora_policy.stop_ids[0])
    engine = VLLMEngine(lora_policy, 0.3, seed=0, llm=llm)
    base_before = {k: v.clone() for k, v in lora_policy.model.named_parameters() if "base_layer" in k}
    engine.generate(prompts, images, OPTIONS, seed=0, labels=labels)  # first rollout: sync
    engine.generate(prompts, images, OPTIONS, seed=1, labels=labels)  # no step since: no sync
    assert engine.syncs == 1 and llm.resets == 1
    engine.weights_updated()
    engine.weights_updated()  # two optimizer steps, one push before the next rollout
    engine.generate(prompts, images, OPTIONS, seed=2, labels=labels)
    assert engine.syncs == 2 and llm.resets == 2 and len(llm.model.loads) == 2
    merged = dict(copy.deepcopy(lora_policy.model).merge_and_unload().named_parameters())
    sent = llm.model.loads[-1]
    assert set(sent) == set(merged)
    assert not any("lora_" in k or "base_layer" in k or k.startswith("base_model") for k in sent)
    assert all(torch.allclose(sent[k], merged[k].detach(), atol=1e-7) for k in merged)
    adapted = [k for k in merged if k.endswith("q_proj.weight") and "visual" not in k]
    base = lora_policy.model.base_model.model
    assert adapted and all(
        not torch.equal(sent[k], base.get_parameter(k.replace(".weight", ".base_layer.weight")))
        for k in adapted
    )
    assert all(torch.equal(v, dict(lora_policy.model.named_parameters())[k]) for k, v in base_before.items())


def test_full_fine_tuning_weights_are_sent_as_they_are(tiny_vlm_policy):
    policy = dataclasses.replace(tiny_vlm_policy, cfg=copy.deepcopy(tiny_vlm_policy.cfg))
    policy.cfg.lora.enabled = False  # is_lora reads the config; the names are then the model's own
    names = [n for n, _ in merged_named_weights(policy)]
    assert names == [n for n, _ in tiny_vlm_policy.model.named_parameters()]


# -- what check-onpolicy compares an engine's log-probs with ------------------------------------------------
class FullVocabularyEngine(HFEngine):
    """``generate``'s own draws with log-probs over the whole vocabulary, as vLLM's raw log-probs are."""

    masks_suppressed = False

    def generate(self, prompts, images, options, seed, labels):
        from rlgen_cli.vlm.rollout import generation_config, masked_log_softmax_gather

        done = super().generate(prompts, images, options, seed, labels)
        encoded = encode_prompts(self.policy, prompts, images)
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(seed)
            out = self.policy.model.generate(
                **encoded, generation_config=generation_config(self.policy, options, True)
            )
        ids = out.sequences[:, encoded["input_ids"].shape[1] :]
        full = masked_log_softmax_gather(torch.stack(out.logits, dim=1), ids, ())
        done.logprobs = [full[i, : len(row)] for i, row in enumerate(done.ids)]
        return done


@pytest.mark.parametrize("honoured", [True, False])
def test_check_scores_in_the_engines_vocabulary(tmp_path: Path, honoured: bool, monkeypatch):
    from rlgen_cli.recipes.vlm_rl import VLMRLRecipe
    from rlgen_cli.vlm.onpolicy import check_rollout, max_error

    typed, raw = compose_config("check_onpolicy", STEP_GRPO, run_dir=tmp_path)
    recipe = VLMRLRecipe(typed, raw)
    recipe.setup()
    recipe.engine = FullVocabularyEngine(recipe.policy)
    if not honoured:  # a check that ignored the engine's convention would see the vision tokens' mass
        monkeypatch.setattr(FullVocabularyEngine, "masks_suppressed", True)
    worst = max_error(check_rollout(recipe, typed.algo.train_batch_size, lambda params: None))
    recipe.cleanup()
    assert (worst <= typed.check.text_tolerance) == honoured, worst


# -- configuration ---------------------------------------------------------------------------------------
def test_engine_options_are_validated(monkeypatch):
    # choices and ranges are checked once, at the config boundary (schema/ranges.check_settings)
    with pytest.raises(UserError, match="token.engine='sglang'"):
        check_settings(OmegaConf.structured(TokenGRPOOptions(engine="sglang")), "algo.token.")
    with pytest.raises(UserError, match="vllm_gpu_memory_utilization"):
        check_settings(OmegaConf.structured(TokenGRPOOptions(vllm_gpu_memory_utilization=0.0)), "algo.token.")
    monkeypatch.setattr("rlgen_cli.schema.vlm.vllm_installed", lambda: True)
    assert TokenGRPOOptions(engine="vllm").engine == "vllm"
    with pytest.raises(UserError, match="old_logprobs=recompute"):
        TokenGRPOOptions(engine="vllm", old_logprobs="sampler")


@pytest.mark.skipif(vllm_installed(), reason="vLLM is installed here")
def test_selecting_vllm_without_vllm_exits_2_with_the_fix(tmp_path: Path):
    with pytest.raises(UserError, match="pip install vllm"):
        TokenGRPOOptions(engine="vllm")
    code, out = run_cli("train", *STEP_GRPO, "algo.token.engine=vllm", f"hydra.run.dir={tmp_path}")
    assert code == 2, out
    assert "vLLM is not installed" in out and "algo.token.engine=hf" in out


# -- real vLLM (GPU box: pytest -m gpu tests/vlm/test_engines.py) ----------------------------------------
# RLGEN_VLLM_MODEL_PATH=/path/to/Qwen2-VL-2B-Instruct runs them on a real checkpoint instead of the tiny one.
_REAL = os.environ.get("RLGEN_VLLM_MODEL_PATH")
_MODEL = (
    ["model=qwen2_vl", f"model.path={_REAL}", "model.lora.enabled=true", "model.dtype=bfloat16"]
    if _REAL
    else ["model=tiny_qwen2_vl"]
)
GPU_RUN = [
    *_MODEL,
    *(o for o in STEP_GRPO if not o.startswith("model=")),
    "device=cuda",
    "algo.token.engine=vllm",
]


@pytest.mark.gpu
@pytest.mark.skipif(not vllm_installed() or not torch.cuda.is_available(), reason="needs vLLM and CUDA")
def test_vllm_samples_from_the_synced_training_weights():
    from rlgen_cli.vlm.policy import build_vlm
    from rlgen_cli.vlm.rollout import collate, completion_logprobs, pad_stack

    typed, _ = compose_config("train", GPU_RUN)
    policy = build_vlm(typed.model, torch.device("cuda"))
    with torch.no_grad():  # a trained-looking adapter: vLLM must sample from base + ΔW, not the base
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    engine = build_engine(policy, typed.algo.token, typed.seed)
    assert isinstance(engine, VLLMEngine)
    try:
        prompts, images, labels = _rows(policy, 2, 2)
        options = SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=16)
        done = engine.generate(prompts, images, options, seed=0, labels=labels)
        assert engine.syncs == 1
        for ids, truncated in zip(done.ids, done.truncated, strict=True):
            assert not set(ids.tolist()) & set(policy.suppressed_ids)
            stops = [i for i, t in enumerate(ids.tolist()) if t in policy.stop_ids]
            assert (stops == [] and truncated and len(ids) == 16) or (
                stops == [len(ids) - 1] and not truncated
            )
        batch = collate(policy, prompts, images, done.ids)
        mask = batch.completion_mask.bool()
        with torch.no_grad():
            trained = completion_logprobs(policy, batch)
            with policy.reference() as reference:
                base = completion_logprobs(policy, batch, reference)
        sampled = pad_stack(done.logprobs, trained.shape[1]).to(trained.device)
        gap = (trained - sampled).abs()[mask]
        # vLLM's log-probs exclude the −100 logit bias on the few vision tokens: a small gap remains
        assert gap.mean() < 0.05 and (trained - base).abs()[mask].mean() > 4 * gap.mean()
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not vllm_installed() or not torch.cuda.is_available(), reason="needs vLLM and CUDA")
def test_step_grpo_with_vllm_rollouts_stays_exactly_on_policy(tmp_path: Path):
    import json

    # A fresh process: one vLLM engine per process (it initialises torch.distributed).
    code = "from rlgen_cli.cli import app; app()"
    args = ["train", *GPU_RUN, "epochs=2", f"hydra.run.dir={tmp_path}"]
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["ratio_min"] == rows[0]["ratio_max"] == 1.0  # π_old recomputed by the training model
    assert rows[1]["global_step"] == 2 and all(r["reward/std"] >= 0 for r in rows)
