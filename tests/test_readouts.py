"""The clip readouts (``last_clipped_norm``, ``last_clipped``, ``clipped_count``) and
``nonfinite="assert"``.

Each step's post-clip norm is checked against the float64 norm of the grads the inner
step used (SGD and fused AdamW leave them in ``.grad``: scaled in place, or divided by
``grad_scale`` and written back by the fused kernel), the flag against the pre-clip norm
``torch.nn.utils.clip_grad_norm_`` returns compared with ``max_norm``, the count against
the sum of those flags, over steps whose norms cross the threshold.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import clipopt
from clipopt import ClippedOptimizer

SHAPES = [(4, 3), (3,), (2, 2, 2)]
SCALES = [0.05, 3.0, 0.2, 40.0, 1.0]  # grad norms on both sides of MAX_NORM
MAX_NORM = 1.5


def _params(count: int = len(SHAPES)) -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(s)) for s in SHAPES[:count]]


def _grads(params: list[nn.Parameter], step: int, scale: float) -> list[Tensor]:
    gen = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=gen) * scale / (1 + i) for i, p in enumerate(params)]


def _norm64(tensors: list[Tensor], p: float = 2.0) -> Tensor:
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(t.double(), p) for t in tensors]), p
    )


def _torch_norm(grads: list[Tensor], p: float = 2.0) -> float:
    """The pre-clip norm torch's clip_grad_norm_ returns, on copies."""
    copies = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for c, g in zip(copies, grads, strict=True):
        c.grad = g.clone()
    return float(torch.nn.utils.clip_grad_norm_(copies, MAX_NORM, norm_type=p))


def _feed(params: list[nn.Parameter], step: int, scale: float) -> float:
    """Give ``params`` the grads of ``step``; return torch's pre-clip norm of them."""
    grads = _grads(params, step, scale)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    return _torch_norm(grads)


def _run(
    opt: ClippedOptimizer, params: list[nn.Parameter], step: Callable[[], Any] | None = None
) -> list[tuple[float, Tensor]]:
    """Step through SCALES; per step torch's pre-clip norm and the float64 norm of the
    grads the inner step used, with the readouts checked against them as it goes."""
    seen: list[tuple[float, Tensor]] = []
    count = 0
    for i, scale in enumerate(SCALES):
        pre = _feed(params, i, scale)
        (step or opt.step)()
        post = _norm64([p.grad for p in params if p.grad is not None])
        clipped = pre > MAX_NORM
        count += clipped
        assert opt.last_clipped_norm is not None and opt.last_clipped is not None
        assert opt.last_clipped_norm.dtype == opt.last_norm.dtype  # type: ignore[union-attr]
        torch.testing.assert_close(opt.last_clipped_norm.double(), post, rtol=1e-5, atol=1e-7)
        assert opt.last_clipped.dtype == torch.bool and bool(opt.last_clipped) == clipped, i
        assert opt.clipped_count.dtype == torch.int64 and int(opt.clipped_count) == count, i
        seen.append((pre, post))
    assert 0 < count < len(SCALES)
    return seen


@pytest.mark.parametrize("fused", [False, True])
def test_fixed_threshold_readouts_follow_the_grads_the_step_used(fused: bool) -> None:
    params = _params()
    inner: torch.optim.Optimizer = (
        torch.optim.AdamW(params, lr=0.0, fused=True) if fused else torch.optim.SGD(params, lr=0.0)
    )
    opt = ClippedOptimizer(inner, max_norm=MAX_NORM)
    for pre, post in _run(opt, params):
        want = min(pre, MAX_NORM) if pre > MAX_NORM else pre
        assert math.isclose(float(post), want, rel_tol=1e-4)


