"""GARDO's reference refresh (``ReferenceSwitch.refresh``) on a one-weight model: y = (base + lora)·x."""

from __future__ import annotations

import torch
from torch import nn

from rlgen_cli.models.base import ReferenceSwitch


class OneWeight(nn.Module):
    """A frozen base weight and a 'LoRA' weight that ``disable_adapters`` switches off, as peft's do."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.tensor(2.0), requires_grad=False)
        self.lora_w = nn.Parameter(torch.tensor(1.0))
        self.enabled = True

    def disable_adapters(self) -> None:
        self.enabled = False

    def enable_adapters(self) -> None:
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.base + (self.lora_w if self.enabled else 0.0)) * x


class Owner:
    def __init__(self) -> None:
        self.transformer = OneWeight()


def reference_output(owner: Owner, switch: ReferenceSwitch) -> float:
    with torch.no_grad(), switch():
        return owner.transformer(torch.tensor(1.0)).item()


def test_lora_reference_is_the_base_until_refreshed_then_the_adapter_frozen_at_the_refresh() -> None:
    owner = Owner()
    switch = ReferenceSwitch(owner, "transformer", lora=True)
    assert reference_output(owner, switch) == 2.0  # adapter disabled: the base alone
    switch.refresh()  # the reference takes lora = 1
    with torch.no_grad():
        owner.transformer.lora_w.fill_(5.0)  # training moves the live adapter
    assert reference_output(owner, switch) == 3.0  # 2 + the frozen 1
    assert owner.transformer(torch.tensor(1.0)).item() == 7.0  # the live policy is back: 2 + 5
    switch.refresh()
    assert reference_output(owner, switch) == 7.0


def test_full_finetuning_reference_is_the_frozen_copy_until_refreshed() -> None:
    owner = Owner()
    switch = ReferenceSwitch(owner, "transformer", lora=False)
    with torch.no_grad():
        owner.transformer.lora_w.fill_(4.0)
    assert reference_output(owner, switch) == 3.0  # the copy made at the start: 2 + 1
    switch.refresh()
    assert reference_output(owner, switch) == 6.0  # 2 + 4
    with torch.no_grad():
        owner.transformer.lora_w.fill_(0.0)
    assert reference_output(owner, switch) == 6.0 and owner.transformer(torch.tensor(1.0)).item() == 2.0
