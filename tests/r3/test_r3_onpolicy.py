"""``rlgen check-onpolicy model=tiny_r3``: text and image tracks at ratio exactly 1 in both stages."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_cli
from tests.r3.conftest import TINY_R3


def test_both_tracks_both_stages_are_exactly_on_policy(tmp_path: Path):
    code, out = run_cli("check-onpolicy", *TINY_R3, f"hydra.run.dir={tmp_path}")
    assert code == 0, out
    assert "PASS max |ratio − 1| 0.000e+00" in out
    for stage in ("reason", "refine"):
        assert sum(line.count(stage) for line in out.splitlines()) == 2  # a text and an image row each
    assert "image (SDE step" in out


def test_sde_off_checks_the_text_alone(tmp_path: Path):
    overrides = [*TINY_R3, "r3.enable_sde_gen=false", "r3.enable_sde_edit=false", f"hydra.run.dir={tmp_path}"]
    code, out = run_cli("check-onpolicy", *overrides)
    assert code == 0, out
    assert "SDE step -1" in out and "PASS" in out
