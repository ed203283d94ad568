"""Norms of lists of gradients by torch's own ops, grouped by device and dtype.

No value is read on the host and no Python branch depends on one. Callers validate
arguments first.

A total p-norm is the p-norm of partial p-norms: each (device, dtype) group gives a
vector of partials, combined in :func:`combine_dtype` by one cascade ``sum``.

- Off the CPU: one ``torch._foreach_norm`` per group (one ``vector_norm`` per grad with
  ``foreach=False``), half types accumulated and returned in float32.
- CPU: the inf-norm by one ``aminmax`` per grad (torch's ``vector_norm(inf)`` reads 5
  to 10 times slower). The 1- and 2-norm by one ``_foreach_norm`` per group (a C++ loop,
  where torch's clip loops in Python), grads past ``SPLIT`` elements split into views of
  that many, each read by torch's fast flat kernel: float32 error grows with the view,
  not the grad (2e-7 relative at 40M elements, where one flat ``vector_norm`` is off by
  3e-3). Half types are accumulated and returned in float32 (past 65504, and with
  float32's precision); since ``vector_norm(dtype=float32)`` first copies the whole grad,
  a large one is widened ``CHUNK`` elements at a time into a float32 scratch and its
  rows of ``ROW`` reduced there, a copy that torch's clip (which rounds each grad's norm
  to bfloat16) does not make. Large non-contiguous grads are copied and reduced by rows.
- Orders other than 1, 2 and inf, and the CPU's 1-norm, accumulate float32 in float64
  (their sums lose float32's precision; for p > 2, its range).

Limit: squares are taken in float32 (bfloat16 and float32 grads) as torch takes them, so
an element past about 1.8e19 makes the 2-norm inf, and elements all below about 1e-19
make it 0, as in torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "Groups",
    "accumulate_dtype",
    "combine_dtype",
    "group",
    "grouped_total_norm",
    "per_tensor_norms",
    "result_dtype",
    "total_norm",
]

GroupKey = tuple[torch.device, torch.dtype]

ROW = 1024
ROWS_FROM = 1 << 12
CHUNK = 1 << 18
SPLIT = 1 << 16
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Groups:
    """Tensors by (device, dtype) in order of first appearance: the dense ones, and the
    sparse COO ones with values."""

    dense: dict[GroupKey, list[Tensor]]
    sparse: dict[GroupKey, list[Tensor]]


def group(tensors: Sequence[Tensor]) -> Groups:
    """:class:`Groups` of ``tensors``, each group in the given order."""
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
    wide = {torch.float64, torch.complex128}
    return torch.float64 if any(d in wide for d in dtypes) else torch.float32


def combine_dtype(device: torch.device) -> torch.dtype:
    """float64 on CPU and CUDA, float32 elsewhere (MPS has no double): partial norms'
    squares leave float32's range though the norm does not."""
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype to pass to ``vector_norm``: float32 for half types, None to keep it."""
    return torch.float32 if dtype in _HALF else None


def _order_dtype(t: Tensor, p: float) -> torch.dtype | None:
    """The dtype to accumulate ``t``'s ``p``-norm in (see the module's docstring)."""
    if p == math.inf:
        return None  # a max is exact in any dtype
    if p == 2.0 or (p == 1.0 and t.device.type != "cpu"):
        return accumulate_dtype(t.dtype)
    if combine_dtype(t.device) != torch.float64 or t.dtype in (torch.float64, torch.complex128):
        return accumulate_dtype(t.dtype)
    return torch.complex128 if t.is_complex() else torch.float64


def _abs_maxes(tensors: list[Tensor]) -> Tensor:
    """Each real CPU tensor's largest magnitude, by one ``aminmax`` a tensor (no ``abs``
    copy; NaN propagates): torch's CPU inf-norm kernel reads 5 to 10 times slower."""
    lows, highs = zip(*(torch.aminmax(t) for t in tensors), strict=True)
    return torch.maximum(torch.stack(highs), -torch.stack(lows))


def _flat(t: Tensor) -> Tensor:
    """``t``'s elements in memory order, a view where they are dense (channels-last,
    transposed): the order of a norm's terms does not matter. A copy where there are gaps."""
    if t.is_contiguous():
        return t.view(-1)
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d)), reverse=True)
    return t.permute(order).reshape(-1)


def _row_norms(flat: Tensor, p: float) -> list[Tensor]:
    """Norms of a 1-D float tensor's rows of ``ROW`` elements, and of its ragged tail."""
    body = flat.numel() - flat.numel() % ROW
    parts = [torch.linalg.vector_norm(flat[:body].view(-1, ROW), p, dim=1)]
    if body < flat.numel():
        parts.append(torch.linalg.vector_norm(flat[body:], p).reshape(1))
    return parts


def _rows(t: Tensor, p: float) -> list[Tensor]:
    """Partial 1- or 2-norms of a large CPU tensor that is not contiguous or of a half
    type: rows of ``ROW`` elements, a half type's widened ``CHUNK`` elements at a time
    into a float32 scratch."""
    flat = _flat(t)
    if t.dtype not in _HALF:
        return _row_norms(flat, p)
    scratch = torch.empty(min(CHUNK, flat.numel()))
    parts = []
    for start in range(0, flat.numel(), CHUNK):
        piece = flat[start : start + CHUNK]
        wide = scratch[: piece.numel()]
        wide.copy_(piece)
        parts += _row_norms(wide, p)
    return parts


def _by_aminmax(t: Tensor, p: float) -> bool:
    return p == math.inf and t.device.type == "cpu" and not t.is_complex()


