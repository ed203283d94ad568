"""The functional API case by case: every norm order, half precision, sparse and complex
grads, accuracy, bad input, and equivalence with ``torch.nn.utils``.

Expected values come from a float64 reference (the ``float64_norm`` fixture) or from
torch run side by side; where torch's answer differs on purpose, the test asserts what
torch does too, so the difference stays documented.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor
from torch.torch_version import TorchVersion

import clipopt

Float64Norm = Callable[[Sequence[Tensor | None], float | str], float]

_BITS = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def with_grads(*grads: Tensor | None) -> list[torch.nn.Parameter]:
    """Parameters whose ``.grad`` are ``grads`` (None: no grad)."""
    params = []
    for grad in grads:
        like = torch.zeros(()) if grad is None else torch.zeros_like(grad)
        param = torch.nn.Parameter(like.to_dense() if like.is_sparse else like)
        param.grad = grad
        params.append(param)
    return params


def clones(grads: Sequence[Tensor | None]) -> list[Tensor | None]:
    return [None if g is None else g.clone() for g in grads]


def snapshot(params: Sequence[Tensor]) -> list[Tensor | None]:
    return clones([p.grad for p in params])


def same_bits(a: Tensor | None, b: Tensor | None) -> bool:
    """Bit-for-bit equality (NaN payloads included), or both None."""
    if a is None or b is None:
        return a is None and b is None
    if a.is_sparse or b.is_sparse:
        return same_bits(a.to_dense(), b.to_dense())
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_complex():
        return same_bits(torch.view_as_real(a), torch.view_as_real(b))
    return torch.equal(a.contiguous().view(_BITS[a.dtype]), b.contiguous().view(_BITS[b.dtype]))


def assert_untouched(params: Sequence[Tensor], before: Sequence[Tensor | None]) -> None:
    for p, grad in zip(params, before, strict=True):
        assert same_bits(p.grad, grad)


def mixed_grads(seed: int = 0) -> list[Tensor | None]:
    """Small, medium and large, fp32/fp16/bf16/fp64, an empty one and a missing one."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.randn(shape, generator=generator).to(dtype)

    return [
        normal(7, 3),
        None,
        normal(20_000),
        normal(5000, dtype=torch.float16),
        normal(0),
        normal(12_289, dtype=torch.bfloat16),
        normal(4, 4, dtype=torch.float64).t(),
    ]


# --- Every order p > 0 ------------------------------------------------------------------

ORDERS = [0.25, 0.5, 1, 1.5, 2, 2.0, 3, 3.5, 8, math.inf, "inf", "INF", np.float64(2.0)]


@pytest.mark.parametrize("norm_type", ORDERS, ids=repr)
def test_every_order_matches_float64(norm_type: float | str, float64_norm: Float64Norm) -> None:
    grads = mixed_grads()
    expected = float64_norm(grads, "inf" if isinstance(norm_type, str) else norm_type)
    p = math.inf if isinstance(norm_type, str) else float(norm_type)
    # The p-th root scales the float32 sum's relative error by 1/p, so small p gets slack.
    rtol = 1e-5 / min(p, 1.0)
    for foreach in (None, True, False):
        norm = clipopt.get_total_norm(grads, norm_type, foreach=foreach)
        assert norm.dtype == torch.float64  # one grad is double
        assert math.isclose(float(norm), expected, rel_tol=rtol)


def test_float32_result_for_single_and_half_precision(float64_norm: Float64Norm) -> None:
    grads = [g for g in mixed_grads() if g is not None and g.dtype != torch.float64]
    norm = clipopt.get_total_norm(grads)
    assert norm.dtype == torch.float32
    assert math.isclose(float(norm), float64_norm(grads, 2), rel_tol=1e-6)


