"""Adaptive clip rules and SpikeSkip: AutoClip and ZClip against their packages, and the
checks every rule shares (AdaGC's and AGC's own are in test_adagc.py and test_agc.py).

- AutoClip and ZClip against the reference packages (``autoclip`` 0.2.1, ``zclip`` 1.0.0)
  fed the same 2,000-step grad streams side by side: thresholds and clipped grads agree to
  1e-5 relative at every step.
- SpikeSkip against the published rule written out below in float64 (AdaGC against
  its authors' code: tests/test_adagc.py).
- No host read in the step, for each rule, on the paths that promise none.
- Bit-exact resume for each rule with SGD and AdamW, fused and not.
- A checkpoint of another rule (or other settings) is refused and changes nothing; bad
  settings are refused naming the value.
"""

from __future__ import annotations

import io
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from autoclip.torch import QuantileClip
from helpers import assert_same
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor
from zclip import ZClip as ReferenceZClip

import clipopt
from clipopt._kernels import _norms

SHAPES = [(4, 3), (3,), (2, 2)]
STEPS = 2000


def grad_stream(steps: int = STEPS, seed: int = 0, base: float = 1.0) -> Iterator[list[Tensor]]:
    """Grads with a warm-up (small, growing), a slow drift, and spikes every 97 steps."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        scale = base * min(1.0, 0.05 + step / 50) * (1.0 + 0.5 * math.sin(step / 300))
        if step % 97 == 96:
            scale *= 30.0
        yield [torch.randn(shape, generator=gen) * scale for shape in SHAPES]


def fresh_params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]


def set_grads(params: list[torch.nn.Parameter], grads: list[Tensor]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()


class Series:
    """Per-step values of both implementations, compared to 1e-5 relative at the end
    (one comparison, naming the first step that differs)."""

    def __init__(self) -> None:
        self.ours: list[Tensor] = []
        self.theirs: list[Tensor] = []

    def add(self, ours: Tensor, theirs: Tensor) -> None:
        self.ours.append(ours.detach().double().flatten())
        self.theirs.append(theirs.detach().double().flatten())

    def add_grads(self, ours: list[torch.nn.Parameter], theirs: list[torch.nn.Parameter]) -> None:
        self.add(_flat_grads(ours), _flat_grads(theirs))

    def check(self, what: str) -> None:
        a, b = torch.stack(self.ours), torch.stack(self.theirs)
        close = torch.isclose(a, b, rtol=1e-5, atol=0.0).all(dim=1)
        first = int((~close).nonzero()[0]) if not bool(close.all()) else -1
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0.0, msg=f"{what}, first at step {first}")


def _flat_grads(params: list[torch.nn.Parameter]) -> Tensor:
    return torch.cat([p.grad.flatten() for p in params if p.grad is not None])


# ---------------------------------------------------------------- AutoClip vs autoclip


@pytest.mark.parametrize(("percentile", "history"), [(10.0, 10_000), (50.0, 37), (90.0, 1)])
def test_autoclip_global_matches_quantileclip(percentile: float, history: int) -> None:
    ours, theirs = fresh_params(), fresh_params()
    rule = clipopt.AutoClip(percentile=percentile, history=history)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(ours, lr=0.0), max_norm=rule)
    ref = QuantileClip(
        theirs, quantile=percentile / 100, history_length=history, global_threshold=True
    )
    thresholds, clipped = Series(), Series()
    for grads in grad_stream():
        set_grads(ours, grads)
        set_grads(theirs, grads)
        past = ref.state["global_history"]
        expected = math.inf if len(past) == 0 else torch.quantile(past, percentile / 100)
        ref.step()
        opt.step()
        assert rule.last_threshold is not None
        thresholds.add(rule.last_threshold, torch.as_tensor(expected))
        clipped.add_grads(ours, theirs)
    thresholds.check("thresholds")
    clipped.check("clipped grads")
    assert 0 < int(opt.clipped_count) < STEPS


def test_autoclip_first_step_does_not_clip() -> None:
    params = fresh_params()
    rule = clipopt.AutoClip(percentile=0.0)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.0), max_norm=rule)
    grads = [torch.full(shape, 100.0) for shape in SHAPES]
    set_grads(params, grads)
    opt.step()
    assert rule.last_threshold is not None and math.isinf(float(rule.last_threshold))
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
    assert int(opt.clipped_count) == 0


@pytest.mark.parametrize(("percentile", "history"), [(10.0, 10_000), (75.0, 13)])
def test_autoclip_per_tensor_matches_quantileclip(percentile: float, history: int) -> None:
    ours, theirs = fresh_params(), fresh_params()
    rule = clipopt.AutoClip(percentile=percentile, history=history, per_tensor=True)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(ours, lr=0.0), max_norm=rule)
    ref = QuantileClip(theirs, quantile=percentile / 100, history_length=history)
    thresholds, clipped = Series(), Series()
    for grads in grad_stream(seed=1):
        set_grads(ours, grads)
        set_grads(theirs, grads)
        expected = []
        for p in theirs:
            past = ref.state[p].get("history")
            q = math.inf if past is None else torch.quantile(past, percentile / 100)
            expected.append(torch.as_tensor(q, dtype=torch.float32))
        ref.step()
        opt.step()
        assert rule.last_threshold is not None and rule.last_threshold.shape == (len(SHAPES),)
        thresholds.add(rule.last_threshold, torch.stack(expected))
        clipped.add_grads(ours, theirs)
    thresholds.check("thresholds")
    clipped.check("clipped grads")
    assert 0 < int(opt.clipped_count) < STEPS


def test_autoclip_zeroes_a_grad_whose_past_norms_were_zero_as_the_package_does() -> None:
    """A grad that was zero leaves a threshold of 0: the next non-zero grad is scaled to
    0, as torch's clip at ``max_norm=0`` does (not to NaN, as a tensor ``max_norm`` of 0
    given by a user is)."""
    ours, theirs = fresh_params(), fresh_params()
    rule = clipopt.AutoClip(percentile=0.0, history=5, per_tensor=True)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(ours, lr=0.0), max_norm=rule)
    ref = QuantileClip(theirs, quantile=0.0, history_length=5)
    for step, grads in enumerate(grad_stream(steps=3, seed=2)):
        if step == 0:
            grads[1] = torch.zeros_like(grads[1])
        set_grads(ours, grads)
        set_grads(theirs, grads)
        ref.step()
        opt.step()
        assert_same(_flat_grads(ours), _flat_grads(theirs))
    assert ours[1].grad is not None and torch.equal(ours[1].grad, torch.zeros(SHAPES[1]))


def test_autoclip_keeps_a_nan_out_of_its_history_where_the_package_does_not() -> None:
    """autoclip 0.2.1 appends a NaN norm to its history, and every later threshold is
    then NaN: every later grad turns NaN. clipopt skips the step (nonfinite="skip") and
    keeps clipping at the percentile of the finite norms."""
    ours, theirs = fresh_params(), fresh_params()
    rule = clipopt.AutoClip(percentile=50.0, history=100)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(ours, lr=0.0), max_norm=rule, nonfinite="skip")
    ref = QuantileClip(theirs, quantile=0.5, history_length=100, global_threshold=True)
    for step, grads in enumerate(grad_stream(steps=30)):
        if step == 10:
            grads[0][0, 0] = math.nan
        set_grads(ours, grads)
        set_grads(theirs, grads)
        ref.step()
        opt.step()
    assert all(bool(p.grad.isnan().all()) for p in theirs if p.grad is not None)
    assert all(bool(p.grad.isfinite().all()) for p in ours if p.grad is not None)
    assert int(opt.skip_count) == 1
    assert rule.last_threshold is not None and bool(rule.last_threshold.isfinite())


@given(
    norms=st.lists(
        st.floats(min_value=1e-3, max_value=1e3, allow_nan=False), min_size=1, max_size=40
    ),
    percentile=st.floats(min_value=0.0, max_value=100.0),
    history=st.integers(min_value=1, max_value=12),
)
def test_autoclip_threshold_is_torch_quantile_of_the_last_norms(
    norms: list[float], percentile: float, history: int
) -> None:
    rule = clipopt.AutoClip(percentile=percentile, history=history)
    for n, norm in enumerate(norms):
        value = torch.tensor(norm, dtype=torch.float32)
        coefficient, threshold = rule.decide(value)
        seen = torch.tensor(norms[max(0, n - history) : n], dtype=torch.float32)
        if n == 0:
            assert math.isinf(float(threshold))
        else:
            want = torch.quantile(seen, percentile / 100)
            torch.testing.assert_close(threshold, want, rtol=0.0, atol=0.0)
        rule.commit(value, coefficient, threshold)


# ---------------------------------------------------------------- ZClip vs zclip


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(fresh_params())


ZCLIP_CASES: list[dict[str, Any]] = [
    {},
    {"max_grad_norm": None},
    {"max_grad_norm": None, "clip_option": "mean"},
    {"max_grad_norm": 3.0, "mode": "percentile", "z_thresh": 2.0},
    {"max_grad_norm": None, "skip_update_on_spike": True, "alpha": 0.9},
    {"max_grad_norm": 5.0, "clip_factor": 0.7, "warmup_steps": 1, "eps": 1e-3},
]


@pytest.mark.parametrize("kwargs", ZCLIP_CASES, ids=lambda k: ",".join(map(str, k.values())))
def test_zclip_matches_the_zclip_package(kwargs: dict[str, Any]) -> None:
    ours = fresh_params()
    net = _Net()
    theirs = list(net.weights)
    rule = clipopt.ZClip(**kwargs)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(ours, lr=0.0), max_norm=rule)
    ref = ReferenceZClip(**kwargs)
    cap = kwargs.get("max_grad_norm", 1.0)
    cap = math.inf if cap is None else cap
    clip_values: list[float | None] = []
    compute = ref._compute_clip_val

    def recording(grad_norm: float) -> float | None:
        clip_values.append(compute(grad_norm))
        return clip_values[-1]

    ref._compute_clip_val = recording  # type: ignore[method-assign]
    spikes = 0
    thresholds, clipped = Series(), Series()
    for grads in grad_stream(seed=2, base=0.3):
        set_grads(ours, grads)
        set_grads(theirs, grads)
        warm = not ref.initialized
        clip_values.clear()
        ref.step(net)
        opt.step()
        clip_val = None if warm else clip_values[0]
        spikes += clip_val is not None
        expected = cap if clip_val is None else min(clip_val, cap)
        assert rule.last_threshold is not None
        thresholds.add(rule.last_threshold, torch.tensor(expected))
        clipped.add_grads(ours, theirs)
    thresholds.check("thresholds")
    clipped.check("clipped grads")
    assert spikes > 10  # the stream exercises the rule, not just its warm-up


def test_zclip_keeps_a_nan_out_of_its_averages_where_the_package_does_not() -> None:
    """zclip 1.0.0 folds a NaN norm into its EMA mean, which stays NaN: no later norm
    is a spike again (z is NaN), so the spikes after it are not clipped."""
    ours = fresh_params()
    net = _Net()
    rule = clipopt.ZClip(max_grad_norm=None, warmup_steps=5)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(ours, lr=0.0), max_norm=rule, nonfinite="skip")
    ref = ReferenceZClip(max_grad_norm=None, warmup_steps=5)
    for step in range(40):
        grads = [torch.ones(shape) * (1.0 + 0.01 * (step % 3)) for shape in SHAPES]
        if step == 20:
            grads[0][0, 0] = math.nan
        if step == 30:
            grads = [g * 100 for g in grads]
        set_grads(ours, grads)
        set_grads(list(net.weights), grads)
        ref.step(net)
        opt.step()
        if step == 30:
            theirs = [p.grad.clone() for p in net.weights if p.grad is not None]
            mine = [p.grad.clone() for p in ours if p.grad is not None]
    assert math.isnan(ref.mean)
    assert torch.equal(theirs[0], torch.ones(4, 3) * 100)  # the spike went through
    assert float(mine[0].max()) < 2.0  # clipopt clipped it
    assert int(opt.skip_count) == 1


# ---------------------------------------------------------------- SpikeSkip vs float64


def _published_spike_skip(
    norms: list[float], window: int, sigma: float, min_history: int
) -> list[bool]:
    """The rule in float64: skip when |n - mean| / std of the previous <= window norms
    (unbiased std) exceeds sigma, once min_history norms are seen; every norm enters."""
    past: deque[float] = deque(maxlen=window)
    skips = []
    for n in norms:
        skip = False
        if len(past) >= min_history:
            mean, std = statistics.fmean(past), statistics.stdev(past)
            skip = std > 0 and abs(n - mean) / std > sigma
        skips.append(skip)
        past.append(n)
    return skips


def _norm64(grads: list[Tensor]) -> float:
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(("window", "sigma", "min_history"), [(128, 6.0, None), (16, 3.0, 4)])
def test_spike_skip_matches_the_published_rule(
    fused: bool, window: int, sigma: float, min_history: int | None
) -> None:
    stream = list(grad_stream(steps=600, seed=3))
    norms = [_norm64(g) for g in stream]
    minimum = max(20, window // 2) if min_history is None else min_history
    expected = _published_spike_skip(norms, window, sigma, minimum)
    assert 3 < sum(expected) < 100

    params = fresh_params()
    spikes = clipopt.SpikeSkip(window=window, sigma=sigma, min_history=min_history)
    inner = torch.optim.AdamW(params, lr=0.01, fused=fused)
    opt = clipopt.ClippedOptimizer(inner, max_norm=math.inf, skip_spikes=spikes)
    twin = fresh_params()
    reference = torch.optim.AdamW(twin, lr=0.01, fused=fused)
    got = []
    for grads, skip in zip(stream, expected, strict=True):
        before = int(opt.skip_count)
        set_grads(params, grads)
        opt.step()
        got.append(int(opt.skip_count) > before)
        if not skip:
            set_grads(twin, grads)
            reference.step()
    assert got == expected
    assert int(spikes.spike_count) == sum(expected)
    for a, b in zip(params, twin, strict=True):
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.0)


def test_a_skipped_spike_leaves_params_state_and_grads_untouched() -> None:
    params = fresh_params()
    spikes = clipopt.SpikeSkip(window=8, sigma=3.0, min_history=4)
    opt = clipopt.ClippedOptimizer(
        torch.optim.AdamW(params, lr=0.1), max_norm=1.0, skip_spikes=spikes
    )
    for _ in range(6):
        set_grads(params, [torch.ones(s) for s in SHAPES])
        opt.step()
    saved = {k: v.clone() for k, v in opt.state[params[0]].items()}
    weights = [p.detach().clone() for p in params]
    spike = [torch.ones(s) * 1e3 for s in SHAPES]
    set_grads(params, spike)
    opt.step()
    assert int(opt.skip_count) == 1
    assert all(torch.equal(p, w) for p, w in zip(params, weights, strict=True))
    assert all(torch.equal(p.grad, g) for p, g in zip(params, spike, strict=True))
    assert all(torch.equal(opt.state[params[0]][k], v) for k, v in saved.items())


# ---------------------------------------------------------------- no host read


def _rules() -> dict[str, Callable[[], clipopt.ClipRule]]:
    return {
        "autoclip": lambda: clipopt.AutoClip(percentile=50.0, history=7),
        "autoclip-per-tensor": lambda: clipopt.AutoClip(50.0, 7, per_tensor=True),
        "zclip": lambda: clipopt.ZClip(warmup_steps=3),
        "agc": lambda: clipopt.AGC(clipping=0.05),
        "adagc": lambda: clipopt.AdaGC(warmup_steps=3),
    }


@pytest.mark.parametrize("name", sorted(_rules()))
@pytest.mark.parametrize("fused", [False, True])
def test_no_host_read_in_a_ruled_step(
    name: str, fused: bool, no_host_sync: Callable[[], Any]
) -> None:
    params = fresh_params()
    # torch's unfused CPU Adam reads its step count on the host itself: SGD there.
    inner = (
        torch.optim.AdamW(params, lr=0.01, fused=True)
        if fused
        else torch.optim.SGD(params, lr=0.01, momentum=0.9)
    )
    opt = clipopt.ClippedOptimizer(inner, max_norm=_rules()[name]())
    with no_host_sync():
        for grads in grad_stream(steps=30):
            set_grads(params, grads)
            opt.step()
    assert opt.rule is not None and int(opt.clipped_count) > 0


def test_no_host_read_when_a_fused_optimizer_skips_spikes(no_host_sync: Callable[[], Any]) -> None:
    params = fresh_params()
    spikes = clipopt.SpikeSkip(window=16, sigma=3.0, min_history=4)
    opt = clipopt.ClippedOptimizer(
        torch.optim.AdamW(params, lr=0.01, fused=True),
        max_norm=clipopt.AutoClip(50.0, 20),
        skip_spikes=spikes,
    )
    with no_host_sync():
        for grads in grad_stream(steps=200):
            set_grads(params, grads)
            opt.step()
    assert int(opt.skip_count) > 0


def test_spike_skip_on_an_unfused_optimizer_reads_the_host(no_host_sync: Callable[[], Any]) -> None:
    """Documented: skipping Adam's step needs the verdict on the host."""
    params = fresh_params()
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(params, lr=0.01, momentum=0.9),
        max_norm=1.0,
        skip_spikes=clipopt.SpikeSkip(window=4, min_history=2),
    )
    for grads in grad_stream(steps=2):  # no verdict before min_history norms
        set_grads(params, grads)
        with no_host_sync():
            opt.step()
    set_grads(params, next(grad_stream(steps=1)))
    with no_host_sync(), pytest.raises(AssertionError, match="host sync"):
        opt.step()


