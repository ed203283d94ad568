"""The ClippedOptimizer contract: transparency, clipping, closures, non-finite norms,
hooks, copies, errors and state-dict validation.

References are computed independently: float64 norms of the concatenated grads, and
the same optimizer driven by :func:`clipopt.clip_grad_norm_` + ``step()`` by hand.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import pytest
import torch
from helpers import assert_same
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import clipopt
from clipopt import ClippedOptimizer, NonFiniteNormError

EPS = 1e-6


# ---------------------------------------------------------------------------- helpers


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _backward(model: nn.Module, scale: float = 10.0, seed: int = 1) -> Tensor:
    data = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 4, generator=data)
    loss = model(x).pow(2).sum() * scale
    loss.backward()
    return loss.detach()


def _grads(model: nn.Module) -> list[Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _params(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _ref_norm(tensors: list[Tensor], p: float) -> float:
    """The p-norm of the concatenated tensors, in float64."""
    flat = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    return torch.linalg.vector_norm(flat, p).item()


def _full_state(opt: ClippedOptimizer, model: nn.Module) -> dict[str, Any]:
    """Everything a step or a load could change, copied."""
    return {
        "optimizer": copy.deepcopy(opt.state_dict()),
        "params": _params(model),
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "identity": (id(opt.param_groups), id(opt.state)),
    }


@contextmanager
def _no_host_reads() -> Iterator[None]:
    """Fail on any read of a tensor's value by the host (item, tolist, bool, float, int)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("host read of a tensor value in the step path")

    names = ("item", "tolist", "__bool__", "__float__", "__int__")
    saved = {name: getattr(Tensor, name) for name in names}
    try:
        for name in names:
            setattr(Tensor, name, refuse)
        yield
    finally:
        for name, method in saved.items():
            setattr(Tensor, name, method)


@contextmanager
def _counted_host_reads() -> Iterator[list[str]]:
    """Record each read of a tensor's value by the host (item, tolist, bool, float, int)."""
    names = ("item", "tolist", "__bool__", "__float__", "__int__")
    saved = {name: getattr(Tensor, name) for name in names}
    reads: list[str] = []

    def counted(name: str) -> Callable[..., Any]:
        def read(self: Tensor, *args: Any, **kwargs: Any) -> Any:
            reads.append(name)
            return saved[name](self, *args, **kwargs)

        return read

    try:
        for name in names:
            setattr(Tensor, name, counted(name))
        yield reads
    finally:
        for name, method in saved.items():
            setattr(Tensor, name, method)


def _sgd(model: nn.Module, **kwargs: Any) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **kwargs)


# ---------------------------------------------------------------------------- transparency


def test_is_a_transparent_optimizer() -> None:
    model = _model()
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt = ClippedOptimizer(inner, max_norm=2.0, norm_type=3)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.optimizer is inner
    assert opt.param_groups is inner.param_groups
    assert opt.state is inner.state
    assert opt.defaults is inner.defaults
    assert opt.defaults["betas"] == (0.9, 0.999)
    assert (opt.defaults["clip_max_norm"], opt.defaults["clip_norm_type"]) == (2.0, 3.0)
    assert opt.param_groups[0]["clip_max_norm"] == 2.0
    assert "step" not in vars(opt), "step must be the class's method"
    assert opt.step.__func__ is ClippedOptimizer.step  # type: ignore[attr-defined]


def test_identity_survives_load_state_dict() -> None:
    model = _model()
    opt = ClippedOptimizer(_sgd(model), max_norm=1.0)
    _backward(model)
    opt.step()
    saved = opt.state_dict()
    groups_before = opt.param_groups
    opt.load_state_dict(saved)
    assert opt.param_groups is not groups_before, "torch's load replaces the list"
    assert opt.param_groups is opt.optimizer.param_groups
    assert opt.state is opt.optimizer.state


def test_inner_holds_no_reference_to_wrapper() -> None:
    model = _model()
    inner = _sgd(model)
    opt = ClippedOptimizer(inner, max_norm=1.0)
    _backward(model)
    opt.step()
    opt.state_dict()
    alive = weakref.ref(opt)
    del opt
    assert alive() is None, "no cycle: refcounting alone frees the wrapper"
    assert "clip_max_norm" in inner.param_groups[0]


@pytest.mark.parametrize("via", ["wrapper", "inner"])
def test_add_param_group_fills_clip_defaults(via: str) -> None:
    model = _model()
    extra = nn.Parameter(torch.randn(3))
    pinned = nn.Parameter(torch.randn(2))
    opt = ClippedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), max_norm=0.5)
    target = opt if via == "wrapper" else opt.optimizer
    target.add_param_group({"params": [extra]})
    target.add_param_group({"params": [pinned], "clip_max_norm": 0.25, "lr": 0.2})
    assert len(opt.param_groups) == len(opt.optimizer.param_groups) == 3
    assert (
        opt.param_groups[1]["clip_max_norm"] == 0.5 and opt.param_groups[1]["clip_norm_type"] == 2.0
    )
    assert opt.param_groups[2]["clip_max_norm"] == 0.25 and opt.param_groups[2]["lr"] == 0.2


def test_add_param_group_rejects_bad_clip_values_before_adding() -> None:
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), max_norm=0.5)
    with pytest.raises(ValueError, match=r"max_norm.*-1"):
        opt.add_param_group({"params": list(model[2].parameters()), "clip_max_norm": -1.0})
    with pytest.raises(ValueError, match=r"norm_type.*'l3'"):
        opt.add_param_group({"params": list(model[2].parameters()), "clip_norm_type": "l3"})
    assert len(opt.param_groups) == 1


