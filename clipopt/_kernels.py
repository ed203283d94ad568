"""Norm and scale kernels over lists of gradients, grouped by device and dtype.

Everything here stays on the tensors' devices: no value is read on the host, and no
Python branch depends on one. Callers validate arguments first: the functional API, the
cross-rank reduction and the wrapper's step.

A total p-norm is the p-norm of partial p-norms, so every path reduces each
(device, dtype) group to short vectors of partial norms and combines those with one
``sum`` of p-th powers (``torch.sum`` is a cascade sum, accurate to a few ulp).

CPU, p in (1, 2, inf) and float32, float64, bfloat16 or float16 grads: every grad
whose memory is dense (contiguous, or contiguous up to a permutation of its dims, e.g.
channels-last) is read by one call into the C reduction of :mod:`clipopt._cpu`,
on torch's own threads, at the speed of ``torch.sum`` (float16's 1- and 2-norm at
about half of it on CPUs without F16C); grads with gaps in memory (a strided slice) are
reduced in place by torch ops, their last dim split into rows.

CPU, any other p or dtype (complex), or any case where the C kernel is not in use
(not built, or ``CLIPOPT_DISABLE_NATIVE``): torch ops.

- A tensor of at least ``_PACK_BELOW`` elements whose memory is dense is viewed as rows
  of ``_ROW`` elements and reduced row-wise, one ``vector_norm(dim=1)`` per tensor.
  Short rows keep float32 accumulation accurate: its error grows with the row length,
  not with the tensor's size, as one flat ``vector_norm``'s does. Its ragged tail joins
  the small tensors.
- Smaller tensors are packed ``_PACK_RUN`` elements at a time into one buffer by
  ``torch.cat`` (tensors whose shapes agree past dim 0 join without a per-tensor view),
  which is then reduced row-wise. A per-tensor reduction costs a dispatch per tensor
  and ``_foreach_norm`` on CPU is a loop of them; packing costs one bounded copy.
- Half types are widened to float32 ``_CHUNK`` elements at a time in a scratch buffer,
  so nothing proportional to the model is allocated.
- For p > 1 but inf, float32 and bfloat16 grads (strided ones too) are copied
  ``_CHUNK`` elements at a time to a double scratch instead, one norm per piece: their
  powers in float32 overflow past 1.8e19 (and vanish below 1e-19) where the norm does
  not (:func:`_range_dtype`). The real inf-norm is one ``aminmax`` per tensor or run.

Each CPU group is read last to first: the pass that usually follows (the scale, a fused
optimizer step) runs first to last and so starts on grads still in cache.

Other devices (CUDA): one ``torch._foreach_norm`` per (device, dtype) group (one
``vector_norm`` per grad with ``foreach=False``), accumulating in :func:`_range_dtype`:
float32 for half types, float64 for float32 and bfloat16 powers on CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import cast

import torch
from torch import Tensor

from clipopt import _cpu

__all__ = [
    "EPS",
    "clip_coefficient",
    "combine_dtype",
    "group_by_device_and_dtype",
    "grouped_total_norm",
    "per_tensor_norms",
    "result_dtype",
    "scale_",
    "scale_groups_",
    "total_norm",
]

EPS = 1e-6
"""Added to the norm before dividing, as torch.nn.utils does."""

_ROW = 1024
"""Row length of the blocked CPU reduction: short enough for exact float32 sums."""

_PACK_BELOW = 1 << 14
"""CPU tensors with fewer elements are packed into a shared buffer before reducing."""

_CHUNK = 1 << 18
"""Elements per half-precision scratch (1 MiB of float32)."""

_PACK_RUN = 1 << 15
"""Elements per packed run of small tensors. ``torch.cat`` copies serially up to 32768
output elements (ATen's grain size); above that it opens a parallel region per input,
which on thousands of small inputs and two threads costs 4x."""

_INF = math.inf

GroupKey = tuple[torch.device, torch.dtype]
Groups = tuple[dict[GroupKey, list[Tensor]], dict[GroupKey, list[Tensor]]]
"""Dense and sparse tensors split by (device, dtype)."""


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


_WIDE = (torch.float64, torch.complex128)


def _range_dtype(dtype: torch.dtype, p: float, device: torch.device) -> torch.dtype | None:
    """The dtype to take ``dtype``'s p-th powers in: wide enough for their range.

    A float32 (or bfloat16) element past 1.8e19 squares to inf in float32, and one below
    1e-19 to 0 (less than 1e-23 for subnormals), though the norm is fine; float64 holds
    every p-th power of every float32, subnormals included, for p up to 7. The 1- and
    inf-norms take no powers (a sum of magnitudes cannot pass the norm it adds up to),
    nor do orders below 1 leave the range, and float16's powers fit in float32. Off CPU
    and CUDA (no float64) it is the accumulation dtype alone.

    Returns:
      float64 (complex128 for complex64) where float32 accumulation would leave the
      range, else :func:`_accumulate_dtype`'s answer.
    """
    acc = _accumulate_dtype(dtype)
    if p <= 1.0 or p == _INF or combine_dtype(device) != torch.float64:
        return acc
    if dtype in (torch.float32, torch.bfloat16):
        return torch.float64
    if dtype == torch.complex64:
        return torch.complex128
    return acc


_CPU = torch.device("cpu")


def _widens(dtype: torch.dtype, p: float) -> bool:
    """Whether CPU ``dtype`` grads take their p-th powers in a wider dtype than float32."""
    return dtype not in _WIDE and _range_dtype(dtype, p, _CPU) in _WIDE


def _sparse_values(t: Tensor) -> Tensor:
    """The values that define a sparse COO tensor's norm (duplicates summed first)."""
    return t.coalesce().values()


def _uses_foreach(device: torch.device, foreach: bool | None) -> bool:
    """foreach=None means: multi-tensor kernels where the device has fast ones (not CPU)."""
    if foreach is None:
        return device.type != "cpu"
    return foreach


def _is_real_inf(p: float, dtype: torch.dtype) -> bool:
    """The inf-norm of a real dtype: a max reduction, no powers, no accumulation."""
    return p == _INF and not dtype.is_complex


def _abs_max(t: Tensor) -> Tensor:
    """max |t| of a real tensor as a 1-element tensor, without materialising ``abs``.

    One ``aminmax`` pass; NaN propagates, and for half types the result is exact.
    """
    lo, hi = torch.aminmax(t)
    return torch.maximum(hi, -lo).reshape(1)


def _row_norms(flat: Tensor, p: float) -> Tensor:
    """p-norms of the ``_ROW``-element rows of a 1-D tensor whose length they divide."""
    rows = flat.view(-1, _ROW)
    norms: Tensor = torch.linalg.vector_norm(rows, p, dim=1, dtype=_accumulate_dtype(flat.dtype))
    return norms


class _Scratch:
    """Scratch buffers of at most ``_CHUNK`` elements, one per dtype, for one group.

    Allocated once per group: a fresh buffer per tensor is a fresh mapping of its pages,
    whose faults cost a transformer's 2-norm a third more.
    """

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A 1-D buffer of ``dtype`` with at least ``min(numel, _CHUNK)`` elements."""
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < min(numel, _CHUNK):
            buffer = self._buffers[dtype] = torch.empty(min(numel, _CHUNK), dtype=dtype)
        return buffer


def _widened_row_norms(flat: Tensor, p: float, scratch: _Scratch) -> list[Tensor]:
    """Row norms of a half-precision 1-D tensor, widened to float32 a chunk at a time.

    ``vector_norm(dtype=float32)`` would first copy the whole tensor to float32.
    """
    buffer = scratch.get(flat.numel(), torch.float32)
    norms = []
    for start in range(0, flat.numel(), _CHUNK):
        piece = flat[start : start + _CHUNK]
        wide = buffer[: piece.numel()]
        wide.copy_(piece)
        norms.append(_row_norms(wide, p))
    return norms


def _pieces(t: Tensor) -> Iterator[Tensor]:
    """Views that cover ``t`` once, each of at most ``_CHUNK`` elements (for any strides)."""
    if t.dim() <= 1:
        for start in range(0, t.numel(), _CHUNK):
            yield t[start : start + _CHUNK]
        return
    inner = t.numel() // t.shape[0]
    if inner > _CHUNK:
        for sub in t.unbind(0):
            yield from _pieces(sub)
        return
    step = _CHUNK // inner
    for start in range(0, t.shape[0], step):
        yield t[start : start + step]


def _widened_partials(t: Tensor, p: float, scratch: _Scratch) -> list[Tensor]:
    """Partial norms of any CPU tensor, its pieces copied to a float64 (or complex128)
    scratch of at most ``_CHUNK`` elements, one norm per piece.

    Double sums of 2**18 terms are accurate to about 1e-13, and hold every power that
    :func:`_range_dtype` widens for; ``vector_norm(dtype=float64)`` would first copy the
    whole tensor. The 2-norm squares the scratch in place and sums it, two thirds of a
    double ``vector_norm``'s cost; a BLAS ``dot`` would be cheaper still, but MKL's
    threads stalled for milliseconds a call on a busy 2-core machine.
    """
    wide = _range_dtype(t.dtype, p, _CPU)
    assert wide is not None
    buffer = scratch.get(t.numel(), wide)
    norms = []
    for piece in _pieces(t):
        flat = buffer[: piece.numel()]
        flat.view(piece.shape).copy_(piece)
        if p == 2.0 and not wide.is_complex:
            norms.append(flat.square_().sum().sqrt().reshape(1))
        else:
            norms.append(torch.linalg.vector_norm(flat, p).reshape(1))
    return norms


def _body_partials(flat: Tensor, p: float, scratch: _Scratch) -> list[Tensor]:
    """Partial norms of a dense 1-D tensor whose length ``_ROW`` divides."""
    if flat.numel() == 0:
        return []
    if _is_real_inf(p, flat.dtype):
        return [_abs_max(flat)]
    if _widens(flat.dtype, p):
        return _widened_partials(flat, p, scratch)
    if _accumulate_dtype(flat.dtype) is not None:
        return _widened_row_norms(flat, p, scratch)
    return [_row_norms(flat, p)]


def _flat_partials(flat: Tensor, p: float, scratch: _Scratch) -> list[Tensor]:
    """Partial norms of any dense 1-D tensor: the row-aligned body, then the tail."""
    body = flat.numel() - flat.numel() % _ROW
    parts = _body_partials(flat[:body], p, scratch)
    if body < flat.numel():
        tail = flat[body:]
        if _is_real_inf(p, flat.dtype):
            parts.append(_abs_max(tail))
        else:
            acc = _range_dtype(flat.dtype, p, _CPU)
            parts.append(torch.linalg.vector_norm(tail, p, dtype=acc).reshape(1))
    return parts


def _strided_partials(t: Tensor, p: float, scratch: _Scratch) -> Tensor:
    """Partial norms of a tensor with gaps in memory, read in place (no copy).

    Its last dim is split into rows of ``_ROW`` (a view for any strides) and each row
    reduced; the ragged ends form one more set of rows. Where float32 powers would leave
    float32's range, pieces are copied to a double scratch instead.
    """
    if _is_real_inf(p, t.dtype):
        return _abs_max(t)
    if _widens(t.dtype, p):
        return torch.cat(_widened_partials(t, p, scratch))
    acc = _accumulate_dtype(t.dtype)
    length = t.shape[-1]
    body = length - length % _ROW
    parts = []
    if body:
        rows = t[..., :body].view(*t.shape[:-1], body // _ROW, _ROW)
        parts.append(torch.linalg.vector_norm(rows, p, dim=-1, dtype=acc).reshape(-1))
    if body < length:
        parts.append(torch.linalg.vector_norm(t[..., body:], p, dim=-1, dtype=acc).reshape(-1))
    return torch.cat(parts)


def _packed_partials(run: list[Tensor], p: float, scratch: _Scratch) -> list[Tensor]:
    """Partial norms of tensors that ``torch.cat`` joins: one copy, one reduction."""
    return _flat_partials(torch.cat(run).reshape(-1), p, scratch)  # cat keeps channels-last


class _Packer:
    """Small tensors of two or more dims (or none) packed in runs of <= ``_PACK_RUN`` elements.

    Tensors whose shapes agree past dim 0 concatenate along it without a per-tensor
    ``view``; a full run is reduced at once, so at most one run's copy is alive.
    """

    def __init__(self, p: float, scratch: _Scratch) -> None:
        self.p = p
        self.scratch = scratch
        self.parts: list[Tensor] = []
        self._runs: dict[int | tuple[int, ...], list[Tensor]] = {}
        self._sizes: dict[int | tuple[int, ...], int] = {}

    def add(self, t: Tensor, numel: int, dims: int) -> None:
        """Queue ``t`` (``numel`` > 0 elements, ``dims`` != 1 dims) for packing."""
        if dims == 2:
            key: int | tuple[int, ...] = t.size(1)  # 5x cheaper than slicing the shape
        elif dims == 0:
            t, key = t.view(1), ()
        else:
            key = tuple(t.shape[1:])
        run = self._runs.get(key)
        if run is None or self._sizes[key] + numel > _PACK_RUN:
            if run:
                self.parts.extend(_packed_partials(run, self.p, self.scratch))
            run = self._runs[key] = []
            self._sizes[key] = 0
        run.append(t)
        self._sizes[key] += numel

    def flush(self) -> list[Tensor]:
        """Reduce the runs still open; return every partial norm."""
        for run in self._runs.values():
            self.parts.extend(_packed_partials(run, self.p, self.scratch))
        self._runs.clear()
        self._sizes.clear()
        return self.parts


def _large_partials(t: Tensor, p: float, scratch: _Scratch) -> tuple[list[Tensor], Tensor | None]:
    """Partial norms of a large tensor read in place, and its tail to pack (or None)."""
    flat = _cpu.dense_flat_view(t)
    if flat is None:
        return [_strided_partials(t, p, scratch)], None
    ragged = flat.numel() % _ROW
    if not ragged:  # the usual case: no slicing, which costs as much as a small kernel
        return _body_partials(flat, p, scratch), None
    body = flat.numel() - ragged
    return _body_partials(flat[:body], p, scratch), flat[body:]


def _cpu_partials(tensors: list[Tensor], p: float) -> list[Tensor]:
    """Partial norms of one dense CPU group: the C reduction where it applies, else torch's."""
    if not _cpu.supports(p, tensors[0].dtype):
        return _torch_cpu_partials(tensors, p)
    dense, gappy = _cpu.split_dense(tensors)
    parts = [_cpu.norm_partial(dense, p)] if dense else []
    scratch = _Scratch()
    return parts + [_strided_partials(t, p, scratch) for t in gappy]


def _torch_cpu_partials(tensors: list[Tensor], p: float) -> list[Tensor]:
    """Partial norms of one dense CPU group from torch ops: large tensors in place, small
    ones packed. The real inf-norm is one ``aminmax`` per tensor or packed run; powers
    that would leave float32's range are taken in double (:func:`_range_dtype`).

    Small 1-D tensors (the usual biases and norms) take the short path through this
    loop: on thousands of them the Python cost per tensor is what shows.
    """
    parts: list[Tensor] = []
    scratch = _Scratch()
    others = _Packer(p, scratch)
    run: list[Tensor] = []
    run_size = 0
    # Last to first: the pass that usually follows (the scale, or a fused optimizer step)
    # runs first to last, and then finds the grads it starts with still in cache.
    for t in reversed(tensors):
        numel = t.numel()
        if numel >= _PACK_BELOW:
            large, tail = _large_partials(t, p, scratch)
            parts.extend(large)
            if tail is None:
                continue
            t, numel = tail, tail.numel()
        elif numel == 0:
            continue
        elif (dims := t.dim()) != 1:
            others.add(t, numel, dims)
            continue
        if run_size + numel > _PACK_RUN:
            parts.extend(_packed_partials(run, p, scratch))
            run, run_size = [], 0
        run.append(t)
        run_size += numel
    if run:
        parts.extend(_packed_partials(run, p, scratch))
    return parts + others.flush()


def _group_partial_norms(tensors: list[Tensor], p: float, foreach: bool | None) -> list[Tensor]:
    """Partial p-norms of one (device, dtype) group, each tensor's contribution once."""
    device, dtype = tensors[0].device, tensors[0].dtype
    acc = _range_dtype(dtype, p, device)
    if tensors[0].is_sparse:
        values = [_sparse_values(t) for t in tensors]
        if device.type == "cpu":
            return _torch_cpu_partials(values, p)
        return [torch.linalg.vector_norm(v, p, dtype=acc).reshape(1) for v in values]
    if device.type == "cpu":
        return _cpu_partials(tensors, p)
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return []
    # float32 grads take float64 partials here: _foreach_norm accumulates in its output
    # dtype; vector_norm first copies the tensor to it.
    if _uses_foreach(device, foreach):
        return [torch.stack(torch._foreach_norm(tensors, p, dtype=acc))]
    return [torch.linalg.vector_norm(t, p, dtype=acc).reshape(1) for t in tensors]


def _combine(partials: Tensor, p: float) -> Tensor:
    """The p-norm of a vector of partial p-norms: a max, or a cascade sum of p-th powers."""
    if p == _INF:
        return partials.amax()
    if p == 2.0:
        return partials.square().sum().sqrt()
    if p == 1.0:
        return partials.sum()
    return partials.pow(p).sum().pow(1.0 / p)


def _holds_values(t: Tensor) -> bool:
    return t._nnz() > 0 if t.is_sparse else t.numel() > 0


def _group_in_cpp(tensors: Sequence[Tensor]) -> dict[GroupKey, list[Tensor]]:
    """(device, dtype) groups by torch's C++ helper (as in ``torch.nn.utils``).

    Groups come in order of first appearance, and each keeps its tensors' order: the
    helper's own dict order is unspecified, but it reports each tensor's index.
    """
    if not tensors:
        return {}
    listed = cast(list[Tensor | None], list(tensors))
    grouped = torch._C._group_tensors_by_device_and_dtype([listed], True)
    by_first_index = sorted(grouped.items(), key=lambda item: item[1][1][0])
    return {key: cast(list[Tensor], lists[0]) for key, (lists, _) in by_first_index}


def _groups(tensors: Sequence[Tensor]) -> Groups:
    """Dense and sparse (device, dtype) groups in order of first appearance, none empty.

    Dense tensors with no elements may remain in a group; sparse ones without values
    are dropped. The order is fixed so that eager and compiled runs add the same
    partial norms in the same order.
    """
    if not any(t.is_sparse for t in tensors):
        return _group_in_cpp(tensors), {}
    dense: dict[GroupKey, list[Tensor]] = {}
    sparse: dict[GroupKey, list[Tensor]] = {}
    for t in tensors:
        if not t.is_sparse:
            dense.setdefault((t.device, t.dtype), []).append(t)
        elif t._nnz() > 0:
            sparse.setdefault((t.device, t.dtype), []).append(t)
    return dense, sparse


def total_norm(tensors: Sequence[Tensor], p: float, foreach: bool | None = None) -> Tensor:
    """The p-norm of all ``tensors`` taken together, as one 0-dim tensor.

    Args:
      tensors: dense or sparse COO tensors; may mix devices and dtypes. Empty tensors
        contribute nothing (the inf-norm of an empty tensor would raise in torch).
      p: a validated norm order, ``> 0`` or ``math.inf``.
      foreach: use multi-tensor kernels (True), per-tensor ones (False) or pick (None).
        CPU tensors always take the exact blocked and packed paths described above:
        ``_foreach_norm`` on CPU is a loop of flat ``vector_norm`` calls, slower and
        accumulated over whole tensors.

    Returns:
      A 0-dim tensor on the first tensor's device, float32 (float64 if any input is
      double precision). With no tensors at all, ``tensor(0.)`` on CPU; with only empty
      ones, a zero on the first one's device.
    """
    return grouped_total_norm(tensors, p, foreach)[0]


def grouped_total_norm(
    tensors: Sequence[Tensor], p: float, foreach: bool | None = None
) -> tuple[Tensor, Groups]:
    """:func:`total_norm`, and the groups it split ``tensors`` into, for :func:`scale_groups_`.

    A clip that measures and then scales the same tensors groups them once: on
    thousands of small grads the grouping costs as much as a tenth of the clip.
    """
    out_device = next((t.device for t in tensors if _holds_values(t)), None)
    if out_device is None:  # nothing to measure: a zero where a norm would have been
        device = tensors[0].device if tensors else None
        zero = torch.zeros((), dtype=result_dtype([t.dtype for t in tensors]), device=device)
        return zero, ({}, {})
    dense, sparse = _groups(tensors)
    out_dtype = result_dtype([dtype for _, dtype in (*dense, *sparse)])
    wide = combine_dtype(out_device)
    partials: list[Tensor] = []
    for group in (*dense.values(), *sparse.values()):
        for part in _group_partial_norms(group, p, foreach):
            partials.append(part.to(device=out_device, dtype=wide))
    return _combine(torch.cat(partials), p).to(out_dtype), (dense, sparse)


def per_tensor_norms(tensors: Sequence[Tensor], p: float, foreach: bool | None = None) -> Tensor:
    """The p-norm of each tensor, in one 1-D tensor in the order given (for per-tensor rules).

    One ``torch._foreach_norm`` per (device, dtype) group (one ``vector_norm`` per
    tensor with ``foreach=False``, and for sparse ones, by their values), accumulating
    as :func:`total_norm` does on CUDA; the groups' norms are put back in order on the
    host (a list, no index tensor) and stacked once on the first tensor's device, in
    float32 (float64 if any tensor is double). Empty tensors have norm 0.
    """
    if not tensors:
        raise ValueError("per_tensor_norms needs at least one tensor")
    out_device = tensors[0].device
    out_dtype = result_dtype([t.dtype for t in tensors])
    norms: list[Tensor | None] = [None] * len(tensors)
    grouped: dict[GroupKey, list[int]] = {}
    for index, t in enumerate(tensors):
        if t.is_sparse or t.numel() == 0:
            values = _sparse_values(t) if t.is_sparse else t
            acc = _range_dtype(t.dtype, p, t.device)
            norms[index] = (
                torch.linalg.vector_norm(values, p, dtype=acc)
                if values.numel()
                else torch.zeros((), dtype=t.dtype, device=t.device)
            )
        else:
            grouped.setdefault((t.device, t.dtype), []).append(index)
    for (device, dtype), indices in grouped.items():
        group = [tensors[i] for i in indices]
        acc = _range_dtype(dtype, p, device)
        if foreach is False:
            found = [torch.linalg.vector_norm(t, p, dtype=acc) for t in group]
        else:
            found = list(torch._foreach_norm(group, p, dtype=acc))
        for i, norm in zip(indices, found, strict=True):
            norms[i] = norm
    ready = [cast(Tensor, n).to(device=out_device, dtype=out_dtype) for n in norms]
    return torch.stack(ready)


def combine_dtype(device: torch.device) -> torch.dtype:
    """float64 on CPU and CUDA, float32 elsewhere (MPS and some XPUs have no double): the
    square of a float32 norm past 1.8e19 (or below 1e-19) leaves float32's range, though
    the norm itself does not."""
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def clip_coefficient(max_norm: float | Tensor, norm: Tensor) -> Tensor:
    """``min(1, max_norm / (norm + EPS))`` on ``norm``'s device, without a host sync.

    A tensor ``max_norm`` of inf gives exactly 1.0, as a float inf scales nothing:
    ``inf / (inf + EPS)`` would otherwise turn an inf norm's grads into NaN. Two
    coefficients are NaN, so that the grads turn NaN (or a ``nonfinite`` policy skips or
    raises) rather than change silently:

    - a tensor ``max_norm`` that is not > 0 (negative, zero, NaN; a float one is refused
      before anything runs), which would flip or zero every grad;
    - a coefficient below the dtype's smallest normal number (``norm / max_norm`` past
      8.5e37 in float32), whose reciprocal, the ``grad_scale`` a fused optimizer divides
      by, overflows: the folded step and the explicit one then agree.

    An infinite norm still gives 0, as in torch.
    """
    coef: Tensor = torch.clamp(max_norm / (norm + EPS), max=1.0)
    invalid = (coef > 0) & (coef < torch.finfo(coef.dtype).tiny)
    if isinstance(max_norm, Tensor):
        limit = _beside(max_norm, coef)
        coef = torch.where(limit == math.inf, 1.0, coef)
        invalid = invalid | ~(limit > 0)
    return torch.where(invalid, math.nan, coef)


def _beside(value: Tensor, other: Tensor) -> Tensor:
    """``value`` on ``other``'s device; a CPU scalar is read by an add, never copied.

    ``torch.where`` would copy a CPU condition to the device, a blocking transfer.
    """
    if value.device == other.device:
        return value
    return other.new_zeros(()) + value


def scale_(tensors: Sequence[Tensor], coef: Tensor, foreach: bool | None = None) -> None:
    """Multiply every tensor in place by the 0-dim ``coef`` (moved to each device once).

    Dense CPU grads of float32, float64 and bfloat16 take one call into the C kernel of
    :mod:`clipopt._cpu`, whatever ``foreach`` says (it rounds as ``mul_`` does, and
    writes nothing when ``coef`` is exactly 1). Other dense groups use one
    ``_foreach_mul_`` unless ``foreach=False``. Sparse COO tensors are scaled one by one.
    """
    sparse = [t for t in tensors if t.is_sparse]
    dense = [t for t in tensors if not t.is_sparse] if sparse else list(tensors)
    scale_groups_((_group_in_cpp(dense), group_by_device_and_dtype(sparse)), coef, foreach)


_COEF_DTYPES = (torch.float32, torch.float64)


def _refuse_inference_tensors(tensors: list[Tensor]) -> None:
    if not any(map(Tensor.is_inference, tensors)):
        return
    for t in tensors:
        if t.is_inference():
            raise RuntimeError(
                f"cannot scale a grad of shape {tuple(t.shape)} in place: it is an inference "
                "tensor and inference mode is off (torch's mul_ refuses this too); clone it "
                "outside torch.inference_mode() first"
            )


def _scale_cpu_group_(group: list[Tensor], coef: Tensor, foreach: bool | None) -> None:
    """Scale one dense CPU group: dense grads by one C call, grads with gaps by torch;
    all of them by torch where the C kernel does not scale the group.

    Raises:
      RuntimeError: a grad is an inference tensor and inference mode is off, where
        ``mul_`` would refuse it too; checked before any grad is touched.
    """
    if not torch.compiler.is_compiling() and not torch.is_inference_mode_enabled():
        _refuse_inference_tensors(group)
    if not (_cpu.scales(group[0].dtype) and coef.dtype in _COEF_DTYPES):
        _scale_by_torch_(group, coef, foreach)
        return
    dense, gappy = _cpu.split_dense(group)
    if dense:
        _cpu.scale_(dense, coef)
    if gappy:
        torch._foreach_mul_(gappy, coef)


def _scale_by_torch_(group: list[Tensor], coef: Tensor, foreach: bool | None) -> None:
    if foreach is False:
        for t in group:
            t.mul_(coef)
    else:
        torch._foreach_mul_(group, coef)


def scale_groups_(groups: Groups, coef: Tensor, foreach: bool | None = None) -> None:
    """:func:`scale_` over tensors already grouped, e.g. by :func:`grouped_total_norm`."""
    dense, sparse = groups
    coef_on: dict[torch.device, Tensor] = {}
    for (device, _), group in dense.items():
        coef_here = coef_on.setdefault(device, coef.to(device))
        if device.type == "cpu":
            _scale_cpu_group_(group, coef_here, foreach)
        else:
            _scale_by_torch_(group, coef_here, foreach)
    for group in sparse.values():
        for t in group:
            t.mul_(coef_on.setdefault(t.device, coef.to(t.device)))
