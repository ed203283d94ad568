"""Every example keeps working as its one command: it runs, and what it prints is true."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
import runpy
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same_picture

QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"
HEADER = re.compile(
    r"clipping to max_norm ([\d.]+); outlier batches \(targets x100\) at steps ([\d, ]+)"
)
SUMMARY = re.compile(
    r"(run|resumed) +steps +(\d+)-(\d+) +clipped +(\d+) \((\d+)/(\d+) so far\) +"
    r"outlier norms ([\d, ]+) -> ([\d.]+)"
)
CHECKPOINT = re.compile(r"(saved|resumed) +(\S+) at step (\d+) \((\d+) clipped\)")
DONE = re.compile(r"done +loss ([\d.]+) -> ([\d.]+) on ordinary batches, final lr (\S+)")
BAR = re.compile(
    r"\r(run|resumed): +\d+%\|[^|]*\| (\d+)/(\d+) \[[^]]*?step/s, (norm \S+, )?"
    r"clipped (\d+)/(\d+)\]"
)


def quickstart_globals() -> dict[str, Any]:
    """The live globals of quickstart.py, loaded but its ``main`` not run yet."""
    main = runpy.run_path(str(QUICKSTART), run_name="quickstart")["main"]
    return main.__globals__  # type: ignore[no-any-return]  # run_path returns a copy


@dataclass(frozen=True)
class Replay:
    """The quickstart's uninterrupted run again, each step clipped by
    ``torch.nn.utils.clip_grad_norm_`` instead of ClippedOptimizer: its own record of
    the pre-clip norms, losses and last lr, to recount what the example prints."""

    max_norm: float
    norms: list[float]
    losses: list[float]
    final_lr: float

    def clipped(self, start: int, stop: int) -> int:
        return sum(norm > self.max_norm for norm in self.norms[start:stop])

    @property
    def outliers(self) -> list[int]:
        """Steps whose norm is orders of magnitude past the threshold."""
        return [step for step, norm in enumerate(self.norms) if norm > 50 * self.max_norm]


@pytest.fixture(scope="module")
def replay() -> Replay:
    example = quickstart_globals()
    max_norm = example["MAX_NORM"]
    model, wrapper, sched = example["build"]()  # the example's model and schedule
    adamw = wrapper.optimizer  # stepped here directly: the wrapper does nothing
    norms, losses = [], []
    with warnings.catch_warnings():
        # The scheduler counts the wrapper's steps, which this loop bypasses.
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
        for step in range(example["STEPS"]):
            x, y = example["batch"](step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            adamw.zero_grad()
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
            losses.append(loss.item())
            adamw.step()
            sched.step()
    return Replay(max_norm, norms, losses, sched.get_last_lr()[0])


def check_summary(match: re.Match[str] | None, label: str, replay: Replay) -> tuple[int, int]:
    """A phase's summary line says what the replay recounts; returns its step range."""
    assert match, label
    start, last = int(match[2]), int(match[3])
    assert match[1] == label
    assert int(match[4]) == replay.clipped(start, last + 1)
    assert (int(match[5]), int(match[6])) == (replay.clipped(0, last + 1), last + 1)
    shown = [float(norm) for norm in match[7].split(", ")]
    expected = [replay.norms[s] for s in replay.outliers if start <= s <= last]
    assert shown == pytest.approx(expected, abs=0.5)  # printed as integers
    assert float(match[8]) == replay.max_norm
    return start, last


