"""Each path of :mod:`clipopt._kernels._norms` against a float64 reference.

The CPU norm picks a path per tensor (for tensors of ``ROWS_FROM`` elements or more,
read in memory order through a permuted view where they are channels-last or
transposed, copied where they have gaps: views of ``SPLIT``, or a half type's rows of
``ROW`` widened ``CHUNK`` elements at a time; ``aminmax`` for the inf-norm;
``_foreach_norm`` for smaller ones), so the cases
below sit on each side of every threshold. The reference is built from ``abs``, ``pow``,
``sum`` and ``max`` in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from clipopt._kernels import _norms, _scale
from clipopt._kernels._norms import CHUNK as _CHUNK
from clipopt._kernels._norms import ROW as _ROW
from clipopt._kernels._norms import ROWS_FROM as _PACK_BELOW
from clipopt._kernels._norms import SPLIT as _SPLIT

NORM_TYPES = [1.0, 2.0, 3.5, math.inf]
HALF = [torch.float16, torch.bfloat16]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def reference_norm(tensors: Sequence[Tensor], p: float) -> Tensor:
    """The p-norm of all elements in float64 (complex128 magnitudes), on the CPU."""
    parts = []
    for t in tensors:
        dense = t.detach().cpu()
        dense = dense.to_dense() if dense.is_sparse else dense
        wide = torch.complex128 if dense.is_complex() else torch.float64
        parts.append(dense.to(wide).abs().reshape(-1))
    values = torch.cat(parts)
    if values.numel() == 0:
        return torch.tensor(0.0, dtype=torch.float64)
    if p == math.inf:
        return values.max()
    return values.pow(p).sum().pow(1.0 / p)


def assert_norm_close(got: Tensor, tensors: Sequence[Tensor], p: float, rtol: float = 1e-6) -> None:
    expected = reference_norm(tensors, p)
    torch.testing.assert_close(got.double().cpu(), expected, rtol=rtol, atol=0.0, equal_nan=True)


def randn(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=generator) * 3).to(dtype)


# ---------------------------------------------------------------- thresholds and tails

BOUNDARY_SIZES = [
    1,
    _ROW - 1,
    _ROW,
    _ROW + 1,
    _PACK_BELOW - 1,
    _PACK_BELOW,
    _PACK_BELOW + 1,
    _PACK_BELOW + _ROW - 1,
    3 * _ROW * 7 + 5,
    _SPLIT - 1,
    _SPLIT + 1,
]


@pytest.mark.parametrize("numel", BOUNDARY_SIZES)
@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *HALF])
def test_one_tensor_each_side_of_every_threshold(numel: int, p: float, dtype: torch.dtype) -> None:
    t = randn(numel, dtype, seed=numel)
    got = _norms.total_norm([t], p)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_norm_close(got, [t], p)


@pytest.mark.parametrize("p", NORM_TYPES)
def test_half_precision_scratch_across_its_chunk_boundary(p: float) -> None:
    """A large bf16 tensor is widened ``_CHUNK`` elements at a time; the last one is short."""
    t = randn(2 * _CHUNK + 3 * _ROW + 17, torch.bfloat16, seed=3)
    assert_norm_close(_norms.total_norm([t], p), [t], p)


@pytest.mark.parametrize("p", NORM_TYPES)
def test_many_small_tensors_of_every_shape(p: float) -> None:
    """1600 small tensors of 0 to 3 dims, by one ``_foreach_norm``."""
    generator = torch.Generator().manual_seed(0)
    shapes: list[tuple[int, ...]] = []
    for i in range(1600):
        n = int(torch.randint(1, 1200, (1,), generator=generator))
        shapes.append([(n,), (n, 3), (), (2, n % 7 + 1, 2)][i % 4])
    tensors = [torch.randn(s, generator=generator) for s in shapes]
    assert_norm_close(_norms.total_norm(tensors, p), tensors, p)


@pytest.mark.parametrize("p", NORM_TYPES)
def test_tails_of_large_tensors_join_the_small_ones(p: float) -> None:
    tensors = [randn(_PACK_BELOW + k, seed=k) for k in (1, 100, _ROW - 1)] + [randn(5)]
    assert_norm_close(_norms.total_norm(tensors, p), tensors, p)


@pytest.mark.parametrize("foreach", [True, False, None])
@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_per_tensor_norms_match_each_tensors_reference(
    dtype: torch.dtype, p: float, foreach: bool | None
) -> None:
    """Empty, small, row-reduced, widened and permuted tensors, and another dtype beside."""
    generator = torch.Generator().manual_seed(4)
    sizes = [0, 1, 3, 500, _PACK_BELOW - 1, _PACK_BELOW + 1, _CHUNK + 3]
    tensors = [(torch.randn(n, generator=generator) * 10).to(dtype) for n in sizes]
    tensors.append(torch.randn(400, 300, generator=generator).to(dtype).t())
    tensors.append(torch.randn(7, dtype=torch.float64))
    got = _norms.per_tensor_norms(tensors, p, foreach)
    assert got.dtype == torch.float64
    expected = torch.stack([reference_norm([t], p) for t in tensors])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0.0)


# ---------------------------------------------------------------- memory layouts


def _layouts(dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    base = randn(4 * 64 * 9 * 11, dtype, seed=7).view(4, 64, 9, 11)
    wide = randn(3 * 3 * _PACK_BELOW, dtype, seed=8).view(3, 3 * _PACK_BELOW)
    return {
        "transposed": randn(300 * 200, dtype, seed=1).view(300, 200).t(),
        "channels_last": base.contiguous(memory_format=torch.channels_last),
        "strided_rows": wide[:, ::2],
        "strided_1d": randn(5 * _PACK_BELOW + 3, dtype, seed=2)[::3],
        "sliced_columns": randn(400 * 130, dtype, seed=4).view(400, 130)[:, 3:120],
        "expanded": randn(_ROW + 9, dtype, seed=5).expand(20, _ROW + 9),
        "long_strided_rows": randn(2 * 20 * _ROW + 10, dtype, seed=6).view(2, -1)[:, 1:],
    }


@pytest.mark.parametrize("name", list(_layouts()))
@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_large_tensors(name: str, p: float, dtype: torch.dtype) -> None:
    t = _layouts(dtype)[name]
    assert not t.is_contiguous() and t.numel() >= _PACK_BELOW
    assert_norm_close(_norms.total_norm([t], p), [t], p)


@pytest.mark.parametrize("p", NORM_TYPES)
def test_non_contiguous_small_tensors(p: float) -> None:
    """Below ``ROWS_FROM`` a channels-last or transposed tensor goes to ``_foreach_norm``."""
    conv = randn(8 * 3 * 5 * 5, seed=9).view(8, 3, 5, 5)
    for t in (
        conv.contiguous(memory_format=torch.channels_last),
        randn(600, seed=3).view(30, 20).t(),
    ):
        assert not t.is_contiguous() and t.numel() < _PACK_BELOW
        assert_norm_close(_norms.total_norm([t], p), [t], p)


def test_the_norm_never_writes_its_inputs() -> None:
    tensors = [t.clone() for t in _layouts().values()] + [randn(100), randn(70_000, torch.float16)]
    before = [t.clone() for t in tensors]
    for p in NORM_TYPES:
        _norms.total_norm(tensors, p)
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t, b)


# ---------------------------------------------------------------- values


@pytest.mark.parametrize("numel", [10, _PACK_BELOW + 5])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_inf_norm_propagates_nan_wherever_it_sits(numel: int, dtype: torch.dtype) -> None:
    for index in (0, numel // 2, numel - 1):
        t = randn(numel, dtype)
        t[index] = math.nan
        for p in NORM_TYPES:
            assert torch.isnan(_norms.total_norm([randn(3), t], p))


@pytest.mark.parametrize("numel", [10, _PACK_BELOW + 5])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_minus_inf_gives_an_infinite_norm(numel: int, dtype: torch.dtype) -> None:
    t = randn(numel, dtype)
    t[numel // 3] = -math.inf
    for p in NORM_TYPES:
        assert _norms.total_norm([t], p) == math.inf


@pytest.mark.parametrize("numel", [10, _PACK_BELOW + 5])
def test_inf_norm_takes_the_most_negative_value(numel: int) -> None:
    t = randn(numel).clamp(-1, 1)
    t[numel // 2] = -7.5
    assert _norms.total_norm([t], math.inf) == 7.5


@pytest.mark.parametrize("numel", [1000, 3 * _PACK_BELOW])
def test_half_types_accumulate_in_float32(numel: int) -> None:
    """fp16 elements of 3000: the sum of squares overflows fp16 but not float32."""
    t = torch.full((numel,), 3000.0, dtype=torch.float16)
    got = _norms.total_norm([t], 2.0)
    assert got.dtype == torch.float32
    expected = torch.tensor(3000.0 * math.sqrt(numel), dtype=torch.float64)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0.0)


def test_float32_norm_is_exact_on_short_mantissa_data() -> None:
    """bf16-valued float32 data (uniform in [1, 2)) is where long float32 sums build a bias."""
    generator = torch.Generator().manual_seed(0)
    t = (torch.rand(1 << 22, generator=generator) + 1).bfloat16().float()
    assert_norm_close(_norms.total_norm([t], 2.0), [t], 2.0, rtol=2e-7)


@pytest.mark.parametrize("p", NORM_TYPES)
def test_complex_small_and_large(p: float) -> None:
    generator = torch.Generator().manual_seed(1)
    tensors = [
        torch.randn(50, dtype=torch.complex64, generator=generator),
        torch.randn(_PACK_BELOW + 33, dtype=torch.complex64, generator=generator),
        torch.randn(40, 1000, dtype=torch.complex64, generator=generator)[:, ::2],
    ]
    assert_norm_close(_norms.total_norm(tensors, p), tensors, p)


@pytest.mark.parametrize("p", NORM_TYPES)
def test_sparse_dense_empty_and_mixed_dtypes_together(p: float) -> None:
    indices = torch.tensor([[0, 2, 2, 5]])
    sparse = torch.sparse_coo_tensor(
        indices, torch.tensor([1.0, -2.0, 4.0, 3.0]), (8,), check_invariants=True
    )
    no_values = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0), (8,))
    tensors = [
        torch.zeros(0),
        sparse,
        randn(_PACK_BELOW + 1, torch.float16),
        no_values,
        randn(77, torch.float64),
        torch.zeros(3, 0),
        randn(9),
    ]
    got = _norms.total_norm(tensors, p)
    assert got.dtype == torch.float64
    assert_norm_close(got, tensors, p)


def test_nothing_to_measure_gives_zero() -> None:
    assert torch.equal(_norms.total_norm([], 2.0), torch.tensor(0.0))
    assert torch.equal(
        _norms.total_norm([torch.zeros(0), torch.zeros(2, 0)], 2.0), torch.tensor(0.0)
    )


@pytest.mark.parametrize("foreach", [True, False, None])
@pytest.mark.parametrize("p", NORM_TYPES)
def test_every_foreach_setting_gives_the_reference(foreach: bool | None, p: float) -> None:
    tensors = [
        randn(n, dtype, seed=n)
        for n, dtype in [
            (20, torch.float32),
            (40_000, torch.bfloat16),
            (_PACK_BELOW + 1, torch.float32),
        ]
    ]
    assert_norm_close(_norms.total_norm(tensors, p, foreach), tensors, p)


shapes = st.lists(
    st.one_of(
        st.integers(0, 3 * _ROW).map(lambda n: (n,)),
        st.sampled_from(
            [(_PACK_BELOW - 1,), (_PACK_BELOW,), (_PACK_BELOW + _ROW + 1,), (3, 7), ()]
        ),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=20, deadline=None)
@given(
    shapes=shapes,
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    p=st.sampled_from(NORM_TYPES),
    seed=st.integers(0, 2**16),
)
def test_random_layouts_match_the_reference(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, p: float, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    tensors = [(torch.randn(s, generator=generator) * 10).to(dtype) for s in shapes]
    if all(t.numel() == 0 for t in tensors):
        assert torch.equal(_norms.total_norm(tensors, p), torch.tensor(0.0))
        return
    assert_norm_close(_norms.total_norm(tensors, p), tensors, p)


@settings(max_examples=30, deadline=None)
@given(
    shapes=shapes,
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    p=st.sampled_from([1.0, 2.0, math.inf]),
    magnitude=st.sampled_from([1e-30, 1.0, 1e30]),
    seed=st.integers(0, 2**16),
)
def test_an_empty_group_beside_changes_no_bit(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, p: float, magnitude: float, seed: int
) -> None:
    """An empty tensor of another dtype beside the grads (a second group with nothing to
    measure, the same result dtype) leaves the norm's bits alone."""
    generator = torch.Generator().manual_seed(seed)
    tensors = [(torch.randn(s, generator=generator) * magnitude).to(dtype) for s in shapes]
    if all(t.numel() == 0 for t in tensors):
        return
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    alone = _norms.total_norm(tensors, p)
    beside = _norms.total_norm([*tensors, torch.empty(0, dtype=other)], p)
    assert alone.dtype == beside.dtype and alone.shape == beside.shape == ()
    assert torch.equal(alone.view(-1), beside.view(-1)) or (alone.isnan() & beside.isnan())