@pytest.mark.parametrize("norm_type", [1, 2.0, 3.5, math.inf])
def test_single_and_double_precision_match_torch(
    norm_type: float, float64_norm: Float64Norm
) -> None:
    """Where torch's answer is right (within 1e-5 of float64), ours equals it to that
    precision, clipped grads included; ours is within 1e-6."""
    grads = [g for g in mixed_grads(seed=1) if g is not None and g.dtype == torch.float32]
    grads = [g for g in grads if g.numel() > 0]  # torch's inf-norm raises on empty ones
    grads += [torch.randn(6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)]
    expected = float64_norm(grads, norm_type)
    ours, theirs = with_grads(*grads), with_grads(*[g.clone() for g in grads])
    max_norm = 0.5
    norm = clipopt.clip_grad_norm_(ours, max_norm, norm_type)
    torch_norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert math.isclose(float(norm), expected, rel_tol=1e-6)
    assert math.isclose(float(torch_norm), expected, rel_tol=1e-5)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=0)


# --- Half precision ---------------------------------------------------------------------


def test_fp16_norm_past_65504_is_exact_where_torch_overflows(float64_norm: Float64Norm) -> None:
    grad = torch.full((1000,), 3000.0, dtype=torch.float16)
    expected = float64_norm([grad], 2)
    assert math.isclose(expected, 3000.0 * math.sqrt(1000), rel_tol=1e-12)  # 94868.33

    ours = with_grads(grad.clone())
    norm = clipopt.clip_grad_norm_(ours, max_norm=1.0)
    assert norm.dtype == torch.float32
    assert math.isclose(float(norm), expected, rel_tol=1e-6)
    clipped = ours[0].grad
    assert clipped is not None and clipped.dtype == torch.float16
    assert math.isclose(float64_norm([clipped], 2), 1.0, rel_tol=torch.finfo(torch.float16).eps)

    theirs = with_grads(grad.clone())
    torch_norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm=1.0)
    assert torch.isinf(torch_norm)
    assert theirs[0].grad is not None and not theirs[0].grad.any()  # every grad zeroed


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm_type", [1, 2.0, 3.5, math.inf])
def test_half_precision_accumulates_in_float32(
    dtype: torch.dtype, norm_type: float, float64_norm: Float64Norm
) -> None:
    grads = [
        (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 50).to(dtype)
        for n in (3, 3000, 9000)
    ]
    norm = clipopt.get_total_norm(grads, norm_type)
    assert norm.dtype == torch.float32
    assert math.isclose(float(norm), float64_norm(grads, norm_type), rel_tol=1e-5)


# --- The inf-norm on CPU ----------------------------------------------------------------

LARGE = 1 << 16
"""A tensor this big must not go through vector_norm(inf) on CPU (about 10x the cost of
torch.sum over the same bytes: docs/benchmarks.md)."""