def test_scheduler_sees_no_step_order_warning_and_sets_lr() -> None:
    model = _model()
    opt = ClippedOptimizer(_sgd(model), max_norm=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            _backward(model)
            opt.step()
            sched.step()
            opt.zero_grad()
    assert opt.optimizer.param_groups[0]["lr"] == 0.1 * 0.5**3
    assert getattr(opt, "_opt_called", False)
    assert not hasattr(opt.optimizer, "_opt_called"), "the scheduler patched the wrapper"


def test_zero_grad_delegates() -> None:
    model = _model()
    opt = ClippedOptimizer(_sgd(model), max_norm=1.0)
    _backward(model)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------------------- clipping


def test_last_norm_none_before_first_step_then_matches_hand_driven_bit_for_bit() -> None:
    model_a, model_b = _model(), _model()
    opt = ClippedOptimizer(_sgd(model_a), max_norm=1.0)
    ref_opt = _sgd(model_b)
    assert opt.last_norm is None
    for step in range(4):
        _backward(model_a, seed=step)
        _backward(model_b, seed=step)
        opt.step()
        hand_norm = clipopt.clip_grad_norm_(model_b.parameters(), 1.0)
        ref_opt.step()
        assert opt.last_norm is not None
        assert opt.last_norm.dtype == torch.float32 and opt.last_norm.dim() == 0
        assert torch.equal(opt.last_norm, hand_norm)
        assert_same(_grads(model_a), _grads(model_b))
        assert_same(_params(model_a), _params(model_b))
        opt.zero_grad()
        ref_opt.zero_grad()
    assert int(opt.step_count) == 4


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3), min_size=1, max_size=4),
    norm_type=st.sampled_from([1.0, 2.0, 3.5, math.inf, 0.5]),
    max_norm=st.floats(0.01, 100.0),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_clips_to_float64_reference(
    shapes: list[list[int]], norm_type: float, max_norm: float, scale: float, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * scale
    before = [p.grad.clone() for p in params if p.grad is not None]
    ref = _ref_norm(before, norm_type) if any(g.numel() for g in before) else 0.0
    opt = ClippedOptimizer(torch.optim.SGD(params, lr=0.0), max_norm, norm_type)
    opt.step()
    assert opt.last_norm is not None
    assert math.isclose(opt.last_norm.item(), ref, rel_tol=1e-5, abs_tol=1e-30)
    coef = min(1.0, max_norm / (ref + EPS))
    for p, g in zip(params, before, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad.double(), g.double() * coef, rtol=1e-5, atol=1e-30)


def test_per_group_max_norm_with_one_global_norm() -> None:
    model = _model()
    inner = torch.optim.SGD(
        [
            {"params": model[0].parameters(), "clip_max_norm": 0.5},
            {"params": model[2].parameters()},
        ],
        lr=0.0,
    )
    opt = ClippedOptimizer(inner, max_norm=2.0)
    _backward(model)
    first, second = list(model[0].parameters()), list(model[2].parameters())
    before = [p.grad.clone() for p in first + second]  # type: ignore[union-attr]
    total = _ref_norm(before, 2.0)
    opt.step()
    assert opt.last_norm is not None
    assert math.isclose(opt.last_norm.item(), total, rel_tol=1e-6)
    for p, g in zip(first + second, before, strict=True):
        limit = 0.5 if any(p is q for q in first) else 2.0
        expected = g.double() * min(1.0, limit / (total + EPS))
        torch.testing.assert_close(p.grad.double(), expected, rtol=1e-6, atol=0)  # type: ignore[union-attr]


def _two_groups(model: nn.Module, first_norm_type: float | None) -> list[dict[str, Any]]:
    first: dict[str, Any] = {"params": list(model[0].parameters())}
    if first_norm_type is not None:
        first["clip_norm_type"] = first_norm_type
    return [first, {"params": list(model[2].parameters())}]


def test_mixed_norm_types_need_per_group_at_construction() -> None:
    inner = torch.optim.SGD(_two_groups(_model(), 1.0), lr=0.1)
    groups_before = copy.deepcopy(inner.state_dict()["param_groups"])
    with pytest.raises(ValueError, match=r"norm_type.*per_group=True"):
        ClippedOptimizer(inner, max_norm=0.1)
    assert inner.state_dict()["param_groups"] == groups_before  # no defaults filled in
    ClippedOptimizer(inner, max_norm=0.1, norm_type=1.0)  # the same order everywhere is fine
    assert ClippedOptimizer(inner, max_norm=0.1, per_group=True).per_group


def test_mixed_norm_types_set_after_construction_fail_the_step_and_touch_nothing() -> None:
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(_two_groups(model, None), lr=0.1), max_norm=0.1)
    opt.param_groups[0]["clip_norm_type"] = 1.0
    _backward(model)
    before = _full_state(opt, model)
    with pytest.raises(ValueError, match=r"norm_type.*per_group=True"):
        opt.step()
    assert_same(before, _full_state(opt, model))


def test_add_param_group_refuses_a_second_norm_type_without_per_group() -> None:
    model = _model()
    groups = _two_groups(model, None)
    opt = ClippedOptimizer(torch.optim.SGD(groups[:1], lr=0.1), max_norm=0.1)
    before = _full_state(opt, model)
    with pytest.raises(ValueError, match=r"norm_type.*per_group=True"):
        opt.add_param_group({**groups[1], "clip_norm_type": math.inf})
    assert_same(before, _full_state(opt, model))
    opt.add_param_group({**groups[1], "clip_norm_type": 2})  # the shared order, spelled as an int
    per_group = ClippedOptimizer(torch.optim.SGD(groups[:1], lr=0.1), 0.1, per_group=True)
    per_group.add_param_group({**groups[1], "clip_norm_type": math.inf})
    assert [g["clip_norm_type"] for g in per_group.param_groups] == [2.0, math.inf]


@pytest.mark.parametrize("with_clip_entry", [True, False])
def test_load_state_dict_refuses_mixed_norm_types_without_per_group(
    with_clip_entry: bool,
) -> None:
    model = _model()
    source = ClippedOptimizer(
        torch.optim.SGD(_two_groups(model, 1.0), lr=0.1), max_norm=0.1, per_group=True
    )
    saved = source.state_dict()
    if with_clip_entry:  # the checkpoint itself says one global norm
        saved["clip"]["settings"]["per_group"] = False
    else:  # a plain inner state dict, loaded into a wrapper without per_group
        del saved["clip"]
    target = ClippedOptimizer(torch.optim.SGD(_two_groups(model, None), lr=0.5), max_norm=0.2)
    _backward(model)
    target.step()
    before = _full_state(target, model)
    with pytest.raises(ValueError, match=r"norm_type.*per_group=True"):
        target.load_state_dict(saved)
    assert_same(before, _full_state(target, model))
    assert target.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("norm_types", [(2.0, 2.0), (1.0, math.inf)])
def test_per_group_norms_match_float64_references(norm_types: tuple[float, float]) -> None:
    model = _model()
    groups = [list(model[0].parameters()), list(model[2].parameters())]
    inner = torch.optim.SGD(
        [
            {"params": groups[0], "clip_norm_type": norm_types[0], "clip_max_norm": 0.3},
            {"params": groups[1], "clip_norm_type": norm_types[1]},
        ],
        lr=0.0,
    )
    opt = ClippedOptimizer(inner, max_norm=1.5, per_group=True)
    _backward(model)
    before = [[p.grad.clone() for p in g] for g in groups]  # type: ignore[union-attr]
    refs = [_ref_norm(b, p) for b, p in zip(before, norm_types, strict=True)]
    opt.step()
    assert opt.last_group_norms is not None and opt.last_group_norms.shape == (2,)
    for got, ref in zip(opt.last_group_norms.tolist(), refs, strict=True):
        assert math.isclose(got, ref, rel_tol=1e-6)
    assert opt.last_norm is not None
    assert math.isclose(opt.last_norm.item(), math.hypot(*refs), rel_tol=1e-6)
    for params, grads, limit, ref in zip(groups, before, (0.3, 1.5), refs, strict=True):
        for p, g in zip(params, grads, strict=True):
            expected = g.double() * min(1.0, limit / (ref + EPS))
            torch.testing.assert_close(p.grad.double(), expected, rtol=1e-6, atol=0)  # type: ignore[union-attr]