# ---------------------------------------------------------------- memory


def _largest_allocation(fn: Callable[[], object]) -> int:
    """Bytes of the largest single allocation any op made while ``fn`` ran."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        fn()
    return max(e.cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [2.0, math.inf])
def test_no_allocation_grows_with_the_model(dtype: torch.dtype, p: float) -> None:
    """One large grad and many small ones: scratch stays within one packed chunk."""
    tensors = [randn(8 * _CHUNK, dtype)] + [randn(900, dtype, seed=i) for i in range(1500)]
    bound = 2 * _CHUNK * 4
    assert _largest_allocation(lambda: _norms.total_norm(tensors, p)) <= bound
    whole = sum(t.numel() for t in tensors) * 4
    assert _largest_allocation(lambda: torch.cat(tensors).float()) >= whole  # the probe works


# ---------------------------------------------------------------- scale


@pytest.mark.parametrize("foreach", [True, False, None])
def test_scale_multiplies_every_kind_of_tensor(foreach: bool | None) -> None:
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 3]]), torch.tensor([2.0, -4.0]), (5,))
    tensors = [
        randn(10),
        randn(_PACK_BELOW + 3, torch.bfloat16),
        torch.zeros(0),
        sparse,
        randn(4, torch.float64),
    ]
    expected = [(t.to_dense() if t.is_sparse else t).double() * 0.25 for t in tensors]
    _scale.scale_(tensors, torch.tensor(0.25), foreach)
    for t, e in zip(tensors, expected, strict=True):
        torch.testing.assert_close(
            (t.to_dense() if t.is_sparse else t).double(), e, rtol=4e-3, atol=0
        )


@pytest.mark.parametrize("dtype", HALF)
def test_sparse_half_grads_scale_as_dense_ones_by_a_tiny_coefficient(dtype: torch.dtype) -> None:
    """A coefficient below float16's normal range (a 1-norm of a large grad, clipped to
    1) scales a sparse grad's values bit for bit as a dense grad's: torch's sparse
    ``mul_`` rounds it to the grad's dtype first (1.4% off in float16)."""
    dense = randn(1000, dtype, seed=2)
    sparse = dense.to_sparse()
    coef = torch.tensor(1.234e-6)
    _scale.scale_([dense, sparse], coef)
    assert torch.equal(sparse.to_dense(), dense)


