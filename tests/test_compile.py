"""Norm and scale trace into one graph under ``torch.compile(fullgraph=True)``.

``fullgraph=True`` turns every graph break into an error, and a Python branch on a
tensor's value (``.item()``, ``if norm > x``) is a graph break: so a clean trace shows the
path never waits on the device. The ``aot_eager`` backend runs the traced graph with
eager kernels: it traces exactly what inductor would, without minutes of C++ compilation
on CI's two cores. Its decompositions may reorder a reduction, so the norm must equal the
eager one to float64 rounding and each grad to one unit in the last place of its dtype.
(The CUDA tests compile with inductor.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import assert_same
from torch import Tensor

import clipopt

BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_params(seed: int) -> list[torch.nn.Parameter]:
    """fp32 small and large (the blocked CPU path), fp16, bf16, fp64, and a missing grad."""
    generator = torch.Generator().manual_seed(seed)
    layouts = [
        ((7, 3), torch.float32),
        ((20_000,), torch.float32),
        ((300,), torch.float16),
        ((9000,), torch.bfloat16),
        ((4, 5), torch.float64),
        ((3,), torch.float32),
    ]
    params = []
    for i, (shape, dtype) in enumerate(layouts):
        param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        if i != len(layouts) - 1:
            param.grad = (torch.randn(shape, generator=generator) * 10).to(dtype)
        params.append(param)
    return params


def norm_then_scale(params: list[torch.nn.Parameter], max_norm: float, norm_type: float) -> Tensor:
    norm = clipopt.get_total_norm([p.grad for p in params], norm_type)
    clipopt.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def clip_in_place(params: list[torch.nn.Parameter], max_norm: float, norm_type: float) -> Tensor:
    return clipopt.clip_grad_norm_(params, max_norm, norm_type)


Step = Callable[[list[torch.nn.Parameter], float, float], Tensor]


def assert_same_result(
    traced: list[torch.nn.Parameter],
    eager: list[torch.nn.Parameter],
    traced_norm: Tensor,
    eager_norm: Tensor,
) -> None:
    torch.testing.assert_close(traced_norm, eager_norm, rtol=1e-12, atol=0)
    for a, b in zip(traced, eager, strict=True):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None and b.grad is not None:
            ulp = torch.finfo(a.grad.dtype).eps
            torch.testing.assert_close(a.grad, b.grad, rtol=ulp, atol=0)


@pytest.mark.parametrize(
    ("step", "norm_type"),
    [
        (norm_then_scale, 2.0),
        (norm_then_scale, math.inf),
        (norm_then_scale, 3.5),
        (clip_in_place, 2.0),
    ],
)
def test_fullgraph_compile_gives_the_eager_result(step: Step, norm_type: float) -> None:
    compiled = torch.compile(step, fullgraph=True, backend=BACKEND)
    # A changing max_norm makes dynamo trace it as a symbolic float after the first call.
    for call, max_norm in enumerate([1.0, 0.5, 1e9]):
        traced, eager = make_params(call), make_params(call)
        traced_norm = compiled(traced, max_norm, norm_type)
        eager_norm = step(eager, max_norm, norm_type)
        assert traced_norm.dtype == torch.float64  # one grad is double
        assert_same_result(traced, eager, traced_norm, eager_norm)


@pytest.mark.parametrize("step", [clip_in_place, norm_then_scale])
def test_fullgraph_compile_with_a_tensor_max_norm(step: Step) -> None:
    """A threshold computed on device each step (as adaptive clipping does) also traces,
    an inf one included (it scales by exactly 1.0, chosen on device)."""
    compiled = torch.compile(step, fullgraph=True, backend=BACKEND)
    thresholds = [torch.tensor(1.0), torch.tensor(250.0), torch.tensor(math.inf)]
    for call, max_norm in enumerate(thresholds):
        traced, eager = make_params(call), make_params(call)
        before = [None if p.grad is None else p.grad.clone() for p in traced]
        traced_norm = compiled(traced, max_norm, 2.0)
        eager_norm = step(eager, max_norm, 2.0)
        assert_same_result(traced, eager, traced_norm, eager_norm)
    for param, grad in zip(traced, before, strict=True):  # the inf call scaled nothing
        assert (param.grad is None and grad is None) or torch.equal(param.grad, grad)


def test_a_python_branch_on_the_norm_breaks_the_graph() -> None:
    """The check above can fail: the old ``if clip_coef < 1`` is rejected by fullgraph."""

    def branchy(params: list[torch.nn.Parameter], max_norm: float, norm_type: float) -> Tensor:
        norm = clipopt.get_total_norm([p.grad for p in params], norm_type)
        clip_coef = max_norm / (norm + 1e-6)
        if clip_coef < 1:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(clip_coef)
        return norm

    compiled = torch.compile(branchy, fullgraph=True, backend=BACKEND)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled(make_params(0), 1.0, 2.0)


# --- ClippedOptimizer under torch.compile(opt.step) -----------------------------------------

COMPILED_STEPS = 4
POISONED = 2  # with nonfinite="skip", this step's grads hold an inf and it is skipped


def _wrapped_run(
    compiled: bool, fused: bool, nonfinite: str, layout: str
) -> tuple[list[Tensor], list[tuple[Tensor | None, Tensor | None, list[int]]]]:
    """Train a few steps, eager or with torch's compiled-optimizer recipe; return the
    parameters and, after each step, what the wrapper recorded. ``layout``: one global
    norm, ``per_group``, or ``clip_groups`` (two, and a group left unclipped)."""
    generator = torch.Generator().manual_seed(3)
    sizes = ((6, 5), (5,), (3,))
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in sizes]
    groups: list[dict[str, Any]] = [{"params": [p]} for p in params]
    if layout == "clip_groups":
        for group, name in zip(groups, ("a", "b", None), strict=True):
            group["clip_group"] = name
    inner = torch.optim.AdamW(groups, lr=0.1, fused=fused, foreach=not fused)
    per_group = layout == "per_group"
    opt = clipopt.ClippedOptimizer(inner, 0.5, per_group=per_group, nonfinite=nonfinite)  # type: ignore[arg-type]
    step = torch.compile(opt.step, backend=BACKEND) if compiled else opt.step
    records = []
    for i in range(COMPILED_STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator) * 10
        if i == POISONED and nonfinite == "skip":
            params[0].grad[0, 0] = math.inf
        step()
        counters = [int(opt.step_count), int(opt.skip_count), int(opt.consecutive_skips)]
        last = None if opt.last_norm is None else opt.last_norm.clone()
        group = None if opt.last_group_norms is None else opt.last_group_norms.clone()
        records.append((last, group, counters))
    return [p.detach().clone() for p in params], records


@pytest.mark.parametrize("layout", ["global", "per_group", "clip_groups"])
@pytest.mark.parametrize("nonfinite", ["propagate", "skip", "raise"])
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_compiled_step_records_and_steps_as_the_eager_one(
    fused: bool, nonfinite: str, layout: str
) -> None:
    eager_params, eager = _wrapped_run(False, fused, nonfinite, layout)
    compiled_params, compiled = _wrapped_run(True, fused, nonfinite, layout)
    for (norm, group, counters), (eager_norm, eager_group, eager_counters) in zip(
        compiled, eager, strict=True
    ):
        assert counters == eager_counters
        assert norm is not None and eager_norm is not None
        torch.testing.assert_close(norm, eager_norm, rtol=1e-6, atol=0, equal_nan=True)
        assert (group is None) == (eager_group is None) == (layout == "global")
        if group is not None:
            torch.testing.assert_close(group, eager_group, rtol=1e-6, atol=0, equal_nan=True)
    if nonfinite == "skip":
        assert eager[POISONED][2][1] == 1  # the poisoned step was skipped
    for ours, theirs in zip(compiled_params, eager_params, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# --- clip rules under torch.compile(opt.step, fullgraph=True) -------------------------------

# One line per rule: a new rule is covered by adding its factory here.
RULES: dict[str, Callable[[], float | clipopt.ClipRule]] = {
    "fixed": lambda: 0.5,
    "autoclip": lambda: clipopt.AutoClip(percentile=50.0, history=4),
    "autoclip-per-tensor": lambda: clipopt.AutoClip(50.0, 4, per_tensor=True),
    "zclip": lambda: clipopt.ZClip(warmup_steps=2, max_grad_norm=None),
    "adagc": lambda: clipopt.AdaGC(warmup_steps=2),
    "agc": lambda: clipopt.AGC(clipping=0.05),
}
RULE_STEPS = 6
SPIKE_AT = 4  # this step's grads are 30 times larger


class Momentum(torch.optim.Optimizer):
    """Heavy-ball SGD written to trace: torch's own optimizers break the graph on purpose
    around their step (``_use_grad_for_differentiable``), so with them only the clip
    could be one graph, never ``opt.step``."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                    p.add_(buf.mul_(0.9).add_(p.grad), alpha=-group["lr"])


