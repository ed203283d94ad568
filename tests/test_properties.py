"""Properties of the functional API over random parameter lists.

Each example is a list of parameters of random shapes (some empty, some large enough for
the blocked CPU reduction, some non-contiguous), dtypes, devices and magnitudes, with
None grads mixed in. Results are checked against a float64 reference and against
``torch.nn.utils`` wherever torch's own answer is right.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from hypothesis import assume, event, given
from hypothesis import strategies as st
from torch import Tensor

import clipopt

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
NORM_TYPES: list[float | int | str] = [1, 2, 2.0, 3.5, math.inf, "inf"]
"""Orders p >= 1, where a float32 norm is within 1e-5 of float64 (test_functional covers
p < 1, whose p-th root doubles the sum's rounding error at p = 0.5)."""
HALF_TYPES = (torch.float16, torch.bfloat16)

Float64Norm = Callable[[Sequence[Tensor | None], float | str], float]


@dataclass
class Case:
    """A drawn parameter list: parameters (grads set or None) and their description."""

    params: list[torch.nn.Parameter]
    norm_type: float | int | str

    @property
    def grads(self) -> list[Tensor | None]:
        return [p.grad for p in self.params]

    @property
    def dtypes(self) -> set[torch.dtype]:
        return {p.grad.dtype for p in self.params if p.grad is not None}

    def clone(self) -> Case:
        """Fresh parameters holding copies of the same grads (strides kept)."""
        params = []
        for p in self.params:
            q = torch.nn.Parameter(p.detach().clone())
            if p.grad is not None:
                q.grad = torch.empty_strided(
                    p.grad.shape, p.grad.stride(), dtype=p.grad.dtype, device=p.grad.device
                ).copy_(p.grad)
            params.append(q)
        return Case(params, self.norm_type)


@st.composite
def shapes(draw: st.DrawFn) -> tuple[int, ...]:
    """Mostly small shapes (empty ones included), sometimes one large flat tensor."""
    if draw(st.integers(0, 5)) == 0:
        return (draw(st.sampled_from([8191, 8192, 12_289, 20_000])),)
    return tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))


@st.composite
def grad_tensor(draw: st.DrawFn, seed: int) -> Tensor:
    """A random grad: normal values times a drawn magnitude, maybe a transposed view."""
    shape = draw(shapes())
    dtype = draw(st.sampled_from(DTYPES))
    device = draw(st.sampled_from(DEVICES))
    scale = draw(st.sampled_from([1e-3, 1.0, 100.0]))
    transpose = len(shape) == 2 and draw(st.booleans())
    if transpose:
        shape = (shape[1], shape[0])
    generator = torch.Generator().manual_seed(seed)
    values = (torch.randn(shape, generator=generator, dtype=torch.float64) * scale).to(dtype)
    values = values.to(device)
    return values.t() if transpose else values


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """One to six parameters; each has a grad with probability 3/4."""
    count = draw(st.integers(1, 6))
    params = []
    for i in range(count):
        grad = draw(grad_tensor(seed=draw(st.integers(0, 2**31)) + i))
        param = torch.nn.Parameter(torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device))
        if draw(st.integers(0, 3)) > 0:
            param.grad = grad
        params.append(param)
    return Case(params, draw(st.sampled_from(NORM_TYPES)))


def unit_roundoff(dtypes: set[torch.dtype]) -> float:
    """Relative rounding error of storing a value in the coarsest of ``dtypes``."""
    return max([torch.finfo(d).eps / 2 for d in dtypes], default=0.0)


def norm_rtol(dtypes: set[torch.dtype]) -> float:
    """How far our norm may be from float64: float32 accumulation, unless all double."""
    return 1e-12 if dtypes == {torch.float64} else 1e-5


def subnormal_atol(dtypes: set[torch.dtype]) -> float:
    """Absolute slack for values that land among the coarsest dtype's subnormals."""
    return max([torch.finfo(d).smallest_normal * torch.finfo(d).eps for d in dtypes], default=0)


def clip_coefficient(max_norm: float, norm: float) -> float:
    return min(1.0, max_norm / (norm + 1e-6))


def assert_scaled_copy(clipped: Tensor, original: Tensor, coef: float, rtol: float) -> None:
    """``clipped == coef * original`` up to storing in the grad's dtype: same direction."""
    expected = original.detach().cpu().double() * coef
    atol = subnormal_atol({original.dtype})
    torch.testing.assert_close(clipped.detach().cpu().double(), expected, rtol=rtol, atol=atol)


