"""Every process group rlgen starts waits COLLECTIVE_TIMEOUT in a collective, not torch's 10-minute NCCL
default: under DDP rank 0 evaluates and saves alone while the others wait, and a whole test split takes
longer than 10 minutes on one GPU. The accelerator is stood in for (no launch, no GPU)."""

from __future__ import annotations

import datetime

import pytest

from rlgen_cli.training.distributed import dist


class _Recorder:
    """Takes the place of ``accelerate.Accelerator``: records its keyword arguments."""

    calls: list[dict] = []

    def __init__(self, **kwargs) -> None:
        type(self).calls.append(kwargs)
        self.process_index, self.num_processes, self.device = 0, 2, "cpu"


@pytest.mark.parametrize("cpu", [False, True])
def test_the_launched_process_group_waits_the_collective_timeout(monkeypatch, cpu):
    import accelerate

    _Recorder.calls = []
    monkeypatch.setattr(accelerate, "Accelerator", _Recorder)
    monkeypatch.setattr(dist, "launched_engine", lambda: None)
    dist.AccelerateDist(cpu=cpu)
    (handler,) = _Recorder.calls[0]["kwargs_handlers"]
    assert handler.timeout == dist.COLLECTIVE_TIMEOUT >= datetime.timedelta(hours=1)
    assert handler.to_kwargs() == {"timeout": dist.COLLECTIVE_TIMEOUT}  # only what differs from defaults


def test_the_cpu_deepspeed_group_keeps_gloo_and_the_timeout():
    handler = dist.process_group_kwargs(backend="gloo")
    assert handler.backend == "gloo" and handler.timeout == dist.COLLECTIVE_TIMEOUT