class InfNormSpy:
    """Wraps torch's norm entry points; an inf-order call on a large CPU tensor fails.

    ``torch._foreach_norm`` is checked only while ``foreach_allowed`` is False: with
    ``foreach=True`` the caller asked for the multi-tensor kernel by name.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.foreach_allowed = False
        vector_norm, foreach_norm, tensor_norm = (
            torch.linalg.vector_norm,
            torch._foreach_norm,
            torch.Tensor.norm,
        )

        def spy_vector_norm(x: Tensor, ord: object = 2, *args: object, **kw: object) -> Tensor:
            self.check("vector_norm", [x], ord)
            return vector_norm(x, ord, *args, **kw)

        def spy_foreach_norm(tensors: list[Tensor], ord: object = 2, **kw: object) -> object:
            if not self.foreach_allowed:
                self.check("_foreach_norm", tensors, ord)
            return foreach_norm(tensors, ord, **kw)

        def spy_tensor_norm(t: Tensor, p: object = "fro", *args: object, **kw: object) -> object:
            self.check("Tensor.norm", [t], p)
            return tensor_norm(t, p, *args, **kw)

        monkeypatch.setattr(torch.linalg, "vector_norm", spy_vector_norm)
        monkeypatch.setattr(torch, "_foreach_norm", spy_foreach_norm)
        monkeypatch.setattr(torch.Tensor, "norm", spy_tensor_norm)

    @staticmethod
    def check(name: str, tensors: Sequence[Tensor], order: object) -> None:
        is_inf = isinstance(order, (int, float)) and math.isinf(order)
        if is_inf and any(t.device.type == "cpu" and t.numel() >= LARGE for t in tensors):
            raise AssertionError(f"{name}(ord=inf) on a large CPU tensor")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("foreach", [None, True, False])
def test_cpu_inf_norm_avoids_vector_norm_inf_on_large_tensors(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    foreach: bool | None,
    float64_norm: Float64Norm,
) -> None:
    spy = InfNormSpy(monkeypatch)
    for sanity in (
        lambda: torch.linalg.vector_norm(torch.zeros(LARGE), math.inf),
        lambda: torch._foreach_norm([torch.zeros(LARGE)], math.inf),
    ):
        with pytest.raises(AssertionError):  # the spy is live
            sanity()
    spy.foreach_allowed = foreach is True
    large = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3)).to(dtype)
    large[12345] = -40.0  # the largest magnitude is negative
    grads = [large, torch.randn(5, 5).to(dtype), None, large[:0]]
    params = with_grads(*grads)
    for norm_type in (math.inf, "inf"):
        norm = clipopt.get_total_norm(grads, norm_type, foreach=foreach)
        assert float(norm) == float64_norm(grads, "inf") == 40.0
    clipopt.clip_grad_norm_(params, 4.0, "inf", foreach=foreach)
    assert math.isclose(float64_norm([p.grad for p in params], "inf"), 4.0, rel_tol=1e-2)


# --- Sparse and complex grads -----------------------------------------------------------


def embedding_grads(sparse: bool, indices: list[int]) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 4, sparse=sparse)
    (embedding(torch.tensor(indices, dtype=torch.long)) * 25).sum().backward()
    return list(embedding.parameters())


@pytest.mark.parametrize("norm_type", [1, 2.0, 3.5, math.inf])
@pytest.mark.parametrize("foreach", [None, True, False])
def test_sparse_embedding_grads_clip_like_their_dense_equivalent(
    norm_type: float, foreach: bool | None
) -> None:
    indices = [1, 7, 1, 3]  # a repeated index: backward leaves duplicates in the grad
    sparse, dense = embedding_grads(True, indices), embedding_grads(False, indices)
    sparse_grad = sparse[0].grad
    assert sparse_grad is not None and sparse_grad.is_sparse
    norm = clipopt.clip_grad_norm_(sparse, 3.0, norm_type, foreach=foreach)
    dense_norm = clipopt.clip_grad_norm_(dense, 3.0, norm_type, foreach=foreach)
    torch.testing.assert_close(norm, dense_norm, rtol=1e-6, atol=0)
    assert sparse[0].grad is not None and dense[0].grad is not None
    torch.testing.assert_close(sparse[0].grad.to_dense(), dense[0].grad, rtol=1e-6, atol=0)


def test_torch_clips_sparse_embedding_grads_only_from_2_14_and_then_as_clipopt_does() -> None:
    theirs_params, ours_params = embedding_grads(True, [1, 7, 1]), embedding_grads(True, [1, 7, 1])
    try:
        theirs = torch.nn.utils.clip_grad_norm_(theirs_params, 1.0)
    except NotImplementedError:
        assert TorchVersion(torch.__version__) < (2, 14)
        return
    assert TorchVersion(torch.__version__) >= (2, 14)
    ours = clipopt.clip_grad_norm_(ours_params, 1.0)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    ours_grad, theirs_grad = ours_params[0].grad, theirs_params[0].grad
    assert ours_grad is not None and theirs_grad is not None
    torch.testing.assert_close(ours_grad.to_dense(), theirs_grad.to_dense(), rtol=1e-6, atol=0)


def uncoalesced() -> Tensor:
    """Values 1 and -3 both at index 0, 2 at index 2: densely [-2, 0, 2, 0]."""
    indices = torch.tensor([[0, 2, 0]])
    values = torch.tensor([1.0, 2.0, -3.0])
    return torch.sparse_coo_tensor(indices, values, (4,), check_invariants=True)


@pytest.mark.parametrize("norm_type", [0.5, 1, 2.0, 3.5, math.inf])
def test_uncoalesced_sparse_grad_is_measured_as_its_dense_sum(
    norm_type: float, float64_norm: Float64Norm
) -> None:
    grad = uncoalesced()
    assert not grad.is_coalesced()
    dense = grad.to_dense()
    assert torch.equal(dense, torch.tensor([-2.0, 0.0, 2.0, 0.0]))
    norm = clipopt.get_total_norm([grad], norm_type)
    assert math.isclose(float(norm), float64_norm([dense], norm_type), rel_tol=1e-6)
    naive = float64_norm([grad._values()], norm_type)  # duplicates counted apart
    assert not math.isclose(float(norm), naive, rel_tol=1e-3)


def test_uncoalesced_sparse_grad_clips_like_its_dense_equivalent() -> None:
    sparse, dense = with_grads(uncoalesced()), with_grads(uncoalesced().to_dense())
    norm = clipopt.clip_grad_norm_(sparse, 1.0)
    dense_norm = clipopt.clip_grad_norm_(dense, 1.0)
    torch.testing.assert_close(norm, dense_norm)
    assert sparse[0].grad is not None and dense[0].grad is not None
    torch.testing.assert_close(sparse[0].grad.to_dense(), dense[0].grad)


def test_clip_grad_value_clamps_duplicate_sparse_entries_after_summing() -> None:
    sparse, dense = with_grads(uncoalesced()), with_grads(uncoalesced().to_dense())
    clipopt.clip_grad_value_(sparse, 1.5)
    torch.nn.utils.clip_grad_value_(dense, 1.5)
    assert sparse[0].grad is not None and dense[0].grad is not None
    # Clamping the stored values one by one would give -0.5 at index 0.
    assert torch.equal(sparse[0].grad.to_dense(), dense[0].grad)  # [-1.5, 0, 1.5, 0]


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_sparse_grad_with_no_stored_values(norm_type: float) -> None:
    """An embedding that saw no indices has a sparse grad with nnz == 0."""
    params = embedding_grads(True, [])
    assert params[0].grad is not None and params[0].grad._nnz() == 0
    assert torch.equal(clipopt.clip_grad_norm_(params, 1.0, norm_type), torch.tensor(0.0))
    mixed = [*params, *with_grads(torch.tensor([-3.0, 4.0]))]
    expected = torch.tensor(4.0 if norm_type == math.inf else 5.0)
    assert torch.equal(clipopt.clip_grad_norm_(mixed, 1.0, norm_type), expected)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("norm_type", [1, 2.0, 3.5, math.inf])
def test_complex_grads_norm_and_clip(
    dtype: torch.dtype, norm_type: float, float64_norm: Float64Norm
) -> None:
    generator = torch.Generator().manual_seed(4)
    grads = [torch.randn(n, generator=generator, dtype=dtype) for n in (3, 20_000)]
    expected = float64_norm(grads, norm_type)
    ours, theirs = with_grads(*clones(grads)), with_grads(*clones(grads))
    norm = clipopt.clip_grad_norm_(ours, 1.0, norm_type)
    assert norm.dtype == (torch.float64 if dtype == torch.complex128 else torch.float32)
    assert math.isclose(float(norm), expected, rel_tol=1e-6)
    coef = 1.0 / (float(norm) + 1e-6)
    for p, grad in zip(ours, grads, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, grad * coef, rtol=1e-6, atol=1e-9)
    torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-6, atol=1e-9)


# --- Empty, missing and absent grads ----------------------------------------------------


@pytest.mark.parametrize("norm_type", [1, 2.0, math.inf, "inf"])
def test_empty_grads_are_skipped(norm_type: float | str) -> None:
    params = with_grads(torch.zeros(0), torch.tensor([-3.0, 2.0]), torch.zeros(3, 0))
    norm = clipopt.clip_grad_norm_(params, 1.0, norm_type)
    expected = {1: 5.0, 2.0: math.sqrt(13)}.get(norm_type, 3.0)
    assert math.isclose(float(norm), expected, rel_tol=1e-6)
    only_empty = with_grads(torch.zeros(0), torch.zeros(2, 0))
    assert torch.equal(clipopt.clip_grad_norm_(only_empty, 1.0, norm_type), torch.tensor(0.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_only_empty_grads_give_a_zero_of_torchs_dtype(dtype: torch.dtype) -> None:
    grads = [torch.zeros(0, dtype=dtype), torch.zeros(2, 0, dtype=dtype)]
    ours = clipopt.get_total_norm(grads)
    theirs = torch.nn.utils.get_total_norm(grads)  # right here: no half-precision sum
    assert ours.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert ours.device == grads[0].device and float(ours) == float(theirs) == 0.0
    if dtype != torch.float16:
        assert ours.dtype == theirs.dtype


def test_torch_inf_norm_raises_on_an_empty_grad() -> None:
    with pytest.raises(RuntimeError, match="empty"):
        torch.nn.utils.clip_grad_norm_(with_grads(torch.zeros(0), torch.ones(2)), 1.0, "inf")


@pytest.mark.parametrize("norm_type", [1, 2.0, 3.5, math.inf])
def test_no_grads_at_all_gives_zero_and_clips_nothing(norm_type: float) -> None:
    for params in ([], with_grads(None, None)):
        norm = clipopt.clip_grad_norm_(params, 1.0, norm_type)
        assert torch.equal(norm, torch.tensor(0.0)) and norm.dtype == torch.float32
        assert all(p.grad is None for p in params)
        clipped, out_norm = clipopt.clip_grad_norm(params, 1.0, norm_type)
        assert clipped == [None] * len(params) and torch.equal(out_norm, torch.tensor(0.0))
    assert torch.equal(clipopt.get_total_norm([], norm_type), torch.tensor(0.0))


# --- Accuracy of one large float32 grad -------------------------------------------------


def test_l2_norm_of_a_large_float32_grad_is_within_1e_6_of_float64(
    float64_norm: Float64Norm,
) -> None:
    """4M elements here (the benchmark measures 40M). torch's CPU vector_norm, measured on
    this input, is off by ~8e-5; ours by ~3e-9."""
    grad = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0))
    expected = float64_norm([grad], 2)
    ours = clipopt.get_total_norm([grad])
    assert abs(float(ours) / expected - 1) < 1e-6
    torch_error = abs(float(torch.linalg.vector_norm(grad)) / expected - 1)
    assert torch_error > 1e-6  # measurably worse: it misses the bound we meet


# --- Bad input: a clear error and nothing touched ---------------------------------------

BAD_MAX_NORMS: list[tuple[object, type[Exception]]] = [
    (-1.0, ValueError),
    (-1, ValueError),
    (0, ValueError),
    (0.0, ValueError),
    (-0.0, ValueError),
    (math.nan, ValueError),
    (-math.inf, ValueError),
    (np.float32(-2.0), ValueError),
    (True, TypeError),
    (False, TypeError),
    ("1.0", TypeError),
    (None, TypeError),
    ([1.0], TypeError),
    (1 + 0j, TypeError),
    (torch.tensor([1.0, 2.0]), TypeError),
    (torch.tensor(True), TypeError),
]


CLIPS: dict[str, Callable[[list[torch.nn.Parameter], Any], object]] = {
    "in_place": clipopt.clip_grad_norm_,
    "out_of_place": clipopt.clip_grad_norm,
    "with_norm": lambda params, max_norm: clipopt.clip_grads_with_norm_(
        params, max_norm, torch.tensor(10.0)
    ),
}


@pytest.mark.parametrize(("max_norm", "error"), BAD_MAX_NORMS, ids=repr)
@pytest.mark.parametrize("clip", CLIPS.values(), ids=CLIPS.keys())
def test_bad_max_norm_raises_naming_it_and_touches_nothing(
    max_norm: object,
    error: type[Exception],
    clip: Callable[[list[torch.nn.Parameter], object], object],
) -> None:
    params = with_grads(torch.tensor([3.0, -4.0]), None, torch.tensor([[12.0]]))
    before = snapshot(params)
    with pytest.raises(error) as raised:
        clip(params, max_norm)
    assert "max_norm" in str(raised.value)
    assert repr(max_norm) in str(raised.value)
    assert_untouched(params, before)


def test_torch_flips_every_grad_for_a_negative_max_norm() -> None:
    grad = torch.tensor([3.0, -4.0])
    theirs = with_grads(grad.clone())
    torch.nn.utils.clip_grad_norm_(theirs, max_norm=-1.0)
    assert theirs[0].grad is not None
    assert torch.equal(theirs[0].grad.sign(), -grad.sign())


@pytest.mark.parametrize("max_norm", [math.inf, np.float64(math.inf), float("inf")])
def test_infinite_max_norm_measures_and_never_scales(max_norm: float) -> None:
    params = with_grads(
        torch.tensor([3.0, math.nan]), torch.tensor([math.inf, -1.0]), None, torch.tensor([4.0])
    )
    before = snapshot(params)
    norm = clipopt.clip_grad_norm_(params, max_norm)
    assert norm.isnan()
    assert_untouched(params, before)
    clipped, out_norm = clipopt.clip_grad_norm(params, max_norm)
    assert out_norm.isnan()
    for copy, grad in zip(clipped, before, strict=True):
        assert same_bits(copy, grad)
    finite = with_grads(torch.tensor([30.0, 40.0]))
    assert torch.equal(clipopt.clip_grad_norm_(finite, max_norm), torch.tensor(50.0))
    assert torch.equal(finite[0].grad, torch.tensor([30.0, 40.0]))


@pytest.mark.parametrize("max_norm", [np.float32(1.0), np.float64(1.0), np.int64(1)])
def test_numpy_scalars_are_accepted_like_python_numbers(max_norm: object) -> None:
    ours, reference = with_grads(torch.tensor([30.0, 40.0])), with_grads(torch.tensor([30.0, 40.0]))
    clipopt.clip_grad_norm_(ours, max_norm)
    clipopt.clip_grad_norm_(reference, 1.0)
    assert torch.equal(ours[0].grad, reference[0].grad)


def test_a_tensor_max_norm_is_used_on_device() -> None:
    ours, reference = with_grads(torch.tensor([30.0, 40.0])), with_grads(torch.tensor([30.0, 40.0]))
    clipopt.clip_grad_norm_(ours, torch.tensor(2.0))
    clipopt.clip_grad_norm_(reference, 2.0)
    assert torch.equal(ours[0].grad, reference[0].grad)


BAD_NORM_TYPES: list[tuple[object, type[Exception]]] = [
    (0, ValueError),
    (0.0, ValueError),
    (-1, ValueError),
    (-2.5, ValueError),
    (math.nan, ValueError),
    (-math.inf, ValueError),
    ("-inf", ValueError),
    ("fro", ValueError),
    ("nuc", ValueError),
    ("", ValueError),
    ("2", ValueError),
    (True, TypeError),
    (None, TypeError),
    ([2], TypeError),
]


@pytest.mark.parametrize(("norm_type", "error"), BAD_NORM_TYPES, ids=repr)
def test_bad_norm_type_raises_naming_it_and_touches_nothing(
    norm_type: object, error: type[Exception]
) -> None:
    params = with_grads(torch.tensor([3.0, -4.0]), None)
    before = snapshot(params)
    calls: list[Callable[[], object]] = [
        lambda: clipopt.clip_grad_norm_(params, 1.0, norm_type),
        lambda: clipopt.clip_grad_norm(params, 1.0, norm_type),
        lambda: clipopt.get_total_norm([p.grad for p in params], norm_type),
    ]
    for call in calls:
        with pytest.raises(error) as raised:
            call()
        assert "norm_type" in str(raised.value) and repr(norm_type) in str(raised.value)
    assert_untouched(params, before)


@pytest.mark.parametrize("foreach", ["yes", 1, 0.0])
def test_a_foreach_that_is_not_a_bool_raises_naming_it_and_touches_nothing(
    foreach: object,
) -> None:
    params = with_grads(torch.tensor([3.0, -4.0]), None)
    before = snapshot(params)
    calls: list[Callable[[], object]] = [
        lambda: clipopt.clip_grad_norm_(params, 1.0, foreach=foreach),  # type: ignore[arg-type]
        lambda: clipopt.clip_grad_norm(params, 1.0, foreach=foreach),  # type: ignore[arg-type]
        lambda: clipopt.get_total_norm([params[0].grad], foreach=foreach),  # type: ignore[arg-type]
        lambda: clipopt.clip_grads_with_norm_(params, 1.0, torch.tensor(5.0), foreach),  # type: ignore[arg-type]
        lambda: clipopt.clip_grad_value_(params, 1.0, foreach),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(TypeError) as raised:
            call()
        assert "foreach" in str(raised.value) and repr(foreach) in str(raised.value)
    assert_untouched(params, before)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("norm_type", [1, 2.0, math.inf])
@pytest.mark.parametrize("foreach", [None, True, False])
def test_error_if_nonfinite_raises_before_touching_any_grad(
    bad: float, norm_type: float, foreach: bool | None
) -> None:
    params = with_grads(torch.tensor([30.0, 40.0]), torch.tensor([bad, 1.0]), torch.ones(9000))
    before = snapshot(params)
    with pytest.raises(clipopt.NonFiniteNormError, match="non-finite"):
        clipopt.clip_grad_norm_(params, 1.0, norm_type, error_if_nonfinite=True, foreach=foreach)
    assert_untouched(params, before)
    with pytest.raises(RuntimeError):  # torch's exception type, so handlers keep working
        clipopt.clip_grad_norm(params, 1.0, norm_type, error_if_nonfinite=True)
    with pytest.raises(FloatingPointError):
        clipopt.get_total_norm([p.grad for p in params], norm_type, error_if_nonfinite=True)
    assert_untouched(params, before)
    with pytest.raises(RuntimeError):
        torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type, error_if_nonfinite=True)


def test_without_error_if_nonfinite_a_nan_norm_propagates_like_torch() -> None:
    grads = [torch.tensor([30.0, 40.0]), torch.tensor([math.nan])]
    ours, theirs = with_grads(*grads), with_grads(*[g.clone() for g in grads])
    assert clipopt.clip_grad_norm_(ours, 1.0).isnan()
    assert torch.nn.utils.clip_grad_norm_(theirs, 1.0).isnan()
    for a, b in zip(ours, theirs, strict=True):
        assert same_bits(a.grad, b.grad)


BAD_CLIP_VALUES: list[tuple[object, type[Exception]]] = [
    (-1.0, ValueError),
    (0, ValueError),
    (math.nan, ValueError),
    (True, TypeError),
    ("1", TypeError),
    (None, TypeError),
    ([1.0], TypeError),
    (torch.tensor(1.0), TypeError),
]


@pytest.mark.parametrize(("clip_value", "error"), BAD_CLIP_VALUES, ids=repr)
def test_bad_clip_value_raises_naming_it_and_touches_nothing(
    clip_value: object, error: type[Exception]
) -> None:
    params = with_grads(torch.tensor([3.0, -4.0]), None, uncoalesced())
    before = snapshot(params)
    with pytest.raises(error) as raised:
        clipopt.clip_grad_value_(params, clip_value)
    assert "clip_value" in str(raised.value) and repr(clip_value) in str(raised.value)
    assert_untouched(params, before)


def test_torch_clamps_every_grad_to_a_negative_clip_value() -> None:
    theirs = with_grads(torch.tensor([3.0, -4.0, 0.5]))
    torch.nn.utils.clip_grad_value_(theirs, -1.0)
    assert torch.equal(theirs[0].grad, torch.full((3,), -1.0))


def test_clip_grad_value_rejects_complex_grads_and_touches_nothing() -> None:
    params = with_grads(torch.tensor([3.0, -4.0]), torch.tensor([1 + 5j]))
    before = snapshot(params)
    with pytest.raises(TypeError, match="complex"):
        clipopt.clip_grad_value_(params, 1.0)
    assert_untouched(params, before)


def test_infinite_clip_value_changes_nothing() -> None:
    params = with_grads(torch.tensor([3.0, -math.inf, math.nan]), torch.tensor([1e30]))
    before = snapshot(params)
    clipopt.clip_grad_value_(params, math.inf)
    assert_untouched(params, before)


# --- Out of place -----------------------------------------------------------------------


def test_clip_grad_norm_returns_aligned_copies_and_leaves_grads_alone() -> None:
    params = with_grads(torch.tensor([30.0, 0.0]), None, torch.tensor([[40.0]]))
    before = snapshot(params)
    clipped, norm = clipopt.clip_grad_norm(iter(params), max_norm=1.0)
    assert_untouched(params, before)
    assert torch.equal(norm, torch.tensor(50.0))
    assert clipped[1] is None
    torch.testing.assert_close(clipped[0], torch.tensor([0.6, 0.0]))
    torch.testing.assert_close(clipped[2], torch.tensor([[0.8]]))
    clipped[0].add_(1.0)  # a copy, not a view of the grad
    assert_untouched(params, before)
    in_place_norm = clipopt.clip_grad_norm_(params, max_norm=1.0)
    assert torch.equal(in_place_norm, norm)
    assert torch.equal(params[2].grad, clipped[2])


def test_torch_clip_grad_norm_is_a_deprecated_in_place_alias() -> None:
    theirs = with_grads(torch.tensor([30.0, 40.0]))
    with pytest.warns(FutureWarning, match="deprecated"):
        torch.nn.utils.clip_grad_norm(theirs, max_norm=1.0)
    assert torch.allclose(theirs[0].grad, torch.tensor([0.6, 0.8]))


# --- clip_grads_with_norm_ and clip_grad_value_ against torch ---------------------------


@pytest.mark.parametrize("max_norm", [0.1, 1.0, 1e6, torch.tensor(0.5)], ids=repr)
@pytest.mark.parametrize("foreach", [None, True, False])
def test_clip_grads_with_norm_is_bit_identical_to_torch(
    max_norm: float | Tensor, foreach: bool | None
) -> None:
    grads = [g for g in mixed_grads(seed=2)]
    ours, theirs = (
        with_grads(*grads),
        with_grads(*[None if g is None else g.clone() for g in grads]),
    )
    total = clipopt.get_total_norm([p.grad for p in ours])
    clipopt.clip_grads_with_norm_(ours, max_norm, total, foreach=foreach)
    torch.nn.utils.clip_grads_with_norm_(theirs, max_norm, total, foreach=foreach)
    for a, b in zip(ours, theirs, strict=True):
        assert same_bits(a.grad, b.grad)


@pytest.mark.parametrize("clip_value", [1e-3, 0.5, 2, 1e4])
@pytest.mark.parametrize("foreach", [None, True, False])
def test_clip_grad_value_is_bit_identical_to_torch(clip_value: float, foreach: bool | None) -> None:
    grads = mixed_grads(seed=3)
    ours, theirs = (
        with_grads(*grads),
        with_grads(*[None if g is None else g.clone() for g in grads]),
    )
    clipopt.clip_grad_value_((p for p in ours), clip_value, foreach=foreach)
    torch.nn.utils.clip_grad_value_(theirs, clip_value, foreach=foreach)
    for a, b in zip(ours, theirs, strict=True):
        assert same_bits(a.grad, b.grad)


@pytest.mark.parametrize(
    "grads",
    [
        [torch.tensor([math.inf, 1.0])],
        [torch.tensor([math.nan, -0.0])],
        [torch.tensor([3.0, -4.0]), torch.tensor([1e30, 1e-30], dtype=torch.float64)],
    ],
    ids=["inf", "nan", "finite"],
)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_a_tensor_max_norm_of_inf_scales_nothing_like_the_float_inf(
    grads: list[Tensor], norm_type: float
) -> None:
    by_float, by_tensor = with_grads(*clones(grads)), with_grads(*clones(grads))
    float_norm = clipopt.clip_grad_norm_(by_float, math.inf, norm_type)
    tensor_norm = clipopt.clip_grad_norm_(by_tensor, torch.tensor(math.inf), norm_type)
    assert same_bits(tensor_norm, float_norm)
    for got, float_got, original in zip(
        snapshot(by_tensor), snapshot(by_float), grads, strict=True
    ):
        assert same_bits(got, original) and same_bits(float_got, original)
    norm = clipopt.get_total_norm(grads, norm_type)
    after_norm = with_grads(*clones(grads))
    clipopt.clip_grads_with_norm_(after_norm, torch.tensor(math.inf, dtype=torch.float64), norm)
    assert all(same_bits(a, b) for a, b in zip(snapshot(after_norm), grads, strict=True))


def test_a_finite_tensor_max_norm_still_propagates_a_nan_norm() -> None:
    # Only an inf threshold is exempt: torch scales the grads of an inf norm to NaN.
    ours = with_grads(torch.tensor([math.inf, 4.0]))
    theirs = with_grads(torch.tensor([math.inf, 4.0]))
    clipopt.clip_grad_norm_(ours, torch.tensor(1.0))
    torch.nn.utils.clip_grad_norm_(theirs, torch.tensor(1.0))
    assert same_bits(ours[0].grad, theirs[0].grad)