@given(case=cases(), foreach=st.sampled_from([None, True, False]))
def test_total_norm_matches_float64_reference(
    case: Case, foreach: bool | None, float64_norm: Float64Norm
) -> None:
    norm = clipopt.get_total_norm(case.grads, case.norm_type, foreach=foreach)
    reference = float64_norm(case.grads, case.norm_type)
    assert math.isclose(float(norm), reference, rel_tol=norm_rtol(case.dtypes), abs_tol=0)
    present = [g for g in case.grads if g is not None and g.numel() > 0]
    if present:  # float64 if any grad is, empty or not, as torch's type promotion gives
        assert norm.dtype == (torch.float64 if torch.float64 in case.dtypes else torch.float32)
        assert norm.device == present[0].device
    elif all(g is None for g in case.grads):  # no grads at all: a plain tensor(0.)
        assert norm.dtype == torch.float32 and norm.device == torch.device("cpu")
    else:  # only empty grads: a zero of their promoted dtype where the first one lives
        empty = [g for g in case.grads if g is not None]
        assert norm.dtype == (torch.float64 if torch.float64 in case.dtypes else torch.float32)
        assert norm.device == empty[0].device
    assert norm.dim() == 0


@given(case=cases(), fraction=st.sampled_from([0.001, 0.3, 0.9]))
def test_clipping_bounds_the_norm_and_keeps_directions(
    case: Case, fraction: float, float64_norm: Float64Norm
) -> None:
    reference = float64_norm(case.grads, case.norm_type)
    max_norm = reference * fraction if reference > 0 else 1.0
    originals = [None if g is None else g.clone() for g in case.grads]
    norm = clipopt.clip_grad_norm_(case.params, max_norm, case.norm_type)
    assert math.isclose(float(norm), reference, rel_tol=norm_rtol(case.dtypes))
    rounding = max(unit_roundoff(case.dtypes), 1e-5)
    after = float64_norm(case.grads, case.norm_type)
    # Each clipped element may round by a subnormal step; n of them add up to n**(1/p).
    elements = sum(g.numel() for g in case.grads if g is not None)
    p = math.inf if case.norm_type in ("inf", math.inf) else float(case.norm_type)
    spread = 1.0 if p == math.inf else max(elements, 1) ** (1.0 / p)
    assert after <= max_norm * (1 + rounding) + subnormal_atol(case.dtypes) * spread
    coef = clip_coefficient(max_norm, float(norm))
    for grad, original in zip(case.grads, originals, strict=True):
        assert (grad is None) == (original is None)
        if grad is not None and original is not None:
            assert_scaled_copy(grad, original, coef, rtol=rounding + 1e-6)


@given(case=cases(), margin=st.sampled_from([1.01, 2.0, 1e6]))
def test_grads_below_the_threshold_are_bit_identical(
    case: Case, margin: float, float64_norm: Float64Norm
) -> None:
    max_norm = max(float64_norm(case.grads, case.norm_type) * margin, 1e-3)
    originals = [None if g is None else g.clone() for g in case.grads]
    clipopt.clip_grad_norm_(case.params, max_norm, case.norm_type)
    for grad, original in zip(case.grads, originals, strict=True):
        assert (grad is None and original is None) or torch.equal(grad, original)


def torch_tolerance(dtypes: set[torch.dtype]) -> float:
    """How far torch's norm may be from float64 and still count as right.

    torch reduces half types in their own precision and rounds the partial and total
    norms to it, so allow a few roundings of the coarsest dtype.
    """
    return 1e-5 if not dtypes & set(HALF_TYPES) else 8 * unit_roundoff(dtypes)


def torch_clip(case: Case, max_norm: float) -> tuple[Tensor | None, list[Tensor | None]]:
    """torch.nn.utils.clip_grad_norm_ on a copy; (None, []) where torch raises."""
    copy = case.clone()
    try:
        norm = torch.nn.utils.clip_grad_norm_(copy.params, max_norm, copy.norm_type)
    except RuntimeError as error:
        # torch's inf-norm has no identity for an empty tensor; ours skips empty grads.
        assert "empty" in str(error) and math.isinf(float(case.norm_type))
        return None, []
    return norm, copy.grads


@given(case=cases(), fraction=st.sampled_from([0.01, 0.5, 2.0]))
def test_matches_torch_wherever_torch_is_right(
    case: Case, fraction: float, float64_norm: Float64Norm
) -> None:
    reference = float64_norm(case.grads, case.norm_type)
    max_norm = reference * fraction if reference > 0 else 1.0
    torch_norm, torch_grads = torch_clip(case, max_norm)
    tolerance = torch_tolerance(case.dtypes)
    torch_right = torch_norm is not None and math.isclose(
        float(torch_norm), reference, rel_tol=tolerance, abs_tol=1e-30
    )
    if not case.dtypes & set(HALF_TYPES):
        assert torch_right or torch_norm is None, "torch is right on fp32/fp64 grads"
    event(f"torch right: {torch_right}")
    if not torch_right:
        return
    norm = clipopt.clip_grad_norm_(case.params, max_norm, case.norm_type)
    assert math.isclose(float(norm), float(torch_norm), rel_tol=tolerance, abs_tol=1e-30)
    for ours, theirs in zip(case.grads, torch_grads, strict=True):
        assert (ours is None) == (theirs is None)
        if ours is not None and theirs is not None:
            rtol = tolerance + unit_roundoff({ours.dtype})
            atol = subnormal_atol({ours.dtype})
            torch.testing.assert_close(ours.double(), theirs.double(), rtol=rtol, atol=atol)