def test_max_norm_inf_leaves_grads_bit_identical_and_still_measures() -> None:
    model = _model()
    opt = ClippedOptimizer(_sgd(model), max_norm=math.inf)
    _backward(model, scale=1e4)
    before = _grads(model)
    opt.step()
    assert_same(_grads(model), before)
    assert opt.last_norm is not None
    assert math.isclose(opt.last_norm.item(), _ref_norm(before, 2.0), rel_tol=1e-6)


def test_tensor_threshold_in_a_group() -> None:
    model_a, model_b = _model(), _model()
    inner = torch.optim.SGD(model_a.parameters(), lr=0.1)
    opt = ClippedOptimizer(inner, max_norm=100.0)
    opt.param_groups[0]["clip_max_norm"] = torch.tensor(0.5)
    _backward(model_a)
    _backward(model_b)
    opt.step()
    clipopt.clip_grad_norm_(model_b.parameters(), 0.5)
    assert_same(_grads(model_a), _grads(model_b))


def test_no_grads_at_all_steps_and_records_zero() -> None:
    model = _model()
    opt = ClippedOptimizer(_sgd(model), max_norm=1.0)
    opt.step()
    assert opt.last_norm is not None and opt.last_norm.item() == 0.0
    assert int(opt.step_count) == 1


def test_propagate_step_reads_nothing_on_the_host() -> None:
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=0.1)
    _backward(model)
    with _no_host_reads():
        opt.step()
        opt.step()
    assert int(opt.step_count) == 2


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_skip_and_raise_read_the_host_once_per_step(nonfinite: Literal["skip", "raise"]) -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = ClippedOptimizer(inner, max_norm=0.1, nonfinite=nonfinite)
    _backward(model)
    with _counted_host_reads() as reads:
        opt.step()
        opt.step()
    assert len(reads) == 2 and int(opt.step_count) == 2
    if nonfinite == "skip":
        next(model.parameters()).grad[0] = math.nan  # type: ignore[index]
        with _counted_host_reads() as reads:
            opt.step()
        assert len(reads) == 1 and int(opt.skip_count) == 1


@pytest.mark.parametrize("limit", [None, 3])
def test_fused_skip_reads_at_most_the_previous_steps_copy(limit: int | None) -> None:
    """With a fused inner optimizer ``found_inf`` decides the skip on the device; only
    ``max_consecutive_skips`` reads the host copy of the count that the step before made."""
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    opt = ClippedOptimizer(inner, max_norm=0.1, nonfinite="skip", max_consecutive_skips=limit)
    _backward(model)
    opt.step()
    with _counted_host_reads() as reads:
        opt.step()
        opt.step()
    # The second step checks the count the host-decided first one left (known on the
    # host: no read), the third the device copy the second made (one read).
    assert reads == ([] if limit is None else ["item"])
    assert int(opt.step_count) == 3


# ---------------------------------------------------------------------------- closures


def test_closure_is_clipped_and_its_loss_returned() -> None:
    model_a, model_b = _model(), _model()
    opt = ClippedOptimizer(_sgd(model_a), max_norm=0.2)
    ref_opt = _sgd(model_b)
    calls = [0]

    def closure() -> Tensor:
        calls[0] += 1
        opt.zero_grad()
        return _backward(model_a)

    loss = opt.step(closure)
    assert calls[0] == 1
    ref_loss = _backward(model_b)
    hand_norm = clipopt.clip_grad_norm_(model_b.parameters(), 0.2)
    ref_opt.step()
    assert torch.equal(loss, ref_loss)
    assert opt.last_norm is not None and torch.equal(opt.last_norm, hand_norm)
    assert_same(_params(model_a), _params(model_b))


def test_lbfgs_closure_is_clipped_at_every_evaluation() -> None:
    model_a, model_b = _model(), _model()
    opt = ClippedOptimizer(torch.optim.LBFGS(model_a.parameters(), lr=0.5), max_norm=0.3)
    ref_opt = torch.optim.LBFGS(model_b.parameters(), lr=0.5)
    calls, hand_norms = [0], []

    def closure() -> Tensor:
        calls[0] += 1
        opt.zero_grad()
        return _backward(model_a)

    def hand_closure() -> Tensor:
        ref_opt.zero_grad()
        loss = _backward(model_b)
        hand_norms.append(clipopt.clip_grad_norm_(model_b.parameters(), 0.3))
        return loss

    for _ in range(2):
        assert torch.equal(opt.step(closure), ref_opt.step(hand_closure))
    assert calls[0] == len(hand_norms) > 2, "LBFGS evaluated the closure several times"
    assert opt.last_norm is not None and torch.equal(opt.last_norm, hand_norms[-1])
    assert_same(_params(model_a), _params(model_b))
    assert int(opt.step_count) == 2


# ---------------------------------------------------------------------------- non-finite


def _poison(model: nn.Module, value: float) -> None:
    first = next(model.parameters())
    assert first.grad is not None
    first.grad.view(-1)[0] = value


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_propagate_lets_nonfinite_through_like_torch(bad: float) -> None:
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1.0)
    _backward(model)
    _poison(model, bad)
    opt.step()
    assert opt.last_norm is not None and not torch.isfinite(opt.last_norm)
    assert not torch.isfinite(next(model.parameters())).all()
    assert int(opt.step_count) == 1 and int(opt.skip_count) == 0


@pytest.mark.parametrize("bad", [math.nan, -math.inf])
@pytest.mark.parametrize("per_group", [False, True])
def test_skip_leaves_params_state_and_grads_untouched(bad: float, per_group: bool) -> None:
    model = _model()
    inner = torch.optim.Adam(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.1
    )
    opt = ClippedOptimizer(inner, max_norm=0.1, nonfinite="skip", per_group=per_group)
    _backward(model)
    opt.step()
    opt.zero_grad()
    _backward(model, seed=2)
    _poison(model, bad)
    before = _full_state(opt, model)
    assert opt.step() is None
    after = _full_state(opt, model)
    for key in ("params", "grads", "identity"):
        assert_same(before[key], after[key])
    assert_same(before["optimizer"]["state"], after["optimizer"]["state"])
    clip = after["optimizer"]["clip"]
    assert (int(clip["step_count"]), int(clip["skip_count"]), int(clip["consecutive_skips"])) == (
        1,
        1,
        1,
    )
    assert opt.last_norm is not None and not torch.isfinite(opt.last_norm)
    opt.zero_grad()
    _backward(model, seed=3)
    opt.step()
    assert (int(opt.step_count), int(opt.skip_count), int(opt.consecutive_skips)) == (2, 1, 0)


