"""`make demo` keeps working: the quick-start example trains and reports each step."""

from __future__ import annotations

import re
import runpy
import sys
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


FIRST_LAST = re.compile(r"step +(\d+) +loss +([\d.]+) +grad norm +([\d.]+)")


def run_example(
    name: str, argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    """Run ``examples/<name>.py`` as its one command would, returning what it printed."""
    path = QUICKSTART.parent / f"{name}.py"
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    runpy.run_path(str(path), run_name="__main__")
    return capsys.readouterr().out.splitlines()


@pytest.mark.integrations
@pytest.mark.parametrize("name", ["lightning_example", "accelerate_example"])
def test_framework_example_trains_to_a_zero_lr(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip(name.split("_")[0])
    lines = run_example(name, ["--steps", "12"], capsys, monkeypatch)
    (first, last) = [m.groups() for m in map(FIRST_LAST.fullmatch, lines) if m]
    assert (first[0], last[0]) == ("0", "11")
    assert float(last[1]) < float(first[1]) / 2, lines
    assert lines[-1] == "12 steps, final lr 0.00e+00"


@pytest.mark.integrations
def test_hf_trainer_example_resumes_to_the_same_loss(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    lines = run_example("hf_trainer_example", ["--output-dir", str(tmp_path)], capsys, monkeypatch)
    first = re.fullmatch(r"first run: loss ([\d.]+) -> ([\d.]+)", lines[-3])
    resumed = re.fullmatch(r"resumed at step 8: 8 more steps to ([\d.]+)", lines[-2])
    assert first and resumed, lines[-3:]
    assert float(first[2]) < float(first[1]) and resumed[1] == first[2]
    assert lines[-1].startswith("wrapper steps 16, last grad norm ")
    assert (tmp_path / "checkpoint-8" / "optimizer.pt").is_file()


@pytest.mark.integrations
def test_tensorboard_example_writes_an_event_file(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("tensorboard")
    lines = run_example("tensorboard_logging", ["--logdir", str(tmp_path)], capsys, monkeypatch)
    assert lines[-1] == "20 steps, 4 clipped, event files: 1"
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