@pytest.mark.parametrize(
    "rule",
    [
        lambda: clipopt.ZClip(max_grad_norm=None, warmup_steps=1),
        lambda: clipopt.AutoClip(percentile=50.0),
    ],
    ids=["ZClip", "AutoClip"],
)
@pytest.mark.parametrize("fused", [False, True])
def test_a_global_rule_reads_its_coefficient(rule: Callable[[], Any], fused: bool) -> None:
    params = _params()
    inner: torch.optim.Optimizer = (
        torch.optim.AdamW(params, lr=0.0, fused=True) if fused else torch.optim.SGD(params, lr=0.0)
    )
    opt = ClippedOptimizer(inner, max_norm=rule())
    count = 0
    for i, scale in enumerate(SCALES):
        for p, g in zip(params, _grads(params, i, scale), strict=True):
            p.grad = g
        opt.step()
        post = _norm64([p.grad for p in params if p.grad is not None])
        threshold = opt.rule.last_threshold  # type: ignore[union-attr]
        clipped = bool(opt.last_norm > threshold + 1e-6)  # type: ignore[operator]
        count += clipped
        assert opt.last_clipped_norm is not None
        torch.testing.assert_close(opt.last_clipped_norm.double(), post, rtol=1e-5, atol=1e-7)
        assert bool(opt.last_clipped) == clipped and int(opt.clipped_count) == count
    assert count > 0


@pytest.mark.parametrize(
    "rule",
    [
        lambda: clipopt.AutoClip(percentile=50.0, per_tensor=True),
        lambda: clipopt.AdaGC(),
        lambda: clipopt.AGC(clipping=0.05),
    ],
    ids=["AutoClip-per-tensor", "AdaGC", "AGC"],
)
def test_per_tensor_and_unit_rules_combine_each_coefficient(rule: Callable[[], Any]) -> None:
    """The post-clip norm is the float64 norm of the grads the step scaled, tensor by
    tensor (unit by unit); the flag says whether any was scaled."""
    params = _params()
    opt = ClippedOptimizer(torch.optim.SGD(params, lr=0.0), max_norm=rule())
    count = 0
    for i, scale in enumerate(SCALES * 3):
        grads = _grads(params, i, scale)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        post = _norm64([p.grad for p in params if p.grad is not None])
        scaled = any(not torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
        count += scaled
        assert opt.last_clipped_norm is not None
        torch.testing.assert_close(opt.last_clipped_norm.double(), post, rtol=1e-4, atol=1e-7)
        assert bool(opt.last_clipped) == scaled and int(opt.clipped_count) == count, i
    assert count > 0


def _check_two_norms(
    opt: ClippedOptimizer,
    step: Callable[[], Any],
    params: list[nn.Parameter],
    members: tuple[list[nn.Parameter], list[nn.Parameter]],
) -> None:
    """Step through SCALES with two norms, over ``members``' params, thresholds MAX_NORM
    and MAX_NORM / 4: each readout one per norm, against torch's pre-clip norms and the
    float64 norms of the grads the step used."""
    counts = torch.zeros(2, dtype=torch.int64)
    for i, scale in enumerate(SCALES):
        for p, g in zip(params, _grads(params, i, scale), strict=True):
            p.grad = g
        pre = torch.tensor([_torch_norm([p.grad for p in ps]) for ps in members])
        step()
        post = torch.stack([_norm64([p.grad for p in ps]) for ps in members])
        flags = pre > torch.tensor([MAX_NORM, MAX_NORM / 4])
        counts += flags
        assert opt.last_clipped_norm is not None and opt.last_clipped_norm.shape == (2,)
        torch.testing.assert_close(opt.last_clipped_norm.double(), post, rtol=1e-5, atol=1e-7)
        assert torch.equal(opt.last_clipped, flags) and torch.equal(opt.clipped_count, counts)
    assert 0 < int(counts.sum()) < 2 * len(SCALES)


def test_per_group_readouts_are_one_per_group() -> None:
    params = _params()
    groups = [{"params": params[:2]}, {"params": params[2:], "clip_max_norm": MAX_NORM / 4}]
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.0), max_norm=MAX_NORM, per_group=True)
    _check_two_norms(opt, opt.step, params, (params[:2], params[2:]))


