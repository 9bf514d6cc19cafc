"""Hand-computed checks of the weight EMA (rlgen_cli.training.control.ema)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from rlgen_cli.training.control.ema import EMA


def _param(values: list[float], dtype: torch.dtype = torch.float32) -> nn.Parameter:
    return nn.Parameter(torch.tensor(values, dtype=dtype))


def _set(param: nn.Parameter, values: list[float]) -> None:
    with torch.no_grad():
        param.copy_(torch.tensor(values))


def test_shadow_by_hand_and_update_every() -> None:
    # decay 0.5, update every 2 steps; shadow starts at the param [1, 2]
    p = _param([1.0, 2.0])
    ema = EMA([p], decay=0.5, update_every=2)
    _set(p, [3.0, 4.0])
    assert not ema.step(1)  # 1 % 2 != 0 -> no update
    torch.testing.assert_close(ema.shadow[0], torch.tensor([1.0, 2.0]))
    assert ema.step(2)  # 0.5·[1, 2] + 0.5·[3, 4] = [2, 3]
    torch.testing.assert_close(ema.shadow[0], torch.tensor([2.0, 3.0]))
    _set(p, [5.0, 6.0])
    assert not ema.step(3)
    assert ema.step(4)  # 0.5·[2, 3] + 0.5·[5, 6] = [3.5, 4.5]
    torch.testing.assert_close(ema.shadow[0], torch.tensor([3.5, 4.5]))
    assert ema.last_step == 4


def test_defaults_update_every_8_with_decay_09() -> None:
    # param jumps 0 -> 10 after the first step; updates only at steps 8 and 16:
    #   step 8: 0.9·0 + 0.1·10 = 1;   step 16: 0.9·1 + 0.1·10 = 1.9
    p = _param([0.0])
    ema = EMA([p])
    _set(p, [10.0])
    updated = [s for s in range(1, 17) if ema.step(s)]
    assert updated == [8, 16]
    torch.testing.assert_close(ema.shadow[0], torch.tensor([1.9]))


def test_repeated_or_zero_step_does_not_update() -> None:
    # step 0 = no optimizer step yet; a repeated global_step (per micro-batch calls) updates once
    p = _param([0.0])
    ema = EMA([p], decay=0.5, update_every=1)
    _set(p, [4.0])
    assert not ema.step(0)
    assert ema.step(1)  # 0.5·0 + 0.5·4 = 2
    assert not ema.step(1)
    torch.testing.assert_close(ema.shadow[0], torch.tensor([2.0]))


def test_warmup_decay_matches_upstream_schedule() -> None:
    # warmup: decay at step 8 = min((1 + 8)/(10 + 8), 0.9) = 0.5 -> 0.5·0 + 0.5·10 = 5
    p = _param([0.0])
    ema = EMA([p], warmup=True)
    assert ema.current_decay(8) == pytest.approx(0.5)
    assert ema.current_decay(1000) == pytest.approx(0.9)
    _set(p, [10.0])
    assert ema.step(8)
    torch.testing.assert_close(ema.shadow[0], torch.tensor([5.0]))


def test_swap_loads_ema_and_restores_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(3, 4, generator=gen)), nn.Parameter(torch.randn(5, generator=gen))]
    ema = EMA(params, decay=0.9, update_every=1)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen))
    ema.step(1)
    live = [p.detach().clone() for p in params]
    with ema.swap():
        for p, s in zip(params, ema.shadow, strict=True):
            assert torch.equal(p.detach(), s)
        with pytest.raises(RuntimeError, match="already active"), ema.swap():
            pass
        with pytest.raises(RuntimeError, match="inside"):
            ema.step(2)
    for p, saved in zip(params, live, strict=True):
        assert torch.equal(p.detach(), saved)  # bit-exact restore
        assert p.requires_grad


def test_swap_restores_after_exception() -> None:
    p = _param([1.0, 2.0])
    ema = EMA([p], decay=0.5, update_every=1)
    _set(p, [3.0, 4.0])
    ema.step(1)  # shadow [2, 3]
    with pytest.raises(KeyError), ema.swap():
        torch.testing.assert_close(p.detach(), torch.tensor([2.0, 3.0]))
        raise KeyError("eval failed")
    torch.testing.assert_close(p.detach(), torch.tensor([3.0, 4.0]))
    with ema.swap():  # the swap flag was cleared
        pass


def test_bf16_params_keep_fp32_shadows() -> None:
    # 0.9·1 + 0.1·1.0078125 (next bf16 above 1) = 1.00078125: representable in fp32, not in bf16
    p = _param([1.0], dtype=torch.bfloat16)
    ema = EMA([p], decay=0.9, update_every=1)
    _set(p, [1.0078125])
    ema.step(1)
    assert ema.shadow[0].dtype == torch.float32
    assert ema.shadow[0].item() == pytest.approx(1.00078125)
    with ema.swap():
        assert p.dtype == torch.bfloat16


def test_state_dict_round_trip() -> None:
    p = _param([1.0, 2.0])
    ema = EMA([p], decay=0.5, update_every=2)
    _set(p, [3.0, 4.0])
    ema.step(2)  # shadow [2, 3]
    state = ema.state_dict()
    state_shadow_before = state["shadow"][0].clone()
    ema.step(4)  # the saved state holds clones: it must not move
    assert torch.equal(state["shadow"][0], state_shadow_before)

    q = _param([0.0, 0.0])
    fresh = EMA([q], decay=0.5, update_every=2)
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh.shadow[0], torch.tensor([2.0, 3.0]))
    assert fresh.last_step == 2
    assert not fresh.step(2)  # already applied before the save


def test_load_state_dict_mismatch_raises() -> None:
    ema = EMA([_param([1.0, 2.0])])
    with pytest.raises(ValueError, match="holds 2 tensors"):
        ema.load_state_dict({"shadow": [torch.zeros(2), torch.zeros(1)], "last_step": 0})
    with pytest.raises(ValueError, match="shape"):
        ema.load_state_dict({"shadow": [torch.zeros(3)], "last_step": 0})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"decay": 1.0}, "decay"), ({"decay": -0.1}, "decay"), ({"update_every": 0}, "update_every")],
)
def test_bad_config_raises(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EMA([_param([1.0])], **kwargs)


def test_empty_parameters_and_negative_step_raise() -> None:
    with pytest.raises(ValueError, match="no parameters"):
        EMA([])
    with pytest.raises(ValueError, match="global_step"):
        EMA([_param([1.0])]).step(-1)


class _Shards:
    """A stand-in for ZeRO-3: between gathers a parameter holds no data (its value lives in ``full``);
    inside one it holds the full value, written back on exit only when ``modify``."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.full = {id(p): p.detach().clone() for p in params}
        self.calls: list[bool] = []
        for p in params:
            p.data = torch.empty(0)

    @contextmanager
    def gather(self, params: list[torch.Tensor], modify: bool = False) -> Iterator[None]:
        self.calls.append(modify)
        for p in params:
            p.data = self.full[id(p)].clone()
        yield
        for p in params:
            if modify:
                self.full[id(p)] = p.detach().clone()
            p.data = torch.empty(0)


def test_sharded_parameters_update_and_swap_through_the_gather() -> None:
    # shards hold [1, 2]; shadow = [1, 2]; live becomes [3, 4]; decay 0.5 -> shadow [2, 3]
    p = _param([1.0, 2.0])
    shards = _Shards([p])
    ema = EMA([p], decay=0.5, update_every=1, gather=shards.gather)
    torch.testing.assert_close(ema.shadow[0], torch.tensor([1.0, 2.0]))  # read inside a gather
    shards.full[id(p)] = torch.tensor([3.0, 4.0])  # an optimizer step on the shards
    assert ema.step(1)
    torch.testing.assert_close(ema.shadow[0], torch.tensor([2.0, 3.0]))
    assert shards.calls == [False, False]  # reading needs no write-back
    with ema.swap():
        torch.testing.assert_close(shards.full[id(p)], torch.tensor([2.0, 3.0]))  # the EMA reached the shards
    assert shards.calls[2:] == [True, True]
    assert torch.equal(shards.full[id(p)], torch.tensor([3.0, 4.0]))  # the live values restored exactly