def test_quickstart_clips_the_spikes_and_resumes_bit_exactly(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    replay: Replay,
) -> None:
    monkeypatch.setattr(sys, "argv", [str(QUICKSTART), "--out", str(tmp_path)])
    runpy.run_path(str(QUICKSTART), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    checkpoint = tmp_path / "checkpoint.pt"
    saved = torch.load(checkpoint, weights_only=True)
    assert sorted(saved) == ["model", "opt", "sched"]
    saved_step = int(saved["opt"]["clip"]["step_count"])  # the optimizer's own counter

    header = HEADER.fullmatch(lines[0])
    assert header, lines[0]
    assert float(header[1]) == replay.max_norm
    assert [int(s) for s in header[2].split(", ")] == replay.outliers
    assert len(replay.outliers) >= 4 and replay.clipped(0, len(replay.norms)) > len(
        replay.outliers
    )  # the spikes are clipped, and so are a few ordinary early steps
    # The uninterrupted run: two phases around the checkpoint.
    first = check_summary(SUMMARY.fullmatch(lines[1]), "run", replay)
    saving = CHECKPOINT.fullmatch(lines[2])
    assert saving and saving[1] == "saved" and saving[2] == str(checkpoint), lines[2]
    assert first == (0, saved_step - 1) and int(saving[3]) == saved_step
    assert (
        int(saving[4])
        == int(saved["opt"]["clip"]["clipped_count"])
        == replay.clipped(0, saved_step)
    )
    second = check_summary(SUMMARY.fullmatch(lines[3]), "run", replay)
    assert second == (saved_step, len(replay.norms) - 1)
    done = DONE.fullmatch(lines[4])
    assert done, lines[4]
    ordinary = [loss for step, loss in enumerate(replay.losses) if step not in replay.outliers]
    assert float(done[1]) == pytest.approx(ordinary[0], rel=5e-3)
    assert float(done[2]) == pytest.approx(ordinary[-1], rel=5e-3)
    assert float(done[2]) < float(done[1]) / 5
    assert float(done[3]) == pytest.approx(replay.final_lr, rel=5e-3)
    # The resumed run starts from the checkpoint's counts and continues them.
    resuming = CHECKPOINT.fullmatch(lines[5])
    assert resuming and resuming[1] == "resumed" and resuming[2] == str(checkpoint), lines[5]
    assert (int(resuming[3]), int(resuming[4])) == (
        saved_step,
        int(saved["opt"]["clip"]["clipped_count"]),
    )
    assert check_summary(SUMMARY.fullmatch(lines[6]), "resumed", replay) == second
    assert lines[6].replace("resumed ", "run     ", 1) == lines[3]
    assert (
        lines[7]
        == "resume check: parameters and norms bit-identical to the uninterrupted run: True"
    )
    # What docs/getting-started.md says the run prints, it prints.
    page = (QUICKSTART.parent.parent / "docs" / "getting-started.md").read_text()
    shown = page.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.replace("quickstart-out", str(tmp_path)) for line in shown] == lines
    if importlib.util.find_spec("matplotlib") is None:
        assert lines[8:] == ["matplotlib is not installed (pip install clipopt[plot]): no plot"]
        return
    assert lines[8:] == [f"plot: {tmp_path / 'norms.png'}"]
    assert (tmp_path / "norms.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The plot on the Getting started page is this run's (regenerate it with:
    # python examples/quickstart.py --plot docs/img/quickstart-norms.png).
    committed = QUICKSTART.parent.parent / "docs" / "img" / "quickstart-norms.png"
    assert_same_picture(tmp_path / "norms.png", committed)


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
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    replay: Replay,
) -> None:
    tqdm = pytest.importorskip("tqdm")
    # tqdm redraws at most every 0.1 s, and a phase can take less: draw at every step.
    every_step = functools.partial(tqdm.tqdm, mininterval=0, miniters=1)
    monkeypatch.setattr(tqdm, "tqdm", every_step)
    example = quickstart_globals()
    example["main"](["--out", str(tmp_path)])
    plain = capsys.readouterr().out
    assert "\r" not in plain  # no bar where stdout is no terminal
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    example["main"](["--out", str(tmp_path)])
    out = capsys.readouterr().out
    bars = [m.groups() for m in BAR.finditer(out)]
    for _, step, total, _, clipped, steps in bars:
        # Every frame counts the steps so far, the run's whole length as its total.
        assert (int(steps), int(total)) == (int(step), len(replay.norms))
        assert int(clipped) == replay.clipped(0, int(step))
    # A bar's first frame (no norm yet) is where its phase starts: the resumed one at the
    # checkpoint's step, with the checkpoint's clipped count.
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    saved_step = int(saved["opt"]["clip"]["step_count"])
    starts = [(label, int(step)) for label, step, _, norm, _, _ in bars if norm is None]
    assert starts == [("run", 0), ("run", saved_step), ("resumed", saved_step)], out
    assert len(bars) > len(starts)  # and they move
    # Each bar is cleared when its phase ends (leave=False) and the phase's summary line
    # takes its place: what the terminal is left showing is the plain output.
    assert "\n".join(line.rsplit("\r", 1)[-1] for line in out.split("\n")) == plain


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


