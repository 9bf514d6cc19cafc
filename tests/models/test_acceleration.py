"""Gradient checkpointing, the attention kernel and torch.compile change memory and speed, not results.

For every tiny flow family (built through ``model.gradient_checkpointing=true``, its LoRA perturbed so
every LoRA tensor gets a gradient) and the tiny VLMs (Qwen2-VL, Qwen2.5-VL, Qwen3-VL):

* checkpointing: the training loss (a GRPO-like step log-prob objective; the VLMs' completion
  log-likelihood) and every LoRA gradient equal those with checkpointing off, within
  :data:`GRAD_TOLERANCE` of the gradient's scale in fp32; the transformer's layers do run again in the
  backward (more Linear calls), and not at all under ``no_grad`` (the rollouts);
* attention: ``eager`` and ``sdpa`` give the same velocity (VLMs: log-probs) within
  :data:`ATTENTION_TOLERANCE`, and each choice reaches every attention call (a spy on
  ``scaled_dot_product_attention`` sees the math kernel alone under eager — VLMs: no sdpa call at all);
* the checks can fail: every LoRA B moved by 1e-4 of its scale breaks the gradient and velocity
  tolerances; the loss, a sum dominated by the Gaussian's constant terms, hardly moves then (1.8e-7 of
  itself, float32 rounding), so its tolerance is shown to fail on LoRA B moved by a tenth of its scale;
* compile (``slow``): the tiny SD3's compiled rollout, compiled gradient-carrying recompute and eager
  forward, and the tiny Qwen2-VL's compiled and eager training forwards, agree within
  :data:`COMPILE_TOLERANCE`; the full-FT reference copy is compiled on its own (a copy of a compiled
  module would run the original).

The tolerances and the measured gaps are in docs/memory_speed.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch
from torch import nn

from rlgen_cli.errors import UserError
from rlgen_cli.models import build_policy
from rlgen_cli.models.acceleration import set_attention
from rlgen_cli.sde.rollout import StepSpec, recompute_step, rollout
from rlgen_cli.sde.sampling import conditioned
from rlgen_cli.sde.window import WindowPlan
from tests.conftest import TINY_RUN
from tests.models.helpers import CPU, model_cfg

FLOW_FAMILIES = {
    "sd3": "tiny_sd3", "flux": "tiny_flux", "flux_kontext": "tiny_flux_kontext", "flux2": "tiny_flux2",
    "flux2_klein": "tiny_flux2_klein", "qwen_image": "tiny_qwen_image", "qwen_image_edit": "tiny_qwen_image_edit",
    "qwen_image_edit_plus": "tiny_qwen_image_edit_plus", "wan2_1": "tiny_wan2_1", "wan2_2": "tiny_wan2_2",
    "wan2_2_i2v": "tiny_wan2_2_i2v", "z_image": "tiny_z_image", "qwen_image_2": "tiny_qwen_image_2",
    "qwen_image_2_edit": "tiny_qwen_image_2_edit",
    "bagel": "tiny_bagel", "bagel_edit": "tiny_bagel_edit",
}  # fmt: skip
VLM_FAMILIES = {"qwen2_vl": "tiny_qwen2_vl", "qwen2_5_vl": "tiny_qwen2_vl", "qwen3_vl": "tiny_qwen3_vl"}
PROMPTS = ["a red circle", "two blue squares"]
STEPS = 2
SPEC = StepSpec("flow_sde", 0.7)
ADVANTAGES = torch.tensor([1.0, -0.5])

FLOAT32_EPS = torch.finfo(torch.float32).eps
"""float32's relative rounding step (1.2e-7): a relative gap of a few of these is rounding, not a change."""
GRAD_TOLERANCE = 1e-6
"""Checkpointing, fp32: max |Δ| of the loss and of each gradient tensor ≤ this × its max |value| (≈ 8 ×
:data:`FLOAT32_EPS`: room for reordered sums, far below any real change)."""
ATTENTION_TOLERANCE = 1e-5
"""eager vs sdpa, fp32: max |Δ| of the velocity (VLMs: the log-probs) ≤ this × its max |value|."""
COMPILE_TOLERANCE = 1e-5
"""compiled vs eager and rollout vs recompute under compile, fp32: max |Δ log p| (absolute, per step)."""


