"""Resuming a ClippedOptimizer from a file is bit-exact.

Each case trains N steps in one go, and separately trains k steps, saves model,
optimizer and scheduler to a file, builds fresh objects (with different initial
weights, so nothing leaks through), loads the file with ``weights_only=True`` and trains
N - k more. Parameters, learning rates, ``last_norm``, counters and the whole optimizer
state dict must be bit-identical. ``MAX_NORM`` is below every grad norm of the problem,
so every step clips.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch_optimizer
from helpers import assert_same
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

import clipopt
from clipopt import ClippedOptimizer

TOTAL_STEPS = 8
MAX_NORM = 0.05
POISONED_STEP = 2  # with nonfinite="skip", this step's grads hold a NaN and are skipped

MakeOptimizer = Callable[[list[dict[str, Any]]], Optimizer]

OPTIMIZERS: dict[str, MakeOptimizer] = {
    "sgd-momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2, amsgrad=True),
    "adamw-fused": lambda groups: torch.optim.AdamW(groups, lr=1e-2, fused=True),
    "lamb": lambda groups: torch_optimizer.Lamb(groups, lr=1e-2),
}


def _model(seed: int, device: str = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).to(device)


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    return [
        {"params": list(model[0].parameters())},
        {"params": list(model[2].parameters()), "clip_max_norm": MAX_NORM / 2},
    ]


def _backward(model: nn.Module, step: int, poison: bool) -> None:
    device = next(model.parameters()).device
    data = torch.Generator().manual_seed(step)
    x = torch.randn(16, 5, generator=data).to(device)
    y = torch.randn(16, 2, generator=data).to(device)
    (torch.nn.functional.mse_loss(model(x), y) * 100).backward()
    if poison and step == POISONED_STEP:
        first = next(model.parameters())
        assert first.grad is not None
        first.grad.view(-1)[0] = math.nan


def _build(
    name: str, seed: int, per_group: bool, nonfinite: str, device: str = "cpu"
) -> tuple[nn.Module, ClippedOptimizer, LRScheduler]:
    model = _model(seed, device)
    inner = OPTIMIZERS[name](_groups(model))
    opt = ClippedOptimizer(inner, MAX_NORM, per_group=per_group, nonfinite=nonfinite)  # type: ignore[arg-type]
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=inner.defaults["lr"], total_steps=TOTAL_STEPS, cycle_momentum=False
    )
    return model, opt, sched


def _train(
    model: nn.Module,
    opt: ClippedOptimizer,
    sched: LRScheduler,
    steps: range,
    poison: bool,
) -> None:
    for step in steps:
        opt.zero_grad()
        _backward(model, step, poison)
        opt.step()
        sched.step()
        assert opt.last_norm is not None
        if torch.isfinite(opt.last_norm):
            assert opt.last_norm.item() > MAX_NORM, "every step clips"


def _resume_case(
    tmp_path: Path, name: str, per_group: bool, nonfinite: str, device: str, split: int
) -> None:
    poison = nonfinite == "skip"
    straight = _build(name, seed=0, per_group=per_group, nonfinite=nonfinite, device=device)
    _train(*straight, range(TOTAL_STEPS), poison)

    first = _build(name, seed=0, per_group=per_group, nonfinite=nonfinite, device=device)
    _train(*first, range(split), poison)
    model, opt, sched = first
    path = tmp_path / "checkpoint.pt"
    torch.save(
        {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()},
        path,
    )

    resumed = _build(name, seed=123, per_group=per_group, nonfinite=nonfinite, device=device)
    checkpoint = torch.load(path, weights_only=True)
    resumed[0].load_state_dict(checkpoint["model"])
    resumed[1].load_state_dict(checkpoint["optim"])
    resumed[2].load_state_dict(checkpoint["sched"])
    _train(*resumed, range(split, TOTAL_STEPS), poison)

    (model_a, opt_a, sched_a), (model_b, opt_b, sched_b) = straight, resumed
    assert_same(list(model_a.parameters()), list(model_b.parameters()), "params")
    assert_same(sched_a.get_last_lr(), sched_b.get_last_lr(), "lrs")
    assert_same([g["lr"] for g in opt_a.param_groups], [g["lr"] for g in opt_b.param_groups], "lr")
    assert_same(opt_a.last_norm, opt_b.last_norm, "last_norm")
    assert_same(opt_a.state_dict(), opt_b.state_dict(), "optimizer")
    expected_skips = 1 if poison else 0
    assert int(opt_b.skip_count) == expected_skips
    assert int(opt_b.step_count) == TOTAL_STEPS - expected_skips


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_resume_is_bit_exact(tmp_path: Path, name: str) -> None:
    _resume_case(tmp_path, name, per_group=False, nonfinite="propagate", device="cpu", split=3)


@pytest.mark.parametrize("name", ["sgd-momentum", "adamw-fused"])
def test_resume_is_bit_exact_with_per_group_norms_and_a_skipped_step(
    tmp_path: Path, name: str
) -> None:
    _resume_case(tmp_path, name, per_group=True, nonfinite="skip", device="cpu", split=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_resume_is_bit_exact_on_cuda(tmp_path: Path, name: str) -> None:
    _resume_case(tmp_path, name, per_group=True, nonfinite="skip", device="cuda", split=3)


def test_run_started_unwrapped_resumes_wrapped(tmp_path: Path) -> None:
    """k steps with clip_grad_norm_ by hand, then N - k wrapped: same as all by hand."""

    def by_hand(model: nn.Module, opt: Optimizer, steps: range) -> None:
        for step in steps:
            opt.zero_grad()
            _backward(model, step, poison=False)
            clipopt.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()

    reference = _model(0)
    reference_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    by_hand(reference, reference_opt, range(TOTAL_STEPS))

    model = _model(0)
    bare = torch.optim.Adam(model.parameters(), lr=1e-2)
    by_hand(model, bare, range(3))
    path = tmp_path / "bare.pt"
    torch.save({"model": model.state_dict(), "optim": bare.state_dict()}, path)

    fresh = _model(7)
    opt = ClippedOptimizer(torch.optim.Adam(fresh.parameters(), lr=1e-2), MAX_NORM)
    checkpoint = torch.load(path, weights_only=True)
    fresh.load_state_dict(checkpoint["model"])
    with pytest.warns(UserWarning, match=r"without a 'clip' entry.*ClippedOptimizerState"):
        opt.load_state_dict(checkpoint["optim"])  # a bare run's: the clip state starts here
    for step in range(3, TOTAL_STEPS):
        opt.zero_grad()
        _backward(fresh, step, poison=False)
        opt.step()
    assert_same(list(reference.parameters()), list(fresh.parameters()), "params")
    assert_same(reference_opt.state_dict()["state"], opt.state_dict()["state"], "state")
    assert int(opt.step_count) == TOTAL_STEPS - 3


# --- A checkpoint written by format 1 of the "clip" entry -------------------------------

DATA = Path(__file__).parent / "data"
FORMAT_1 = DATA / "format_1_adamw_zclip.pt"


def _format_1_maker() -> ModuleType:
    """``tests/data/make_format_1.py``, which wrote ``FORMAT_1``: its model, wrapper,
    grads and read-outs."""
    spec = importlib.util.spec_from_file_location("make_format_1", DATA / "make_format_1.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


maker = _format_1_maker()


def _loaded_format_1() -> tuple[list[nn.Parameter], ClippedOptimizer, dict[str, Any]]:
    saved = torch.load(FORMAT_1, weights_only=True)
    params = maker.params()
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(saved["params"], params)
    return params, maker.wrapper(params), saved


def test_a_format_1_checkpoint_loads_and_resumes_bit_for_bit() -> None:
    """The loaded wrapper reports what the writing run recorded at the save, and its
    next steps are that run's continued steps, bit for bit; its clip count starts at 0
    (the saved one was the rule's) and counts the clips that run counted after the save."""
    params, opt, saved = _loaded_format_1()
    assert saved["optimizer"]["clip"]["format"] == 1
    opt.load_state_dict(saved["optimizer"])
    start = saved["recorded"]["clipped_count"]
    assert_same(maker.readouts(opt), {**saved["recorded"], "clipped_count": start - start})
    for i, step in enumerate(range(maker.SAVED_AT, maker.SAVED_AT + maker.CONTINUED)):
        maker.set_grads(params, step)
        opt.step()
        expected = {key: values[i] for key, values in saved["continued"].items()}
        expected["clipped_count"] = expected["clipped_count"] - start
        assert_same({"params": maker.flat(params), **maker.readouts(opt)}, expected, f"{step}")


def test_a_format_1_checkpoint_starts_the_clip_readouts_afresh() -> None:
    """Format 1 has no clip readouts: the count starts at 0, the last ones are None."""
    _, opt, saved = _loaded_format_1()
    opt.load_state_dict(saved["optimizer"])
    assert opt.last_clipped is None and opt.last_clipped_norm is None
    assert_same(opt.clipped_count, torch.zeros((), dtype=torch.int64))
    assert opt.state_dict()["clip"]["format"] == 2


FORMAT_2 = DATA / "format_2_adamw_zclip.pt"


def test_a_format_2_checkpoint_loads_and_resumes_bit_for_bit() -> None:
    """As format 1, with the clip readouts (``tests/data/make_format_2.py``)."""
    sys.path.insert(0, str(DATA))  # make_format_2 imports make_format_1
    try:
        spec = importlib.util.spec_from_file_location("make_format_2", DATA / "make_format_2.py")
        assert spec is not None and spec.loader is not None
        maker_2 = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(maker_2)
    finally:
        sys.path.remove(str(DATA))
    saved = torch.load(FORMAT_2, weights_only=True)
    assert saved["optimizer"]["clip"]["format"] == 2
    params = maker.params()
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(saved["params"], params)
    opt = maker.wrapper(params)
    opt.load_state_dict(saved["optimizer"])
    assert_same(maker_2.readouts(opt), saved["recorded"])
    # the rule's own count, saved then, is ignored and no longer written
    assert "clipped_count" in saved["optimizer"]["clip"]["rule"]
    assert "clipped_count" not in opt.state_dict()["clip"]["rule"]
    assert int(saved["continued"]["clipped_count"][-1]) > int(saved["recorded"]["clipped_count"])
    for i, step in enumerate(range(maker.SAVED_AT, maker.SAVED_AT + maker.CONTINUED)):
        maker.set_grads(params, step)
        opt.step()
        expected = {key: values[i] for key, values in saved["continued"].items()}
        assert_same({"params": maker.flat(params), **maker_2.readouts(opt)}, expected, f"{step}")


@pytest.mark.parametrize("version", [None, 0, 3, True, 1.0, "2"])
def test_a_clip_entry_of_another_format_is_refused_touching_nothing(version: object) -> None:
    params, opt, saved = _loaded_format_1()
    maker.set_grads(params, 0)
    opt.step()
    before, weights = opt.state_dict(), maker.flat(params).clone()
    clip = dict(saved["optimizer"]["clip"])
    if version is None:
        del clip["format"]
    else:
        clip["format"] = version
    with pytest.raises(ValueError, match=re.escape(f"['clip']['format'] is {version!r}")):
        opt.load_state_dict({**saved["optimizer"], "clip": clip})
    assert_same(opt.state_dict(), before)
    assert_same(maker.flat(params), weights)
