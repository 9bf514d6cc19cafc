"""Data: prompt datasets read from local files and the distributed group sampler."""

from rlgen_cli.data.prompts import PromptDataset, PromptExample
from rlgen_cli.data.sampler import GroupSampler

__all__ = ["GroupSampler", "PromptDataset", "PromptExample"]
