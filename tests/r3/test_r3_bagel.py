"""R3 on one BAGEL network (``model=tiny_r3_bagel``): the text track's KV-cache sampler against the full
forward, the two tracks' adapters and references, thinking on / off, and the recipe through the CLI —
both stages, both tracks, on one process and on two; then full fine-tuning (upstream's default): which
weights each track owns, the frozen-copy references, the release-layout checkpoint and a CLI run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_cli
from tests.r3.conftest import compose_r3

TINY = ["model=tiny_r3_bagel", "progress=false", "eval_every=0"]
PROMPTS = ["a photo of a cat", "two red squares", "a blue circle left of a green triangle", "x"]
WEIGHTS = "checkpoints/epoch_000002/weights/pytorch_lora_weights.safetensors"


def _policy(*overrides: str):
    from rlgen_cli.r3.bagel import build_bagel_unified

    typed, _ = compose_r3("train", [*TINY, *overrides])
    torch.manual_seed(typed.seed)
    return build_bagel_unified(typed.r3.policy, torch.device("cpu"))


def _options(tokens: int = 10):
    from rlgen_cli.vlm.rollout import SamplingOptions

    return SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=tokens)


@torch.no_grad()
def _move_adapters(policy, track: str, std: float = 0.3, seed: int = 1) -> None:
    """Give a track's LoRA B matrices (zero at init) values, so its adapters change the network's output."""
    generator = torch.Generator().manual_seed(seed)
    for param in policy.trainable_parameters(track):
        param.add_(torch.randn(param.shape, generator=generator) * std)


@pytest.fixture(scope="module")
def policy():
    from rlgen_cli.r3.policy import IMAGE, TEXT

    built = _policy()
    _move_adapters(built, TEXT)
    _move_adapters(built, IMAGE, seed=2)
    return built


def _sampler_gap(policy, thoughts) -> float:
    batch = policy.token_batch(thoughts, slice(0, len(thoughts)))
    with torch.no_grad():
        trained = policy.token_logprobs(batch)
    return max(
        (trained[i, : c.numel()] - thoughts.sampler_logprobs[i]).abs().max().item()
        for i, c in enumerate(thoughts.completions)
    )


# -- text track -------------------------------------------------------------------------------------------
def test_cached_sampling_agrees_with_the_full_forward(policy):
    thoughts = policy.think(PROMPTS, _options(), seed=3)
    assert [c.numel() for c in thoughts.completions] == [10] * 4  # random weights: no stop within 10
    assert all(lp.shape == c.shape for lp, c in zip(thoughts.sampler_logprobs, thoughts.completions))
    gap = _sampler_gap(policy, thoughts)
    assert gap < 1e-5  # fp32 rounding of the cached vs the full products (measured 1.4e-6)
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    reflections = policy.reflect(images, PROMPTS[:2], _options(), seed=4)
    assert reflections.images[0] is not None and _sampler_gap(policy, reflections) < 1e-5


def test_the_check_fails_when_the_text_weights_move(policy):
    from rlgen_cli.r3.policy import TEXT

    thoughts = policy.think(PROMPTS[:2], _options(), seed=5)
    moved = _policy()
    _move_adapters(moved, TEXT, std=0.3, seed=9)  # another text adapter than the one that sampled
    assert _sampler_gap(moved, thoughts) > 1e-3


def test_a_row_samples_the_same_alone_or_in_a_padded_batch(policy):
    together = policy.think(PROMPTS, _options(), seed=7)
    alone = policy.think(PROMPTS[:1], _options(), seed=7)
    assert torch.equal(together.completions[0], alone.completions[0])
    other_seed = policy.think(PROMPTS[:1], _options(), seed=8)
    assert not torch.equal(other_seed.completions[0], alone.completions[0])


def test_reference_turns_the_adapters_off_and_the_image_adapters_do_not_touch_text(policy):
    thoughts = policy.think(PROMPTS[:2], _options(), seed=3)
    batch = policy.token_batch(thoughts, slice(0, 2))
    with torch.no_grad():
        trained = policy.token_logprobs(batch)
        reference = policy.token_logprobs(batch, reference=True)
        with policy.image_reference():  # generation-expert adapters off: a text pass never uses them
            image_off = policy.token_logprobs(batch)
    assert torch.equal(trained, image_off)
    assert (trained - reference).abs().max() > 1e-3


# -- image track ----------------------------------------------------------------------------------------
def test_tracks_split_by_expert_and_image_reference_switches_the_generation_expert_only(policy):
    from rlgen_cli.r3.policy import GENERATE, IMAGE, STAGE_KEY, TEXT

    names = {id(p): n for n, p in policy.network.named_parameters()}
    assert all("_moe_gen" in names[id(p)] for p in policy.trainable_parameters(IMAGE))
    assert all("_moe_gen" not in names[id(p)] for p in policy.trainable_parameters(TEXT))
    assert len(policy.trainable_parameters(TEXT)) == len(policy.trainable_parameters(IMAGE)) == 28
    cond = policy.encode_generate(PROMPTS[:2], ["a plan", ""])
    assert cond.extras[STAGE_KEY] == GENERATE
    x = policy.noise(2, [torch.Generator().manual_seed(i) for i in range(2)], GENERATE)
    sigma = torch.tensor(0.5)
    with torch.no_grad():
        live = policy.velocity(x, sigma, cond)
        with policy.image_reference():
            image_off = policy.velocity(x, sigma, cond)
        with policy.image.trainable.reference():
            all_off = policy.velocity(x, sigma, cond)
        again = policy.velocity(x, sigma, cond)
    assert torch.equal(live, again)  # the adapters are back on after the context
    assert (live - image_off).abs().max() > 1e-4 and (image_off - all_off).abs().max() > 1e-4


def test_thinking_puts_system_prompt_and_plan_in_the_generation_context():
    thinking, plain = _policy(), _policy("r3.policy.think=false")
    with_plan = thinking.encode_generate(PROMPTS[:1], ["draw one cat"]).tensors
    without = thinking.encode_generate(PROMPTS[:1], [""]).tensors
    plain_cond = plain.encode_generate(PROMPTS[:1], ["ignored"]).tensors
    tokens = len(thinking.image.tokenizer.encode("draw one cat", add_special_tokens=False))
    assert int(with_plan["text_mask"].sum()) == int(without["text_mask"].sum()) + tokens + 2  # + markers
    assert int(with_plan["neg_text_mask"].sum()) > 0  # the CFG branch keeps the system prompt
    # thinking off: exactly BAGEL's own text-to-image context, against the empty one
    expected = plain.image.encode(PROMPTS[:1]).tensors
    assert torch.equal(plain_cond["text_ids"], expected["text_ids"])
    assert torch.equal(plain_cond["text_mask"], expected["text_mask"])
    assert int(plain_cond["neg_text_mask"].sum()) == 0
    empty = plain.think(PROMPTS[:2], _options(), seed=0)
    assert [c.numel() for c in empty.completions] == [0, 0] and empty.texts == ["", ""]


def test_editing_conditions_on_the_source_image(policy):
    from rlgen_cli.r3.policy import EDIT, STAGE_KEY

    sources = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))  # resized to 32 px
    cond = policy.encode_edit(sources, ["make it red", "make it red"])
    assert cond.extras[STAGE_KEY] == EDIT
    x = policy.noise(2, [torch.Generator().manual_seed(0)] * 2, EDIT)
    with torch.no_grad():
        v = policy.velocity(x, torch.tensor(0.5), cond)
    assert v.shape == x.shape and (v[0] - v[1]).abs().max() > 1e-4  # same noise, different sources


def test_trainable_weights_round_trip(policy, tmp_path: Path):
    from rlgen_cli.r3.policy import IMAGE, TEXT

    policy.save_trainable(tmp_path)
    fresh = _policy()
    fresh.load_trainable(tmp_path)
    for track in (TEXT, IMAGE):
        for a, b in zip(policy.trainable_parameters(track), fresh.trainable_parameters(track), strict=True):
            assert torch.equal(a, b)


# -- through the CLI --------------------------------------------------------------------------------------
def _rows(out: str) -> list[str]:
    return [
        line for line in out.splitlines() if line.startswith("│ ") and ("reason" in line or "refine" in line)
    ]


def test_check_onpolicy_passes_and_fails_when_the_weights_move(tmp_path: Path):
    code, out = run_cli("check-onpolicy", *TINY, f"hydra.run.dir={tmp_path / 'ok'}")
    assert code == 0, out
    rows = _rows(out)
    assert len(rows) == 4 and all(row.rstrip("│ ").endswith("ok") for row in rows), out
    assert "image, step" in out
    code, out = run_cli(
        "check-onpolicy", *TINY, "check.perturb_weights=1e-3", f"hydra.run.dir={tmp_path / 'moved'}"
    )
    assert code == 1, out
    assert len(_rows(out)) == 4 and all(row.rstrip("│ ").endswith("FAIL") for row in _rows(out)), out


def _lora_b(path: Path) -> dict[str, float]:
    """Largest |B| of each track's LoRA tensors (B starts at zero)."""
    state = load_file(path)
    out = {"text": 0.0, "image": 0.0}
    for name, value in state.items():
        if "lora_B" in name:
            track = "image" if "_moe_gen" in name else "text"
            out[track] = max(out[track], value.abs().max().item())
    return out