def test_skip_with_closure_returns_loss_without_stepping() -> None:
    model = _model()
    opt = ClippedOptimizer(_sgd(model), max_norm=0.1, nonfinite="skip")
    params = _params(model)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = _backward(model)
        _poison(model, math.nan)
        return loss

    assert torch.isfinite(opt.step(closure))
    assert_same(params, _params(model))
    assert int(opt.skip_count) == 1


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_nonfinite_in_a_later_lbfgs_evaluation_raises(nonfinite: str) -> None:
    model = _model()
    opt = ClippedOptimizer(
        torch.optim.LBFGS(model.parameters(), lr=0.5), max_norm=0.3, nonfinite=nonfinite
    )
    calls = [0]

    def closure() -> Tensor:
        calls[0] += 1
        opt.zero_grad()
        loss = _backward(model)
        if calls[0] == 2:
            _poison(model, math.nan)
        return loss

    with pytest.raises(NonFiniteNormError, match="non-finite"):
        opt.step(closure)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_raise_touches_nothing(bad: float) -> None:
    model = _model()
    opt = ClippedOptimizer(_sgd(model), max_norm=0.1, nonfinite="raise")
    _backward(model)
    opt.step()
    _backward(model, seed=2)
    _poison(model, bad)
    before = _full_state(opt, model)
    with pytest.raises(FloatingPointError, match="non-finite") as raised:
        opt.step()
    assert isinstance(raised.value, RuntimeError) and isinstance(raised.value, NonFiniteNormError)
    assert_same(before, _full_state(opt, model))


def test_max_consecutive_skips_raises_then_none_never_does() -> None:
    model = _model()
    opt = ClippedOptimizer(_sgd(model), max_norm=0.1, nonfinite="skip", max_consecutive_skips=3)
    _backward(model)
    _poison(model, math.nan)
    for _ in range(3):
        opt.step()
    before = _full_state(opt, model)
    with pytest.raises(NonFiniteNormError, match=r"3 skipped steps in a row"):
        opt.step()
    assert_same(before, _full_state(opt, model))
    assert int(opt.consecutive_skips) == 3

    patient = ClippedOptimizer(
        opt.optimizer.__class__(model.parameters(), lr=0.1),
        max_norm=0.1,
        nonfinite="skip",
        max_consecutive_skips=None,
    )
    for _ in range(25):
        patient.step()
    assert int(patient.skip_count) == 25 and int(patient.step_count) == 0


def test_a_finite_step_resets_the_streak() -> None:
    model = _model()
    opt = ClippedOptimizer(_sgd(model), max_norm=0.1, nonfinite="skip", max_consecutive_skips=2)
    for _ in range(3):
        opt.zero_grad()
        _backward(model)
        _poison(model, math.nan)
        opt.step()
        opt.step()
        opt.zero_grad()
        _backward(model)
        opt.step()
    assert (int(opt.skip_count), int(opt.step_count), int(opt.consecutive_skips)) == (6, 3, 0)


# ---------------------------------------------------------------------------- hooks


def test_step_hooks_fire_around_the_whole_clipped_step() -> None:
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=0.1)
    _backward(model)
    raw_norm = _ref_norm(_grads(model), 2.0)
    events: list[tuple[str, float]] = []

    def norm_now() -> float:
        return _ref_norm(_grads(model), 2.0)

    opt.register_step_pre_hook(lambda o, a, k: events.append(("wrapper pre", norm_now())))
    opt.optimizer.register_step_pre_hook(lambda o, a, k: events.append(("inner pre", norm_now())))
    opt.optimizer.register_step_post_hook(lambda o, a, k: events.append(("inner post", norm_now())))
    opt.register_step_post_hook(lambda o, a, k: events.append(("wrapper post", norm_now())))
    opt.step()
    assert [name for name, _ in events] == [
        "wrapper pre",
        "inner pre",
        "inner post",
        "wrapper post",
    ]
    assert math.isclose(events[0][1], raw_norm, rel_tol=1e-6)
    for _, seen in events[1:]:
        assert math.isclose(seen, 0.1, rel_tol=1e-4), "later hooks see clipped grads"


