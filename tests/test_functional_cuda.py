"""The functional API on CUDA: foreach kernels, no device sync, inductor, mixed devices.

Skipped where no GPU is present; the device-independent properties also run on CUDA
through ``tests/test_properties.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch
from helpers import sync_is_an_error
from torch import Tensor

import clipopt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

Float64Norm = Callable[[Sequence[Tensor | None], float | str], float]
NORM_TYPES = [1, 2.0, 3.5, math.inf, "inf"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def cuda_params(seed: int = 0, dtypes: Sequence[torch.dtype] = DTYPES) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    params = []
    for i, dtype in enumerate(dtypes):
        for n in (7, 20_000):
            grad = (torch.randn(n, generator=generator) * (i + 1)).to(dtype).cuda()
            param = torch.nn.Parameter(torch.zeros_like(grad))
            param.grad = grad
            params.append(param)
    params.append(torch.nn.Parameter(torch.zeros(3, device="cuda")))  # no grad
    return params


def clone_params(params: Sequence[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("foreach", [None, True, False])
def test_cuda_norm_matches_float64(
    norm_type: float | str, foreach: bool | None, float64_norm: Float64Norm
) -> None:
    params = cuda_params()
    grads = [p.grad for p in params]
    norm = clipopt.get_total_norm(grads, norm_type, foreach=foreach)
    assert norm.device.type == "cuda" and norm.dtype == torch.float64
    assert math.isclose(float(norm), float64_norm(grads, norm_type), rel_tol=1e-5)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("foreach", [None, True, False])
def test_cuda_clip_never_waits_for_the_device(norm_type: float | str, foreach: bool | None) -> None:
    params, reference = cuda_params(), cuda_params()
    with sync_is_an_error():
        norm = clipopt.clip_grad_norm_(params, 1.0, norm_type, foreach=foreach)
        clipped, _ = clipopt.clip_grad_norm(reference, 1.0, norm_type, foreach=foreach)
        clipopt.clip_grad_value_(reference, 0.1, foreach=foreach)
    assert norm.device.type == "cuda"
    for p, copy in zip(params, clipped, strict=True):
        assert (p.grad is None and copy is None) or torch.equal(p.grad, copy)


def test_the_sync_detector_is_live() -> None:
    norm = clipopt.get_total_norm([torch.ones(3, device="cuda")])
    with sync_is_an_error(), pytest.raises(RuntimeError):
        norm.item()


@pytest.mark.parametrize("norm_type", [1, 2.0, math.inf])
def test_cuda_matches_torch_on_single_and_double_precision(norm_type: float) -> None:
    params = cuda_params(dtypes=[torch.float32, torch.float64])
    theirs = clone_params(params)
    norm = clipopt.clip_grad_norm_(params, 0.5, norm_type)
    torch_norm = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type)
    torch.testing.assert_close(norm, torch_norm, rtol=1e-5, atol=0)
    for a, b in zip(params, theirs, strict=True):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None and b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=0)


def test_cuda_fp16_norm_past_65504_is_exact_where_torch_overflows(
    float64_norm: Float64Norm,
) -> None:
    grad = torch.full((1000,), 3000.0, dtype=torch.float16, device="cuda")
    ours, theirs = torch.nn.Parameter(torch.zeros_like(grad)), torch.nn.Parameter(grad.clone())
    ours.grad, theirs.grad = grad.clone(), grad.clone()
    norm = clipopt.clip_grad_norm_([ours], 1.0)
    assert math.isclose(float(norm), float64_norm([grad], 2), rel_tol=1e-6)
    assert torch.isinf(torch.nn.utils.clip_grad_norm_([theirs], 1.0))
    assert not theirs.grad.any()


def test_cuda_l2_norm_of_a_large_float32_grad_is_within_1e_6(float64_norm: Float64Norm) -> None:
    grad = torch.randn(1 << 23, generator=torch.Generator().manual_seed(0)).cuda()
    expected = float64_norm([grad], 2)
    assert abs(float(clipopt.get_total_norm([grad])) / expected - 1) < 1e-6


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_mixed_cpu_and_cuda_grads(norm_type: float, float64_norm: Float64Norm) -> None:
    on_cuda, on_cpu = torch.randn(50, device="cuda"), torch.randn(70) * 3
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in (on_cuda, on_cpu)]
    params[0].grad, params[1].grad = on_cuda.clone(), on_cpu.clone()
    norm = clipopt.clip_grad_norm_(params, 0.5, norm_type)
    assert norm.device.type == "cuda"  # the first grad's device
    assert math.isclose(float(norm), float64_norm([on_cuda, on_cpu], norm_type), rel_tol=1e-5)
    assert math.isclose(float64_norm([p.grad for p in params], norm_type), 0.5, rel_tol=1e-5)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_cuda_empty_grads_are_skipped(norm_type: float) -> None:
    params = [torch.nn.Parameter(torch.zeros(0, device="cuda")), torch.nn.Parameter(torch.zeros(2))]
    params[0].grad = torch.zeros(0, device="cuda")
    params[1].grad = torch.tensor([3.0, -4.0], device="cuda")
    norm = clipopt.clip_grad_norm_(params, 1.0, norm_type)
    assert math.isclose(float(norm), 4.0 if norm_type == math.inf else 5.0, rel_tol=1e-6)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_cuda_sparse_embedding_grads_clip_like_dense(norm_type: float) -> None:
    def grads(sparse: bool) -> list[torch.nn.Parameter]:
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(10, 4, sparse=sparse).cuda()
        (embedding(torch.tensor([1, 7, 1], device="cuda")) * 25).sum().backward()
        return list(embedding.parameters())

    sparse, dense = grads(True), grads(False)
    torch.testing.assert_close(
        clipopt.clip_grad_norm_(sparse, 1.0, norm_type),
        clipopt.clip_grad_norm_(dense, 1.0, norm_type),
    )
    torch.testing.assert_close(sparse[0].grad.to_dense(), dense[0].grad)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_inductor_fullgraph_gives_the_eager_result(norm_type: float) -> None:
    def step(params: list[torch.nn.Parameter], max_norm: float) -> Tensor:
        return clipopt.clip_grad_norm_(params, max_norm, norm_type)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    for max_norm in (1.0, 0.5):
        traced, eager = cuda_params(), cuda_params()
        torch.testing.assert_close(
            compiled(traced, max_norm), step(eager, max_norm), rtol=1e-5, atol=0
        )
        for a, b in zip(traced, eager, strict=True):
            if a.grad is not None and b.grad is not None:
                rtol = max(torch.finfo(a.grad.dtype).eps, 1e-5)
                torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=1e-6)
    torch._dynamo.reset()


def test_cuda_clip_grad_value_is_bit_identical_to_torch() -> None:
    params = cuda_params()
    theirs = clone_params(params)
    clipopt.clip_grad_value_(params, 0.5)
    torch.nn.utils.clip_grad_value_(theirs, 0.5)
    for a, b in zip(params, theirs, strict=True):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
