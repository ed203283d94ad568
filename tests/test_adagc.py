"""AdaGC (Wang et al., ICML 2026) against the authors' rule written out in float64.

- ``PublishedAdaGC`` below is the class ``AdaGC`` of the authors' Megatron patch
  (``megatron/optimizer/clip_grads.py`` in github.com/lishuai-97/AdaGC), one process, no
  tensor parallelism, transcribed loop for loop into plain float64 torch. It and
  ``ClippedOptimizer(SGD(lr=0), max_norm=clipopt.AdaGC(...))`` are fed the same
  2,000-step grad streams; thresholds, clipped grads and the state agree to 1e-5
  relative at every step.
- Properties of the coefficients (hypothesis), non-finite norms, the last norm, settings
  and checkpoints. The shared checks (no host read, bit-exact resume, refused loads, the
  bad-settings table) are in tests/test_adaptive.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import assert_same
from hypothesis import given
from hypothesis import strategies as st
from test_adaptive import Series
from torch import Tensor

import clipopt

SHAPES = [(16, 8), (8,), (4, 4, 2), (1,), (3, 5)]
LEVELS = [0.03, 0.02, 0.04, 0.02, 0.003]  # each tensor's own scale; total norm about 0.5
STEPS = 2000


def adagc_stream(steps: int = STEPS, seed: int = 0, base: float = 1.0) -> Iterator[list[Tensor]]:
    """Grads as in pre-training: large at first and falling (the warm-up), then a slow
    drift that differs per tensor, spikes of all tensors every 97 steps and of one
    tensor every 41."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        grads = []
        for index, (shape, level) in enumerate(zip(SHAPES, LEVELS, strict=True)):
            scale = base * level * (1.0 + 4.0 * math.exp(-step / 30))
            scale *= 1.0 + 0.2 * math.sin(step / 300 + index)
            if step % 97 == 96:
                scale *= 30.0
            if step % 41 == 40 and step // 41 % len(SHAPES) == index:
                scale *= 8.0
            grads.append(torch.randn(shape, generator=gen) * scale)
        yield grads


def fresh_params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]