@pytest.mark.parametrize("p", [2.0, math.inf])
def test_grouped_norm_and_scale_touch_each_tensor_once(p: float) -> None:
    """The groups handed from the norm to the scale hold every tensor with values once."""
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 3]]), torch.tensor([2.0, -4.0]), (5,))
    tensors = [
        randn(10),
        randn(_PACK_BELOW + 3, torch.bfloat16),
        sparse,
        randn(4, torch.float64),
        randn(2 * _ROW, seed=1),
    ]
    expected = [(t.to_dense() if t.is_sparse else t).double() * 0.25 for t in tensors]
    norm, groups = _norms.grouped_total_norm(tensors, p)
    assert_norm_close(norm, tensors, p)
    assert torch.equal(norm, _norms.total_norm(tensors, p))
    _scale.scale_groups_(groups, torch.tensor(0.25))
    for t, e in zip(tensors, expected, strict=True):
        torch.testing.assert_close(
            (t.to_dense() if t.is_sparse else t).double(), e, rtol=4e-3, atol=0
        )


def _coefficient_like(t: Tensor, kind: str, gen: torch.Generator) -> Tensor:
    """A coefficient in [0.01, 1] broadcastable to ``t``: 0-dim, one per leading row,
    one per element, or one per column (not along leading dims: left to the slow route)."""
    shape = {
        "scalar": (),
        "rows": t.shape[:1] + (1,) * (t.dim() - 1),
        "full": t.shape,
        "column": (1,) * (t.dim() - 1) + t.shape[-1:],
    }[kind]
    return torch.rand(shape, generator=gen) * 0.99 + 0.01


