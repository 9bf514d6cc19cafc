"""Schema of ``rlgen check-onpolicy``: a recipe's training config plus the ``check`` section.

What is compared, per track (``tasks/check_onpolicy.py``): each log-prob recorded *while sampling* (the
flow rollout's step log-probs; ``generate``'s raw logits for text) against the training path's
recompute on the same samples — two different computations, so the check can fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from rlgen_cli.errors import require
from rlgen_cli.schema.families import family_spec
from rlgen_cli.schema.ranges import COUNT, NON_NEGATIVE, POSITIVE
from rlgen_cli.schema.unread import require_defaults, shown

if TYPE_CHECKING:  # the type checker reads the mixin as the recipe schema it is mixed into
    from rlgen_cli.schema.run import RunConfig as _RecipeSchema
else:
    _RecipeSchema = object

__all__ = ["TEXT_TOLERANCE", "TEXT_TOLERANCES", "CheckConfig", "CheckSection"]

TEXT_TOLERANCE = 1e-5
"""Default ``check.text_tolerance``. Measured in fp32 on CPU, ``generate``'s KV-cache decoding against the
training layout's full forward: ≤ 9.5e-7 on the tiny Qwen2-VL (one or two float32 ulps of a log-prob near
−12; temperatures 0.7–1.2, completions of up to 48 tokens, 16 samples per epoch, training batches of 2–8)
and ≤ 4.8e-7 on R3's tiny Qwen2.5-VL text policy (4 seeds, both stages). 1e-5 leaves a 10× margin, and
LoRA noise of std 1e-5 already moves the log-probs by ≈ 2.6e-5, failing it."""

TEXT_TOLERANCES = {"float32": TEXT_TOLERANCE, "float16": 2e-3, "bfloat16": 1e-2}
"""Default ``check.text_tolerance`` per dtype of the text policy (docs/precision.md). In a low precision
every layer's output is rounded, so the KV-cache decoding and the full forward part by whole ulps: on
the tiny Qwen2-VL (32 completions of up to 32 tokens, 3 seeds, temperatures 0.7 and 1.2) the gap is
≤ 1.9e-3 in bf16 (2⁻⁹: one ulp of a logit below 1) and ≤ 2.4e-4 in fp16 (2⁻¹²); the defaults leave ≥ 5×.
Larger logits have larger ulps, so a real model's gap is larger: measure it and set the tolerance."""


@dataclass
class CheckConfig:
    tolerance: Annotated[float, POSITIVE] = 1e-6
    """Largest allowed |ratio − 1| (and |Δ log-prob|) of the image / flow tracks: the rollout stores the
    fp32 transition it sampled, so the training path reproduces it to rounding — exactly, in every
    ``model.dtype``, on the tiny models (docs/precision.md)."""
    text_tolerance: Annotated[float | None, POSITIVE] = None
    """Largest allowed |ratio − 1| (and |Δ log-prob|) of the text tracks (VLM, R3's think / reflect):
    the sampler's KV-cache decoding vs the training forward; null = ``TEXT_TOLERANCES`` of the text
    policy's dtype (1e-5 in fp32, 1e-2 in bf16)."""
    train_noise_level: Annotated[float | None, NON_NEGATIVE] = None
    """Noise level of the training-side recompute; null = the sampling one (set it to see the check fail)."""
    train_batch_size: Annotated[int | None, COUNT] = None
    """Training-side batch size; null = algo.train_batch_size."""
    perturb_weights: Annotated[float, NON_NEGATIVE] = 0.0
    """Test switch: after the rollout and before the training-path recompute, add Gaussian noise of this
    standard deviation (seeded by ``seed``) to every trainable weight — the check must then fail (exit 1).
    It shows the check can fail; 0 = off. 1e-3 moves the log-probs by ≈ 2e-3 (tiny VLM, R3 text), ≈ 1e-4
    (R3 image steps, ShapesEval UNet) and ≈ 4e-6 (tiny SD3, whose LoRA starts at B = 0; 1e-2: ≈ 5e-5)."""


@dataclass
class CheckSection(_RecipeSchema):
    """Mixed into a recipe's training schema (``schema/recipes.py``): ``rlgen check-onpolicy``'s config."""

    check: CheckConfig = field(default_factory=CheckConfig)

    def __post_init__(self) -> None:
        super().__post_init__()  # the recipe's own checks
        require_one_process(self.launcher.name)
        refuse_other_tracks(self.check, self.model.family)
        if self.check.text_tolerance is None:
            self.check.text_tolerance = TEXT_TOLERANCES[self.text_policy_dtype()]  # the recipe's schema says


def require_one_process(launcher: str) -> None:
    """The check rolls out and recomputes in this process: it starts no launcher's workers."""
    require(
        launcher == "local",
        f"launcher={launcher} spreads a training run over processes, and rlgen check-onpolicy rolls out and "
        "recomputes in this one process (it starts no workers), so the launcher would do nothing: drop "
        "launcher= (the check runs with launcher=local)",
    )


_NOT_READ_BY_KIND: dict[str, dict[str, str]] = {
    "flow": {
        "text_tolerance": "bounds the text tracks (VLMs, R3's text policy), and a flow model has none: its "
        "steps are held to check.tolerance",
    },
    "vlm": {
        "tolerance": "bounds the image / flow tracks, and a VLM's tokens are held to check.text_tolerance: "
        "set check.text_tolerance instead",
        "train_noise_level": "recomputes flow steps at another noise level; it has no meaning for a VLM "
        "(use check.perturb_weights to see the check fail)",
    },
    "unified": {
        "train_noise_level": "recomputes flow steps at another noise level; it has no meaning for a unified "
        "policy (use check.perturb_weights to see the check fail)",
    },
}
"""Per family kind: the ``check`` settings its tracks never read → what they are for instead."""


def refuse_other_tracks(check: CheckConfig, family: str) -> None:
    """A ``check`` setting of a track ``family``'s kind does not run, at a value other than its default,
    would do nothing: refused (before ``text_tolerance``'s null takes its dtype's default)."""
    unread = _NOT_READ_BY_KIND[family_spec(family).kind]
    require_defaults(
        check,
        CheckConfig,
        unread,
        lambda key, value, default: (
            f"check.{key}={shown(value)} does nothing for model.family={family}: it {unread[key]}. Drop "
            f"check.{key} (back to its default, {shown(default)})"
        ),
    )