def set_grads(params: list[torch.nn.Parameter], grads: list[Tensor]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()


def _norm(t: Tensor, p: float) -> Tensor:
    """The p-norm of a float64 tensor by abs, pow, sum and max only."""
    if p == math.inf:
        return t.abs().max()
    return t.abs().pow(p).sum().pow(1.0 / p)


class PublishedAdaGC:
    """The authors' ``AdaGC.clip_by_norm``, in float64, on grads of its own.

    ``steps`` counts the calls; while ``steps <= start_clip_steps`` every grad is scaled
    by ``max_norm / (total_norm + eps)`` if that is below 1, and each tensor's state is
    the minimum of the norm of its scaled grad (the first one's to start). After, each
    tensor with a norm above ``clip_ratio * state`` is scaled by ``clip_ratio * state /
    (norm + eps)`` and counts as that value; then ``state = state * beta + norm * (1 -
    beta)``. A tensor without state takes its current norm first.

    Also records what clipopt calls the thresholds: ``clip_ratio * state``, and in
    warm-up ``max_norm * (norm + eps) / (total_norm + eps)``, at which the tensor's
    ``threshold / (norm + eps)`` is the global coefficient (the authors have none).
    """

    def __init__(
        self, clip_ratio: float, beta: float, eps: float, start_clip_steps: int, max_norm: float
    ) -> None:
        self.clip_ratio, self.beta, self.eps = clip_ratio, beta, eps
        self.start_clip_steps, self.max_norm = start_clip_steps, max_norm
        self.steps = 0
        self.state: dict[int, Tensor] = {}

    def step(self, grads: list[Tensor], norm_type: float) -> tuple[list[Tensor], Tensor]:
        """Clip ``grads`` (float64, in place); return the thresholds and total norm."""
        self.steps += 1
        norms = [_norm(g, norm_type) for g in grads]
        if norm_type == math.inf:
            total_norm = max(norms)
        else:
            total_norm = sum(n**norm_type for n in norms) ** (1.0 / norm_type)
        thresholds = []
        if self.steps <= self.start_clip_steps:
            clip_coeff = self.max_norm / (total_norm + self.eps)
            if clip_coeff < 1.0:
                for g in grads:
                    g.mul_(clip_coeff)
            for index, g in enumerate(grads):
                thresholds.append(clip_coeff * (norms[index] + self.eps))
                norm_value = _norm(g, norm_type)
                if index not in self.state:
                    self.state[index] = norm_value
                if norm_value < self.state[index]:
                    self.state[index] = norm_value
        else:
            for index, g in enumerate(grads):
                norm_value = _norm(g, norm_type)
                if index not in self.state:
                    self.state[index] = norm_value
                avg_norm_value = self.state[index]
                thresholds.append(self.clip_ratio * avg_norm_value)
                if norm_value > self.clip_ratio * avg_norm_value:
                    clip_coef = (self.clip_ratio * avg_norm_value) / (norm_value + self.eps)
                    g.mul_(clip_coef)
                    norm_value = self.clip_ratio * avg_norm_value
                self.state[index] = avg_norm_value * self.beta + norm_value * (1.0 - self.beta)
        return thresholds, total_norm

    def gamma(self) -> Tensor:
        return torch.stack([self.state[i] for i in sorted(self.state)])


CASES: list[dict[str, Any]] = [
    {},
    {"ratio": 1.2, "beta": 0.9, "warmup_steps": 10, "warmup_max_norm": 5.0},
    {"warmup_steps": 0},
    {"ratio": 1.5, "beta": 0.0, "warmup_steps": 300, "warmup_max_norm": 0.2, "eps": 1e-3},
    {"ratio": 0.99, "beta": 0.5, "warmup_steps": 0},
]


# a seed each, and a scale that puts the total norm of each order near 0.5
STREAMS = {2.0: (0, 1.0), 1.0: (1, 0.15), math.inf: (2, 4.0)}


def _published(kwargs: dict[str, Any]) -> PublishedAdaGC:
    defaults = {"ratio": 1.04, "beta": 0.99, "warmup_steps": 100, "warmup_max_norm": 1.0}
    settings = {**defaults, "eps": 1e-6, **kwargs}
    return PublishedAdaGC(
        settings["ratio"],
        settings["beta"],
        settings["eps"],
        settings["warmup_steps"],
        settings["warmup_max_norm"],
    )


# every case in the L2 norm; the other orders (in warm-up's total and each tensor's norm)
# with two of them
RUNS = [(case, 2.0) for case in CASES] + [(case, p) for p in (1.0, math.inf) for case in CASES[:2]]


def _run_id(run: tuple[dict[str, Any], float]) -> str:
    return ",".join([f"{k}={v}" for k, v in run[0].items()] + [f"p={run[1]}"])


@pytest.mark.parametrize(("kwargs", "norm_type"), RUNS, ids=map(_run_id, RUNS))
def test_adagc_matches_the_published_rule(kwargs: dict[str, Any], norm_type: float) -> None:
    params = fresh_params()
    rule = clipopt.AdaGC(**kwargs)
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(params, lr=0.0), max_norm=rule, norm_type=norm_type
    )
    ref = _published(kwargs)
    seed, base = STREAMS[norm_type]
    thresholds, clipped, gammas, last = Series(), Series(), Series(), Series()
    clipped_after_warmup = 0  # (step, tensor) pairs scaled after warm-up
    for step, grads in enumerate(adagc_stream(seed=seed, base=base)):
        set_grads(params, grads)
        theirs = [g.double() for g in grads]
        expected, total = ref.step(theirs, norm_type)
        opt.step()
        assert rule.last_threshold is not None and rule.last_threshold.shape == (len(SHAPES),)
        thresholds.add(rule.last_threshold, torch.stack(expected))
        clipped.add(
            torch.cat([p.grad.flatten() for p in params if p.grad is not None]),
            torch.cat([g.flatten() for g in theirs]),
        )
        gammas.add(rule.state["gamma"], ref.gamma())
        last.add(opt.last_norm, total)
        if step >= ref.start_clip_steps:
            clipped_after_warmup += sum(
                not torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True)
            )
    thresholds.check("thresholds")
    clipped.check("clipped grads")
    gammas.check("gamma")
    last.check("last_norm (the pre-clip global norm)")
    pairs = (STEPS - ref.start_clip_steps) * len(SHAPES)
    assert pairs // 100 < clipped_after_warmup < pairs - pairs // 100  # both branches run


