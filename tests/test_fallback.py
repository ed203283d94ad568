"""Without the C kernel (not built, or ``CLIPOPT_DISABLE_NATIVE=1``): every CPU case goes
through torch ops and gives the same answers.

``make test`` also runs the whole suite with the variable set; these tests force the
fallback by patching ``clipopt._kernels._cpu._ENABLED`` so that they compare both paths in one
process.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import Tensor

import clipopt
from clipopt._kernels import _cpu

Float64Norm = Callable[[Sequence[Tensor | None], float | str], float]
NORMS = [1.0, 2.0, 3.0, math.inf]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.fixture
def fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C kernel left unused for the test, as the environment variable would."""
    monkeypatch.setattr(_cpu, "_ENABLED", False)


def grads_of(dtype: torch.dtype) -> list[Tensor]:
    """Large, small, channels-last, strided, empty and 0-dim grads of one dtype."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    return [
        randn(70_000),
        randn(300),
        randn(8, 3, 5, 5).contiguous(memory_format=torch.channels_last),
        randn(64, 300)[:, :200],
        randn(0),
        randn(1).view(()),
        randn(20_000, 3),
    ]


def imported_available(value: str | None) -> str:
    """``clipopt._kernels._cpu.available()`` as a fresh interpreter sees it, with the variable
    set to ``value`` (or unset)."""
    env = {k: v for k, v in os.environ.items() if k != _cpu.DISABLE_ENV}
    if value is not None:
        env[_cpu.DISABLE_ENV] = value
    code = "import clipopt._kernels._cpu as c; print(c.available())"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_the_environment_variable_is_read_at_import() -> None:
    assert imported_available("1") == "False"
    built = _cpu._native is not None
    for value in (None, "", "0"):
        assert imported_available(value) == str(built)


def test_the_fallback_supports_and_scales_nothing(fallback: None) -> None:
    assert not _cpu.available()
    for dtype in DTYPES:
        assert not _cpu.scales(dtype)
        for p in NORMS:
            assert not _cpu.supports(p, dtype)


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("p", NORMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fallback_norm_matches_the_reference_and_the_kernel(
    dtype: torch.dtype,
    p: float,
    foreach: bool | None,
    float64_norm: Float64Norm,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grads = grads_of(dtype)
    reference = float64_norm(grads, p)
    with_kernel = clipopt.get_total_norm(grads, p, foreach=foreach)
    monkeypatch.setattr(_cpu, "_ENABLED", False)
    without = clipopt.get_total_norm(grads, p, foreach=foreach)
    assert without.dtype == with_kernel.dtype
    rtol = 1e-12 if dtype == torch.float64 else 2e-6
    assert math.isclose(float(without), reference, rel_tol=rtol)
    assert math.isclose(float(without), float(with_kernel), rel_tol=2 * rtol)
    if p == math.inf:  # a max is exact on every path
        assert float(without) == float(with_kernel) == reference


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fallback_scale_gives_torchs_bits(
    fallback: None, dtype: torch.dtype, foreach: bool | None
) -> None:
    params = [torch.nn.Parameter(torch.zeros(g.shape, dtype=dtype)) for g in grads_of(dtype)]
    theirs = [torch.nn.Parameter(torch.zeros(g.shape, dtype=dtype)) for g in grads_of(dtype)]
    for ours, torchs, g, h in zip(params, theirs, grads_of(dtype), grads_of(dtype), strict=True):
        ours.grad, torchs.grad = g, h
    norm = clipopt.clip_grad_norm_(params, 1.0, foreach=foreach)
    torch.nn.utils.clip_grads_with_norm_(theirs, 1.0, norm, foreach=foreach)
    for ours, torchs in zip(params, theirs, strict=True):
        assert ours.grad is not None and torchs.grad is not None
        assert torch.equal(ours.grad, torchs.grad)
        assert ours.grad.stride() == torchs.grad.stride()


def test_fallback_refuses_an_inference_grad_before_scaling_any(fallback: None) -> None:
    """The C scale checked this itself; ``_foreach_mul_`` might write the grads before it."""
    params = [torch.nn.Parameter(torch.zeros(1000)) for _ in range(3)]
    params[0].grad = torch.full((1000,), 5.0)
    with torch.inference_mode():
        params[1].grad = torch.full((1000,), 5.0)
    params[2].grad = torch.full((1000,), 5.0)
    with pytest.raises(RuntimeError, match=r"shape \(1000,\) in place: it is an inference tensor"):
        clipopt.clip_grad_norm_(params, 1.0)
    assert all(torch.equal(p.grad, torch.full((1000,), 5.0)) for p in params if p.grad is not None)


def test_fallback_never_calls_the_c_kernel(fallback: None, monkeypatch: pytest.MonkeyPatch) -> None:
    if _cpu._native is None:
        pytest.skip("clipopt._kernels._native was not built: there is nothing to call")

    def refuse(*args: object) -> None:
        raise AssertionError("the C kernel was called with the fallback forced")

    for name in ("reduce", "scale", "layout", "reduce_layout", "scale_layout"):
        monkeypatch.setattr(_cpu._native, name, refuse)
    params = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads_of(torch.float32)]
    for param, grad in zip(params, grads_of(torch.float32), strict=True):
        param.grad = grad
    for p in NORMS:
        clipopt.clip_grad_norm_(params, 1.0, p)
