"""Every registered family satisfies the flow-policy protocol and declares what it does.

Each family is built tiny with guidance 2 (a CFG family then encodes a negative branch) and its declared
``capabilities`` are checked against what ``encode`` / ``decode`` actually do, so a recipe that reads
``policy.capabilities`` instead of probing for methods gets the truth.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from rlgen_cli.data.images import EDITING_FAMILIES
from rlgen_cli.errors import UserError
from rlgen_cli.models import FAMILIES, build_policy
from rlgen_cli.models.base import Capabilities, FlowPolicy, Trainable
from rlgen_cli.schema.families import families, family_spec
from tests.models.helpers import CPU, model_cfg

TINY_CONFIGS = {
    "sd3": "tiny_sd3", "flux": "tiny_flux", "flux_kontext": "tiny_flux_kontext", "qwen_image": "tiny_qwen_image",
    "flux2": "tiny_flux2", "flux2_klein": "tiny_flux2_klein",
    "qwen_image_edit": "tiny_qwen_image_edit", "wan2_1": "tiny_wan2_1", "shapes": "shapes_unet",
    "wan2_2": "tiny_wan2_2", "wan2_2_i2v": "tiny_wan2_2_i2v",
    "z_image": "tiny_z_image", "qwen_image_edit_plus": "tiny_qwen_image_edit_plus",
    "qwen_image_2": "tiny_qwen_image_2", "qwen_image_2_edit": "tiny_qwen_image_2_edit", "bagel": "tiny_bagel", "bagel_edit": "tiny_bagel_edit",
}  # fmt: skip
EDITS_ON_REQUEST = set(families(edits_on_request=True))
"""Text-to-image families whose ``encode`` also edits when given sources (one model generates and edits)."""
PROMPTS = ["a red circle", "two blue squares"]


def _policy(family: str, guidance: float = 2.0) -> FlowPolicy:
    return build_policy(dataclasses.replace(model_cfg(TINY_CONFIGS[family]), guidance_scale=guidance), CPU)


@pytest.fixture(scope="module")
def built() -> dict[str, FlowPolicy]:
    """Policies built so far in this module, by family (each family is built once)."""
    return {}


def _built(built: dict[str, FlowPolicy], family: str) -> FlowPolicy:
    if family not in built:
        built[family] = _policy(family)
    return built[family]


def _sources(policy: FlowPolicy) -> torch.Tensor:
    cfg = policy.cfg
    return torch.rand(len(PROMPTS), 3, cfg.height or cfg.resolution, cfg.width or cfg.resolution)


def _has_negative_branch(cond) -> bool:
    return any(key.startswith("neg_") for key in cond.tensors)


def test_every_family_has_a_tiny_config_here():
    assert set(TINY_CONFIGS) == set(FAMILIES)


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_family_satisfies_the_protocol_and_its_capabilities_hold(built, family: str):
    policy = _built(built, family)
    caps = policy.capabilities
    assert isinstance(policy, FlowPolicy) and isinstance(caps, Capabilities) and policy.family == family
    assert isinstance(policy.trainable, Trainable) and isinstance(policy.trainable.module, nn.Module)
    params = policy.trainable.parameters()
    assert params and all(p.requires_grad and p.dtype == torch.float32 for p in params)
    assert len(list(policy.trainable.named())) == len(params)

    # takes_source_images: an editing family refuses to encode without sources, the others refuse sources
    if caps.takes_source_images:
        with pytest.raises(UserError, match="source image"):
            policy.encode(PROMPTS)
        cond = policy.encode(PROMPTS, _sources(policy))
    else:
        if family in EDITS_ON_REQUEST:
            with_sources = policy.encode(PROMPTS, _sources(policy))  # the editing conditioning
            assert with_sources.tensors.keys() > policy.encode(PROMPTS).tensors.keys()
        else:
            with pytest.raises(UserError, match="takes no"):
                policy.encode(PROMPTS, _sources(policy))
        cond = policy.encode(PROMPTS)
    assert len(cond) == len(PROMPTS)
    assert _has_negative_branch(cond) == caps.has_cfg  # guidance 2: CFG families encode the negative prompt

    x0 = policy.noise(len(PROMPTS), torch.Generator().manual_seed(0))
    decoded = policy.decode(x0)
    assert decoded.dim() == (5 if caps.is_video else 4) and decoded.shape[:2] == (len(PROMPTS), 3)
    assert caps.is_video == family_spec(family).video  # the table's video column tells the truth

    assert hasattr(policy, "encode_images") == caps.encodes_images
    if caps.encodes_images:  # the inverse of decode
        images = torch.rand(2, 3, 32, 32)
        torch.testing.assert_close(policy.decode(policy.encode_images(images)), images, atol=1e-6, rtol=0)


def test_guidance_one_declares_and_encodes_no_cfg():
    policy = _policy("shapes", guidance=1.0)
    assert not policy.capabilities.has_cfg and not _has_negative_branch(policy.encode(PROMPTS))


def test_the_editing_families_are_the_policies_that_take_source_images(built):
    """``data.images.EDITING_FAMILIES`` (which datasets need source images) agrees with the policies."""
    editing = {family for family in TINY_CONFIGS if _built(built, family).capabilities.takes_source_images}
    assert editing == set(EDITING_FAMILIES)