def _ruled_run(
    make: Callable[[], float | clipopt.ClipRule], compiled: bool, track: bool = False
) -> tuple[list[Tensor], list[list[Tensor]]]:
    """A few steps, eager or fullgraph-compiled after one eager step (torch's DCP check,
    a frame inspection, runs while the inner state is empty); the grads are written in
    place, as backward does into kept grads, so no step invalidates the graph's guards.
    Returns the parameters and, per step, what the wrapper and its rule recorded."""
    generator = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in ((6, 5), (5,))]
    opt = clipopt.ClippedOptimizer(Momentum(params), make(), track_tensor_norms=track)
    step = opt.step
    records = []
    for i in range(RULE_STEPS):
        for p in params:
            grad = torch.randn(p.shape, generator=generator) * (30.0 if i == SPIKE_AT else 1.0)
            p.grad = grad if p.grad is None else p.grad.copy_(grad)
        step()
        if i == 0 and compiled:
            step = torch.compile(opt.step, fullgraph=True, backend=BACKEND)
        seen = [opt.last_norm, opt.step_count]
        if opt.rule is not None:
            seen += [opt.rule.last_threshold, opt.clipped_count]
        if track:
            seen += list(opt.last_tensor_norms.values())
        records.append([t.clone() for t in seen])
    return [p.detach().clone() for p in params], records


