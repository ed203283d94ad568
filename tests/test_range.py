"""Norms across the whole float32 range, on every CPU path and on CUDA.

A float32 element past 1.8e19 squares to inf in float32, and one below 1e-19 to 0, though
the norm itself is a float32 like any other. Every path (the C kernel on dense grads, the
in-place row split of strided ones, sparse values, and the torch-ops fallback used
without the C kernel) must give the true norm wherever it fits in float32, and a clip
must then scale the grads to ``max_norm`` instead of zeroing them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import clipopt
from clipopt._kernels import _cpu
from clipopt._kernels._torch_norms import CHUNK as _CHUNK
from clipopt._kernels._torch_norms import PACK_BELOW as _PACK_BELOW

Float64Norm = Callable[[Sequence[Tensor | None], float | str], float]

LAYOUTS = ["contiguous", "transposed", "strided", "sparse"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
NORMS = [1.0, 2.0, 3.0, math.inf]
SIZES = [1, 7, 1500, _PACK_BELOW + 33, _CHUNK + 5000]
EXPONENTS = {torch.float16: (-12, 10)}
"""Powers of two the grads are scaled by; the rest span -100 to 100. Every norm drawn
fits in float32 (fp16 elements stay below its 65504)."""


@contextlib.contextmanager
def kernel(enabled: bool) -> Iterator[None]:
    """Route CPU grads through the C kernel (if it is in use) or force the fallback."""
    with pytest.MonkeyPatch.context() as patch:
        if not enabled:
            patch.setattr(_cpu, "_ENABLED", False)
        yield


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
    sizes: list[int], layout: str, dtype: torch.dtype, data: st.DataObject, seed: int
) -> list[Tensor]:
    """Grads of ``sizes`` whose magnitudes sit at one drawn power of two of ``dtype``'s range."""
    low, high = EXPONENTS.get(dtype, (-100, 100))
    exponent = data.draw(st.integers(low, high), label="exponent")
    return [make_grad(n, layout, dtype, exponent, seed + i) for i, n in enumerate(sizes)]


@given(
    sizes=st.lists(st.sampled_from(SIZES), min_size=1, max_size=3),
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(DTYPES),
    p=st.sampled_from(NORMS),
    native=st.booleans(),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_every_cpu_path_gives_the_true_norm_across_the_float32_range(
    sizes: list[int],
    layout: str,
    dtype: torch.dtype,
    p: float,
    native: bool,
    data: st.DataObject,
    seed: int,
    float64_norm: Float64Norm,
) -> None:
    """The C kernel (``native``, dense layouts) or the fallback, against float64."""
    grads = drawn_grads(sizes, layout, dtype, data, seed)
    with kernel(native):
        check_norm_and_clip(grads, p, float64_norm)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("p", NORMS)
@pytest.mark.parametrize("value", [1e20, 3e36, 1e-30, 1e-38])
def test_the_issues_cases(
    value: float, p: float, layout: str, native: bool, float64_norm: Float64Norm
) -> None:
    """``get_total_norm([torch.full((4000,), 1e20)[::2]])`` was inf (true 4.47e21), its
    sparse twin too, and tiny values' norms were 0 (1e-38 is a float32 subnormal). The
    1-norm of 4000 elements of 3e36 does not fit in float32, and is not checked."""
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
    with kernel(native):
        norm = clipopt.get_total_norm([grad], p)
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
    grads = drawn_grads(sizes, layout, dtype, data, seed)
    check_norm_and_clip(on("cuda", grads), p, float64_norm, foreach)