@settings(max_examples=80, deadline=None)
@given(
    layout=st.lists(
        st.tuples(
            st.lists(st.integers(0, 4), max_size=3),
            st.sampled_from(["scalar", "rows", "full", "column"]),
            st.booleans(),  # transposed: not contiguous
        ),
        min_size=1,
        max_size=6,
    ),
    dtype=st.sampled_from([torch.float32, torch.float64, *HALF]),
    seed=st.integers(0, 2**16),
)
def test_scale_each_batched_matches_float64_and_the_per_tensor_path(
    layout: list[tuple[list[int], str, bool]], dtype: torch.dtype, seed: int
) -> None:
    """The batched path (forced on the CPU through ``_scale.batched``) scales each grad
    by its own coefficient as the float64 product, rounded once or twice (the coefficient
    in the grad's dtype), and as the per-tensor path does within that."""
    gen = torch.Generator().manual_seed(seed)
    grads, coefficients = [], []
    for shape, kind, transposed in layout:
        grad = (torch.randn(shape, generator=gen) * 3).to(dtype)
        grads.append(grad.t() if transposed and grad.dim() == 2 else grad)
        coefficients.append(_coefficient_like(grads[-1], kind, gen))
    expected = [g.double() * c.double() for g, c in zip(grads, coefficients, strict=True)]
    tol = {"rtol": 2 * torch.finfo(dtype).eps, "atol": 0.0}
    each = [g.clone() for g in grads]
    _scale.scale_each_(each, coefficients, None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_scale, "batched", lambda device: True)
        _scale.scale_each_(grads, coefficients, None)
    for got, one, want in zip(grads, each, expected, strict=True):
        torch.testing.assert_close(got.double(), want, **tol)
        torch.testing.assert_close(got.double(), one.double(), **tol)


