"""The clip coefficient ``min(1, max_norm / (norm + EPS))`` and in-place scales of grads."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from clipopt._kernels._norms import Groups, group

EPS = 1e-6
"""Added to the norm before dividing, as torch.nn.utils does."""


def batched(device: torch.device) -> bool:
    """Stacked per-tensor work (constant launches) off the CPU; on it, tensor by tensor,
    bit-exact with timm's and autoclip's references."""
    return device.type != "cpu"


def runs(sizes: Sequence[tuple[int, int]], device: torch.device) -> Tensor:
    """``count`` runs of ``length`` for each ``(length, count)``, int64 on ``device``, no sync."""
    pairs = torch.tensor(sizes, dtype=torch.int64).view(-1, 2).to(device, non_blocking=True)
    return torch.repeat_interleave(pairs[:, 0], pairs[:, 1], output_size=sum(c for _, c in sizes))


def coefficient(threshold: float | Tensor, norm: Tensor) -> Tensor:
    """``min(1, threshold / (norm + EPS))``, unguarded: for a rule's thresholds."""
    return torch.clamp(threshold / (norm + EPS), max=1.0)


def _beside(value: Tensor, other: Tensor) -> Tensor:
    """``value`` on ``other``'s device by an add (``torch.where`` would block on a copy)."""
    return value if value.device == other.device else other.new_zeros(()) + value


def clip_coefficient(max_norm: float | Tensor, norm: Tensor) -> Tensor:
    """:func:`coefficient` for a user's ``max_norm``: 1 for a tensor inf; NaN for a tensor
    one not > 0, and below the smallest normal (its reciprocal, ``grad_scale``, overflows)."""
    coef = coefficient(max_norm, norm)
    invalid = (coef > 0) & (coef < torch.finfo(coef.dtype).tiny)
    if isinstance(max_norm, Tensor):
        limit = _beside(max_norm, coef)
        coef = torch.where(limit == math.inf, 1.0, coef)
        invalid = invalid | torch.logical_not(limit > 0)
    return torch.where(invalid, math.nan, coef)


def scale_(tensors: Sequence[Tensor], coef: Tensor, foreach: bool | None = None) -> None:
    """Multiply every tensor in place by the 0-dim ``coef``."""
    scale_groups_(group(tensors), coef, foreach)


def scale_groups_(groups: Groups, coef: Tensor, foreach: bool | None = None) -> None:
    """:func:`scale_` over grouped tensors: one ``_foreach_mul_`` a group."""
    coef_on: dict[torch.device, Tensor] = {}
    for (device, _), tensors in groups.dense.items():
        if not (torch.compiler.is_compiling() or torch.is_inference_mode_enabled()):
            for t in tensors:  # refused before any is written, not midway by mul_
                if t.is_inference():
                    shape = tuple(t.shape)
                    raise RuntimeError(f"cannot scale an inference-tensor grad {shape} in place")
        coef_here = coef_on.setdefault(device, coef.to(device))
        if foreach is False:
            for t in tensors:
                t.mul_(coef_here)
        else:
            torch._foreach_mul_(tensors, coef_here)
    for sparse in groups.sparse.values():
        for t in sparse:  # a sparse mul_ would round coef to t's dtype: fp16 loses 1e-5
            t._values().mul_(coef_on.setdefault(t.device, coef.to(t.device)))


def scale_each_(grads: list[Tensor], coefficients: list[Tensor], foreach: bool | None) -> None:
    """Multiply each grad in place by its coefficient (broadcastable to it). Where
    :func:`batched`, coefficients are repeated into one buffer shaped as the grads: CUDA's
    ``_foreach_mul_`` runs tensor by tensor unless both lists are alike."""
    groups: dict[tuple[torch.device, torch.dtype, bool], list[int]] = {}
    for i, (grad, c) in enumerate(zip(grads, coefficients, strict=True)):
        if grad.is_sparse or foreach is False:
            grad.mul_(c.to(grad.device))
        else:
            wide = batched(grad.device) and grad.is_contiguous() and _leading(c, grad)
            groups.setdefault((grad.device, grad.dtype, wide), []).append(i)
    for (device, _, wide), indices in groups.items():
        tensors, given = [grads[i] for i in indices], [coefficients[i].to(device) for i in indices]
        torch._foreach_mul_(tensors, _repeated(given, tensors) if wide else given)


def _leading(c: Tensor, t: Tensor) -> bool:
    """``c`` varies along leading dims of ``t`` only: each entry scales a run of ``t``."""
    shape, n = (1,) * (t.dim() - c.dim()) + tuple(c.shape), t.dim()
    return t.numel() > 0 and any(shape == (*t.shape[:k], *(1,) * (n - k)) for k in range(n + 1))


def _repeated(coefficients: list[Tensor], like: list[Tensor]) -> list[Tensor]:
    """Each coefficient repeated to its tensor's shape and dtype: views of one buffer."""
    sizes = [(t.numel() // c.numel(), c.numel()) for c, t in zip(coefficients, like, strict=True)]
    values = torch.cat([c.reshape(-1) for c in coefficients]).to(like[0].dtype)
    numels = [t.numel() for t in like]
    flat = torch.repeat_interleave(values, runs(sizes, values.device), output_size=sum(numels))
    return [part.view(t.shape) for part, t in zip(torch.split(flat, numels), like, strict=True)]


def grad_scale_of(max_norm: float | Tensor, norm: Tensor) -> Tensor:
    """A fused step's ``grad_scale``, ``1 / clip_coefficient`` (NaN: bad norm, inf tensor max)."""
    scale = torch.clamp((norm + EPS) / max_norm, min=1.0)
    info = torch.finfo(scale.dtype)
    # Past 1 / tiny: NaN for a finite norm (sqrt of a negative), inf for an infinite one.
    scale = torch.where(scale > 1 / info.tiny, torch.sqrt(norm - info.max), scale)
    if isinstance(max_norm, Tensor):
        scale = torch.where(_beside(max_norm, scale) > 0, scale, math.nan)
    return scale