def test_hooks_fire_in_torchs_order_and_global_ones_once() -> None:
    """torch: global pre-hooks, own pre-hooks, the step, own post-hooks, global post-hooks.
    A wrapped step gives the same sequence as the bare one, with the inner optimizer's own
    hooks around the inner step, and the global hooks see the wrapper and the pre-clip
    grads, as around any optimizer's step."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    def record(
        opt: torch.optim.Optimizer, inner: torch.optim.Optimizer | None
    ) -> list[tuple[int, Any, float]]:
        events: list[tuple[int, Any, float]] = []

        def hook(tag: int) -> Callable[..., None]:
            return lambda o, a, k: events.append((tag, o, _ref_norm(_grads(model), 2.0)))

        handles = [register_optimizer_step_pre_hook(hook(0))]
        opt.register_step_pre_hook(hook(1))
        opt.register_step_post_hook(hook(2))
        if inner is not None:
            inner.register_step_pre_hook(hook(3))
            inner.register_step_post_hook(hook(4))
        handles.append(register_optimizer_step_post_hook(hook(5)))
        try:
            opt.step()
        finally:
            for handle in handles:
                handle.remove()
        return events

    model = _model()
    _backward(model)
    pre_clip = _ref_norm(_grads(model), 2.0)
    bare = torch.optim.SGD(model.parameters(), lr=0.0)
    assert [tag for tag, _, _ in record(bare, None)] == [0, 1, 2, 5]
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    opt = ClippedOptimizer(inner, max_norm=0.1)
    events = record(opt, inner)
    assert [(tag, o) for tag, o, _ in events] == [
        (0, opt),
        (1, opt),
        (3, inner),
        (4, inner),
        (2, opt),
        (5, opt),
    ]
    norms = [norm for _, _, norm in events]
    assert math.isclose(norms[0], pre_clip, rel_tol=1e-6) and pre_clip > 1.0
    assert math.isclose(norms[2], 0.1, rel_tol=1e-4), (
        "the inner optimizer's hooks see clipped grads"
    )


def test_step_pre_hook_may_replace_the_closure() -> None:
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=0.1)
    used = []

    def replacement() -> Tensor:
        used.append(True)
        opt.zero_grad()
        return _backward(model)

    handle = opt.register_step_pre_hook(lambda o, a, k: ((replacement,), {}))
    opt.step(lambda: torch.tensor(0.0))
    assert used == [True]
    handle.remove()
    with pytest.raises(RuntimeError, match="pre-hook must return"):
        opt.register_step_pre_hook(lambda o, a, k: "oops")  # type: ignore[arg-type, return-value]
        opt.step()


def test_state_dict_and_load_hooks_run_on_the_wrapper() -> None:
    model = _model()
    opt = ClippedOptimizer(_sgd(model), max_norm=1.0)
    seen: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("save pre"))

    def add_note(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
        seen.append("save post")
        return {**sd, "note": "kept"}

    opt.register_state_dict_post_hook(add_note)

    def drop_note(o: Any, sd: dict[str, Any]) -> None:
        seen.append("load pre")
        del sd["note"]

    opt.register_load_state_dict_pre_hook(drop_note)
    opt.register_load_state_dict_post_hook(lambda o: seen.append("load post"))
    saved = opt.state_dict()
    assert saved["note"] == "kept" and "clip" in saved
    opt.load_state_dict(saved)
    assert seen == ["save pre", "save post", "load pre", "load post"]
    assert "note" in saved, "load works on a shallow copy"


# ---------------------------------------------------------------------------- repr, copies


def test_repr_shows_settings_and_inner() -> None:
    opt = ClippedOptimizer(_sgd(_model()), max_norm=1.0, norm_type="inf", nonfinite="skip")
    text = repr(opt)
    assert text.startswith(
        "ClippedOptimizer(max_norm=1.0, norm_type=inf, per_group=False, nonfinite='skip', "
        "max_consecutive_skips=10) wrapping\nSGD ("
    )
    assert "momentum: 0.9" in text


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_are_independent_and_equivalent(how: str) -> None:
    model = _model()
    opt = ClippedOptimizer(_sgd(model), max_norm=0.2, per_group=True)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # patches opt.step on the instance
    opt.register_step_post_hook(lambda o, a, k: None)
    _backward(model)
    opt.step()
    clone = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert clone.param_groups is clone.optimizer.param_groups
    assert clone.param_groups is not opt.param_groups
    assert not clone._optimizer_step_post_hooks, "hooks are not copied, as in torch"
    assert_same(opt.state_dict(), clone.state_dict())
    clone_params = [p for g in clone.param_groups for p in g["params"]]
    for p, q in zip(model.parameters(), clone_params, strict=True):
        assert p is not q
        q.grad = p.grad.clone()  # type: ignore[union-attr]
    opt.step()
    clone.step()
    assert_same(opt.state_dict(), clone.state_dict())


# ---------------------------------------------------------------------------- bad input


def test_refuses_what_it_cannot_wrap() -> None:
    model = _model()
    opt = ClippedOptimizer(_sgd(model), max_norm=1.0)
    with pytest.raises(TypeError, match="already a ClippedOptimizer"):
        ClippedOptimizer(opt, max_norm=1.0)
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer, got Sequential"):
        ClippedOptimizer(model, max_norm=1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"\[0\] must be .* got Parameter; a list is optimizers"):
        ClippedOptimizer(list(model.parameters()), max_norm=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="SGD has no parameters"):
        ClippedOptimizer(torch.optim.SGD([{"params": []}], lr=0.1), max_norm=1.0)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"max_norm": -1.0}, ValueError, r"max_norm.*-1\.0"),
        ({"max_norm": 0}, ValueError, r"max_norm.*0"),
        ({"max_norm": math.nan}, ValueError, r"max_norm.*nan"),
        ({"max_norm": "1"}, TypeError, r"max_norm.*'1'"),
        ({"max_norm": True}, TypeError, r"max_norm.*True"),
        ({"max_norm": torch.tensor(1.0)}, TypeError, r"max_norm.*tensor"),
        ({"norm_type": 0}, ValueError, r"norm_type.*0"),
        ({"norm_type": "l2"}, ValueError, r"norm_type.*'l2'"),
        ({"nonfinite": "ignore"}, ValueError, r"nonfinite.*'ignore'"),
        ({"max_consecutive_skips": 0}, ValueError, r"max_consecutive_skips.*0"),
        ({"max_consecutive_skips": 1.5}, TypeError, r"max_consecutive_skips.*1\.5"),
        ({"per_group": "yes"}, TypeError, r"per_group.*'yes'"),
        ({"foreach": 1}, TypeError, r"foreach.*1"),
    ],
)
def test_bad_settings_raise_naming_the_value_and_touch_nothing(
    kwargs: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    inner = _sgd(_model())
    defaults, groups = dict(inner.defaults), copy.deepcopy(inner.state_dict()["param_groups"])
    arguments = {"max_norm": 1.0, **kwargs}
    with pytest.raises(error, match=pattern):
        ClippedOptimizer(inner, **arguments)
    assert inner.defaults == defaults
    assert inner.state_dict()["param_groups"] == groups


def test_bad_group_value_raises_at_step_naming_the_group() -> None:
    model = _model()
    opt = ClippedOptimizer(_sgd(model), max_norm=1.0)
    opt.param_groups[0]["clip_max_norm"] = -3.0
    _backward(model)
    before = _full_state(opt, model)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['clip_max_norm'\].*-3\.0"):
        opt.step()
    assert_same(before, _full_state(opt, model))


# ---------------------------------------------------------------------------- state dicts


def _trained(per_group: bool = False) -> tuple[ClippedOptimizer, nn.Module]:
    model = _model()
    inner = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.05}],
        lr=0.1,
        momentum=0.9,
    )
    opt = ClippedOptimizer(inner, max_norm=0.5, per_group=per_group, nonfinite="skip")
    for seed in range(3):
        opt.zero_grad()
        _backward(model, seed=seed)
        opt.step()
    _poison(model, math.nan)
    opt.step()
    return opt, model


def test_state_dict_layout_and_weights_only_round_trip() -> None:
    opt, _ = _trained(per_group=True)
    saved = opt.state_dict()
    assert set(saved) == {"state", "param_groups", "clip"}
    clip = saved["clip"]
    assert clip["settings"] == {
        "max_norm": 0.5,
        "norm_type": 2.0,
        "per_group": True,
        "nonfinite": "skip",
        "max_consecutive_skips": 10,
    }
    assert clip["last_group_norms"].shape == (2,)
    assert [int(clip[k]) for k in ("step_count", "skip_count", "consecutive_skips")] == [3, 1, 1]
    assert clip["last_norm"] is not opt.last_norm, "a copy, not the live tensor"
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    assert_same(saved, torch.load(buffer, weights_only=True))


def test_load_restores_clip_state_and_settings() -> None:
    opt, _ = _trained(per_group=True)
    saved = copy.deepcopy(opt.state_dict())
    fresh_model = _model(seed=5)
    fresh = ClippedOptimizer(
        torch.optim.SGD(
            [{"params": fresh_model[0].parameters()}, {"params": fresh_model[2].parameters()}],
            lr=1.0,
            momentum=0.9,
        ),
        max_norm=9.0,
    )
    fresh.load_state_dict(saved)
    assert_same(saved, fresh.state_dict())
    assert fresh.per_group and fresh.nonfinite == "skip" and fresh.defaults["clip_max_norm"] == 0.5
    assert fresh.param_groups[1]["lr"] == 0.05


def test_load_a_plain_inner_state_dict() -> None:
    model = _model()
    plain = _sgd(model)
    _backward(model)
    plain.step()
    inner_saved = plain.state_dict()
    fresh_model = _model()
    opt = ClippedOptimizer(_sgd(fresh_model), max_norm=0.7)
    with pytest.warns(UserWarning, match="without a 'clip' entry"):
        opt.load_state_dict(inner_saved)
    assert (
        opt.param_groups[0]["clip_max_norm"] == 0.7 and opt.param_groups[0]["clip_norm_type"] == 2.0
    )
    assert opt.last_norm is None and int(opt.step_count) == 0
    assert_same(inner_saved["state"], opt.state_dict()["state"])
    plain.load_state_dict(opt.state_dict())  # and a wrapped dict loads into a bare optimizer


def _corruptions() -> list[tuple[str, Callable[[dict[str, Any]], None], type[Exception], str]]:
    def set_path(*path: Any, value: Any) -> Callable[[dict[str, Any]], None]:
        def apply(sd: dict[str, Any]) -> None:
            target = sd
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = value

        return apply

    def pop(*path: Any) -> Callable[[dict[str, Any]], None]:
        def apply(sd: dict[str, Any]) -> None:
            target = sd
            for key in path[:-1]:
                target = target[key]
            del target[path[-1]]

        return apply

    return [
        ("clip type", set_path("clip", value=[1]), TypeError, r"\['clip'\] must be a dict"),
        ("clip key", pop("clip", "skip_count"), ValueError, "must have the keys"),
        ("clip extra", set_path("clip", "extra", value=1), ValueError, "must have the keys"),
        ("max_norm", set_path("clip", "settings", "max_norm", value="x"), TypeError, "max_norm"),
        ("mode", set_path("clip", "settings", "nonfinite", value="x"), ValueError, "nonfinite"),
        ("settings", pop("clip", "settings", "per_group"), ValueError, "settings"),
        ("last_norm", set_path("clip", "last_norm", value=1.0), TypeError, "last_norm"),
        ("norm shape", set_path("clip", "last_norm", value=torch.ones(2)), TypeError, "last_norm"),
        ("group norms", set_path("clip", "last_group_norms", value=torch.ones(3)), ValueError, "3"),
        ("counter", set_path("clip", "step_count", value=torch.tensor(1.0)), TypeError, "int64"),
        ("negative", set_path("clip", "skip_count", value=torch.tensor(-1)), ValueError, ">= 0"),
        ("no count", pop("clip", "clipped_count"), ValueError, "must have the keys"),
        ("clip count", set_path("clip", "clipped_count", value=torch.tensor(1)), TypeError, "1"),
        ("clips", set_path("clip", "clipped_count", value=-torch.ones(2).long()), ValueError, "0"),
        ("flag", set_path("clip", "last_clipped", value=torch.ones(2)), TypeError, "bool"),
        ("post", set_path("clip", "last_clipped_norm", value=torch.ones(3)), ValueError, r"\(2,\)"),
        ("group max", set_path("param_groups", 0, "clip_max_norm", value=-2.0), ValueError, "-2.0"),
        ("group p", set_path("param_groups", 1, "clip_norm_type", value="l1"), ValueError, "'l1'"),
    ]


@pytest.mark.parametrize(
    ("corrupt", "error", "pattern"),
    [c[1:] for c in _corruptions()],
    ids=[c[0] for c in _corruptions()],
)
def test_bad_state_dict_raises_and_changes_nothing(
    corrupt: Callable[[dict[str, Any]], None], error: type[Exception], pattern: str
) -> None:
    opt, model = _trained(per_group=True)
    bad = copy.deepcopy(opt.state_dict())
    for group in bad["param_groups"]:
        group["lr"] = 123.0
    bad["clip"]["step_count"] = torch.tensor(77)
    corrupt(bad)
    before = _full_state(opt, model)
    with pytest.raises(error, match=pattern):
        opt.load_state_dict(bad)
    assert_same(before, _full_state(opt, model))


INNER_CORRUPTIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "one group": lambda sd: sd["param_groups"].pop(),
    "group size": lambda sd: sd["param_groups"][1]["params"].pop(),
    "groups type": lambda sd: sd.__setitem__("param_groups", "x"),
    "state type": lambda sd: sd.__setitem__("state", [1]),
}


@pytest.mark.parametrize("corrupt", INNER_CORRUPTIONS.values(), ids=INNER_CORRUPTIONS.keys())
def test_the_inner_optimizer_judges_its_own_part_and_a_refusal_changes_nothing(
    corrupt: Callable[[dict[str, Any]], None],
) -> None:
    """What the wrapper does not read is the inner optimizer's to judge: the wrapper raises
    what the bare optimizer raises for the same dict, no more strictly, and changes nothing."""
    opt, model = _trained(per_group=True)
    bad = copy.deepcopy(opt.state_dict())
    corrupt(bad)
    bare = copy.deepcopy(opt.optimizer)
    inner_part = {k: v for k, v in copy.deepcopy(bad).items() if k != "clip"}
    with pytest.raises(Exception) as theirs:
        bare.load_state_dict(inner_part)
    before = _full_state(opt, model)
    with pytest.raises(type(theirs.value)) as ours:
        opt.load_state_dict(bad)
    assert str(ours.value) == str(theirs.value)
    assert_same(before, _full_state(opt, model))


def test_inner_load_failure_rolls_back() -> None:
    opt, model = _trained()
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["lr"] = 5.0
    before = _full_state(opt, model)

    def fail(o: Any) -> None:
        raise RuntimeError("disk on fire")

    opt.optimizer.register_load_state_dict_post_hook(fail)
    with pytest.raises(RuntimeError, match="disk on fire"):
        opt.load_state_dict(saved)
    assert_same(before, _full_state(opt, model))


def test_non_mapping_state_dict_is_refused() -> None:
    opt, _ = _trained()
    with pytest.raises(TypeError, match="state_dict must be a dict, got list"):
        opt.load_state_dict([])  # type: ignore[arg-type]


@settings(max_examples=15, deadline=None)
@given(
    max_norm=st.floats(1e-3, 1e3),
    norm_type=st.sampled_from([1.0, 2.0, 3.0, math.inf]),
    per_group=st.booleans(),
    nonfinite=st.sampled_from(["propagate", "skip", "raise"]),
    max_consecutive_skips=st.one_of(st.none(), st.integers(1, 50)),
    steps=st.integers(0, 3),
)
def test_state_dict_round_trips_through_a_file(
    max_norm: float,
    norm_type: float,
    per_group: bool,
    nonfinite: str,
    max_consecutive_skips: int | None,
    steps: int,
) -> None:
    model = _model()
    inner = torch.optim.Adam(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=1e-3
    )
    opt = ClippedOptimizer(
        inner,
        max_norm,
        norm_type,
        per_group=per_group,
        nonfinite=nonfinite,  # type: ignore[arg-type]
        max_consecutive_skips=max_consecutive_skips,
    )
    for seed in range(steps):
        opt.zero_grad()
        _backward(model, seed=seed)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    fresh_model = _model(seed=9)
    fresh = ClippedOptimizer(
        torch.optim.Adam(
            [{"params": fresh_model[0].parameters()}, {"params": fresh_model[2].parameters()}]
        ),
        max_norm=1.0,
    )
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert_same(opt.state_dict(), fresh.state_dict())
    assert repr(fresh).splitlines()[0] == repr(opt).splitlines()[0]


@pytest.mark.parametrize("per_group", [False, True])
def test_mixed_dtypes_are_measured_in_float64(per_group: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    wide = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    narrow = nn.Parameter(torch.zeros(3, dtype=torch.float32))
    wide.grad = torch.randn(4, generator=gen, dtype=torch.float64) * 5
    narrow.grad = torch.randn(3, generator=gen) * 5
    before = [wide.grad.clone(), narrow.grad.clone()]
    inner = torch.optim.SGD([{"params": [wide]}, {"params": [narrow]}], lr=0.0)
    opt = ClippedOptimizer(inner, max_norm=0.5, per_group=per_group)
    opt.step()
    _assert_recorded_norms(opt, before, torch.float64)


def _assert_recorded_norms(opt: ClippedOptimizer, before: list[Tensor], dtype: torch.dtype) -> None:
    """``last_norm`` (and, per group, ``last_group_norms``) of one-grad groups whose grads
    were ``before``, against float64 references, to 1e-6."""
    assert opt.last_norm is not None and opt.last_norm.dtype == dtype
    assert math.isclose(opt.last_norm.item(), _ref_norm(before, 2.0), rel_tol=1e-6)
    if opt.per_group:
        assert opt.last_group_norms is not None
        for got, grad in zip(opt.last_group_norms.tolist(), before, strict=True):
            assert math.isclose(got, _ref_norm([grad], 2.0), rel_tol=1e-6)


@pytest.mark.parametrize("per_group", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("scale", [1e20, 1e-25])
def test_float32_norms_whose_squares_leave_float32_are_torchs(
    per_group: bool, fused: bool, scale: float
) -> None:
    """The documented limit: float32 grads whose squares overflow (or underflow) float32
    get the 2-norm torch's own clip records for them, inf (or 0), per group and in total."""
    gen = torch.Generator().manual_seed(4)
    params = [nn.Parameter(torch.zeros(n)) for n in (5, 3000)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * scale
    before = [p.grad.clone() for p in params if p.grad is not None]
    groups = [{"params": [p]} for p in params]
    inner = torch.optim.AdamW(groups, lr=0.0, weight_decay=0.0, fused=fused)
    opt = ClippedOptimizer(inner, max_norm=1.0, per_group=per_group)
    opt.step()
    expected = torch.nn.utils.get_total_norm(before)
    assert float(expected) == (math.inf if scale > 1 else 0.0)
    assert opt.last_norm is not None and torch.equal(opt.last_norm, expected)
    if per_group:
        assert opt.last_group_norms is not None
        for got, grad in zip(opt.last_group_norms, before, strict=True):
            assert torch.equal(got, torch.nn.utils.get_total_norm([grad]))


def _two_steps_second_without_syncs(opt: ClippedOptimizer, make_grads: Callable[[], None]) -> None:
    """Step twice on fresh grads; the second step (buffers and counters in place by
    then) runs under CUDA's sync debug mode, so any host sync raises."""
    for checked in (False, True):
        make_grads()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if checked else "default")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("per_group", [False, True])