def test_clip_coefficient_is_one_below_the_threshold_and_exact_above() -> None:
    norms = torch.tensor([0.0, 0.5, 1.0 - 2e-6, 4.0])
    coefficients = _scale.clip_coefficient(1.0, norms)
    assert torch.equal(coefficients[:3], torch.ones(3))
    torch.testing.assert_close(coefficients[3], torch.tensor(1.0 / (4.0 + _scale.EPS)))


# ---------------------------------------------------------------- CUDA


@needs_cuda
@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_cuda_foreach_norm_matches_the_reference(p: float, dtype: torch.dtype) -> None:
    tensors = [randn(n, dtype, seed=n).cuda() for n in (3, 5000, 70_000)]
    got = _norms.total_norm(tensors, p)
    assert got.device.type == "cuda" and got.dtype == torch.float32
    assert_norm_close(got, tensors, p, rtol=1e-5)


@needs_cuda
def test_cuda_half_norm_does_not_overflow_and_scale_stays_on_device() -> None:
    tensors = [torch.full((5000,), 3000.0, dtype=torch.float16, device="cuda")]
    norm = _norms.total_norm(tensors, 2.0)
    torch.testing.assert_close(norm.double().cpu(), torch.tensor(3000.0 * math.sqrt(5000)).double())
    coef = _scale.clip_coefficient(1.0, norm)
    _scale.scale_(tensors, coef)
    assert coef.device.type == "cuda"
    torch.testing.assert_close(
        _norms.total_norm(tensors, 2.0).cpu(), torch.tensor(1.0), rtol=2e-3, atol=0
    )


@needs_cuda
def test_cpu_and_cuda_tensors_together() -> None:
    tensors = [randn(100).cuda(), randn(_PACK_BELOW + 1)]
    got = _norms.total_norm(tensors, 2.0)
    assert got.device.type == "cuda"
    assert_norm_close(got, tensors, 2.0)


def test_groups_come_in_order_of_first_appearance_and_keep_tensor_order() -> None:
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float64, torch.float32]
    tensors = [torch.ones(i + 1, dtype=dtype) for i, dtype in enumerate(dtypes)]
    for _ in range(2):
        groups = _norms.group(tensors)
        assert not groups.sparse
        assert [dtype for _, dtype in groups.dense] == [
            torch.bfloat16,
            torch.float32,
            torch.float64,
        ]
        for (_, dtype), group in groups.dense.items():
            expected = [t for t in tensors if t.dtype == dtype]
            assert [id(t) for t in group] == [id(t) for t in expected]