def _train(run: Path, *extra: str) -> Path:
    code, out = run_cli("train", *TINY, "epochs=2", "r3.micro_batch_size=2", *extra, f"hydra.run.dir={run}")
    assert code == 0, out
    return run


def test_train_runs_both_stages_and_moves_both_tracks(tmp_path: Path):
    run = _train(tmp_path)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["stage"] for m in metrics] == [0.0, 1.0]  # reason, then refine
    assert all(m["ratio_error_max"] == 0.0 for m in metrics)
    moved = _lora_b(run / WEIGHTS)
    assert moved["text"] > 0 and moved["image"] > 0, moved
    # rlgen eval of the checkpoint: generation, then reflect → refine rounds on the trained network
    checkpoint = run / WEIGHTS.split("/weights")[0]
    code, out = run_cli(
        "eval", "model=tiny_r3_bagel", f"checkpoint={checkpoint}", f"hydra.run.dir={tmp_path / 'eval'}"
    )
    assert code == 0, out
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["rounds"] == 2 and "round_2/overall" in results, results


def test_the_text_loss_trains_the_understanding_expert(tmp_path: Path):
    from rlgen_cli.r3.policy import IMAGE, TEXT
    from rlgen_cli.recipes.r3 import R3Recipe

    # A random network never closes a plan, so its text rewards (format × …) are all 0: the advantages of
    # a real reason rollout are set by hand, and the recipe's update runs the text loss alone.
    typed, raw = compose_r3(
        "train", [*TINY, "r3.tune_image_cot=false", "r3.kl_weight_text=0"], run_dir=tmp_path
    )
    recipe = R3Recipe(typed, raw)
    recipe.setup()
    try:
        policy = recipe.policy
        batch = recipe.rollout_reason(0)
        text_before = [p.detach().clone() for p in policy.trainable_parameters(TEXT)]
        image_before = [p.detach().clone() for p in policy.trainable_parameters(IMAGE)]
        recipe.update(batch)  # zero advantages: no text gradient
        unchanged = all(torch.equal(a, p) for a, p in zip(text_before, policy.trainable_parameters(TEXT)))
        batch.text_adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
        recipe.update(batch)
    finally:
        recipe.cleanup()
    assert unchanged
    assert any(
        not torch.equal(a, p) for a, p in zip(text_before, policy.trainable_parameters(TEXT), strict=True)
    )
    assert all(
        torch.equal(a, p) for a, p in zip(image_before, policy.trainable_parameters(IMAGE), strict=True)
    )


