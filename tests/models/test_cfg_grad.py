"""``algo.cfg_grad``: the training forward's gradient through classifier-free guidance.

v = u + g·(c − u). ``both`` differentiates both branches: ∂v = g·∂c + (1 − g)·∂u. ``conditional``
detaches the unconditional prediction: ∂v = g·∂c. The hand computations below take c and u from the
same network run WITHOUT guidance (one branch per call), so they do not reuse the CFG code under test.
"""

from __future__ import annotations

import pytest
import torch

from rlgen_cli.errors import UserError
from rlgen_cli.models.base import Cond, cfg_gradient, uncond_takes_grad
from rlgen_cli.models.shapes import ShapesPolicy
from rlgen_cli.models.shapes_unet import ShapesUNet
from rlgen_cli.models.wan import WanPolicy
from rlgen_cli.schema.model import model_config
from rlgen_cli.schema.run import LoraConfig
from rlgen_cli.tasks.common import validated
from tests.conftest import TINY_RUN
from tests.schema.test_compose import _compose

GUIDANCE = 4.5
PROMPTS = ["a red circle", "two blue squares"]


def _shapes_policy(unet: ShapesUNet, guidance: float) -> ShapesPolicy:
    cfg = model_config(
        "shapes",
        tiny=True,
        dtype="float32",
        resolution=16,
        guidance_scale=guidance,
        shift=1.0,
        max_sequence_length=16,
        lora=LoraConfig(enabled=False, target_modules=["to_q"], init="kaiming"),
    )
    return ShapesPolicy(unet, cfg, torch.device("cpu"))


@pytest.fixture(scope="module")
def policies() -> tuple[ShapesPolicy, ShapesPolicy]:
    torch.manual_seed(0)
    unet = ShapesUNet(
        channels=(8, 16),
        cross_attention=(False, True),
        self_attention=(False, False),
        text_dim=16,
        text_layers=1,
        emb_dim=16,
    )
    return _shapes_policy(unet, GUIDANCE), _shapes_policy(unet, 1.0)  # one network, with and without CFG


def _grad(policy: ShapesPolicy, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    params = policy.trainable.parameters()
    return torch.cat([g.flatten() for g in torch.autograd.grad((w * v).sum(), params)])


def test_conditional_gradient_is_g_times_the_conditional_branch(policies):
    guided, plain = policies
    x, sigma = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)), torch.tensor(0.6)
    w = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))  # loss L(v) = Σ w·v
    cond = guided.encode(PROMPTS)

    v_both = guided.velocity(x, sigma, cond)
    grad_both = _grad(guided, v_both, w)
    with cfg_gradient("conditional"):
        v_conditional = guided.velocity(x, sigma, cond)
        grad_conditional = _grad(guided, v_conditional, w)

    # by hand: the conditional and unconditional predictions, one network call each, no guidance
    grad_c = _grad(plain, plain.velocity(x, sigma, plain.encode(PROMPTS)), w)
    grad_u = _grad(plain, plain.velocity(x, sigma, plain.encode([""] * len(PROMPTS))), w)

    # same forward values up to GEMM rounding (conditional runs the branches as two passes); the ratio
    # stays exactly 1 because rollout and training use the same mode (check-onpolicy test below)
    torch.testing.assert_close(v_conditional, v_both, rtol=1e-6, atol=1e-6)
    # the CFG forward runs both branches as one batch of 4, the hand one as batches of 2: GEMM rounding,
    # so errors are measured against the gradient's scale
    scale = float(grad_both.abs().max())
    close = {"rtol": 1e-4, "atol": 1e-5 * scale}
    torch.testing.assert_close(grad_conditional, GUIDANCE * grad_c, **close)
    torch.testing.assert_close(grad_both, GUIDANCE * grad_c + (1 - GUIDANCE) * grad_u, **close)
    assert (grad_conditional - grad_both).abs().max() > 1e-2 * scale  # (1 − g)·∂u is far from negligible


class _TwoPassPolicy:
    """Stand-in for WanPolicy's state: ``velocity`` runs ``_forward`` once per branch."""

    device = torch.device("cpu")
    guidance_scale = GUIDANCE

    def __init__(self) -> None:
        torch.manual_seed(3)
        self.layer = torch.nn.Linear(4, 4)
        self.uncond_forwards_with_grad: list[bool] = []

    def _forward(self, x: torch.Tensor, timestep: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        if embeds is self.neg:
            self.uncond_forwards_with_grad.append(torch.is_grad_enabled())
        return self.layer(x + embeds)


def test_separate_branch_forward_skips_the_unconditional_graph():
    stub = _TwoPassPolicy()
    embeds, stub.neg = torch.randn(2, 4), torch.randn(2, 4)
    cond = Cond({"prompt_embeds": embeds, "neg_prompt_embeds": stub.neg})
    x = torch.randn(2, 4)
    v_both = WanPolicy.velocity(stub, x, torch.tensor(0.5), cond)
    with cfg_gradient("conditional"):
        v_conditional = WanPolicy.velocity(stub, x, torch.tensor(0.5), cond)
        (grad,) = torch.autograd.grad(v_conditional.sum(), stub.layer.weight)
    assert stub.uncond_forwards_with_grad == [True, False]
    assert torch.equal(v_conditional, v_both)
    (grad_c,) = torch.autograd.grad(stub.layer(x + embeds).sum(), stub.layer.weight)
    torch.testing.assert_close(grad, GUIDANCE * grad_c)


def test_mode_is_scoped_and_checked():
    assert uncond_takes_grad()
    with cfg_gradient("conditional"):
        assert not uncond_takes_grad()
    assert uncond_takes_grad()
    with pytest.raises(AssertionError, match="uncond"), cfg_gradient("uncond"):
        pass
    with pytest.raises(UserError, match="algo.cfg_grad='uncond' is not valid"):
        validated(_compose("train", ["algo.cfg_grad=uncond"]))


def test_check_onpolicy_stays_exact_with_conditional_gradient(cli, tmp_path):
    code, out = cli(
        "check-onpolicy",
        *TINY_RUN,
        f"model.guidance_scale={GUIDANCE}",
        "algo.cfg_grad=conditional",
        f"hydra.run.dir={tmp_path}",
    )
    assert code == 0, out