def peak_bytes(fn) -> int:
    """Peak CPU tensor memory allocated while ``fn`` runs, above what was live before: the running sum of
    the profiler's allocation (+) and free (−) records in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    running = peak = 0
    for record in sorted(records, key=lambda e: e.start_ns()):
        running += record.nbytes()
        peak = max(peak, running)
    return peak


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b| (0 when both are 0)."""
    scale = b.abs().max()
    gap = (a - b).abs().max()
    return float(gap / scale) if scale > 0 else float(gap)


# -- flow families ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flow_built() -> dict[str, object]:
    return {}


def _flow_policy(built: dict, family: str):
    """The tiny policy of ``family`` with checkpointing on (from the config), LoRA B drawn at random."""
    if family not in built:
        cfg = dataclasses.replace(model_cfg(FLOW_FAMILIES[family]), gradient_checkpointing=True)
        torch.manual_seed(0)
        policy = build_policy(cfg, CPU)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, param in policy.trainable.named():
                if "lora_B" in name:
                    param.normal_(0, 0.3, generator=generator)
        built[family] = policy
    return built[family]


def _transformers(policy) -> list[nn.Module]:
    """The trained diffusers transformers (both experts of a two-expert Wan)."""
    return [
        m for m in policy.trainable.module.modules() if getattr(m, "_supports_gradient_checkpointing", False)
    ]


def _set_checkpointing(policy, on: bool) -> None:
    for module in _transformers(policy):
        if on:
            module.enable_gradient_checkpointing()
        else:
            module.disable_gradient_checkpointing()


def _cond(policy):
    if policy.capabilities.takes_source_images:
        cfg = policy.cfg
        sources = torch.rand(
            len(PROMPTS),
            3,
            cfg.height or cfg.resolution,
            cfg.width or cfg.resolution,
            generator=torch.Generator().manual_seed(2),
        )
        return policy.encode(PROMPTS, sources)
    return policy.encode(PROMPTS)


def _trajectory(policy):
    cond = _cond(policy)
    x = policy.noise(len(PROMPTS), torch.Generator().manual_seed(3))
    plan = WindowPlan(STEPS, sde_steps=tuple(range(STEPS)), train_steps=tuple(range(STEPS)))
    velocity = functools.partial(conditioned, policy, cond)
    return rollout(velocity, x, policy.schedule(STEPS, x), plan, SPEC, torch.Generator().manual_seed(4)), cond


def _logp(policy, traj, cond) -> torch.Tensor:
    """Σ_j log p_j of every stored step, recomputed on the training path (gradients if enabled)."""
    velocity = functools.partial(conditioned, policy, cond)
    return sum(recompute_step(velocity, traj, j, SPEC).logprob for j in range(STEPS))


