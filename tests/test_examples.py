"""Every example keeps working as its one command: it runs, and what it prints is true."""

from __future__ import annotations

import importlib.util
import re
import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import clipopt._cpu

QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"
STEP = re.compile(
    r"(run|resumed) step +(\d+) +loss +([\d.]+) +grad norm +([\d.]+) +(clipped|kept) +"
    r"clipped (\d+)/(\d+)"
)
MAX_NORM = 5.0  # quickstart.MAX_NORM
SPIKES = [11, 23, 35, 47, 59]  # quickstart's outlier batches


def quickstart_globals() -> dict[str, Any]:
    """The live globals of quickstart.py, loaded but its ``main`` not run yet."""
    main = runpy.run_path(str(QUICKSTART), run_name="quickstart")["main"]
    return main.__globals__  # type: ignore[no-any-return]  # run_path returns a copy


def test_quickstart_clips_the_spikes_and_resumes_bit_exactly(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sys, "argv", [str(QUICKSTART), "--out", str(tmp_path)])
    runpy.run_path(str(QUICKSTART), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    steps = [m.groups() for m in map(STEP.fullmatch, lines) if m]
    run = [s[1:] for s in steps if s[0] == "run"]
    resumed = [s[1:] for s in steps if s[0] == "resumed"]
    assert [int(s[0]) for s in run] == list(range(60))
    assert [int(s[0]) for s in resumed] == list(range(30, 60))
    # The resumed half prints the same losses and norms as the uninterrupted one.
    assert [s[:3] for s in resumed] == [s[:3] for s in run[30:]]
    for step, _, norm, verdict, clipped, seen in run:
        assert (verdict == "clipped") == (float(norm) > MAX_NORM)
        assert int(seen) == int(step) + 1
        assert int(clipped) == sum(float(s[2]) > MAX_NORM for s in run[: int(seen)])
    for spike in SPIKES:  # an outlier batch's norm is far past the threshold
        assert float(run[spike][2]) > 50 * MAX_NORM, run[spike]
    calm = [float(s[1]) for s in run if int(s[0]) not in SPIKES]
    assert calm[-1] < calm[0] / 5, calm
    assert f"60 steps, {sum(s[3] == 'clipped' for s in run)} clipped, final lr" in lines[60]
    assert lines[61] == f"resumed from {tmp_path / 'checkpoint.pt'} at step 30"
    assert "resume check: parameters and norms bit-identical to the uninterrupted run: True" in (
        lines
    )
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert sorted(saved) == ["model", "opt", "sched"]
    assert int(saved["opt"]["clip"]["step_count"]) == 30
    # What docs/getting-started.md says the run prints, it prints.
    page = (QUICKSTART.parent.parent / "docs" / "getting-started.md").read_text()
    shown = page.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    summary = [line for line in lines[60:] if not STEP.fullmatch(line)]  # the step lines aside
    assert shown and [line.replace("quickstart-out", str(tmp_path)) for line in shown] == summary
    if importlib.util.find_spec("matplotlib") is not None:
        assert lines[-1] == f"plot: {tmp_path / 'norms.png'}"
        png = (tmp_path / "norms.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        # The plot on the Getting started page is this run's, byte for byte (matplotlib is
        # pinned; regenerate it with: python examples/quickstart.py --plot docs/img/...).
        # It was made with the C kernel, whose norms the torch-ops path matches only to
        # rounding, which moves the curve by a pixel's fraction: compared with the kernel on.
        if clipopt._cpu.available():
            committed = QUICKSTART.parent.parent / "docs" / "img" / "quickstart-norms.png"
            assert png == committed.read_bytes()


def test_quickstart_check_fails_when_the_resume_is_not_exact(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The bit-identity check is real: a scheduler that forgets its state fails it."""
    example = quickstart_globals()
    build = example["build"]
    built = []

    def forgetful_build() -> object:
        model, opt, sched = build()
        built.append(sched)
        if len(built) == 2:  # the resumed run's scheduler ignores the checkpoint
            monkeypatch.setattr(sched, "load_state_dict", lambda state: None)
        return model, opt, sched

    monkeypatch.setitem(example, "build", forgetful_build)
    with pytest.raises(SystemExit, match="diverged"):
        example["main"](["--out", str(tmp_path)])
    assert capsys.readouterr().out.splitlines()[-1].endswith("uninterrupted run: False")


def test_quickstart_skips_the_plot_without_matplotlib(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    example = quickstart_globals()
    example["main"](["--out", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "matplotlib is not installed (pip install clipopt[plot]): no plot"
    assert not (tmp_path / "norms.png").exists()


def test_quickstart_shows_a_progress_bar_on_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    example = quickstart_globals()
    example["main"](["--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert not STEP.search(out)  # no plain step lines: the bar shows them
    assert "run steps 0-29: 100%" in out and "run steps 30-59: 100%" in out
    assert "resumed steps 30-59: 100%" in out
    assert "clipped=13/60" in out and "clipped=3/30" in out


AMP_STEP = re.compile(
    r"step +(\d+) +loss +([\d.]+) +scale +(\d+) +scaled-grad norm +([\d.]+) +"
    r"last_norm ([\d.]+) +clipped to ([\d.]+) +unscaled norm matches: (True|False)"
)


def test_amp_example_clips_the_unscaled_norm(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = run_example("amp", ["--device", "cpu", "--steps", "6"], capsys, monkeypatch)
    assert lines[0] == "device cpu, autocast bfloat16, max_norm 0.25"
    steps = [m.groups() for m in map(AMP_STEP.fullmatch, lines) if m]
    assert [int(s[0]) for s in steps] == list(range(6))
    for _, _, scale, scaled_norm, last_norm, after, exact in steps:
        assert exact == "True"
        assert int(scale) == 2**16  # GradScaler's initial scale, not yet grown
        # last_norm is the true norm: the scaled grads' norm over the scale, not the scaled one
        assert float(last_norm) == pytest.approx(float(scaled_norm) / 2**16, rel=1e-3)
        assert float(last_norm) > 0.25 and float(after) == pytest.approx(0.25, abs=1e-4)
    assert float(steps[-1][1]) < float(steps[0][1])
    assert lines[-1] == "6 steps, every clip on the unscaled grads"


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