def test_warmup_clips_globally_and_keeps_the_smallest_clipped_norm() -> None:
    params = fresh_params()
    rule = clipopt.AdaGC(warmup_steps=3, warmup_max_norm=1.0)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.0), max_norm=rule)
    # a clipped step, then two under the threshold whose smaller norm differs per tensor
    steps = [(4.0,) * 5, (0.01, 0.2, 0.01, 0.2, 0.01), (0.05,) * 5]
    smallest = None
    for levels in steps:
        grads = [torch.full(shape, level) for shape, level in zip(SHAPES, levels, strict=True)]
        set_grads(params, grads)
        opt.step()
        total = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        coefficient = min(1.0, 1.0 / (total + 1e-6))
        for p, g in zip(params, grads, strict=True):
            torch.testing.assert_close(p.grad, g * coefficient, rtol=1e-6, atol=0.0)
        clipped = torch.tensor([float(g.double().norm()) * coefficient for g in grads])
        smallest = clipped if smallest is None else torch.minimum(smallest, clipped)
    torch.testing.assert_close(rule.state["gamma"], smallest.double(), rtol=1e-6, atol=0)
    assert int(rule.state["count"]) == 3


# ---------------------------------------------------------------- properties


@given(
    steps=st.lists(
        st.lists(st.floats(min_value=1e-4, max_value=1e4), min_size=3, max_size=3),
        min_size=1,
        max_size=12,
    ),
    ratio=st.floats(min_value=0.5, max_value=3.0),
    beta=st.floats(min_value=0.0, max_value=0.999),
    warmup_steps=st.integers(min_value=0, max_value=4),
    warmup_max_norm=st.floats(min_value=1e-2, max_value=1e3),
)
def test_coefficients_are_in_0_1_and_a_grad_under_its_threshold_is_untouched(
    steps: list[list[float]],
    ratio: float,
    beta: float,
    warmup_steps: int,
    warmup_max_norm: float,
) -> None:
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    rule = clipopt.AdaGC(ratio, beta, warmup_steps, warmup_max_norm)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.0), max_norm=rule)
    for step, levels in enumerate(steps):
        grads = [torch.tensor([0.6, 0.8]) * level for level in levels]
        set_grads(params, grads)
        opt.step()
        threshold = rule.last_threshold
        assert threshold is not None
        coefficients = [p.grad.norm() / g.norm() for p, g in zip(params, grads, strict=True)]
        for p, g, c, t in zip(params, grads, coefficients, threshold, strict=True):
            assert 0.0 < float(c) <= 1.0 + 1e-6
            if step >= warmup_steps and float(g.norm()) <= float(t) * (1 - 1e-6):
                assert torch.equal(p.grad, g)
            # the clipped norm never exceeds the threshold (eps makes it smaller)
            assert float(p.grad.norm()) <= float(t) * (1 + 1e-6)
        if step < warmup_steps:  # one coefficient for all
            torch.testing.assert_close(torch.stack(coefficients), coefficients[0].expand(3))


# ---------------------------------------------------------------- non-finite norms


def test_a_nonfinite_warmup_step_changes_nothing_and_does_not_count() -> None:
    params = fresh_params()
    rule = clipopt.AdaGC(warmup_steps=2)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.0), max_norm=rule, nonfinite="skip")
    stream = adagc_stream(steps=4)
    set_grads(params, next(stream))
    opt.step()
    before = {k: v.clone() for k, v in rule.state.items()}
    bad = next(stream)
    bad[2][0, 0, 0] = math.inf
    set_grads(params, bad)
    opt.step()
    assert int(opt.skip_count) == 1
    assert_same(dict(rule.state), before)
    set_grads(params, next(stream))  # still warm-up: the second finite step
    opt.step()
    assert int(rule.state["count"]) == 2
    assert bool(rule.state["gamma"].isfinite().all())


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_after_warmup_a_nonfinite_tensor_keeps_its_state_and_the_others_move(bad: float) -> None:
    params = fresh_params()
    rule = clipopt.AdaGC(warmup_steps=2)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.0), max_norm=rule, nonfinite="skip")
    stream = adagc_stream(steps=5)
    for _ in range(3):
        set_grads(params, next(stream))
        opt.step()
    before = rule.state["gamma"].clone()
    grads = next(stream)
    grads[1][3] = bad
    set_grads(params, grads)
    opt.step()
    after = rule.state["gamma"]
    assert int(opt.skip_count) == 1  # the wrapper's nonfinite policy decides the step
    assert torch.equal(after[1], before[1])
    assert not torch.equal(after[[0, 2, 3, 4]], before[[0, 2, 3, 4]])
    assert bool(after.isfinite().all())