def _loss_and_grads(policy, traj, cond) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The policy-gradient surrogate −mean(A · Σ_j log p_j) and every LoRA gradient."""
    params = policy.trainable.parameters()
    for param in params:
        param.grad = None
    loss = -(ADVANTAGES * _logp(policy, traj, cond)).mean()
    loss.backward()
    return loss.detach(), [param.grad.clone() for param in params]


class LinearCalls:
    """Counts the forward calls of every ``nn.Linear`` of a module (recomputed layers call them again)."""

    def __init__(self, module: nn.Module) -> None:
        self.count = 0
        self._handles = [
            m.register_forward_hook(self._hook) for m in module.modules() if isinstance(m, nn.Linear)
        ]

    def _hook(self, *_: object) -> None:
        self.count += 1

    def __enter__(self) -> LinearCalls:
        return self

    def __exit__(self, *_: object) -> None:
        for handle in self._handles:
            handle.remove()


@pytest.mark.parametrize("family", sorted(FLOW_FAMILIES))
def test_checkpointing_leaves_loss_and_every_lora_gradient_unchanged(flow_built, family):
    policy = _flow_policy(flow_built, family)
    assert all(m.gradient_checkpointing for m in _transformers(policy))  # switched on by the config
    module = policy.trainable.module
    with LinearCalls(module) as rollout_calls:  # no_grad: the same STEPS forwards as the recompute
        traj, cond = _trajectory(policy)
    with LinearCalls(module) as checkpointed:
        loss, grads = _loss_and_grads(policy, traj, cond)
    _set_checkpointing(policy, False)
    try:
        with LinearCalls(module) as plain:
            plain_loss, plain_grads = _loss_and_grads(policy, traj, cond)
    finally:
        _set_checkpointing(policy, True)
    assert (
        checkpointed.count > plain.count == rollout_calls.count
    )  # recomputed in the backward, never without grad
    assert relative_gap(loss, plain_loss) <= GRAD_TOLERANCE
    assert all(g.abs().max() > 0 for g in plain_grads)  # every LoRA tensor takes part
    gaps = [relative_gap(g, p) for g, p in zip(grads, plain_grads, strict=True)]
    assert max(gaps) <= GRAD_TOLERANCE, max(gaps)


@pytest.mark.parametrize("family", sorted(FLOW_FAMILIES))
def test_eager_attention_gives_the_sdpa_velocity(flow_built, family, monkeypatch):
    policy = _flow_policy(flow_built, family)
    cond = _cond(policy)
    x = policy.noise(len(PROMPTS), torch.Generator().manual_seed(5))
    sigma = torch.tensor(0.6)
    kernels = _spy_sdpa(monkeypatch)
    with torch.no_grad():
        sdpa = policy.velocity(x, sigma, cond)
        sdpa_kernels = list(kernels)
        kernels.clear()
        _set_attention(policy, "eager")
        try:
            eager = policy.velocity(x, sigma, cond)
        finally:
            _set_attention(policy, "sdpa")
    assert sdpa_kernels and all(fused for fused in sdpa_kernels)  # sdpa may pick a fused kernel
    assert kernels and not any(kernels)  # eager: every attention call on the math kernel
    assert 0 <= relative_gap(eager, sdpa) <= ATTENTION_TOLERANCE


def _set_attention(policy, attention: str) -> None:
    for module in _transformers(policy):
        set_attention(module, attention, policy.family)


def _spy_sdpa(monkeypatch) -> list[bool]:
    """Record, for each ``scaled_dot_product_attention`` call, whether a fused kernel was allowed."""
    calls: list[bool] = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(torch.backends.cuda.flash_sdp_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def test_the_tolerances_catch_lora_weights_moved_by_1e_4(flow_built):
    """The perturbation arm: every LoRA B moved by 1e-4 of its scale (tiny SD3) breaks the gradient and the
    velocity comparisons (measured: gradients 1.5e-3, velocity 8.8e-5)."""
    policy = _flow_policy(flow_built, "sd3")
    traj, cond = _trajectory(policy)
    _, grads = _loss_and_grads(policy, traj, cond)
    x, sigma = traj.latents[:, 0], traj.sigmas[0]
    with torch.no_grad():
        velocity = policy.velocity(x, sigma, cond)
    with _lora_b_moved(policy, 1e-4):
        _, moved_grads = _loss_and_grads(policy, traj, cond)
        with torch.no_grad():
            moved_velocity = policy.velocity(x, sigma, cond)
    assert max(relative_gap(g, m) for g, m in zip(grads, moved_grads, strict=True)) > 100 * GRAD_TOLERANCE
    assert relative_gap(moved_velocity, velocity) > ATTENTION_TOLERANCE


def test_the_loss_tolerance_catches_lora_weights_moved_by_a_tenth(flow_built):
    """The loss arm: 1e-4 moves the loss by 1.8e-7 of itself, float32 rounding (on some CPUs not at all),
    so the loss comparison is shown to fail on a move it can see: every LoRA B moved by 0.1 of its scale
    moves the loss by 5.7e-4, 100 × beyond the tolerance and ≈ 4800 float32 rounding steps."""
    policy = _flow_policy(flow_built, "sd3")
    traj, cond = _trajectory(policy)
    loss, _ = _loss_and_grads(policy, traj, cond)
    with _lora_b_moved(policy, 0.1):
        moved_loss, _ = _loss_and_grads(policy, traj, cond)
    assert 100 * GRAD_TOLERANCE > 800 * FLOAT32_EPS  # the margin is far above float32 rounding
    assert relative_gap(moved_loss, loss) > 100 * GRAD_TOLERANCE


@contextlib.contextmanager
def _lora_b_moved(policy, fraction: float):
    """Every LoRA B moved by ``fraction`` of its max |value| (Gaussian directions, fixed seed); restored after."""
    saved = [param.detach().clone() for param in policy.trainable.parameters()]
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, param in policy.trainable.named():
            if "lora_B" in name:
                param.add_(fraction * param.abs().max() * torch.randn(param.shape, generator=generator))
    try:
        yield
    finally:
        with torch.no_grad():
            for param, value in zip(policy.trainable.parameters(), saved, strict=True):
                param.copy_(value)


def test_checkpointing_lowers_the_peak_memory_of_an_update():
    """A deeper tiny SD3 (4 blocks; the shipped one has 1, where there is nothing to save): the peak tensor
    memory of one update's forward + backward falls by more than half (docs/memory_speed.md)."""
    from rlgen_cli.models.sd3 import SD3Policy
    from rlgen_cli.models.tiny.image import SD3Sizes, tiny_sd3_pipeline

    peaks = {}
    for on in (False, True):
        cfg = dataclasses.replace(model_cfg("tiny_sd3"), gradient_checkpointing=on)
        policy = SD3Policy(tiny_sd3_pipeline(0, sizes=SD3Sizes(num_layers=4)), cfg, CPU)
        cond = policy.encode(PROMPTS)
        x = policy.noise(len(PROMPTS), torch.Generator().manual_seed(0))

        def update(policy=policy, cond=cond, x=x) -> None:
            policy.velocity(x, torch.tensor(0.6), cond).square().mean().backward()

        update()  # allocations of a first call (caches) stay out of the measure
        peaks[on] = peak_bytes(update)
    assert peaks[True] < 0.5 * peaks[False], peaks


