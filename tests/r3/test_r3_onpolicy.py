"""``rlgen check-onpolicy model=tiny_r3``: in both stages, the text track's training forward against the
sampler's own log-probs and the image track's recomputed step against the one recorded while sampling —
within tolerance as is, failing on every row once the weights move between rollout and check."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_cli
from tests.r3.conftest import TINY_R3


def _rows(out: str) -> list[str]:
    """The report's (stage, track) lines: a text and an image line per stage."""
    return [
        line for line in out.splitlines() if line.startswith("│ ") and ("reason" in line or "refine" in line)
    ]


def test_both_tracks_both_stages_are_on_policy(tmp_path: Path):
    code, out = run_cli("check-onpolicy", *TINY_R3, f"hydra.run.dir={tmp_path}")
    assert code == 0, out
    rows = _rows(out)
    assert [row.split("│")[1].strip() for row in rows] == ["reason", "reason", "refine", "refine"]
    assert sum("│ text " in row or " text │" in row for row in rows) == 2
    assert "image, step" in out and all(row.rstrip("│ ").endswith("ok") for row in rows)
    assert "PASS worst:" in out


def test_every_track_fails_when_the_weights_move_after_the_rollout(tmp_path: Path):
    code, out = run_cli("check-onpolicy", *TINY_R3, "check.perturb_weights=1e-3", f"hydra.run.dir={tmp_path}")
    assert code == 1, out
    rows = _rows(out)
    assert len(rows) == 4 and all(row.rstrip("│ ").endswith("FAIL") for row in rows), (
        out
    )  # text and image, both stages
    assert "FAIL worst:" in out


def test_sde_off_checks_the_text_alone(tmp_path: Path):
    ode = ["r3.enable_sde_gen=false", "r3.enable_sde_edit=false", "r3.tune_image_cot=false"]  # no image step
    overrides = [*TINY_R3, *ode, f"hydra.run.dir={tmp_path}"]
    code, out = run_cli("check-onpolicy", *overrides)
    assert code == 0, out
    assert "image, no SDE" in out and "PASS" in out
