"""Norms of grads by (device, dtype) group, no host read: the p-norm of partial p-norms."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

GroupKey = tuple[torch.device, torch.dtype]

# CPU grads of ROWS_FROM elements or more: inf-norm by aminmax; 1-, 2-norms over views of
# SPLIT (contiguous float32: error grows with the view) or rows of ROW (in memory order;
# half types widened CHUNK elements at a time).
ROW = 1024
ROWS_FROM = 1 << 12
CHUNK = 1 << 18
SPLIT = 1 << 16
_HALF = (torch.float16, torch.bfloat16)
_DOUBLE = (torch.float64, torch.complex128)


@dataclass(frozen=True)
class Groups:
    """Tensors by (device, dtype) in order of first appearance: dense, and non-empty sparse."""

    dense: dict[GroupKey, list[Tensor]]
    sparse: dict[GroupKey, list[Tensor]]


def group(tensors: Sequence[Tensor]) -> Groups:
    dense: dict[GroupKey, list[Tensor]] = {}
    sparse: dict[GroupKey, list[Tensor]] = {}
    for t in tensors:
        if not t.is_sparse:
            dense.setdefault((t.device, t.dtype), []).append(t)
        elif t._nnz() > 0:
            sparse.setdefault((t.device, t.dtype), []).append(t)
    return Groups(dense, sparse)


def result_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """float64 if any input is double precision, else float32: half types never overflow."""
    return torch.float64 if any(d in _DOUBLE for d in dtypes) else torch.float32


def combine_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it (not MPS): partial norms' squares, rules' state."""
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype to pass to ``vector_norm``: float32 for half types, None to keep it."""
    return torch.float32 if dtype in _HALF else None


def _partials(tensors: list[Tensor], p: float, foreach: bool | None) -> list[Tensor]:
    """1-D partial norms of one (device, dtype) group: one per tensor but large CPU ones."""
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return []
    first = tensors[0]
    cpu = first.device.type == "cpu"
    by_rows = cpu and p in (1.0, 2.0)
    by_aminmax = cpu and p == math.inf and not first.is_complex()
    half = first.dtype in _HALF
    parts: list[Tensor] = []
    views: list[Tensor] = []
    ends: list[tuple[Tensor, Tensor]] = []
    for t in tensors:
        if t.numel() < ROWS_FROM or not (by_rows or by_aminmax):
            views.append(t)
        elif by_aminmax:  # no abs copy; NaN propagates
            ends.append(torch.aminmax(t))
        elif not half and t.is_contiguous():
            views += t.view(-1).split(SPLIT)  # type: ignore[no-untyped-call]
        else:
            # in memory order: a view where the elements are dense (channels-last...)
            order = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d)), reverse=True)
            flat = t.permute(order).reshape(-1)
            step = CHUNK if half else flat.numel()
            scratch = torch.empty(min(CHUNK, flat.numel())) if half else None
            for start in range(0, flat.numel(), step):
                piece = flat[start : start + step]
                if scratch is not None:
                    piece = scratch[: piece.numel()].copy_(piece)
                body = piece.numel() - piece.numel() % ROW
                parts.append(torch.linalg.vector_norm(piece[:body].view(-1, ROW), p, dim=1))
                if body < piece.numel():
                    parts.append(torch.linalg.vector_norm(piece[body:], p).reshape(1))
    if ends:
        lows, highs = (torch.stack(side) for side in zip(*ends, strict=True))
        parts.append(torch.maximum(highs, -lows))
    if views:
        acc = None if p == math.inf else accumulate_dtype(first.dtype)  # a max is exact
        wide = p not in (2.0, math.inf) and (p != 1.0 or cpu) and first.dtype not in _DOUBLE
        if wide and (cpu or first.device.type == "cuda"):  # other orders, the CPU's 1-norm
            acc = torch.complex128 if first.is_complex() else torch.float64
        if foreach is False:
            norms = [torch.linalg.vector_norm(t, p, dtype=acc) for t in views]
        else:
            norms = list(torch._foreach_norm(views, p, dtype=acc))
        parts.append(torch.stack(norms))
    return parts


def _combine(partials: list[Tensor], p: float) -> Tensor:
    """The p-norm of 1-D partial p-norms, in :func:`combine_dtype` on the first's device."""
    device = partials[0].device
    wide = [x.to(device, combine_dtype(device)) for x in partials]
    norm: Tensor = torch.linalg.vector_norm(wide[0] if len(wide) == 1 else torch.cat(wide), p)
    return norm


def total_norm(tensors: Sequence[Tensor], p: float, foreach: bool | None = None) -> Tensor:
    """The 0-dim p-norm of all ``tensors`` (dense or sparse COO, any devices and dtypes) in
    :func:`result_dtype`, on the first with values' device."""
    return grouped_total_norm(tensors, p, foreach)[0]


def grouped_total_norm(
    tensors: Sequence[Tensor], p: float, foreach: bool | None = None
) -> tuple[Tensor, Groups]:
    """:func:`total_norm`, and the groups it split ``tensors`` into."""
    groups = group(tensors)
    out_dtype = result_dtype([dtype for _, dtype in (*groups.dense, *groups.sparse)])
    sparse = [[t.coalesce().values() for t in members] for members in groups.sparse.values()]
    partials = [x for m in (*groups.dense.values(), *sparse) for x in _partials(m, p, foreach)]
    if not partials:
        device = tensors[0].device if tensors else None
        return torch.zeros((), dtype=out_dtype, device=device), groups
    return _combine(partials, p).to(out_dtype), groups


def per_tensor_norms(tensors: Sequence[Tensor], p: float, foreach: bool | None = None) -> Tensor:
    """Each tensor's p-norm (0 if empty) as :func:`total_norm`'s, 1-D on the first's device."""
    if not tensors:
        raise ValueError("per_tensor_norms needs at least one tensor")
    device, out_dtype = tensors[0].device, result_dtype([t.dtype for t in tensors])
    zero = torch.zeros((), dtype=out_dtype, device=device)
    norms = [zero] * len(tensors)
    split = p in (1.0, 2.0, math.inf)
    # Positions, not ids: a compiled step would guard on each grad's identity.
    batched: dict[GroupKey, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.is_sparse or (split and t.device.type == "cpu" and t.numel() >= ROWS_FROM):
            parts = _partials([t.coalesce().values() if t.is_sparse else t], p, foreach)
            norms[i] = _combine(parts, p) if parts else zero
        elif t.numel() > 0:
            batched.setdefault((t.device, t.dtype), []).append(i)
    for index in batched.values():
        each = _partials([tensors[i] for i in index], p, foreach)[0].unbind()
        for i, norm in zip(index, each, strict=True):
            norms[i] = norm
    if len({(n.device, n.dtype) for n in norms}) > 1:  # else one stack, one cast
        norms = [n.to(device=device, dtype=out_dtype) for n in norms]
    return torch.stack(norms).to(device=device, dtype=out_dtype)