def test_every_flow_family_built_on_the_trainable_transformer_is_covered_here():
    """A new family joins FLOW_FAMILIES; the ShapesEval UNet has its own test below (it refuses both
    settings)."""
    from rlgen_cli.models import FAMILIES

    assert set(FLOW_FAMILIES) == set(FAMILIES) - {"shapes"}


def test_a_frozen_wan_expert_takes_the_attention_kernel_too():
    """Only the high-noise expert trains; the low-noise one is called by the same velocity and must run the
    same kernel."""
    from rlgen_cli.models.acceleration import MathKernel

    cfg = model_cfg("tiny_wan2_2")
    cfg = dataclasses.replace(
        cfg, attention="eager", experts=dataclasses.replace(cfg.experts, train="high_noise")
    )
    policy = build_policy(cfg, CPU)
    frozen = policy.trainable.experts["low_noise"].module
    processors = [m.processor for m in frozen.modules() if hasattr(m, "processor")]
    assert processors and all(isinstance(p, MathKernel) for p in processors)


# -- settings a family cannot honour, bad values ----------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"gradient_checkpointing": True}, "model.gradient_checkpointing"),
        ({"attention": "eager"}, "model.attention"),
    ],
)
def test_the_shapes_unet_refuses_what_it_has_no_alternative_for(change, match):
    cfg = dataclasses.replace(model_cfg("shapes_unet"), **change)
    with pytest.raises(UserError, match=match):
        build_policy(cfg, CPU)