def test_cuda_step_never_syncs_and_keeps_everything_on_device(per_group: bool) -> None:
    model = _model().cuda()
    opt = ClippedOptimizer(_sgd(model, foreach=True), max_norm=0.1, per_group=per_group)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0)).cuda()

    def make_grads() -> None:
        opt.zero_grad()
        model(x).pow(2).sum().backward()

    _two_steps_second_without_syncs(opt, make_grads)
    assert opt.last_norm is not None and opt.last_norm.device.type == "cuda"
    assert opt.step_count.device.type == "cuda" and int(opt.step_count) == 2


class _HostToDeviceCopies(TorchDispatchMode):
    """Records every copy of a CPU tensor onto another device made while active."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[torch.device, torch.device]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            source, target = args[0], out
        elif func is torch.ops.aten.copy_.default:
            target, source = args[0], args[1]
        else:
            return out
        if source.device.type == "cpu" and target.device.type != "cpu":
            self.copies.append((source.device, target.device))
        return out


@pytest.mark.parametrize("per_group", [False, True])
def test_a_group_without_grads_copies_nothing_from_the_host(per_group: bool) -> None:
    # The meta device stands for an accelerator: any CPU tensor moved there would be a
    # blocking host-to-device copy on CUDA.
    with_grads = nn.Parameter(torch.zeros(3, device="meta"))
    without = nn.Parameter(torch.zeros(2, device="meta"))
    inner = torch.optim.SGD([{"params": [with_grads]}, {"params": [without]}], lr=0.1)
    opt = ClippedOptimizer(inner, max_norm=1.0, per_group=per_group)
    with_grads.grad = torch.ones(3, device="meta")
    opt.step()  # the first step moves the counters onto the grads' device, once
    with _HostToDeviceCopies() as spy:
        opt.step()
    assert spy.copies == []
    assert opt.last_norm is not None and opt.last_norm.device.type == "meta"
    if per_group:
        assert opt.last_group_norms is not None
        assert opt.last_group_norms.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_per_group_step_with_an_empty_group_never_syncs() -> None:
    model = _model().cuda()
    spare = nn.Parameter(torch.zeros(2, device="cuda"))
    inner = torch.optim.SGD([{"params": list(model.parameters())}, {"params": [spare]}], lr=0.1)
    opt = ClippedOptimizer(inner, max_norm=0.1, per_group=True)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0)).cuda()

    def make_grads() -> None:
        opt.zero_grad()
        model(x).pow(2).sum().backward()

    _two_steps_second_without_syncs(opt, make_grads)
    assert opt.last_group_norms is not None and opt.last_group_norms[1].item() == 0.0


@pytest.mark.parametrize("inf_threshold", [math.inf, torch.tensor(math.inf)], ids=repr)
def test_a_group_with_an_inf_tensor_max_norm_is_measured_not_scaled(inf_threshold: Any) -> None:
    measured = nn.Parameter(torch.zeros(2))
    clipped = nn.Parameter(torch.zeros(2))
    measured.grad = torch.tensor([math.inf, 1.0])
    clipped.grad = torch.tensor([30.0, 40.0])
    expected = clipped.grad.clone()
    reference = nn.Parameter(torch.zeros(2))
    reference.grad = expected
    clipopt.clip_grad_norm_([reference], 1.0)
    inner = torch.optim.SGD(
        [{"params": [measured], "clip_max_norm": inf_threshold}, {"params": [clipped]}], lr=0.0
    )
    opt = ClippedOptimizer(inner, max_norm=1.0, per_group=True)
    opt.step()
    assert torch.equal(measured.grad, torch.tensor([math.inf, 1.0]))
    assert torch.equal(clipped.grad, reference.grad)
    assert opt.last_group_norms is not None
    assert opt.last_group_norms.tolist() == [math.inf, 50.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_tensor_max_norms_on_cuda_grads_never_sync() -> None:
    # torch.where copies a CPU condition to the device; the inf check must not.
    params = [nn.Parameter(torch.zeros(3, device="cuda")) for _ in range(2)]
    thresholds = [torch.tensor(math.inf), torch.tensor(0.5)]
    groups = [{"params": [p], "clip_max_norm": t} for p, t in zip(params, thresholds, strict=True)]
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.0), max_norm=1.0, per_group=True)

    def make_grads() -> None:
        for param in params:
            param.grad = torch.full((3,), 4.0, device="cuda")

    _two_steps_second_without_syncs(opt, make_grads)
    assert params[0].grad is not None and params[0].grad.tolist() == [4.0] * 3
    assert params[1].grad is not None
    assert math.isclose(float(params[1].grad.norm()), 0.5, rel_tol=1e-5)


def test_per_group_norms_are_each_groups_norm() -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 6), nn.Linear(6, 3))
    inner = torch.optim.SGD([{"params": layer.parameters()} for layer in model], lr=0.0)
    opt = ClippedOptimizer(inner, max_norm=0.1, per_group=True)
    _backward(model)
    expected = [_ref_norm([p.grad for p in layer.parameters()], 2.0) for layer in model]
    opt.step()
    assert opt.last_group_norms is not None
    for got, ref in zip(opt.last_group_norms.tolist(), expected, strict=True):
        assert math.isclose(got, ref, rel_tol=1e-6)
    assert opt.last_norm is not None
    assert math.isclose(opt.last_norm.item(), math.hypot(*expected), rel_tol=1e-6)


# --------------------------------------------------------------------------- no silent settings


def _clipped_by_hand(max_norm: float) -> list[Tensor]:
    """One SGD step on the same model, clipped by torch's own clip at ``max_norm`` (its
    float32 norm may differ from clipopt's in the last bit, hence the tolerance below)."""
    torch.manual_seed(3)
    model = nn.Linear(6, 4)
    model(torch.randn(5, 6)).pow(2).sum().mul(30).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return [p.detach().clone() for p in model.parameters()]


