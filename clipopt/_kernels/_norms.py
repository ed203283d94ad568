"""Norms of lists of gradients by torch's own ops, grouped by device and dtype, with no
host read (callers validate arguments). A total p-norm is the p-norm of partial
p-norms: each (device, dtype) group gives 1-D partials (:func:`_partials`), all combined
by one ``vector_norm`` in :func:`combine_dtype`.

Off the CPU, one ``torch._foreach_norm`` per group, half types accumulated and returned
in float32. On the CPU, grads of ``ROWS_FROM`` elements or more take faster or more
accurate paths than torch's flat kernels: ``aminmax`` for the inf-norm (5-10x faster);
views of ``SPLIT`` for a contiguous float32 grad's 1- and 2-norm, so that float32 error
grows with the view, not the grad (2e-7 relative at 40M elements, against 3e-3); rows of
``ROW`` in memory order for half-type and non-contiguous grads, a half type widened
``CHUNK`` elements at a time into a float32 scratch (``vector_norm(dtype=float32)``
copies the whole grad, and a flat float32 sum of 64K bfloat16 values is 1e-6 off).
Orders other than 1, 2 and inf, and the CPU's 1-norm, accumulate float32 in float64.

Limit: squares are taken in float32 (bfloat16 and float32 grads) as torch takes them: an
element past about 1.8e19 makes the 2-norm inf, elements all below about 1e-19 make it 0.
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
_DOUBLE = (torch.float64, torch.complex128)


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
    return torch.float64 if any(d in _DOUBLE for d in dtypes) else torch.float32


def combine_dtype(device: torch.device) -> torch.dtype:
    """float64 on CPU and CUDA, float32 elsewhere (MPS has no double): for partial norms,
    whose squares leave float32's range though the norm does not, and rules' state."""
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype to pass to ``vector_norm``: float32 for half types, None to keep it."""
    return torch.float32 if dtype in _HALF else None


def _accumulate(t: Tensor, p: float) -> torch.dtype | None:
    """The dtype to accumulate ``t``'s ``p``-norm in (see the module's docstring)."""
    if p == math.inf:
        return None  # a max is exact in any dtype
    cpu = t.device.type == "cpu"
    exact = p == 2.0 or (p == 1.0 and not cpu) or t.dtype in _DOUBLE
    if exact or not (cpu or t.device.type == "cuda"):  # no float64 there (MPS)
        return torch.float32 if t.dtype in _HALF else None
    return torch.complex128 if t.is_complex() else torch.float64


def _partials(tensors: list[Tensor], p: float, foreach: bool | None) -> list[Tensor]:
    """1-D partial norms of one (device, dtype) group of dense tensors: one norm per
    non-empty tensor, in order, unless a CPU tensor has ``ROWS_FROM`` elements or more
    (its 1- and 2-norms split into views or rows, its inf-norm by ``aminmax``)."""
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return []
    first = tensors[0]
    cpu = first.device.type == "cpu"
    by_rows = cpu and p in (1.0, 2.0)
    by_aminmax = cpu and p == math.inf and not first.is_complex()
    half = first.dtype in _HALF
    acc = _accumulate(first, p)
    parts: list[Tensor] = []
    views: list[Tensor] = []
    lows: list[Tensor] = []
    highs: list[Tensor] = []
    for t in tensors:
        if t.numel() < ROWS_FROM or not (by_rows or by_aminmax):
            views.append(t)
            continue
        if by_aminmax:  # no abs copy; NaN propagates; torch's CPU inf-norm is 5-10x slower
            low, high = torch.aminmax(t)
            lows.append(low)
            highs.append(high)
            continue
        if not half and t.is_contiguous():
            views += t.view(-1).split(SPLIT)  # type: ignore[no-untyped-call]
            continue
        if t.is_contiguous():
            flat = t.view(-1)
        else:  # in memory order: a view where the elements are dense (channels-last...)
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
    if highs:
        parts.append(torch.maximum(torch.stack(highs), -torch.stack(lows)))
    if views:
        if foreach is False:
            norms = [torch.linalg.vector_norm(t, p, dtype=acc) for t in views]
        else:
            norms = list(torch._foreach_norm(views, p, dtype=acc))
        parts.append(torch.stack(norms))
    return parts


def _combine(partials: list[Tensor], p: float) -> Tensor:
    """The p-norm of 1-D partial p-norms, in :func:`combine_dtype` on the first's device."""
    device = partials[0].device
    wide = combine_dtype(device)
    wide_partials = [x.to(device, wide) for x in partials]
    joined = wide_partials[0] if len(wide_partials) == 1 else torch.cat(wide_partials)
    norm: Tensor = torch.linalg.vector_norm(joined, p)
    return norm


def total_norm(tensors: Sequence[Tensor], p: float, foreach: bool | None = None) -> Tensor:
    """The ``p``-norm of all ``tensors`` (dense or sparse COO, any devices and dtypes)
    together: 0-dim in :func:`result_dtype`, on the device of the first with values; with
    none, a zero on the first tensor's device (CPU if none). ``foreach=False``: per-tensor
    kernels."""
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
        partials += _partials(members, p, foreach)
    for members in groups.sparse.values():
        partials += _partials([t.coalesce().values() for t in members], p, foreach)
    if not partials:
        device = tensors[0].device if tensors else None
        return torch.zeros((), dtype=out_dtype, device=device), groups
    return _combine(partials, p).to(out_dtype), groups


def per_tensor_norms(tensors: Sequence[Tensor], p: float, foreach: bool | None = None) -> Tensor:
    """The p-norm of each tensor, in one 1-D tensor in the order given (for per-tensor rules).

    One ``_foreach_norm`` per (device, dtype) group (``vector_norm`` per tensor with
    ``foreach=False``), sparse tensors and large CPU ones as :func:`total_norm` measures
    them, stacked on the first tensor's device in float32 (float64 if any tensor is
    double). Empty tensors have norm 0.
    """
    if not tensors:
        raise ValueError("per_tensor_norms needs at least one tensor")
    device = tensors[0].device
    out_dtype = result_dtype([t.dtype for t in tensors])
    zero = torch.zeros((), dtype=out_dtype, device=device)
    norms = [zero] * len(tensors)
    # Positions, not ids: a compiled step would guard on each grad's identity.
    at: dict[tuple[torch.device, torch.dtype, bool], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() > 0:
            at.setdefault((t.device, t.dtype, t.is_sparse), []).append(i)
    for (where, _, sparse), index in at.items():
        split = p in (1.0, 2.0, math.inf) and where.type == "cpu"
        rest = []
        for i in index:
            t = tensors[i]
            if sparse or (split and t.numel() >= ROWS_FROM):
                parts = _partials([t.coalesce().values() if sparse else t], p, foreach)
                norms[i] = _combine(parts, p) if parts else zero
            else:
                rest.append(i)
        if rest:
            each = _partials([tensors[i] for i in rest], p, foreach)[0].unbind()
            for i, norm in zip(rest, each, strict=True):
                norms[i] = norm
    if len({(n.device, n.dtype) for n in norms}) > 1:  # else one stack, one cast
        norms = [n.to(device=device, dtype=out_dtype) for n in norms]
    return torch.stack(norms).to(device=device, dtype=out_dtype)