def test_an_unknown_attention_kernel_exits_2_naming_the_key_and_the_choices(cli, tmp_path, capsys):
    code, out = cli("check-onpolicy", *TINY_RUN, "model.attention=flash", f"hydra.run.dir={tmp_path}")
    message = " ".join((out + capsys.readouterr().err).split())
    assert code == 2 and "model.attention='flash' is not valid; choose one of sdpa, eager" in message, message


def test_check_onpolicy_with_gradient_checkpointing_gives_ratio_exactly_one(cli, tmp_path):
    code, out = cli(
        "check-onpolicy", *TINY_RUN, "model.gradient_checkpointing=true", f"hydra.run.dir={tmp_path}"
    )
    assert code == 0 and "PASS max error 0.000e+00" in out, out


def test_full_ft_compile_compiles_the_frozen_reference_on_its_own():
    """``nn.Module.compile`` is a closure over its module: a copy taken afterwards would run the original.
    The full-FT reference copy is taken first and compiled itself (checked eagerly: no compilation)."""
    cfg = model_cfg("tiny_sd3")
    cfg = dataclasses.replace(cfg, compile=True, lora=dataclasses.replace(cfg.lora, enabled=False))
    policy = build_policy(cfg, CPU)
    cond = policy.encode(PROMPTS)
    x = policy.noise(len(PROMPTS), torch.Generator().manual_seed(7))
    sigma = torch.tensor(0.6)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        base = policy.velocity(x, sigma, cond)
        for param in policy.trainable.parameters():
            param.add_(0.05)
        moved = policy.velocity(x, sigma, cond)
        with policy.trainable.reference():
            reference = policy.velocity(x, sigma, cond)
            assert policy.trainable.module._compiled_call_impl is not None  # the frozen copy, compiled
    assert relative_gap(moved, base) > 1e-3
    # the original weights in another copy: other memory may take another kernel path (MKL's AVX2 GEMM
    # differs in the last bit), so equal to float32 rounding, 1000 × below the moved weights' gap
    assert relative_gap(reference, base) <= GRAD_TOLERANCE


# -- VLMs ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vlm_built() -> dict[str, object]:
    return {}


def _vlm(built: dict, family: str):
    if family not in built:
        from rlgen_cli.vlm.policy import build_vlm

        cfg = dataclasses.replace(model_cfg(VLM_FAMILIES[family]), family=family, gradient_checkpointing=True)
        policy = build_vlm(cfg, CPU)
        generator = torch.Generator().manual_seed(8)
        with torch.no_grad():
            for name, param in policy.named_trainable().items():
                if "lora_B" in name:
                    param.normal_(0, 0.3, generator=generator)
        built[family] = policy
    return built[family]


def _vlm_batch(policy):
    from rlgen_cli.vlm.data import load_vlm_examples, prompt_text
    from rlgen_cli.vlm.rollout import collate, load_image

    examples = load_vlm_examples("builtin:tiny_r1vl.json")[:2]
    vlm = policy.cfg.vlm
    prompts = [prompt_text(policy.processor, ex, vlm.prompt_format, vlm.system_prompt) for ex in examples]
    completion = torch.tensor(policy.tokenizer("### Step 1: the answer is 3.")["input_ids"])
    return collate(policy, prompts, [load_image(ex.image) for ex in examples], [completion, completion[:-3]])