@pytest.mark.parametrize("script", ["examples/distributed_fsdp2.py", "examples/pipeline_fsdp2.py"])
def test_distributed_example_says_how_to_launch_it_without_torchrun(script: str) -> None:
    """Run as a plain script it exits, printing the torchrun command docs/distributed.md
    gives (with the torchrun of the Python that ran it), before any process group."""
    root = QUICKSTART.parent.parent
    torchrun_env = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in torchrun_env}
    done = subprocess.run(
        [sys.executable, script], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done
    assert done.stdout == "" and "Traceback" not in done.stderr, done.stderr
    assert "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set" in done.stderr
    page = (root / "docs" / "distributed.md").read_text()
    documented = re.search(r"\n(\S*torchrun --nproc_per_node=\d+ " + script + r")\n", page)
    assert documented, "docs/distributed.md shows no torchrun command"
    (command,) = [line.split() for line in done.stderr.splitlines() if line.startswith("    ")]
    assert command[1:] == documented[1].split()[1:]
    beside = Path(sys.executable).with_name("torchrun")
    if beside.is_file():
        assert (root / command[0]).absolute() == beside.absolute()
    else:
        assert command[0] == "torchrun"


PIPELINE_LINE = re.compile(r"rank (\d): norms ([\d. ]+); resumed bit for bit")


def test_pipeline_example_under_torchrun_clips_by_the_whole_models_norm() -> None:
    """examples/pipeline_fsdp2.py as users run it, 4 processes under torchrun: every rank
    prints the norms one process training the whole model measures, and that its resume
    from the DCP checkpoint ended bit for bit where the uninterrupted run did."""
    from helpers import FSDP2_ON_CPU, FSDP2_UNAVAILABLE
    from test_distributed import TEARDOWN_ABORT, _torchrun, free_port

    if not (FSDP2_ON_CPU or torch.cuda.is_available()):
        pytest.skip(FSDP2_UNAVAILABLE)
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this Python")
    script = QUICKSTART.parent / "pipeline_fsdp2.py"
    command = [str(torchrun), "--nproc_per_node=4", "--master_addr=127.0.0.1", "", str(script)]
    for _ in range(2):  # once more only for gloo's teardown abort (test_distributed.py)
        command[3] = f"--master_port={free_port()}"
        code, stdout, stderr = _torchrun(command)
        printed = [m.groups() for m in map(PIPELINE_LINE.fullmatch, stdout.splitlines()) if m]
        if not (code != 0 and TEARDOWN_ABORT in stderr and len(printed) == 4):
            break
    assert code == 0, stdout + stderr
    assert sorted(rank for rank, _ in printed) == ["0", "1", "2", "3"], stdout
    assert len({norms for _, norms in printed}) == 1, stdout
    spec = importlib.util.spec_from_file_location("pipeline_fsdp2", script)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    first, last = example.build_stages()
    whole = torch.nn.Sequential(first, last)
    optimizer = example.make_optimizer(whole.parameters(), None)
    expected = []
    for tokens, targets in example.batches(example.STEPS):
        example.loss_fn(whole(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(float(optimizer.last_norm))
    ours = [float(n) for n in printed[0][1].split()]
    assert ours == pytest.approx(expected, rel=1e-5, abs=1e-6), (ours, expected)


class Collect(logging.Handler):
    """Keeps every record that reaches the handlers: what a logger would print."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def transformers_warnings() -> Iterator[list[str]]:
    """The warnings transformers logs meanwhile (its loggers do not propagate to root)."""
    collect = Collect()
    logger = logging.getLogger("transformers")
    logger.addHandler(collect)
    try:
        yield collect.messages
    finally:
        logger.removeHandler(collect)


@pytest.mark.integrations
def test_hf_trainer_example_resumes_to_the_same_loss_without_warnings(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    transformers_warnings: list[str],
) -> None:
    pytest.importorskip("transformers")
    path = QUICKSTART.parent / "hf_trainer_example.py"
    monkeypatch.setattr(sys, "argv", [str(path), "--output-dir", str(tmp_path)])
    runpy.run_path(str(path), run_name="__main__")
    out, err = capsys.readouterr()
    lines = out.splitlines()
    first = re.fullmatch(r"first run: loss ([\d.]+) -> ([\d.]+)", lines[-3])
    resumed = re.fullmatch(r"resumed at step 8: 8 more steps to ([\d.]+)", lines[-2])
    assert first and resumed, lines[-3:]
    assert float(first[2]) < float(first[1]) and resumed[1] == first[2]
    assert lines[-1].startswith("wrapper steps 16, last grad norm ")
    assert (tmp_path / "checkpoint-8" / "optimizer.pt").is_file()
    assert transformers_warnings == []
    assert "Writing model shards" not in err  # the save's progress bar
    # save_steps matches the checkpoint's only to keep the Trainer quiet: nothing is saved.
    assert not list((tmp_path / "resumed").glob("checkpoint-*"))


@pytest.mark.integrations
@pytest.mark.parametrize("tied", [True, False])
def test_hf_trainer_example_drops_the_missing_head_warning_only_when_tied(
    tied: bool, transformers_warnings: list[str]
) -> None:
    pytest.importorskip("transformers")
    example = runpy.run_path(str(QUICKSTART.parent / "hf_trainer_example.py"), run_name="hf")
    model = example["tiny_gpt2"]()
    if not tied:
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    trainer_logger = logging.getLogger("transformers.trainer")
    missing = "There were missing keys in the checkpoint model loaded: ['lm_head.weight']."
    other = "There were missing keys in the checkpoint model loaded: ['transformer.wte.weight']."
    with example["tied_head_not_reported_missing"](model):
        trainer_logger.warning(missing)
        trainer_logger.warning(other)
    trainer_logger.warning(missing)  # the filter is gone after the block
    assert transformers_warnings == ([] if tied else [missing]) + [other, missing]


@pytest.mark.integrations
def test_tensorboard_example_writes_an_event_file(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("tensorboard")
    lines = run_example("tensorboard_logging", ["--logdir", str(tmp_path)], capsys, monkeypatch)
    assert lines[-1] == "20 steps, 4 clipped, event files: 1"
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
