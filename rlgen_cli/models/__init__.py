"""Model families behind one flow-policy protocol; tiny in-process variants; offline tokenizers."""

from rlgen_cli.models.base import Capabilities, Cond, FlowPolicy, Trainable, cfg_gradient, resolve_device
from rlgen_cli.models.registry import FAMILIES, build_policy

__all__ = [
    "FAMILIES",
    "Capabilities",
    "Cond",
    "FlowPolicy",
    "Trainable",
    "build_policy",
    "cfg_gradient",
    "resolve_device",
]