# ---------------------------------------------------------------- bit-exact resume


RESUME_RULES: dict[str, Callable[[], tuple[clipopt.ClipRule, clipopt.SpikeSkip | None]]] = {
    "autoclip": lambda: (clipopt.AutoClip(30.0, 9), None),
    "autoclip-per-tensor": lambda: (clipopt.AutoClip(30.0, 9, per_tensor=True), None),
    "zclip": lambda: (clipopt.ZClip(warmup_steps=5, max_grad_norm=None), None),
    "agc": lambda: (clipopt.AGC(clipping=0.05), None),
    "adagc": lambda: (clipopt.AdaGC(warmup_steps=10), None),
    "adagc-saved-in-warmup": lambda: (clipopt.AdaGC(ratio=1.1, warmup_steps=40), None),
    "autoclip+spikes": lambda: (
        clipopt.AutoClip(50.0, 30),
        clipopt.SpikeSkip(window=8, sigma=2.0, min_history=4),
    ),
}
OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
}


def _wrapper(rule_name: str, opt_name: str, params: list[torch.nn.Parameter]) -> Any:
    rule, spikes = RESUME_RULES[rule_name]()
    return clipopt.ClippedOptimizer(
        OPTIMIZERS[opt_name](params), max_norm=rule, skip_spikes=spikes, nonfinite="skip"
    )


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("rule_name", sorted(RESUME_RULES))
def test_resume_is_bit_exact(rule_name: str, opt_name: str) -> None:
    stream = list(grad_stream(steps=60, seed=4))
    whole = fresh_params()
    straight = _wrapper(rule_name, opt_name, whole)
    for grads in stream:
        set_grads(whole, grads)
        straight.step()

    first = fresh_params()
    interrupted = _wrapper(rule_name, opt_name, first)
    for grads in stream[:30]:
        set_grads(first, grads)
        interrupted.step()
    buffer = io.BytesIO()
    torch.save({"opt": interrupted.state_dict(), "params": [p.detach() for p in first]}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_params = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    resumed = _wrapper(rule_name, opt_name, resumed_params)
    resumed.load_state_dict(saved["opt"])
    for grads in stream[30:]:
        set_grads(resumed_params, grads)
        resumed.step()

    for a, b in zip(resumed_params, whole, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(resumed.rule.last_threshold, straight.rule.last_threshold)
    assert torch.equal(resumed.clipped_count, straight.clipped_count)
    assert torch.equal(resumed.skip_count, straight.skip_count)
    assert int(straight.clipped_count) > 0


# ---------------------------------------------------------------- refused loads


def _trained(rule: clipopt.ClipRule | float, spikes: clipopt.SpikeSkip | None = None) -> Any:
    params = fresh_params()
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(params, lr=0.1), max_norm=rule, skip_spikes=spikes
    )
    for grads in grad_stream(steps=5):
        set_grads(params, grads)
        opt.step()
    return opt


@pytest.mark.parametrize(
    ("saved", "loader", "match"),
    [
        (lambda: _trained(clipopt.AutoClip(10.0)), lambda: clipopt.AutoClip(20.0), "percentile"),
        (lambda: _trained(clipopt.AutoClip()), lambda: clipopt.ZClip(), "AutoClip"),
        (lambda: _trained(clipopt.ZClip()), lambda: clipopt.AutoClip(), "ZClip"),
        (lambda: _trained(clipopt.AGC()), lambda: clipopt.ZClip(), "AGC"),
        (lambda: _trained(1.0), lambda: clipopt.AutoClip(), "no rule"),
        (
            lambda: _trained(clipopt.AdaGC()),
            lambda: clipopt.AutoClip(per_tensor=True),
            "AdaGC",
        ),
        (lambda: _trained(clipopt.AutoClip(per_tensor=True)), lambda: clipopt.AdaGC(), "AutoClip"),
        (lambda: _trained(clipopt.AdaGC(beta=0.9)), lambda: clipopt.AdaGC(), "beta"),
        (lambda: _trained(clipopt.AutoClip()), lambda: 1.0, "AutoClip"),
        (
            lambda: _trained(1.0, clipopt.SpikeSkip(window=8)),
            lambda: 1.0,
            "skip_spikes",
        ),
    ],
)
def test_another_rules_checkpoint_is_refused_and_changes_nothing(
    saved: Callable[[], Any], loader: Callable[[], Any], match: str
) -> None:
    checkpoint = saved().state_dict()
    target = _trained(loader())
    before = target.state_dict()
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(checkpoint)
    assert_same(target.state_dict(), before)


def test_a_malformed_rule_state_is_refused_and_changes_nothing() -> None:
    opt = _trained(clipopt.AutoClip(history=9))
    checkpoint = opt.state_dict()
    checkpoint["clip"]["rule"]["state"]["buffer"] = torch.zeros(1, 4)
    before = opt.state_dict()
    with pytest.raises(ValueError, match="buffer"):
        opt.load_state_dict(checkpoint)
    assert_same(opt.state_dict(), before)


@pytest.mark.parametrize(
    ("rule", "spikes", "entry"),
    [
        (clipopt.AutoClip(history=9), None, "rule"),
        (clipopt.AutoClip(history=9, per_tensor=True), None, "rule"),
        (clipopt.ZClip(warmup_steps=3), None, "rule"),
        (clipopt.AdaGC(warmup_steps=3), None, "rule"),
        (1.0, clipopt.SpikeSkip(window=4), "skip_spikes"),
    ],
)
@pytest.mark.parametrize("change", ["a key missing", "a key more"])
def test_a_rule_state_with_other_keys_is_refused_and_changes_nothing(
    rule: clipopt.ClipRule | float, spikes: clipopt.SpikeSkip | None, entry: str, change: str
) -> None:
    opt = _trained(rule, spikes)
    checkpoint = opt.state_dict()
    state = checkpoint["clip"][entry]["state"]
    assert state, "the rule must have stepped for its state to be checked"
    if change == "a key missing":
        state.pop(sorted(state)[0])
    else:
        state["extra"] = torch.zeros(())
    before = opt.state_dict()
    with pytest.raises(ValueError, match="state must have the keys"):
        opt.load_state_dict(checkpoint)
    assert_same(opt.state_dict(), before)


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("make", "name", "value"),
    [
        (lambda: clipopt.AutoClip(percentile=101.0), "percentile", "101.0"),
        (lambda: clipopt.AutoClip(percentile=-1.0), "percentile", "-1.0"),
        (lambda: clipopt.AutoClip(history=0), "history", "0"),
        (lambda: clipopt.ZClip(alpha=1.0), "alpha", "1.0"),
        (lambda: clipopt.ZClip(alpha=0.0), "alpha", "0.0"),
        (lambda: clipopt.ZClip(z_thresh=-2.0), "z_thresh", "-2.0"),
        (lambda: clipopt.ZClip(max_grad_norm=-1.0), "max_grad_norm", "-1.0"),
        (lambda: clipopt.ZClip(eps=-1e-6), "eps", "-1e-06"),
        (lambda: clipopt.ZClip(warmup_steps=0), "warmup_steps", "0"),
        (lambda: clipopt.ZClip(mode="median"), "mode", "median"),
        (lambda: clipopt.ZClip(clip_option="max"), "clip_option", "max"),
        (lambda: clipopt.ZClip(clip_factor=0.0), "clip_factor", "0.0"),
        (lambda: clipopt.AdaGC(ratio=0.0), "ratio", "0.0"),
        (lambda: clipopt.AdaGC(ratio=-1.04), "ratio", "-1.04"),
        (lambda: clipopt.AdaGC(ratio=math.inf), "ratio", "inf"),
        (lambda: clipopt.AdaGC(beta=1.0), "beta", "1.0"),
        (lambda: clipopt.AdaGC(beta=-0.5), "beta", "-0.5"),
        (lambda: clipopt.AdaGC(beta=math.nan), "beta", "nan"),
        (lambda: clipopt.AdaGC(warmup_steps=-1), "warmup_steps", "-1"),
        (lambda: clipopt.AdaGC(warmup_max_norm=0.0), "warmup_max_norm", "0.0"),
        (lambda: clipopt.AdaGC(warmup_max_norm=math.inf), "warmup_max_norm", "inf"),
        (lambda: clipopt.AdaGC(eps=-1e-6), "eps", "-1e-06"),
        (lambda: clipopt.SpikeSkip(window=1), "window", "1"),
        (lambda: clipopt.SpikeSkip(sigma=-6.0), "sigma", "-6.0"),
        (lambda: clipopt.SpikeSkip(window=8, min_history=9), "min_history", "9"),
        (lambda: clipopt.SpikeSkip(min_history=1), "min_history", "1"),
    ],
)
def test_bad_settings_are_refused_naming_the_value(
    make: Callable[[], Any], name: str, value: str
) -> None:
    with pytest.raises(ValueError, match=rf"{name}.*{value}"):
        make()


