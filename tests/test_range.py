"""Norms across the float32 range, on every CPU path and on CUDA.

The 1-, inf- and other norms (taken in float64) give the true norm wherever it fits in
float32, and a clip then scales the grads to ``max_norm`` instead of zeroing them. The
2-norm squares in float32, as torch's does: it is exact for elements within 2**+-50, and
past that limit (a float32 element past 1.8e19 squares to inf, one below 1e-19 to 0) it is
inf or 0, as torch's own norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import clipopt
from clipopt._kernels._norms import CHUNK, ROWS_FROM

Float64Norm = Callable[[Sequence[Tensor | None], float | str], float]

LAYOUTS = ["contiguous", "transposed", "strided", "sparse"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
NORMS = [1.0, 2.0, 3.0, math.inf]
SIZES = [1, 7, 1500, ROWS_FROM + 33, CHUNK + 5000]
EXPONENTS = {torch.float16: (-12, 10)}
"""Powers of two the grads are scaled by; the rest span -100 to 100 (-50 to 50 for the
2-norm, see above). Every norm drawn fits in float32 (fp16 elements stay below 65504)."""
SQUARES_FIT = 50


def make_grad(n: int, layout: str, dtype: torch.dtype, exponent: int, seed: int) -> Tensor:
    """``n`` Gaussian elements times ``2**exponent`` in ``layout``, on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(2 * n, generator=generator, dtype=torch.float64) * 2.0**exponent
    if layout == "strided":
        return values.to(dtype).view(2, n)[:, ::2] if n > 1 else values.to(dtype)[::2]
    grad = values[:n].to(dtype)
    if layout == "transposed" and n % 3 == 0:
        return grad.view(3, n // 3).t()
    if layout == "sparse":
        grad[1::3] = 0
        return grad.to_sparse()
    return grad


def on(device: str, grads: list[Tensor]) -> list[Tensor]:
    return [g.to(device) for g in grads]


def check_norm_and_clip(
    grads: list[Tensor], p: float, float64_norm: Float64Norm, foreach: bool | None = None
) -> None:
    """The norm against float64, then a clip to 1 lands on 1 instead of zeroing."""
    dtypes = {g.dtype for g in grads}
    reference = float64_norm(grads, p)
    assert 0 < reference < torch.finfo(torch.float32).max
    norm = clipopt.get_total_norm(grads, p, foreach=foreach)
    assert norm.dtype == (torch.float64 if torch.float64 in dtypes else torch.float32)
    assert math.isclose(float(norm), reference, rel_tol=2e-6, abs_tol=0), (float(norm), reference)

    params = [
        torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype, device=g.device)) for g in grads
    ]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    clipopt.clip_grad_norm_(params, 1.0, p, foreach=foreach)
    clipped = float64_norm([q.grad for q in params], p)
    if reference <= 1.0:
        assert clipped == reference
    elif dtypes <= {torch.float32, torch.float64}:
        assert math.isclose(clipped, 1.0, rel_tol=1e-5)
    else:  # half types round each scaled element: up to 2**-8 relative for bfloat16
        assert math.isclose(clipped, 1.0, rel_tol=2**-7)


def drawn_grads(
    sizes: list[int], layout: str, dtype: torch.dtype, data: st.DataObject, seed: int, p: float
) -> list[Tensor]:
    """Grads of ``sizes`` whose magnitudes sit at one drawn power of two of ``dtype``'s range."""
    low, high = EXPONENTS.get(dtype, (-100, 100))
    if p == 2.0 and dtype != torch.float64:
        low, high = max(low, -SQUARES_FIT), min(high, SQUARES_FIT)
    exponent = data.draw(st.integers(low, high), label="exponent")
    return [make_grad(n, layout, dtype, exponent, seed + i) for i, n in enumerate(sizes)]


@given(
    sizes=st.lists(st.sampled_from(SIZES), min_size=1, max_size=3),
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(DTYPES),
    p=st.sampled_from(NORMS),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_every_cpu_path_gives_the_true_norm_across_the_float32_range(
    sizes: list[int],
    layout: str,
    dtype: torch.dtype,
    p: float,
    data: st.DataObject,
    seed: int,
    float64_norm: Float64Norm,
) -> None:
    """Dense, strided and sparse grads against float64."""
    grads = drawn_grads(sizes, layout, dtype, data, seed, p)
    check_norm_and_clip(grads, p, float64_norm)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("p", NORMS)
@pytest.mark.parametrize("value", [1e20, 3e36, 1e-30, 1e-38])
def test_values_at_the_ends_of_the_range(
    value: float, p: float, layout: str, float64_norm: Float64Norm
) -> None:
    """Elements of 1e20 and 3e36, and tiny ones (1e-38 is a float32 subnormal): the true
    norm, except the 2-norm past its documented limit, which is torch's inf or 0 (and a
    clip by it leaves the grads alone or zeroes them, as torch's). The 1-norm of 4000
    elements of 3e36 does not fit in float32, and is not checked."""
    full = torch.full((8000,), value)
    grad = {
        "contiguous": full[:4000],
        "transposed": full[:4000].view(40, 100).t(),
        "strided": full[::2],
        "sparse": full[:4000].to_sparse(),
    }[layout]
    reference = float64_norm([grad], p)
    if reference > torch.finfo(torch.float32).max:
        return
    norm = clipopt.get_total_norm([grad], p)
    if p == 2.0:
        dense = grad.to_dense() if grad.is_sparse else grad
        assert torch.equal(norm, torch.linalg.vector_norm(dense, p))
        assert float(norm) in (0.0, math.inf)
        return
    assert math.isclose(float(norm), reference, rel_tol=2e-5), (float(norm), reference)
    if reference > 1:  # below, the EPS added to the norm decides the coefficient
        param = torch.nn.Parameter(torch.zeros(grad.shape))
        param.grad = grad.clone()
        clipopt.clip_grad_norm_([param], reference / 2, p)
        assert math.isclose(float64_norm([param.grad], p), reference / 2, rel_tol=2e-5)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@given(
    sizes=st.lists(st.sampled_from(SIZES), min_size=1, max_size=3),
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(DTYPES),
    p=st.sampled_from(NORMS),
    foreach=st.sampled_from([None, True, False]),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_cuda_paths_give_the_true_norm_across_the_float32_range(
    sizes: list[int],
    layout: str,
    dtype: torch.dtype,
    p: float,
    foreach: bool | None,
    data: st.DataObject,
    seed: int,
    float64_norm: Float64Norm,
) -> None:
    """``_foreach_norm`` (foreach None or True) and per-tensor ``vector_norm`` (False)."""
    grads = drawn_grads(sizes, layout, dtype, data, seed, p)
    check_norm_and_clip(on("cuda", grads), p, float64_norm, foreach)