@pytest.mark.slow  # ~20 s: a run on one process and one on two
def test_two_processes_train_as_one(tmp_path: Path):
    one = _train(tmp_path / "one")
    two = _train(tmp_path / "two", "launcher=accelerate", "launcher.num_processes=2")
    a, b = load_file(one / WEIGHTS), load_file(two / WEIGHTS)
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6  # 0 with one thread on both sides
    assert _lora_b(two / WEIGHTS)["text"] > 0 and _lora_b(two / WEIGHTS)["image"] > 0

    def rows(run: Path) -> list[tuple]:
        files = sorted((run / "samples").glob("rank_*.jsonl"))
        parsed = [json.loads(line) for f in files for line in f.read_text().splitlines()]
        return sorted(
            (r["step"], r["position"], r["text"], r["reward_image"], r["noise_sum"]) for r in parsed
        )

    assert rows(one) == rows(two)  # the same texts, images (rewards) and noise, branch by branch


# -- full fine-tuning (r3.policy.bagel.lora.enabled=false) ----------------------------------------------
FULL = "r3.policy.bagel.lora.enabled=false"
FULL_WEIGHTS = "checkpoints/epoch_000002/weights/ema.safetensors"


@pytest.fixture(scope="module")
def full():
    return _policy(FULL)


def _start_state() -> dict[str, torch.Tensor]:
    """The tiny network's starting weights (the tiny model is built from a fixed seed), fp32."""
    return {k: v.float() for k, v in _policy(FULL).network.state_dict().items()}


