"""Files written by clipopt 0.1.0 still load, and training resumes from them bit-exactly.

``tests/data/make_legacy.py`` wrote them with that version: a ``torch.save`` checkpoint
and a pickle of the wrapper, each taken mid-run, with the parameters and state dict that
version reached at the end of the run. Today's code must read every saved value as it
was, resume from the file exactly as from its own checkpoint of the same state, and
reach 0.1.0's end of the run: to the last bit of float32 rounding, not bit for bit, as
the model's matmuls round differently on CPUs other than the one that wrote the files
(AVX2 and AVX-512 machines differ in the last bit of a weight here).
"""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from helpers import assert_identical

DATA = Path(__file__).parent / "data"
CASES = ("sgd-per-group", "adamw-fused")


def _maker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_legacy", DATA / "make_legacy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


legacy = _maker()


def _renamed(state_dict: dict[str, Any]) -> dict[str, Any]:
    """0.1.0's dict with its group keys under today's names, "clip_max_norm" and
    "clip_norm_type"; everything else as it was."""
    legacy = {"max_norm": "clip_max_norm", "norm_type": "clip_norm_type"}
    groups = [{legacy.get(k, k): v for k, v in g.items()} for g in state_dict["param_groups"]]
    return {**state_dict, "param_groups": groups}


def _assert_reached(ours: Any, theirs: Any) -> None:
    """0.1.0's end of the run, to float32 rounding (see the module's docstring); the
    counts and every non-tensor value exactly."""
    assert_identical(ours, theirs, nan_equal=True, rtol=1e-5)


def _loaded(case: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Today's model and wrapper with the 0.1.0 checkpoint's mid-run state loaded."""
    saved = torch.load(DATA / f"legacy_0.1.0_{case}.pt", weights_only=True)
    net = legacy.model()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)  # nothing of the fresh model may leak into the resumed run
    opt = legacy.optimizer(net, case)
    net.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    return net, opt


def _finish(net: torch.nn.Module, opt: torch.optim.Optimizer, case: str) -> None:
    for step in range(legacy.RESUME_AT, legacy.STEPS):
        opt.zero_grad()
        legacy.backward(net, step, legacy.POISONED[case])
        opt.step()


@pytest.mark.parametrize("case", CASES)
def test_a_0_1_0_checkpoint_loads_every_value_as_saved(case: str) -> None:
    saved = torch.load(DATA / f"legacy_0.1.0_{case}.pt", weights_only=True)
    net, opt = _loaded(case)
    assert_identical(net.state_dict(), saved["model"])
    assert_identical(opt.state_dict(), _renamed(saved["optimizer"]), nan_equal=True)


@pytest.mark.parametrize("case", CASES)
def test_a_0_1_0_checkpoint_resumes_bit_exactly(case: str, tmp_path: Path) -> None:
    saved = torch.load(DATA / f"legacy_0.1.0_{case}.pt", weights_only=True)
    net, opt = _loaded(case)
    torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, tmp_path / "today.pt")
    _finish(net, opt, case)
    _assert_reached(net.state_dict(), saved["final_model"])
    _assert_reached(opt.state_dict(), _renamed(saved["final_optimizer"]))
    # The same state, saved by today's code and resumed: every bit the same.
    ours = torch.load(tmp_path / "today.pt", weights_only=True)
    again = legacy.model()
    again_opt = legacy.optimizer(again, case)
    again.load_state_dict(ours["model"])
    again_opt.load_state_dict(ours["opt"])
    _finish(again, again_opt, case)
    assert_identical(again.state_dict(), net.state_dict())
    assert_identical(again_opt.state_dict(), opt.state_dict(), nan_equal=True)


@pytest.mark.parametrize("case", CASES)
def test_a_0_1_0_pickle_resumes_bit_exactly(case: str) -> None:
    saved = torch.load(DATA / f"legacy_0.1.0_{case}.pt", weights_only=True)
    with open(DATA / f"legacy_0.1.0_{case}.pickle", "rb") as f:
        pickled = pickle.load(f)  # our own committed file
    net, opt = pickled["model"], pickled["optimizer"]
    _finish(net, opt, case)
    _assert_reached(net.state_dict(), saved["final_model"])
    _assert_reached(opt.state_dict(), _renamed(saved["final_optimizer"]))
    # The pickle and the checkpoint hold the same mid-run state: both resume to one bit.
    from_checkpoint, checkpoint_opt = _loaded(case)
    _finish(from_checkpoint, checkpoint_opt, case)
    assert_identical(net.state_dict(), from_checkpoint.state_dict())
    assert_identical(opt.state_dict(), checkpoint_opt.state_dict(), nan_equal=True)