def _each_norm(
    tensors: list[Tensor], p: float, acc: torch.dtype | None, foreach: bool | None
) -> list[Tensor]:
    """One ``_foreach_norm`` (a ``vector_norm`` per tensor with ``foreach=False``)."""
    if foreach is False:
        return [torch.linalg.vector_norm(t, p, dtype=acc) for t in tensors]
    return list(torch._foreach_norm(tensors, p, dtype=acc))


def _cpu_partials(tensors: list[Tensor], p: float, foreach: bool | None) -> list[Tensor]:
    """1-D partial 1- or 2-norms of CPU tensors with values, of one dtype: large half
    type or non-contiguous ones by :func:`_rows`, the rest (large ones split into
    ``SPLIT``-element views, each read by torch's fast flat kernel) by one
    ``_foreach_norm``."""
    views: list[Tensor] = []
    parts: list[Tensor] = []
    for t in tensors:
        if t.numel() >= ROWS_FROM and (t.dtype in _HALF or not t.is_contiguous()):
            parts += _rows(t, p)
        elif t.numel() > SPLIT:
            views += _flat(t).split(SPLIT)  # type: ignore[no-untyped-call]
        else:
            views.append(t)
    if views:
        parts.append(torch.stack(_each_norm(views, p, _order_dtype(views[0], p), foreach)))
    return parts


def _group_partials(tensors: list[Tensor], p: float, foreach: bool | None) -> list[Tensor]:
    """1-D partial norms of one dense (device, dtype) group."""
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return []
    if _by_aminmax(tensors[0], p):
        return [_abs_maxes(tensors)]
    if tensors[0].device.type == "cpu" and p in (1.0, 2.0):
        return _cpu_partials(tensors, p, foreach)
    return [torch.stack(_each_norm(tensors, p, _order_dtype(tensors[0], p), foreach))]


def _combine(partials: Tensor, p: float) -> Tensor:
    """The p-norm of a vector of partial p-norms: a max, or a cascade sum of p-th powers."""
    if p == math.inf:
        return partials.amax()
    if p == 2.0:
        return partials.square().sum().sqrt()
    if p == 1.0:
        return partials.sum()
    return partials.pow(p).sum().pow(1.0 / p)


def total_norm(tensors: Sequence[Tensor], p: float, foreach: bool | None = None) -> Tensor:
    """The p-norm of all ``tensors`` taken together, as one 0-dim tensor.

    Args:
      tensors: dense or sparse COO tensors; may mix devices and dtypes. Empty tensors
        contribute nothing.
      p: a validated norm order, ``> 0`` or ``math.inf``.
      foreach: multi-tensor kernels (True), per-tensor ones (False) or pick (None: foreach
        everywhere; on the CPU it is a C++ loop of torch's per-tensor kernels).

    Returns:
      A 0-dim tensor on the first tensor with values' device, float32 (float64 if any
      input is double precision). With no values at all, a zero on the first tensor's
      device (CPU if none).
    """
    return grouped_total_norm(tensors, p, foreach)[0]


def grouped_total_norm(
    tensors: Sequence[Tensor], p: float, foreach: bool | None = None
) -> tuple[Tensor, Groups]:
    """:func:`total_norm`, and the groups it split ``tensors`` into, for
    :func:`~clipopt._kernels._scale.scale_groups_`."""
    groups = group(tensors)
    out_dtype = result_dtype([dtype for _, dtype in (*groups.dense, *groups.sparse)])
    partials: list[Tensor] = []
    for members in groups.dense.values():
        partials += _group_partials(members, p, foreach)
    for members in groups.sparse.values():
        partials += _group_partials([t.coalesce().values() for t in members], p, foreach)
    if not partials:
        device = tensors[0].device if tensors else None
        return torch.zeros((), dtype=out_dtype, device=device), groups
    device = partials[0].device
    wide = combine_dtype(device)
    moved = [part.to(device=device, dtype=wide) for part in partials]
    return _combine(torch.cat(moved), p).to(out_dtype), groups


def per_tensor_norms(tensors: Sequence[Tensor], p: float, foreach: bool | None = None) -> Tensor:
    """The p-norm of each tensor, in one 1-D tensor in the order given (for per-tensor rules).

    One ``_foreach_norm`` per (device, dtype) group (``vector_norm`` per tensor with
    ``foreach=False``; sparse ones by their values), stacked on the first tensor's device
    in float32 (float64 if any tensor is double). Empty tensors have norm 0.
    """
    if not tensors:
        raise ValueError("per_tensor_norms needs at least one tensor")
    out_device = tensors[0].device
    out_dtype = result_dtype([t.dtype for t in tensors])
    norms = [torch.zeros((), dtype=out_dtype, device=out_device)] * len(tensors)
    grouped: dict[GroupKey, list[int]] = {}
    for index, t in enumerate(tensors):
        if t.is_sparse:
            values = t.coalesce().values()
            if values.numel():
                norms[index] = torch.linalg.vector_norm(values, p, dtype=_order_dtype(t, p))
        elif t.device.type == "cpu" and t.numel() > min(SPLIT, ROWS_FROM) and p in (1.0, 2.0):
            norms[index] = _combine(torch.cat(_cpu_partials([t], p, foreach)).double(), p)
        elif t.numel() > 0:
            grouped.setdefault((t.device, t.dtype), []).append(index)
    for indices in grouped.values():
        members = [tensors[i] for i in indices]
        if _by_aminmax(members[0], p):
            found = list(_abs_maxes(members).unbind())
        else:
            found = _each_norm(members, p, _order_dtype(members[0], p), foreach)
        for i, norm in zip(indices, found, strict=True):
            norms[i] = norm
    if len({(n.device, n.dtype) for n in norms}) == 1:  # one stack, one cast: not one a tensor
        return torch.stack(norms).to(device=out_device, dtype=out_dtype)
    return torch.stack([n.to(device=out_device, dtype=out_dtype) for n in norms])
