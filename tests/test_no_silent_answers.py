"""Inputs that used to give a quietly wrong answer now give a loud one, on every path.

- A tensor ``max_norm`` that is not > 0 flipped or zeroed every grad; a coefficient whose
  reciprocal overflows float32 zeroed the grads on the fused path only. Both are now a
  NaN coefficient, which the ``nonfinite`` policy handles like a NaN norm.
- A skipped first step of fused Adam/AdamW left optimizer state behind.
- Resuming changed when ``max_consecutive_skips`` raises on the fused path.
- An empty generator of parameters clipped nothing without a word.
- A load that keeps the clip state as it was says so, at the caller's line.
- A step that raised (parameters on the meta device) left the wrapper unusable.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_same
from torch import nn

import clipopt
from clipopt.distributed import ClippedOptimizerState

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _param(*values: float) -> nn.Parameter:
    w = nn.Parameter(torch.zeros(len(values)))
    w.grad = torch.tensor(values)
    return w


# --- Tensor thresholds that are not > 0 ---------------------------------------------------

BAD_TENSOR_THRESHOLDS = [-1.0, 0.0, math.nan, -math.inf]


@pytest.mark.parametrize("threshold", BAD_TENSOR_THRESHOLDS)
def test_a_bad_tensor_max_norm_turns_grads_nan_not_flipped(threshold: float) -> None:
    w = _param(3.0, -4.0)
    norm = clipopt.clip_grad_norm_([w], torch.tensor(threshold))
    assert float(norm) == 5.0
    assert w.grad is not None and bool(torch.isnan(w.grad).all())
    theirs = _param(3.0, -4.0)
    torch.nn.utils.clip_grad_norm_([theirs], torch.tensor(-1.0))
    assert theirs.grad is not None and float(theirs.grad[0]) < 0  # torch flips the sign


@pytest.mark.parametrize("threshold", BAD_TENSOR_THRESHOLDS)
def test_a_bad_tensor_max_norm_raises_when_asked_and_touches_nothing(threshold: float) -> None:
    calls: list[Callable[[list[nn.Parameter]], object]] = [
        lambda p: clipopt.clip_grad_norm_(p, torch.tensor(threshold), error_if_nonfinite=True),
        lambda p: clipopt.clip_grad_norm(p, torch.tensor(threshold), error_if_nonfinite=True),
    ]
    for call in calls:
        w = _param(3.0, -4.0)
        with pytest.raises(clipopt.NonFiniteNormError, match="coefficient"):
            call([w])
        assert w.grad is not None and torch.equal(w.grad, torch.tensor([3.0, -4.0]))


def _two_groups(fused: bool, threshold: float) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    a, b = _param(3.0, -4.0), _param(1.0)
    groups = [{"params": [a]}, {"params": [b], "clip_max_norm": torch.tensor(threshold)}]
    return [a, b], torch.optim.AdamW(groups, lr=0.1, fused=fused)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("threshold", BAD_TENSOR_THRESHOLDS)
def test_a_bad_group_tensor_threshold_is_skipped_or_raised_by_the_policy(
    threshold: float, fused: bool
) -> None:
    params, inner = _two_groups(fused, threshold)
    opt = clipopt.ClippedOptimizer(inner, max_norm=1.0, per_group=True, nonfinite="skip")
    before = [p.detach().clone() for p in params]
    opt.step()
    assert int(opt.skip_count) == 1 and int(opt.step_count) == 0
    assert all(torch.equal(p, q) for p, q in zip(params, before, strict=True))
    assert not opt.state_dict()["state"]
    params, inner = _two_groups(fused, threshold)
    opt = clipopt.ClippedOptimizer(inner, max_norm=1.0, per_group=True, nonfinite="raise")
    with pytest.raises(clipopt.NonFiniteNormError, match="clip coefficient is NaN"):
        opt.step()
    params, inner = _two_groups(fused, threshold)
    opt = clipopt.ClippedOptimizer(inner, max_norm=1.0, per_group=True)
    opt.step()  # propagate: the group's parameter turns NaN instead of moving uphill
    assert bool(torch.isnan(params[1]).all()) and not bool(torch.isnan(params[0]).any())


# --- A coefficient whose reciprocal overflows ---------------------------------------------


def _absurd_run(fused: bool, nonfinite: str) -> tuple[nn.Parameter, clipopt.ClippedOptimizer]:
    w = nn.Parameter(torch.ones(4))
    inner = torch.optim.AdamW([w], lr=0.1, fused=fused, foreach=not fused)
    opt = clipopt.ClippedOptimizer(inner, max_norm=1e-20, nonfinite=nonfinite)  # type: ignore[arg-type]
    w.grad = torch.full((4,), 1e18)  # norm / max_norm = 2e38: 1 / coefficient overflows
    opt.step()
    return w, opt


@pytest.mark.parametrize("nonfinite", ["propagate", "skip"])
def test_at_absurd_norms_the_folded_and_explicit_steps_agree(nonfinite: str) -> None:
    explicit, explicit_opt = _absurd_run(False, nonfinite)
    folded, folded_opt = _absurd_run(True, nonfinite)
    torch.testing.assert_close(folded, explicit, equal_nan=True, rtol=0, atol=0)
    assert folded.grad is not None and explicit.grad is not None
    torch.testing.assert_close(folded.grad, explicit.grad, equal_nan=True, rtol=0, atol=0)
    if nonfinite == "skip":
        assert torch.equal(explicit, torch.ones(4))  # skipped: untouched
        assert int(folded_opt.skip_count) == int(explicit_opt.skip_count) == 1
    else:
        assert bool(torch.isnan(explicit).all())  # NaN, not a silent zero-grad step
    coefficient = clipopt._kernels._scale.clip_coefficient(1e-3, torch.tensor(2e36))
    assert bool(torch.isnan(coefficient))
    assert float(
        clipopt._kernels._scale.clip_coefficient(1e-3, torch.tensor(1e30))
    ) == pytest.approx(1e-33, rel=1e-6)


# --- A skipped first step of a fused optimizer ---------------------------------------------


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "Adagrad"])
def test_a_skipped_first_fused_step_leaves_the_state_dict_as_it_was(name: str) -> None:
    w = nn.Parameter(torch.ones(3))
    kwargs: dict[str, Any] = {"momentum": 0.9} if name == "SGD" else {}
    inner = getattr(torch.optim, name)([w], lr=0.1, fused=True, **kwargs)
    opt = clipopt.ClippedOptimizer(inner, max_norm=1.0, nonfinite="skip")
    before = copy.deepcopy(opt.state_dict())
    w.grad = torch.tensor([1.0, math.nan, 1.0])
    opt.step()
    after = opt.state_dict()
    assert int(after["clip"]["skip_count"]) == 1
    after["clip"], before["clip"] = None, None
    assert_same(after, before)


# --- Resume and the skip limit on the fused path ------------------------------------------


def _fused_limit_run(resume_after: int | None) -> list[str]:
    """A finite step, then non-finite ones until the limit raises; what each step did."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.ones(3))

    def build(param: nn.Parameter) -> clipopt.ClippedOptimizer:
        inner = torch.optim.AdamW([param], lr=0.1, fused=True)
        return clipopt.ClippedOptimizer(inner, 1.0, nonfinite="skip", max_consecutive_skips=2)

    opt = build(w)
    w.grad = torch.ones(3)
    opt.step()
    events = []
    for step in range(6):
        if step == resume_after:
            saved = copy.deepcopy(opt.state_dict())
            opt = build(w)
            opt.load_state_dict(saved)
        w.grad = torch.full((3,), math.nan)
        try:
            opt.step()
        except clipopt.NonFiniteNormError:
            events.append("raise")
            break
        events.append("skip")
    return events