@pytest.mark.parametrize("name", sorted(RULES))
def test_a_ruled_step_is_one_graph_and_steps_as_the_eager_one(name: str) -> None:
    """Each rule traces inside ``opt.step`` with ``fullgraph=True`` (no graph break, no
    host read), one graph for every step (no guard on a value that changes per step),
    and clips, records and steps as eager does."""
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled_params, compiled = _ruled_run(RULES[name], compiled=True)
    assert counters["stats"]["unique_graphs"] == 1
    eager_params, eager = _ruled_run(RULES[name], compiled=False)
    for step, (ours, theirs) in enumerate(zip(compiled, eager, strict=True)):
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0, msg=f"step {step}")
    for ours_p, theirs_p in zip(compiled_params, eager_params, strict=True):
        torch.testing.assert_close(ours_p, theirs_p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["autoclip-per-tensor", "agc"])
def test_tracked_tensor_norms_compile_into_the_same_graph(name: str) -> None:
    """Per-tensor norms measured for a per-tensor rule, or summed from AGC's units."""
    counters = torch._dynamo.utils.counters
    counters.clear()
    _, compiled = _ruled_run(RULES[name], compiled=True, track=True)
    assert counters["stats"]["unique_graphs"] == 1
    _, eager = _ruled_run(RULES[name], compiled=False, track=True)
    for ours, theirs in zip(compiled, eager, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


def test_spike_skip_judges_and_commits_without_a_graph_per_step() -> None:
    """SpikeSkip's verdict and history update trace whole, as the wrapper calls them;
    over 14 steps a few graphs at most: its host count of the norms seen changes each
    step, which dynamo makes symbolic after one recompile rather than guard on."""
    norms = [1.0, 1.1, 0.9, 1.05, 0.95, 40.0, 1.0, 1.02, 0.98, 1.01, 1.03, 0.97, 1.0, 0.99]

    def judge(spikes: clipopt.SpikeSkip, norm: Tensor) -> Tensor | None:
        spike = spikes.verdict(norm) if spikes.may_trigger() else None
        spikes.commit(norm, spike)
        return spike

    counters = torch._dynamo.utils.counters
    counters.clear()
    traced = torch.compile(judge, fullgraph=True, backend=BACKEND)
    ours, theirs = clipopt.SpikeSkip(8, 3.0, 4), clipopt.SpikeSkip(8, 3.0, 4)
    verdicts = [(traced(ours, torch.tensor(n)), judge(theirs, torch.tensor(n))) for n in norms]
    assert counters["stats"]["unique_graphs"] <= 3
    judged = [[None if v is None else bool(v) for v in pair] for pair in verdicts]
    assert all(a == b for a, b in judged)
    assert torch.equal(ours.spike_count, theirs.spike_count)
    assert int(theirs.spike_count) == 1  # the check can fail: one spike was judged
    assert_same(ours.state_dict(), theirs.state_dict())


def test_a_compiled_fused_step_skips_spikes_as_the_eager_one() -> None:
    """On fused AdamW the skip rides on ``found_inf`` inside the compiled step."""

    def run(compiled: bool) -> tuple[list[Tensor], int]:
        generator = torch.Generator().manual_seed(2)
        params = [torch.nn.Parameter(torch.randn(4, 3, generator=generator))]
        opt = clipopt.ClippedOptimizer(
            torch.optim.AdamW(params, lr=0.1, fused=True),
            clipopt.AutoClip(50.0, 8),
            skip_spikes=clipopt.SpikeSkip(4, 3.0, 3),
        )
        step = torch.compile(opt.step, backend=BACKEND) if compiled else opt.step
        for i in range(7):
            params[0].grad = torch.randn(4, 3, generator=generator) * (50.0 if i == 5 else 1.0)
            step()
        return [p.detach().clone() for p in params], int(opt.skip_count)

    (ours, our_skips), (theirs, their_skips) = run(True), run(False)
    assert our_skips == their_skips == 1
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_a_compiled_wrapper_step_compiles_once() -> None:
    """``torch.compile(opt.step)`` (PyTorch's compiled-optimizer recipe) settles after its
    first steps: a step's new coefficient tensor must not be guarded on, or every step
    would recompile (and the wrapper fall back to eager at dynamo's recompile limit)."""
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((50,), (6, 7), (3,))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.1), max_norm=1.0)
    bare = torch.optim.SGD(twins, lr=0.1)
    step = torch.compile(opt.step, backend=BACKEND)
    generator = torch.Generator().manual_seed(0)
    for index in range(6):
        grads = [torch.randn(p.shape, generator=generator) * 5 for p in params]
        for p, twin, grad in zip(params, twins, grads, strict=True):
            p.grad, twin.grad = grad.clone(), grad.clone()
        torch.nn.utils.clip_grad_norm_(twins, 1.0)
        bare.step()
        with torch._dynamo.config.patch(error_on_recompile=index >= 3):
            step()
        for p, twin in zip(params, twins, strict=True):
            torch.testing.assert_close(p.detach(), twin.detach(), rtol=1e-6, atol=1e-7)