def test_a_nan_norm_stays_in_the_published_state_but_not_in_ours() -> None:
    """After warm-up the authors' code folds a NaN norm into the tensor's EMA, which
    stays NaN: ``norm > NaN`` is false, so that tensor is never clipped again, spikes
    included. clipopt skips the step (nonfinite="skip") and keeps clipping."""
    params = fresh_params()
    rule = clipopt.AdaGC(warmup_steps=5)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.0), max_norm=rule, nonfinite="skip")
    ref = _published({"warmup_steps": 5})
    for step, grads in enumerate(adagc_stream(steps=30)):
        if step == 10:
            grads[0][0, 0] = math.nan
        if step == 20:
            grads = [g * 100 for g in grads]
        set_grads(params, grads)
        theirs = [g.double() for g in grads]
        ref.step(theirs, 2.0)
        opt.step()
        if step == 20:
            assert torch.equal(theirs[0], grads[0].double())  # the spike went through
            assert float(params[0].grad.norm()) < float(grads[0].norm()) / 10  # clipped
    assert math.isnan(float(ref.state[0]))
    assert bool(rule.state["gamma"].isfinite().all())
    assert int(opt.skip_count) == 1


# ---------------------------------------------------------------- settings, checkpoints


@pytest.mark.parametrize(
    "kwargs",
    [{"warmup_steps": 0}, {"beta": 0.0}, {"eps": 0.0}, {"ratio": 1e-3}, {"warmup_max_norm": 1e9}],
)
def test_edge_settings_are_accepted(kwargs: dict[str, Any]) -> None:
    params = fresh_params()
    rule = clipopt.AdaGC(**kwargs)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.0), max_norm=rule)
    for grads in adagc_stream(steps=5):
        set_grads(params, grads)
        opt.step()
    assert rule.last_threshold is not None and bool(rule.last_threshold.isfinite().all())
    assert rule.config() == {**rule.config(), **kwargs}


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"ratio": "1.04"}, "ratio"),
        ({"beta": None}, "beta"),
        ({"warmup_steps": 10.0}, "warmup_steps"),
        ({"warmup_steps": True}, "warmup_steps"),
        ({"warmup_max_norm": True}, "warmup_max_norm"),
    ],
)
def test_settings_of_the_wrong_type_are_refused(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(TypeError, match=name):
        clipopt.AdaGC(**kwargs)


def test_an_all_zero_warmup_step_with_eps_0_has_no_nan() -> None:
    params = fresh_params()
    rule = clipopt.AdaGC(warmup_steps=2, eps=0.0)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.0), max_norm=rule)
    set_grads(params, [torch.zeros(shape) for shape in SHAPES])
    opt.step()
    assert rule.last_threshold is not None and bool((rule.last_threshold == math.inf).all())
    assert all(bool((p.grad == 0).all()) for p in params if p.grad is not None)
    assert torch.equal(rule.state["gamma"], torch.zeros(len(SHAPES), dtype=torch.float64))


def test_adagc_needs_the_same_grads_every_step() -> None:
    params = fresh_params()
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.0), max_norm=clipopt.AdaGC())
    set_grads(params, next(adagc_stream(steps=1)))
    opt.step()
    params[3].grad = None
    with pytest.raises(ValueError, match="same grads"):
        opt.step()


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("gamma", torch.zeros(2, 5, dtype=torch.float64), "1-D"),
        ("gamma", torch.zeros(5, dtype=torch.int64), "gamma"),
        ("count", torch.zeros(1, dtype=torch.int64), "count"),
        ("count", torch.zeros((), dtype=torch.float64), "count"),
    ],
)
def test_a_malformed_adagc_state_is_refused_and_changes_nothing(
    key: str, value: Tensor, match: str
) -> None:
    params = fresh_params()
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(params, lr=0.1), max_norm=clipopt.AdaGC(warmup_steps=2)
    )
    for grads in adagc_stream(steps=4):
        set_grads(params, grads)
        opt.step()
    checkpoint = opt.state_dict()
    checkpoint["clip"]["rule"]["state"][key] = value
    before = opt.state_dict()
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(checkpoint)
    assert_same(opt.state_dict(), before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_adagc_on_cuda_matches_the_cpu() -> None:
    rules, runs = [], []
    for device in ("cpu", "cuda"):
        params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in SHAPES]
        rule = clipopt.AdaGC(warmup_steps=20)
        opt = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.0), max_norm=rule)
        clipped = []
        for grads in adagc_stream(steps=300):
            set_grads(params, [g.to(device) for g in grads])
            opt.step()
            clipped.append(torch.cat([p.grad.flatten().cpu() for p in params]))
        rules.append(rule)
        runs.append(torch.stack(clipped))
    assert rules[1].state["gamma"].device.type == "cuda"
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=0.0)
    torch.testing.assert_close(
        rules[1].state["gamma"].cpu(), rules[0].state["gamma"], rtol=1e-5, atol=0
    )
