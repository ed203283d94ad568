"""AutoClip's sorted copy of its history: after any sequence of updates it is the sort
of the ring's filled values, the thresholds are bit for bit those of a sort of the past
norms, and a resumed rule (whose copy is rebuilt from the ring) goes on identically."""

from __future__ import annotations

import io
import math
from collections import deque

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import clipopt

# Duplicates, zeros and non-finite norms often, anything else now and then.
NORM = st.one_of(
    st.sampled_from([0.0, 0.0, 1.0, 1.0, 2.5, 7.0, math.inf, math.nan]),
    st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False),
)


@st.composite
def runs(draw: st.DrawFn) -> tuple[int, int, float, torch.dtype, list[list[float]], int]:
    """Rows, history, percentile, dtype, the steps' norms (up to three times the
    history and more), and the step after which a checkpoint is taken."""
    rows = draw(st.integers(min_value=1, max_value=5))
    history = draw(st.integers(min_value=1, max_value=8))
    percentile = draw(st.floats(min_value=0.0, max_value=100.0))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    steps = draw(st.integers(min_value=1, max_value=3 * history + 4))
    norms = draw(
        st.lists(st.lists(NORM, min_size=rows, max_size=rows), min_size=steps, max_size=steps)
    )
    return rows, history, percentile, dtype, norms, draw(st.integers(0, steps))


def ring_sorted(rule: clipopt.AutoClip) -> Tensor:
    """``torch.sort`` of each row's filled ring slots, padded with ``+inf``."""
    buffer, count = rule.state["buffer"], rule.state["count"]
    filled = [min(int(c), rule.history) for c in count]
    rows = []
    for values, n in zip(buffer, filled, strict=True):
        padded = torch.cat(
            [values[:n], torch.full((rule.history - n,), math.inf, dtype=values.dtype)]
        )
        rows.append(torch.sort(padded).values)
    return torch.stack(rows)


def reference_thresholds(past: list[deque[float]], percentile: float, dtype: torch.dtype) -> Tensor:
    """Each row's percentile of its past finite norms by a sort and ``torch.quantile``
    (``inf`` before any)."""
    out = []
    for values in past:
        if not values:
            out.append(torch.tensor(math.inf, dtype=dtype))
        else:
            ordered = torch.sort(torch.tensor(list(values), dtype=dtype)).values
            out.append(torch.quantile(ordered, percentile / 100.0))
    return torch.stack(out)