def _wrapped_sgd() -> tuple[nn.Module, clipopt.ClippedOptimizer]:
    torch.manual_seed(3)
    model = nn.Linear(6, 4)
    model(torch.randn(5, 6)).pow(2).sum().mul(30).backward()
    return model, clipopt.ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 1.0)


def test_assigning_max_norm_raises_naming_the_group_key_and_changes_nothing() -> None:
    model, opt = _wrapped_sgd()
    before = repr(opt)
    with pytest.raises(AttributeError, match=r"max_norm=2\.0.*'clip_max_norm'"):
        opt.max_norm = 2.0  # type: ignore[assignment]
    with pytest.raises(AttributeError, match=r"norm_type=1\.0.*'clip_norm_type'"):
        opt.norm_type = 1.0  # type: ignore[assignment]
    assert opt.max_norm == 1.0 and opt.norm_type == 2.0 and repr(opt) == before
    opt.step()
    for ours, theirs in zip(model.parameters(), _clipped_by_hand(1.0), strict=True):
        torch.testing.assert_close(ours.detach(), theirs, rtol=1e-6, atol=1e-7)


def test_the_documented_way_reaches_the_step_and_the_repr() -> None:
    model, opt = _wrapped_sgd()
    for group in opt.param_groups:
        group["clip_max_norm"] = 2.5
    assert opt.max_norm == 2.5
    assert "max_norm=2.5" in repr(opt)
    opt.step()
    for ours, theirs in zip(model.parameters(), _clipped_by_hand(2.5), strict=True):
        torch.testing.assert_close(ours.detach(), theirs, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(_clipped_by_hand(1.0)[0], _clipped_by_hand(2.5)[0])


def test_per_group_thresholds_read_and_show_one_per_group() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    groups = [
        {"params": model[0].parameters(), "clip_max_norm": 0.5},
        {"params": model[1].parameters()},
    ]
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(groups, lr=0.1), 2.0, per_group=True)
    assert opt.max_norm == [0.5, 2.0]
    assert "max_norm=[0.5, 2.0]" in repr(opt)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("per_group", True),
        ("foreach", False),
        ("nonfinite", "skip"),
        ("max_consecutive_skips", 3),
        ("rule", None),
        ("skip_spikes", None),
        ("track_tensor_norms", True),
    ],
)
def test_settings_fixed_at_construction_refuse_assignment_by_name(name: str, value: object) -> None:
    _, opt = _wrapped_sgd()
    before = getattr(opt, name)
    with pytest.raises(AttributeError, match=rf"{name}={value!r}.*new ClippedOptimizer"):
        setattr(opt, name, value)
    assert getattr(opt, name) == before
