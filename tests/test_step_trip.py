"""The trip of one ``ClippedOptimizer.step()`` through clipopt, measured with
``sys.setprofile`` after warm-up: a fixed threshold enters at most 6 clipopt modules at
a call depth of at most 6, and no module of a feature it did not configure (pipeline
stages, DeepSpeed, the clip rules)."""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

import pytest
import torch

import clipopt

ROOT = os.path.dirname(os.path.abspath(clipopt.__file__)) + os.sep
UNCONFIGURED = ("_dist/_stages.py", "_dist/_deepspeed.py", "rules/")


def trip(opt: clipopt.ClippedOptimizer) -> tuple[dict[str, int], int]:
    """The clipopt files one ``opt.step()`` enters (each with the deepest depth it is
    entered at), and the deepest call depth inside clipopt."""
    files: dict[str, int] = {}
    depth, deepest = [0], [0]

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(ROOT):
            return
        if event == "call":
            depth[0] += 1
            deepest[0] = max(deepest[0], depth[0])
            name = path[len(ROOT) :].replace(os.sep, "/")
            files[name] = max(files.get(name, 0), depth[0])
        elif event == "return":
            depth[0] -= 1

    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    return files, deepest[0]


def warmed_up(fused: bool) -> clipopt.ClippedOptimizer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    opt = clipopt.ClippedOptimizer(inner, max_norm=1.0)
    for _ in range(3):
        model(torch.randn(4, 8)).pow(2).sum().backward()
        opt.step()
    model(torch.randn(4, 8)).pow(2).sum().backward()
    return opt


@pytest.mark.parametrize("fused", [False, True], ids=["AdamW", "fused AdamW"])
def test_a_fixed_threshold_enters_few_modules_and_none_unconfigured(fused: bool) -> None:
    files, _ = trip(warmed_up(fused))
    assert len(files) <= 6, files
    assert not [f for f in files if f.startswith(UNCONFIGURED)], files


@pytest.mark.parametrize("fused", [False, True], ids=["AdamW", "fused AdamW"])
def test_a_fixed_threshold_stays_within_depth_six(fused: bool) -> None:
    files, deepest = trip(warmed_up(fused))
    assert deepest <= 6, files
