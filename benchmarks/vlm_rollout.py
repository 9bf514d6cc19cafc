"""Rollout overhead of the VLM recipe: rlgen's rollout vs the bare ``generate`` call on the same batch.

Builds the policy of ``model=tiny_qwen2_vl algo=step_grpo data=tiny_vlm`` (plus any overrides), then on
one batch of ``sample_batch_size`` prompts laid out as the recipe's (each prompt ``group_size`` times in a
row, their images loaded once) times, alternately and ``--repeats`` times each:

* **bare** — ``model.generate(**inputs, …)`` with the same sampling options and seed, nothing else;
* **pipeline** — what any transformers rollout does around it: the processor on every row's chat-templated
  prompt and image, the bare ``generate``, ``batch_decode``;
* **rlgen** — encode (chat template + processor), context check, seeded ``generate`` with raw-logit
  log-prob recording, stop detection and decoding (what ``VLMRLRecipe.rollout`` does per batch);
* **log-prob pass** — the training-path forward over prompt + completions (``completion_logprobs``).

Prints JSON: tokens per second of bare and rlgen, the log-prob pass in ms per completion token,
``overhead_vs_pipeline`` = rlgen time / pipeline time (rlgen's own additions: the log-prob recording,
the checks, the seeding), and last ``overhead_ratio`` = rlgen time / bare time (1.0 = no overhead).

    python benchmarks/vlm_rollout.py [key=value overrides…] [--repeats N]

An override of a default's key replaces it: ``model=qwen2_vl model.weights=random_init`` measures the 2B
architecture (docs/memory_speed.md).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rlgen_cli._hydra import conf_dir
from rlgen_cli.schema.store import register_schemas
from rlgen_cli.tasks.common import validated
from rlgen_cli.vlm.data import load_vlm_examples, prompt_text
from rlgen_cli.vlm.policy import build_vlm
from rlgen_cli.vlm.rollout import (
    SamplingOptions,
    check_context,
    collate,
    completion_logprobs,
    encode_prompts,
    generate,
    generation_config,
    load_images,
)
from rlgen_cli.vlm.training import completion_budget

DEFAULTS = ["model=tiny_qwen2_vl", "algo=step_grpo", "data=tiny_vlm", "reward=length", "progress=false"]


def _config(overrides: list[str]):
    register_schemas()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        chosen = {o.split("=", 1)[0] for o in overrides}  # model=qwen2_vl replaces the tiny default
        defaults = [d for d in DEFAULTS if d.split("=", 1)[0] not in chosen]
        raw = compose(config_name="train", overrides=[*defaults, *overrides])
    OmegaConf.set_struct(raw, False)
    raw.run_dir = "/tmp/rlgen-bench-vlm"
    return validated(raw)


def _timed(fn) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main(argv: list[str]) -> dict[str, float]:
    repeats = int(argv[argv.index("--repeats") + 1]) if "--repeats" in argv else 3
    overrides = [a for i, a in enumerate(argv) if a != "--repeats" and (i == 0 or argv[i - 1] != "--repeats")]
    cfg = _config(overrides)
    device = torch.device("cuda" if torch.cuda.is_available() and cfg.device != "cpu" else "cpu")
    policy = build_vlm(cfg.model, device)
    token = cfg.algo.token
    budget = completion_budget(token.max_completion_tokens, cfg.model.vlm.completion_cap)
    options = SamplingOptions(token.temperature, token.top_p, token.top_k, budget)
    examples = load_vlm_examples(cfg.data.train)
    group = cfg.algo.group_size  # laid out as the recipe's batches: each prompt group_size times in a row
    examples = [examples[(i // group) % len(examples)] for i in range(cfg.algo.sample_batch_size)]
    vlm = cfg.model.vlm
    prompts = [prompt_text(policy.processor, ex, vlm.prompt_format, vlm.system_prompt) for ex in examples]
    images = load_images([ex.image for ex in examples])
    encoded = encode_prompts(policy, prompts, images)
    bare_config = generation_config(policy, options, record=False)

    def bare():
        torch.manual_seed(0)
        with torch.no_grad(), policy.autocast():
            return policy.model.generate(**encoded, generation_config=bare_config)

    def pipeline():
        inputs = policy.processor(text=prompts, images=images, return_tensors="pt", padding=True).to(device)
        torch.manual_seed(0)
        with torch.no_grad(), policy.autocast():
            out = policy.model.generate(**inputs, generation_config=bare_config)
        generated = out.sequences[:, inputs["input_ids"].shape[1] :]
        policy.tokenizer.batch_decode(generated, skip_special_tokens=True)
        return generated

    def ours():
        inputs = encode_prompts(policy, prompts, images)
        check_context(policy, inputs, budget, list(range(len(prompts))))
        done = generate(policy, inputs, options, seed=0)
        policy.tokenizer.batch_decode(done.ids, skip_special_tokens=True)
        return done

    bare()  # warm-up (kernels, caches)
    bare_times, pipeline_times, our_times, tokens = [], [], [], 0
    for _ in range(repeats):  # interleaved: a slow stretch of the machine hits all three
        seconds, _ = _timed(bare)
        bare_times.append(seconds)
        seconds, generated = _timed(pipeline)
        pipeline_times.append(seconds)
        seconds, done = _timed(ours)
        our_times.append(seconds)
        tokens = sum(int(ids.numel()) for ids in done.ids)
    if not all(
        torch.equal(row[: ids.numel()].cpu(), ids) for row, ids in zip(generated, done.ids, strict=True)
    ):
        raise RuntimeError(
            "the pipeline and rlgen sampled different tokens: the timings compare different work"
        )
    batch = collate(policy, prompts, images, done.ids)
    with torch.no_grad():
        completion_logprobs(policy, batch)
        lp_seconds, _ = _timed(lambda: completion_logprobs(policy, batch))
    bare_s, our_s = statistics.median(bare_times), statistics.median(our_times)
    pipeline_s = statistics.median(pipeline_times)
    return {
        "device": str(device),
        "batch": len(prompts),
        "max_new_tokens": budget,
        "bare_tokens_per_s": tokens / bare_s,  # same seed and options: the same sampled tokens
        "rlgen_tokens_per_s": tokens / our_s,
        "logprob_ms_per_token": 1000 * lp_seconds / max(batch.num_tokens, 1),
        "bare_s": bare_s,
        "pipeline_s": pipeline_s,
        "rlgen_s": our_s,
        "overhead_vs_pipeline": our_s / pipeline_s,
        "overhead_ratio": our_s / bare_s,
    }


if __name__ == "__main__":
    torch.set_num_threads(min(2, torch.get_num_threads()))
    sys.stdout.write(json.dumps(main(sys.argv[1:]), indent=2) + "\n")