@pytest.mark.parametrize("compiled", [False, True])
def test_clip_group_readouts_are_one_per_clip_group(compiled: bool) -> None:
    """Two clip groups, the first over two param groups, and a group left unclipped: one
    readout per clip group, in the order of ``clip_groups``, from the first step."""
    params = _params()
    extra = nn.Parameter(torch.randn(5))
    groups = [
        {"params": params[:1], "clip_group": "a"},
        {"params": params[2:], "clip_group": "b", "clip_max_norm": MAX_NORM / 4},
        {"params": params[1:2], "clip_group": "a"},
        {"params": [extra], "clip_group": None},
    ]
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.0), max_norm=MAX_NORM)
    assert opt.clip_groups == ("a", "b") and opt.clipped_count.shape == (2,)
    step = torch.compile(opt.step) if compiled else opt.step
    _check_two_norms(opt, step, [*params, extra], ([params[0], params[1]], [params[2]]))


def test_groups_of_other_thresholds_under_one_norm_have_no_post_clip_norm() -> None:
    params = _params()
    groups = [{"params": params[:2]}, {"params": params[2:], "clip_max_norm": 100.0}]
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.0), max_norm=MAX_NORM)
    for p, g in zip(params, _grads(params, 0, 40.0), strict=True):
        p.grad = g
    opt.step()
    assert opt.last_clipped_norm is None
    assert bool(opt.last_clipped) and int(opt.clipped_count) == 1


def test_measure_only_counts_nothing() -> None:
    params = _params()
    opt = ClippedOptimizer(torch.optim.SGD(params, lr=0.0), max_norm=math.inf)
    for p, g in zip(params, _grads(params, 0, 40.0), strict=True):
        p.grad = g
    opt.step()
    assert torch.equal(opt.last_clipped_norm, opt.last_norm)  # type: ignore[arg-type]
    assert not bool(opt.last_clipped) and int(opt.clipped_count) == 0


@pytest.mark.parametrize("fused", [False, True])
def test_a_skipped_step_is_no_clip_and_reads_the_pre_clip_norm(fused: bool) -> None:
    """Skipped for a NaN (on the host, or on the device through found_inf once fused
    AdamW has state) or a spike: not clipped, not counted, the post-clip norm is the
    pre-clip one (the grads were left as they were)."""
    params = _params()
    inner: torch.optim.Optimizer = (
        torch.optim.AdamW(params, lr=0.1, fused=True) if fused else torch.optim.SGD(params, lr=0.1)
    )
    opt = ClippedOptimizer(inner, max_norm=MAX_NORM, nonfinite="skip")
    for p, g in zip(params, _grads(params, 0, 40.0), strict=True):
        p.grad = g
    opt.step()
    assert bool(opt.last_clipped) and int(opt.clipped_count) == 1
    grads = _grads(params, 1, 40.0)
    grads[0][0, 0] = math.nan
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step()
    assert int(opt.skip_count) == 1
    assert not bool(opt.last_clipped) and int(opt.clipped_count) == 1
    assert opt.last_clipped_norm is not None and opt.last_norm is not None
    assert opt.last_norm.isnan()
    torch.testing.assert_close(opt.last_clipped_norm, opt.last_norm, equal_nan=True)
    assert_same([p.grad for p in params], grads)  # left as they were


def test_a_spike_skip_is_no_clip() -> None:
    params = _params()
    spikes = clipopt.SpikeSkip(min_history=2)
    opt = ClippedOptimizer(torch.optim.SGD(params, lr=0.1), max_norm=MAX_NORM, skip_spikes=spikes)
    for i, scale in enumerate([3.0, 3.0, 3.0, 3000.0]):
        for p, g in zip(params, _grads(params, i, scale), strict=True):
            p.grad = g
        opt.step()
    assert int(opt.skip_count) == 1 and int(opt.clipped_count) == 3
    assert not bool(opt.last_clipped)
    assert torch.equal(opt.last_clipped_norm, opt.last_norm)  # type: ignore[arg-type]


