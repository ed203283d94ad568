"""examples/adaptive_thresholds.py: every setting does what its rule says, on the run the
docs' plot shows, checked against the rules written out here in float64."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import re
import runpy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same_picture

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "adaptive_thresholds.py"
COMMITTED_PLOT = EXAMPLE.parent.parent / "docs" / "img" / "adaptive-thresholds.png"


@dataclass(frozen=True)
class Run:
    example: dict[str, Any]
    baseline: Any
    records: list[Any]
    plot: Path
    printed: list[str]
    threads: list[int]
    """torch's thread count in each setting's training run."""
    threads_before: int
    threads_after: int


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    main = runpy.run_path(str(EXAMPLE), run_name="adaptive_thresholds")["main"]
    example = main.__globals__  # the live globals main reads, not run_path's copy
    train, threads = example["train"], []

    def counting_threads(setting: Any) -> Any:
        threads.append(torch.get_num_threads())
        return train(setting)

    example["train"] = counting_threads
    path = tmp_path_factory.mktemp("adaptive") / "plot.png"
    before = torch.get_num_threads()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        baseline, *records = main(["--plot", str(path)])
    printed = out.getvalue().splitlines()
    example["train"] = train
    return Run(example, baseline, records, path, printed, threads, before, torch.get_num_threads())


def by_label(records: list[Any], start: str) -> Any:
    (record,) = [r for r in records if r.label.startswith(start)]
    return record


def test_it_trains_on_one_thread_and_gives_the_caller_its_own_back(run: Run) -> None:
    assert run.threads == [1] * (1 + len(run.example["SETTINGS"]))
    assert run.threads_after == run.threads_before


SUMMARY = re.compile(
    r"(.+?) +clipped +(\d+) +skipped +(\d+) +held-out loss ([\d.]+) -> ([\d.]+) \(best\) "
    r"-> ([\d.]+) \(last\)"
)


def test_it_prints_what_each_run_did(run: Run) -> None:
    """One line per setting, the baseline first, recounted from the steps' norms."""
    rows = [SUMMARY.fullmatch(line) for line in run.printed[:-1]]
    assert all(rows), run.printed
    assert len(rows) == 1 + len(run.records)
    for row, record in zip(rows, [run.baseline, *run.records], strict=True):
        assert row is not None and row[1] == record.label
        steps = list(zip(record.pre, record.post, strict=True))
        clipped = sum(post < pre * (1 - 1e-6) for pre, post in steps if not math.isnan(post))
        assert (int(row[2]), int(row[3])) == (clipped, sum(math.isnan(p) for _, p in steps))
        shown = [float(row[4]), float(row[5]), float(row[6])]
        expected = [record.loss[0], min(record.loss), record.loss[-1]]
        assert shown == pytest.approx(expected, abs=5e-5), record.label
    if importlib.util.find_spec("matplotlib") is not None:
        assert run.printed[-1] == f"plot: {run.plot}"


def test_the_unclipped_run_diverges_and_every_clipped_one_learns(run: Run) -> None:
    assert run.baseline.label == run.example["UNCLIPPED"].label
    assert run.baseline.loss[-1] > 10 * run.baseline.loss[0]
    for record in run.records:
        assert record.loss[-1] < record.loss[0] / 3, record.label


def test_the_fixed_threshold_caps_every_step(run: Run) -> None:
    record = by_label(run.records, "fixed")
    limit = run.example["FIXED_MAX_NORM"]
    for pre, post in zip(record.pre, record.post, strict=True):
        assert post == pytest.approx(min(pre, limit * pre / (pre + 1e-6)), rel=1e-5)
    assert record.clipped == sum(pre > limit for pre in record.pre)


def test_autoclip_clips_at_the_10th_percentile_of_the_norms_before(run: Run) -> None:
    record = by_label(run.records, "AutoClip")
    assert math.isnan(record.threshold[0])  # the first step has no history: no clip
    for step in range(1, len(record.pre)):
        past = torch.tensor(record.pre[:step], dtype=torch.float64)
        expected = float(torch.quantile(past, 0.10))
        assert record.threshold[step] == pytest.approx(expected, rel=1e-5)
        assert record.post[step] == pytest.approx(
            record.pre[step] * min(1.0, expected / (record.pre[step] + 1e-6)), rel=1e-5
        )


def test_zclip_and_adagc_clip_every_injected_spike(run: Run) -> None:
    for start in ("ZClip", "AdaGC"):
        record = by_label(run.records, start)
        for step in run.example["SPIKES"]:
            assert record.post[step] < record.pre[step] / 10, (start, step)
        assert all(
            post <= pre * (1 + 1e-6) for pre, post in zip(record.pre, record.post, strict=True)
        )


def test_spike_skip_skips_the_steps_the_published_rule_names(run: Run) -> None:
    record = by_label(run.records, "SpikeSkip")
    window, sigma, min_history = 64, 6.0, 32  # the example's SpikeSkip(window=64)
    expected = []
    for step, norm in enumerate(record.pre):
        past = torch.tensor(record.pre[max(0, step - window) : step], dtype=torch.float64)
        if len(past) >= min_history:
            std, mean = torch.std_mean(past)
            if abs(norm - float(mean)) / float(std) > sigma:
                expected.append(step)
    skipped = [step for step, post in enumerate(record.post) if math.isnan(post)]
    assert skipped == expected
    assert set(run.example["SPIKES"]) <= set(skipped)
    assert record.skipped == len(skipped)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_the_plot_is_the_one_in_the_docs(run: Run) -> None:
    assert run.plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # docs/adaptive.md embeds this run's plot. Regenerate it with:
    #   python examples/adaptive_thresholds.py --plot docs/img/adaptive-thresholds.png
    assert_same_picture(run.plot, COMMITTED_PLOT)