def test_full_ft_tracks_own_the_experts_and_the_vit_is_frozen(full):
    from rlgen_cli.r3.policy import IMAGE, TEXT

    names = {id(p): n for n, p in full.network.named_parameters()}
    text = {names[id(p)] for p in full.trainable_parameters(TEXT)}
    image = {names[id(p)] for p in full.trainable_parameters(IMAGE)}
    layer = "language_model.model.layers.0."
    assert {
        f"{layer}self_attn.q_proj.weight",
        f"{layer}self_attn.q_norm.weight",
        f"{layer}mlp.up_proj.weight",
        f"{layer}input_layernorm.weight",
        "language_model.model.norm.weight",
        "language_model.lm_head.weight",
        "language_model.model.embed_tokens.weight",
        "connector.fc1.weight",
    } <= text
    assert {
        f"{layer}self_attn.q_proj_moe_gen.weight",
        f"{layer}mlp_moe_gen.up_proj.weight",
        f"{layer}input_layernorm_moe_gen.weight",
        "language_model.model.norm_moe_gen.weight",
        "vae2llm.weight",
        "llm2vae.weight",
        "time_embedder.mlp.0.weight",
    } <= image
    assert not any("_moe_gen" in n for n in text) and not text & image
    vit = {n for n in names.values() if n.startswith("vit_model.")}
    assert vit and not vit & (text | image)
    assert all(not p.requires_grad for p in full.network.vit_model.parameters())
    trained = {n for n, p in full.network.named_parameters() if p.requires_grad}
    assert trained == text | image  # every trained weight is on one track


@torch.no_grad()
def _move(params, std: float = 0.05, seed: int = 7) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.add_(torch.randn(param.shape, generator=generator) * std)


def test_full_ft_references_are_the_frozen_starting_weights():
    from rlgen_cli.r3.policy import GENERATE, IMAGE, TEXT

    policy = _policy(FULL)
    thoughts = policy.think(PROMPTS[:2], _options(), seed=3)
    batch = policy.token_batch(thoughts, slice(0, 2))
    cond = policy.encode_generate(PROMPTS[:2], ["a plan", ""])
    x = policy.noise(2, [torch.Generator().manual_seed(i) for i in range(2)], GENERATE)
    sigma = torch.tensor(0.5)
    with torch.no_grad():
        text_start, v_start = policy.token_logprobs(batch), policy.velocity(x, sigma, cond)
        assert torch.equal(policy.token_logprobs(batch, reference=True), text_start)  # a copy: equal at start
        _move(policy.trainable_parameters(TEXT) + policy.trainable_parameters(IMAGE))  # as a step does
        text_trained, v_trained = policy.token_logprobs(batch), policy.velocity(x, sigma, cond)
        text_reference = policy.token_logprobs(batch, reference=True)
        image_weights = [p.clone() for p in policy.trainable_parameters(IMAGE)]
        with policy.image_reference():
            v_image_reference = policy.velocity(x, sigma, cond)
            text_under_image_reference = policy.token_logprobs(batch)
        v_again = policy.velocity(x, sigma, cond)
        with policy.image.trainable.reference():
            v_all_reference = policy.velocity(x, sigma, cond)
    assert (text_trained - text_start).abs().max() > 1e-3
    assert torch.equal(text_reference, text_start)  # the reference did not move with the trained weights
    assert torch.equal(text_under_image_reference, text_trained)  # a text pass never uses the image track
    assert (v_trained - v_start).abs().max() > 1e-4
    assert torch.equal(v_all_reference, v_start)
    # the image reference: starting generation expert, trained understanding expert (the prompt's context)
    assert (v_image_reference - v_start).abs().max() > 1e-5 and (
        v_image_reference - v_trained
    ).abs().max() > 1e-5
    assert torch.equal(v_again, v_trained)
    assert all(
        torch.equal(a, b) for a, b in zip(image_weights, policy.trainable_parameters(IMAGE), strict=True)
    )