@given(case=cases(), fraction=st.sampled_from([0.1, 2.0]))
def test_foreach_true_false_and_none_agree(
    case: Case, fraction: float, float64_norm: Float64Norm
) -> None:
    reference = float64_norm(case.grads, case.norm_type)
    max_norm = reference * fraction if reference > 0 else 1.0
    results = {}
    for foreach in (None, True, False):
        copy = case.clone()
        norm = clipopt.clip_grad_norm_(copy.params, max_norm, copy.norm_type, foreach=foreach)
        results[foreach] = (norm, copy.grads)
    base_norm, base_grads = results[None]
    rtol = norm_rtol(case.dtypes)
    for foreach in (True, False):
        norm, grads = results[foreach]
        torch.testing.assert_close(norm, base_norm, rtol=rtol, atol=0)
        for ours, base in zip(grads, base_grads, strict=True):
            assert (ours is None) == (base is None)
            if ours is not None and base is not None:
                rounding = rtol + unit_roundoff({ours.dtype})
                atol = subnormal_atol({ours.dtype})
                torch.testing.assert_close(ours, base, rtol=rounding, atol=atol)


@given(case=cases(), fraction=st.sampled_from([0.1, 2.0, math.inf]))
def test_out_of_place_equals_in_place_and_touches_nothing(
    case: Case, fraction: float, float64_norm: Float64Norm
) -> None:
    reference = float64_norm(case.grads, case.norm_type)
    max_norm = reference * fraction if reference > 0 else 1.0
    originals = [None if g is None else g.clone() for g in case.grads]
    clipped, norm = clipopt.clip_grad_norm(case.params, max_norm, case.norm_type)
    for grad, original in zip(case.grads, originals, strict=True):
        assert (grad is None and original is None) or torch.equal(grad, original)
    in_place_norm = clipopt.clip_grad_norm_(case.params, max_norm, case.norm_type)
    assert torch.equal(norm, in_place_norm)
    assert len(clipped) == len(case.params)
    for copy, grad in zip(clipped, case.grads, strict=True):
        assert (copy is None and grad is None) or torch.equal(copy, grad)
        assert copy is None or copy is not grad


@given(
    sizes=st.lists(st.sampled_from([1, 7, 1500, 70_000]), min_size=1, max_size=3),
    exponent=st.integers(-100, 100),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    norm_type=st.sampled_from([1.0, 2.0, math.inf]),
    seed=st.integers(0, 2**31),
)
def test_cpu_norm_is_exact_across_the_float32_exponent_range(
    sizes: list[int],
    exponent: int,
    dtype: torch.dtype,
    norm_type: float,
    seed: int,
    float64_norm: Float64Norm,
) -> None:
    """Float32 and bfloat16 CPU grads scaled by 2**-100 to 2**100 get their true norm and
    are clipped to ``max_norm``; the 2-norm within its documented limit, elements within
    2**+-50, as its squares are taken in float32 (torch's are too). The partial norms are
    combined in double. Every norm here fits in float32.
    A trailing float32 grad makes two dtype groups, whose partials are combined too."""
    assume(norm_type != 2.0 or abs(exponent) <= 50)
    generator = torch.Generator().manual_seed(seed)
    exact = [torch.randn(n, generator=generator, dtype=torch.float64) for n in sizes]
    grads = [(g * 2.0**exponent).to(dtype) for g in exact]
    grads.append(grads[0].to(torch.float32))
    reference = float64_norm(grads, norm_type)
    norm = clipopt.get_total_norm(grads, norm_type)
    assert norm.dtype == torch.float32
    assert math.isclose(float(norm), reference, rel_tol=1e-5, abs_tol=0)

    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    clipopt.clip_grad_norm_(params, 1.0, norm_type)
    clipped = float64_norm([p.grad for p in params], norm_type)
    if reference > 1.0:  # clipped to max_norm, up to storing each element in its dtype
        assert math.isclose(clipped, 1.0, rel_tol=2 * unit_roundoff({dtype}) + 1e-6)
    else:
        assert clipped == reference


def test_the_strategy_draws_the_cases_that_matter() -> None:
    """A check on the generator itself: large, strided, empty and missing grads occur."""
    seen: dict[str, bool] = {"large": False, "strided": False, "none": False, "empty": False}

    @given(case=cases())
    def record(case: Case) -> None:
        for p in case.params:
            seen["none"] |= p.grad is None
            if p.grad is not None:
                seen["large"] |= p.grad.numel() >= 8192
                seen["strided"] |= not p.grad.is_contiguous()
                seen["empty"] |= p.grad.numel() == 0

    record()
    assert all(seen.values()), seen