def saved_and_loaded(rule: clipopt.AutoClip) -> dict[str, object]:
    """The rule's state dict through ``torch.save`` and ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    torch.save(rule.state_dict(), buffer)
    buffer.seek(0)
    loaded: dict[str, object] = torch.load(buffer, weights_only=True)
    return loaded


def load_ring(rule: clipopt.AutoClip, buffer: Tensor, count: Tensor) -> None:
    """Load a ring and counts written by hand, through the public state dict."""
    saved = rule.state_dict()
    rule.load_state_dict({**saved, "state": {"buffer": buffer, "count": count}})


def step(rule: clipopt.AutoClip, norms: Tensor) -> Tensor:
    coefficients, thresholds = rule.decide(norms)
    rule.commit(norms, coefficients, thresholds)
    return thresholds


@given(runs())
def test_the_sorted_copy_and_thresholds_match_a_sort_every_step(
    run: tuple[int, int, float, torch.dtype, list[list[float]], int],
) -> None:
    rows, history, percentile, dtype, steps, save_after = run
    per_tensor = rows > 1
    rule = clipopt.AutoClip(percentile, history, per_tensor=per_tensor)
    resumed: clipopt.AutoClip | None = None
    past: list[deque[float]] = [deque(maxlen=history) for _ in range(rows)]
    for n, values in enumerate(steps):
        if n == save_after:
            resumed = clipopt.AutoClip(percentile, history, per_tensor=per_tensor)
            resumed.load_state_dict(saved_and_loaded(rule))
        norms = torch.tensor(values, dtype=dtype).reshape(rows if per_tensor else ())
        want = reference_thresholds(past, percentile, dtype).reshape(norms.shape)
        got = step(rule, norms)
        assert got.dtype == dtype and torch.equal(got, want), (n, got, want)
        if resumed is not None:
            assert torch.equal(step(resumed, norms), got)
        for row, value in zip(past, values, strict=True):
            if math.isfinite(value):
                row.append(value)
        assert torch.equal(rule.state["sorted"], ring_sorted(rule))
        expected = [sorted(row) + [math.inf] * (history - len(row)) for row in past]
        assert torch.equal(rule.state["sorted"], torch.tensor(expected, dtype=dtype))
    if resumed is not None:
        assert torch.equal(resumed.state["sorted"], rule.state["sorted"])
        assert set(resumed.state_dict()["state"]) == {"buffer", "count"}
        assert torch.equal(resumed.state["buffer"], rule.state["buffer"])


def test_a_checkpoint_of_the_ring_alone_rebuilds_the_copy() -> None:
    """The checkpoint holds the ring and counts only, as before the sorted copy: one
    written by hand (a wrapped ring, slots not in time order) loads and goes on as a
    rule that saw those norms."""
    rule = clipopt.AutoClip(50.0, 4, per_tensor=True)
    buffer = torch.tensor([[4.0, 1.0, 3.0, 2.0], [9.0, 5.0, 0.0, 0.0]])
    count = torch.tensor([6, 2])  # row 0 has wrapped: slot 2 is the oldest
    load_ring(rule, buffer, count)
    thresholds = step(rule, torch.tensor([0.5, 7.0]))
    seen = (torch.tensor([4.0, 1.0, 3.0, 2.0]), torch.tensor([9.0, 5.0]))
    assert torch.equal(thresholds, torch.stack([torch.quantile(s, 0.5) for s in seen]))
    assert torch.equal(
        rule.state["buffer"], torch.tensor([[4.0, 1.0, 0.5, 2.0], [9.0, 5.0, 7.0, 0.0]])
    )
    assert torch.equal(rule.state["sorted"], ring_sorted(rule))


@pytest.mark.parametrize(
    ("count", "slot_value", "message"),
    [
        ([2, -1], 0.0, "count must be >= 0, got -1 in row 1"),
        ([6, 2], math.nan, "holds nan in filled slot 1 of row 1"),
        ([6, 2], math.inf, "holds inf in filled slot 1 of row 1"),
    ],
)
def test_a_ring_the_rule_could_not_have_written_is_refused_and_changes_nothing(
    count: list[int], slot_value: float, message: str
) -> None:
    """A negative count, or a non-finite norm in a filled slot (the rule stores finite
    norms only), would make the rebuilt sorted copy disagree with the ring."""
    rule = clipopt.AutoClip(50.0, 4, per_tensor=True)
    step(rule, torch.tensor([3.0, 8.0]))
    before = {k: v.clone() for k, v in rule.state.items()}
    buffer = torch.tensor([[4.0, 1.0, 3.0, 2.0], [9.0, slot_value, 0.0, 0.0]])
    with pytest.raises(ValueError, match=message):
        load_ring(rule, buffer, torch.tensor(count))
    after = rule.state
    assert all(torch.equal(after[k], before[k]) for k in ("buffer", "count"))


def test_a_non_finite_value_in_an_unfilled_slot_is_never_read() -> None:
    """Slots past a row's count are not history: whatever they hold, the threshold is
    the quantile of the filled ones."""
    rule = clipopt.AutoClip(50.0, 4, per_tensor=True)
    buffer = torch.tensor([[4.0, 1.0, 3.0, 2.0], [9.0, 5.0, math.nan, math.inf]])
    load_ring(rule, buffer, torch.tensor([6, 2]))
    thresholds = step(rule, torch.tensor([0.5, 7.0]))
    seen = (torch.tensor([4.0, 1.0, 3.0, 2.0]), torch.tensor([9.0, 5.0]))
    assert torch.equal(thresholds, torch.stack([torch.quantile(s, 0.5) for s in seen]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_sorted_copy_on_cuda_matches_the_cpu_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(0)
    rules = {d: clipopt.AutoClip(30.0, 16, per_tensor=True) for d in ("cpu", "cuda")}
    for n in range(60):
        norms = torch.rand(7, generator=generator).mul(4).round()  # duplicates and zeros
        if n % 11 == 5:
            norms[n % 7] = math.nan if n % 2 else math.inf
        cpu, cuda = (step(rules[d], norms.to(d)) for d in ("cpu", "cuda"))
        assert torch.equal(cuda.cpu(), cpu)
    cuda_rule = rules["cuda"]
    assert cuda_rule.state["sorted"].is_cuda
    assert torch.equal(cuda_rule.state["sorted"].cpu(), ring_sorted(cuda_rule).cpu())