def test_full_ft_checkpoint_is_the_release_layout_and_round_trips(tmp_path: Path):
    from rlgen_cli.models.bagel.config import TINY_BAGEL
    from rlgen_cli.models.bagel.loading import load_checkpoint
    from rlgen_cli.r3.policy import IMAGE, TEXT

    policy = _policy(FULL)
    _move(policy.trainable_parameters(TEXT) + policy.trainable_parameters(IMAGE))
    policy.save_trainable(tmp_path)
    assert {"ema.safetensors", "llm_config.json", "vit_config.json", "ae.safetensors"} <= {
        f.name for f in tmp_path.iterdir()
    }
    fresh = _policy(FULL)
    state = policy.network.state_dict()
    assert any(not torch.equal(v, fresh.network.state_dict()[k]) for k, v in state.items())
    fresh.load_trainable(tmp_path)
    assert all(torch.equal(v, fresh.network.state_dict()[k]) for k, v in state.items())
    # the checkpoint is a BAGEL directory the loader reads (what r3.policy.bagel.path takes)
    network, *_ = load_checkpoint(tmp_path, torch.float32, base=TINY_BAGEL)  # the sizes no JSON file holds
    assert all(torch.equal(v, network.state_dict()[k]) for k, v in state.items())
    lora = _policy()
    with pytest.raises(Exception, match="pytorch_lora_weights"):  # a LoRA policy refuses a full checkpoint
        lora.load_trainable(tmp_path)


def test_full_ft_train_moves_both_experts_and_leaves_the_vit_bit_identical(tmp_path: Path):
    run = _train(tmp_path, FULL)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["stage"] for m in metrics] == [0.0, 1.0] and all(m["ratio_error_max"] == 0.0 for m in metrics)
    trained, start = load_file(run / FULL_WEIGHTS), _start_state()
    assert trained.keys() == start.keys()

    def moved(keep) -> float:
        return max((trained[k] - start[k]).abs().max().item() for k in trained if keep(k))

    assert moved(lambda k: ".layers." in k and "_moe_gen" not in k) > 0  # understanding expert
    assert moved(lambda k: "_moe_gen" in k) > 0  # generation expert
    assert moved(lambda k: k.startswith(("vae2llm.", "llm2vae.", "time_embedder."))) > 0  # generation head
    assert all(torch.equal(trained[k], start[k]) for k in trained if k.startswith("vit_model."))


@pytest.mark.slow  # ~15-35 s: a CLI check on the full-FT network
def test_check_onpolicy_passes_with_full_fine_tuning(tmp_path: Path):
    code, out = run_cli("check-onpolicy", *TINY, FULL, f"hydra.run.dir={tmp_path / 'ok'}")
    assert code == 0, out
    rows = _rows(out)
    assert len(rows) == 4 and all(row.rstrip("│ ").endswith("ok") for row in rows), out
    # (that the check fails when the weights move: test_check_onpolicy_passes_and_fails_when_the_weights_move)


@pytest.mark.slow  # ~25 s: a full-FT run on one process and one on two
def test_full_ft_two_processes_train_as_one(tmp_path: Path):
    one = _train(tmp_path / "one", FULL)
    two = _train(tmp_path / "two", FULL, "launcher=accelerate", "launcher.num_processes=2")
    a, b = load_file(one / FULL_WEIGHTS), load_file(two / FULL_WEIGHTS)
    assert a.keys() == b.keys()
    # 0 with one thread on both sides; the connector, unused in the reason step, too: it gets a zero
    # gradient on one process as under DDP (2.7e-4 = 0.27·lr apart when one process left it without a gradient)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
