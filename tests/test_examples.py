"""`make demo` keeps working: the quick-start example trains and reports each step."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"
STEP = re.compile(r"step +(\d+) +loss +([\d.]+) +grad norm +([\d.]+) +(clipped|kept)")


def test_quickstart_trains_and_reports_every_step(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(QUICKSTART), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    steps = [m.groups() for m in map(STEP.fullmatch, lines) if m]
    assert [int(s[0]) for s in steps] == list(range(20))
    losses = [float(s[1]) for s in steps]
    assert losses[-1] < losses[0] / 5, losses
    assert {s[3] for s in steps} == {"clipped", "kept"}
    for _, _, norm, verdict in steps:
        assert (verdict == "clipped") == (float(norm) > 25.0)
    assert lines[-1].startswith("20 steps")
