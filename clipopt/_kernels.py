"""Norm and scale kernels over lists of gradients, grouped by device and dtype.

Everything here stays on the tensors' devices: no ``.item()``, no Python branch on a
tensor's value. The public, validated entry points live in :mod:`clipopt.functional`.

A total p-norm is the p-norm of partial p-norms, so every path below reduces each
(device, dtype) group to a short vector of partial norms and combines those. On CPU a
large contiguous tensor is viewed as rows of ``_BLOCK`` elements and reduced row-wise:
each row's sum is short, so float32 accumulation stays accurate to ~1e-8 relative at
40M elements, where one flat ``vector_norm`` drifts by ~3e-3.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "EPS",
    "clip_coefficient",
    "group_by_device_and_dtype",
    "result_dtype",
    "scale_",
    "total_norm",
]

EPS = 1e-6
"""Added to the norm before dividing, as torch.nn.utils does."""

_BLOCK = 4096
"""Row length of the blocked CPU reduction: short enough for accurate float32 sums."""

_INF = math.inf

GroupKey = tuple[torch.device, torch.dtype]


def group_by_device_and_dtype(tensors: Sequence[Tensor]) -> dict[GroupKey, list[Tensor]]:
    """Split ``tensors`` into lists that share a device and a dtype, keeping order."""
    groups: dict[GroupKey, list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def result_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """float64 if any input is double precision, else float32: half types never overflow."""
    wide = {torch.float64, torch.complex128}
    return torch.float64 if any(d in wide for d in dtypes) else torch.float32


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype to pass to ``vector_norm``: float32 for half types, None to keep it."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return None


def _sparse_values(t: Tensor) -> Tensor:
    """The values that define a sparse COO tensor's norm (duplicates summed first)."""
    return t.coalesce().values()


def _uses_foreach(device: torch.device, foreach: bool | None) -> bool:
    """foreach=None means: multi-tensor kernels where the device has fast ones (not CPU)."""
    if foreach is None:
        return device.type != "cpu"
    return foreach


def _blocked_partial_norms(t: Tensor, p: float) -> Tensor:
    """Partial p-norms of one large contiguous CPU tensor: one per row of ``_BLOCK``."""
    flat = t.view(-1)
    rows = flat.numel() // _BLOCK
    acc = _accumulate_dtype(t.dtype)
    body = torch.linalg.vector_norm(flat[: rows * _BLOCK].view(rows, _BLOCK), p, dim=1, dtype=acc)
    tail = torch.linalg.vector_norm(flat[rows * _BLOCK :], p, dtype=acc)
    return torch.cat([body, tail.reshape(1)])


def _abs_max(t: Tensor) -> Tensor:
    """max |t| of a real tensor without materialising ``abs``: one min/max pass."""
    lo, hi = torch.aminmax(t)
    return torch.maximum(hi, -lo)


def _group_partial_norms(tensors: list[Tensor], p: float, foreach: bool | None) -> list[Tensor]:
    """Partial p-norms of one (device, dtype) group, each tensor's contribution once."""
    device, dtype = tensors[0].device, tensors[0].dtype
    acc = _accumulate_dtype(dtype)
    if tensors[0].is_sparse:
        return [
            torch.linalg.vector_norm(_sparse_values(t), p, dtype=acc).reshape(1) for t in tensors
        ]
    if device.type == "cpu":
        blocked = [t for t in tensors if t.numel() >= 2 * _BLOCK and t.is_contiguous()]
        rest = [t for t in tensors if not (t.numel() >= 2 * _BLOCK and t.is_contiguous())]
        parts: list[Tensor] = []
        if p == _INF and not dtype.is_complex:
            parts.extend(_abs_max(t).reshape(1) for t in blocked)
        else:
            parts.extend(_blocked_partial_norms(t, p) for t in blocked)
        tensors = rest
    else:
        parts = []
    if not tensors:
        return parts
    if _uses_foreach(device, foreach):
        norms = torch._foreach_norm(tensors, p, dtype=acc)
        parts.append(torch.stack(norms))
    else:
        parts.extend(torch.linalg.vector_norm(t, p, dtype=acc).reshape(1) for t in tensors)
    return parts


def total_norm(tensors: Sequence[Tensor], p: float, foreach: bool | None = None) -> Tensor:
    """The p-norm of all ``tensors`` taken together, as one 0-dim tensor.

    Args:
      tensors: dense or sparse COO tensors; may mix devices and dtypes. Empty tensors
        contribute nothing (the inf-norm of an empty tensor would raise in torch).
      p: a validated norm order, ``> 0`` or ``math.inf``.
      foreach: use multi-tensor kernels (True), per-tensor ones (False) or pick (None).

    Returns:
      A 0-dim tensor on the first tensor's device, float32 (float64 if any input is
      double precision); ``tensor(0.)`` on CPU when there is nothing to measure.
    """
    nonempty = [t for t in tensors if t.numel() > 0 and not (t.is_sparse and t._nnz() == 0)]
    if not nonempty:
        return torch.tensor(0.0)
    out_device = nonempty[0].device
    out_dtype = result_dtype([t.dtype for t in nonempty])
    dense = [t for t in nonempty if not t.is_sparse]
    sparse = [t for t in nonempty if t.is_sparse]
    groups = list(group_by_device_and_dtype(dense).values())
    groups.extend(group_by_device_and_dtype(sparse).values())
    partials: list[Tensor] = []
    for group in groups:
        for part in _group_partial_norms(group, p, foreach):
            partials.append(part.to(device=out_device, dtype=out_dtype))
    norm: Tensor = torch.linalg.vector_norm(torch.cat(partials), p)
    return norm


def clip_coefficient(max_norm: float | Tensor, norm: Tensor) -> Tensor:
    """``min(1, max_norm / (norm + EPS))`` on ``norm``'s device, without a host sync."""
    coef: Tensor = torch.clamp(max_norm / (norm + EPS), max=1.0)
    return coef


def scale_(tensors: Sequence[Tensor], coef: Tensor, foreach: bool | None = None) -> None:
    """Multiply every tensor in place by the 0-dim ``coef`` (moved to each device once).

    Dense groups use one ``_foreach_mul_`` unless ``foreach=False``; on CPU that is a
    C++ loop and still beats a Python one. Sparse COO tensors are scaled one by one.
    """
    dense = [t for t in tensors if not t.is_sparse]
    sparse = [t for t in tensors if t.is_sparse]
    coef_on: dict[torch.device, Tensor] = {}
    for (device, _), group in group_by_device_and_dtype(dense).items():
        coef_here = coef_on.setdefault(device, coef.to(device))
        if foreach is False:
            for t in group:
                t.mul_(coef_here)
        else:
            torch._foreach_mul_(group, coef_here)
    for t in sparse:
        t.mul_(coef_on.setdefault(t.device, coef.to(t.device)))