def test_resume_keeps_where_the_fused_skip_limit_raises() -> None:
    uninterrupted = _fused_limit_run(None)
    assert uninterrupted == ["skip", "skip", "skip", "raise"]
    for resume_after in range(1, 4):
        assert _fused_limit_run(resume_after) == uninterrupted, resume_after


# --- Empty generators -----------------------------------------------------------------------


def test_an_empty_generator_warns_as_torch_does() -> None:
    model = nn.Linear(2, 2)
    used = (p for p in model.parameters())
    list(used)
    for clip in (clipopt.clip_grad_norm_, clipopt.clip_grad_norm, torch.nn.utils.clip_grad_norm_):
        with pytest.warns(UserWarning, match="`parameters` is an empty generator") as caught:
            clip(used, 1.0)
        assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clipopt.clip_grad_norm_([], 1.0)  # an empty list is not a spent generator


def test_a_load_without_the_clip_state_warns_at_the_callers_line() -> None:
    """Both loads that keep the clip state as it was say so, pointing at the line that
    called them (their stacklevel is fixed: no stack is read)."""
    w = _param(3.0, 4.0)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD([w], lr=0.1), max_norm=1.0)
    with pytest.warns(UserWarning, match="without a 'clip' entry") as caught:
        opt.load_state_dict(opt.optimizer.state_dict())
    assert caught[0].filename == __file__
    carrier = ClippedOptimizerState(opt)
    with pytest.warns(UserWarning, match="has no 'stage0'") as caught:
        carrier.load_state_dict(carrier.state_dict())  # a partial dcp.load hands it back
    assert caught[0].filename == __file__


# --- A step that raises leaves the wrapper as it was ---------------------------------------


def test_a_step_that_raises_on_meta_parameters_leaves_the_wrapper_usable() -> None:
    """The deferred-init pattern: built on meta, the first step raises (the inner
    optimizer's own error); the wrapper must not have moved its counters to meta."""
    with torch.device("meta"):
        model = nn.Linear(4, 3)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    opt = clipopt.ClippedOptimizer(inner, max_norm=0.5)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="fused=True"):
        opt.step()
    assert opt.last_norm is None
    assert [t.device.type for t in (opt.step_count, opt.skip_count)] == ["cpu", "cpu"]
    model.to_empty(device="cpu")  # new parameters in torch 2.13: hand them to the optimizer
    inner.param_groups[0]["params"] = list(model.parameters())
    inner.state.clear()
    model.zero_grad()  # to_empty carried the meta grads over, uninitialised
    torch.manual_seed(0)
    reference = nn.Linear(4, 3)
    bare = torch.optim.AdamW(reference.parameters(), lr=0.1, fused=True)
    with torch.no_grad():
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            p.copy_(q)
    for m in (model, reference):
        m(torch.ones(2, 4)).pow(2).sum().backward()
    opt.step()
    clipopt.clip_grad_norm_(reference.parameters(), 0.5)
    bare.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert int(opt.step_count) == 1


def test_an_inner_step_that_raises_records_nothing() -> None:
    w = _param(3.0, 4.0)
    inner = torch.optim.SGD([w], lr=0.1)
    opt = clipopt.ClippedOptimizer(inner, max_norm=1.0, nonfinite="skip")
    opt.step()
    before = copy.deepcopy(opt.state_dict())

    def fail(*args: Any) -> None:
        raise RuntimeError("the inner step failed")

    handle = inner.register_step_pre_hook(fail)
    w.grad = torch.tensor([30.0, 40.0])
    with pytest.raises(RuntimeError, match="the inner step failed"):
        opt.step()
    handle.remove()
    assert_same(opt.state_dict(), before)