def test_a_rule_with_per_group_or_a_group_threshold_is_refused() -> None:
    params = fresh_params()
    with pytest.raises(ValueError, match="per_group"):
        clipopt.ClippedOptimizer(
            torch.optim.SGD(params, lr=0.1), max_norm=clipopt.AutoClip(), per_group=True
        )
    inner = torch.optim.SGD(
        [{"params": params[:1], "clip_max_norm": 2.0}, {"params": params[1:]}], lr=0.1
    )
    with pytest.raises(ValueError, match=r"clip_max_norm.*2\.0"):
        clipopt.ClippedOptimizer(inner, max_norm=clipopt.AutoClip())
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.1), max_norm=clipopt.ZClip())
    opt.param_groups[0]["clip_max_norm"] = 3.0
    set_grads(params, [torch.ones(s) for s in SHAPES])
    with pytest.raises(ValueError, match="clip_max_norm"):
        opt.step()
    with pytest.raises(TypeError, match="skip_spikes"):
        clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.1), max_norm=1.0, skip_spikes=6.0)  # type: ignore[arg-type]


def test_a_per_tensor_rule_needs_the_same_grads_every_step() -> None:
    params = fresh_params()
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(params, lr=0.1), max_norm=clipopt.AutoClip(per_tensor=True)
    )
    set_grads(params, [torch.ones(s) for s in SHAPES])
    opt.step()
    params[2].grad = None
    with pytest.raises(ValueError, match="same grads"):
        opt.step()


# ---------------------------------------------------------------- kernels and fold


@pytest.mark.parametrize("p", [2.0, 3.0])
def test_per_tensor_norms_are_torchs(p: float) -> None:
    tensors = [torch.randn(s) for s in [(5,), (3, 3), (7,), (2, 2, 2)]]
    norms = _norms.per_tensor_norms(tensors, p)
    torch.testing.assert_close(norms, torch.stack([t.norm(p) for t in tensors]))


def test_a_global_rule_on_fused_adamw_trains_as_on_the_plain_one() -> None:
    fused_params, plain_params = fresh_params(), fresh_params()
    fused = clipopt.ClippedOptimizer(
        torch.optim.AdamW(fused_params, lr=0.01, fused=True), max_norm=clipopt.AutoClip(50.0, 10)
    )
    plain = clipopt.ClippedOptimizer(
        torch.optim.AdamW(plain_params, lr=0.01, foreach=False), max_norm=clipopt.AutoClip(50.0, 10)
    )
    for grads in grad_stream(steps=50):
        set_grads(fused_params, grads)
        set_grads(plain_params, grads)
        fused.step()
        plain.step()
    for a, b in zip(fused_params, plain_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