def _vlm_loss_and_grads(policy, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    from rlgen_cli.vlm.rollout import completion_logprobs

    params = policy.trainable_parameters()
    for param in params:
        param.grad = None
    mask = batch.completion_mask
    loss = -(completion_logprobs(policy, batch) * mask).sum() / mask.sum()
    loss.backward()
    return loss.detach(), [param.grad.clone() for param in params]


@pytest.mark.parametrize("family", sorted(VLM_FAMILIES))
def test_vlm_checkpointing_leaves_loss_and_every_lora_gradient_unchanged(vlm_built, family):
    policy = _vlm(vlm_built, family)
    model = policy.model
    assert model.is_gradient_checkpointing and model.training
    batch = _vlm_batch(policy)
    with LinearCalls(model) as checkpointed:
        loss, grads = _vlm_loss_and_grads(policy, batch)
    model.gradient_checkpointing_disable()
    try:
        with LinearCalls(model) as plain:
            plain_loss, plain_grads = _vlm_loss_and_grads(policy, batch)
    finally:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert checkpointed.count > plain.count
    assert relative_gap(loss, plain_loss) <= GRAD_TOLERANCE
    assert all(g.abs().max() > 0 for g in plain_grads)
    assert max(relative_gap(g, p) for g, p in zip(grads, plain_grads, strict=True)) <= GRAD_TOLERANCE


@pytest.mark.parametrize("family", sorted(VLM_FAMILIES))
def test_vlm_eager_attention_gives_the_sdpa_logprobs(vlm_built, family, monkeypatch):
    from rlgen_cli.vlm.rollout import completion_logprobs

    policy = _vlm(vlm_built, family)
    batch = _vlm_batch(policy)
    mask = batch.completion_mask.bool()
    kernels = _spy_sdpa(monkeypatch)
    with torch.no_grad():
        sdpa = completion_logprobs(policy, batch)[mask]
        sdpa_calls = len(kernels)
        policy.model.set_attn_implementation("eager")
        try:
            eager = completion_logprobs(policy, batch)[mask]
        finally:
            policy.model.set_attn_implementation("sdpa")
    assert sdpa_calls > 0 and len(kernels) == sdpa_calls  # eager: no sdpa call at all
    assert relative_gap(eager, sdpa) <= ATTENTION_TOLERANCE


# -- compile ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_compiled_sd3_logprobs_match_the_rollout_and_the_eager_forward():
    cfg = dataclasses.replace(model_cfg("tiny_sd3"), compile=True)
    torch.manual_seed(0)
    policy = build_policy(cfg, CPU)
    with torch.no_grad():
        for name, param in policy.trainable.named():
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(9))
    traj, cond = _trajectory(policy)  # the compiled no-grad graph
    velocity = functools.partial(conditioned, policy, cond)
    for j in range(STEPS):
        compiled = recompute_step(velocity, traj, j, SPEC).logprob  # the compiled training graph
        compiled.mean().backward()
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            eager = recompute_step(velocity, traj, j, SPEC).logprob
        assert (compiled.detach() - traj.logprobs[:, j]).abs().max() <= COMPILE_TOLERANCE
        assert (compiled.detach() - eager).abs().max() <= COMPILE_TOLERANCE
    assert policy.trainable.module._compiled_call_impl is not None


@pytest.mark.slow
def test_compiled_vlm_training_forward_matches_the_eager_one():
    """VLMs compile the training forward only: ``train_model`` is the compiled wrapper of the bare model,
    which ``generate`` and the reference keep using eagerly."""
    from rlgen_cli.vlm.policy import build_vlm
    from rlgen_cli.vlm.rollout import completion_logprobs

    policy = build_vlm(dataclasses.replace(model_cfg("tiny_qwen2_vl"), compile=True), CPU)
    with torch.no_grad():
        for name, param in policy.named_trainable().items():
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(10))
    batch = _vlm_batch(policy)
    mask = batch.completion_mask.bool()
    compiled = completion_logprobs(policy, batch)
    compiled.sum().backward()
    with torch.no_grad():
        eager = completion_logprobs(policy, batch, model=policy.model)
    assert policy.train_model is not policy.model and policy.train_model._orig_mod is policy.model
    assert (compiled.detach() - eager)[mask].abs().max() <= COMPILE_TOLERANCE