@settings(max_examples=25, deadline=None)
@given(
    scales=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=6),
    max_norm=st.floats(0.1, 10.0),
)
def test_the_count_is_the_number_of_steps_over_the_threshold(
    scales: list[float], max_norm: float
) -> None:
    params = _params(2)
    opt = ClippedOptimizer(torch.optim.SGD(params, lr=0.0), max_norm=max_norm)
    count = 0
    for i, scale in enumerate(scales):
        pre = _feed(params, i, scale)
        opt.step()
        if abs(pre - max_norm) < 1e-4 * max_norm:  # the eps in the coefficient decides
            return
        count += pre > max_norm
        want = min(pre, max_norm)
        assert math.isclose(float(opt.last_clipped_norm), want, rel_tol=1e-4)  # type: ignore[arg-type]
    assert int(opt.clipped_count) == count


def test_a_compiled_step_reads_out_as_the_eager_one() -> None:
    torch._dynamo.reset()
    eager_params, compiled_params = _params(), _params()
    eager = ClippedOptimizer(torch.optim.SGD(eager_params, lr=0.1), max_norm=MAX_NORM)
    compiled = ClippedOptimizer(torch.optim.SGD(compiled_params, lr=0.1), max_norm=MAX_NORM)
    step = torch.compile(compiled.step)
    _run(eager, eager_params)
    _run(compiled, compiled_params, step)
    for name in ("last_clipped_norm", "last_clipped", "clipped_count"):
        assert_same(getattr(compiled, name), getattr(eager, name), name)


@pytest.mark.parametrize("per_group", [False, True])
def test_the_readouts_resume_bit_for_bit(tmp_path: Path, per_group: bool) -> None:
    def make() -> tuple[list[nn.Parameter], ClippedOptimizer]:
        params = _params()
        groups = [{"params": params[:2]}, {"params": params[2:]}]
        inner = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
        return params, ClippedOptimizer(inner, max_norm=MAX_NORM, per_group=per_group)

    def steps(params: list[nn.Parameter], opt: ClippedOptimizer, at: range) -> None:
        for i in at:
            for p, g in zip(params, _grads(params, i, SCALES[i % len(SCALES)]), strict=True):
                p.grad = g
            opt.step()

    params, straight = make()
    steps(params, straight, range(6))
    params, first = make()
    steps(params, first, range(3))
    torch.save({"params": [p.detach() for p in params], "opt": first.state_dict()}, tmp_path / "c")
    saved = torch.load(tmp_path / "c", weights_only=True)
    assert saved["opt"]["clip"]["format"] == 2
    resumed_params, resumed = make()
    with torch.no_grad():
        for p, q in zip(resumed_params, saved["params"], strict=True):
            p.copy_(q)
    resumed.load_state_dict(saved["opt"])
    for name in ("last_clipped_norm", "last_clipped", "clipped_count"):
        assert_same(getattr(resumed, name), getattr(first, name), name)
    steps(resumed_params, resumed, range(3, 6))
    for name in ("last_clipped_norm", "last_clipped", "clipped_count"):
        assert_same(getattr(resumed, name), getattr(straight, name), name)


# --- nonfinite="assert" ---------------------------------------------------------------


@pytest.mark.parametrize("compiled", [False, True])
def test_assert_raises_on_the_cpu_at_once_and_changes_nothing(compiled: bool) -> None:
    torch._dynamo.reset()
    params = _params()
    opt = ClippedOptimizer(torch.optim.SGD(params, lr=0.1), max_norm=MAX_NORM, nonfinite="assert")
    step = torch.compile(opt.step) if compiled else opt.step
    for p, g in zip(params, _grads(params, 0, 3.0), strict=True):
        p.grad = g
    step()  # finite: it does nothing
    assert int(opt.step_count) == 1
    grads = _grads(params, 1, 3.0)
    grads[1][0] = math.inf
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    weights = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="non-finite, nonfinite=assert"):
        step()
    assert_same([p.detach() for p in params], weights)
    assert_same([p.grad for p in params], grads)
    assert int(opt.step_count) == 1


def test_assert_is_a_setting() -> None:
    params = _params()
    opt = ClippedOptimizer(torch.optim.SGD(params, lr=0.1), max_norm=1.0, nonfinite="assert")
    assert opt.nonfinite == "assert"
    assert opt.state_dict()["clip"]["settings"]["nonfinite"] == "assert"
