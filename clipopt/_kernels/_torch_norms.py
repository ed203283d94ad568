"""Partial norms of CPU grads by torch ops: what the C kernel does not read.

Used for grads with gaps in memory (a strided slice), for orders and dtypes the C
kernel does not compute, and for every CPU grad when it is not in use (not built, or
``CLIPOPT_DISABLE_NATIVE``).

- A tensor of at least ``PACK_BELOW`` elements whose memory is dense is viewed as rows
  of ``ROW`` elements and reduced row-wise, one ``vector_norm(dim=1)`` per tensor.
  Short rows keep float32 accumulation accurate: its error grows with the row length,
  not with the tensor's size, as one flat ``vector_norm``'s does. Its ragged tail joins
  the small tensors.
- Smaller tensors are packed ``PACK_RUN`` elements at a time into one buffer by
  ``torch.cat`` (tensors whose shapes agree past dim 0 join without a per-tensor view),
  which is then reduced row-wise. A per-tensor reduction costs a dispatch per tensor
  and ``_foreach_norm`` on CPU is a loop of them; packing costs one bounded copy.
- Half types are widened to float32 ``CHUNK`` elements at a time in a scratch buffer,
  so nothing proportional to the model is allocated.
- For p > 1 but inf, float32 and bfloat16 grads (strided ones too) are copied
  ``CHUNK`` elements at a time to a double scratch instead, one norm per piece: their
  powers in float32 overflow past 1.8e19 (and vanish below 1e-19) where the norm does
  not (:func:`range_dtype`). The real inf-norm is one ``aminmax`` per tensor or run.

Each group is read last to first: the pass that usually follows (the scale, a fused
optimizer step) runs first to last and so starts on grads still in cache.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

from clipopt._kernels import _cpu

__all__ = [
    "CHUNK",
    "PACK_BELOW",
    "PACK_RUN",
    "ROW",
    "Scratch",
    "accumulate_dtype",
    "combine_dtype",
    "range_dtype",
    "strided_partials",
    "torch_cpu_partials",
]

ROW = 1024
"""Row length of the blocked CPU reduction: short enough for exact float32 sums."""

PACK_BELOW = 1 << 14
"""CPU tensors with fewer elements are packed into a shared buffer before reducing."""

CHUNK = 1 << 18
"""Elements per half-precision scratch (1 MiB of float32)."""

PACK_RUN = 1 << 15
"""Elements per packed run of small tensors. ``torch.cat`` copies serially up to 32768
output elements (ATen's grain size); above that it opens a parallel region per input,
which on thousands of small inputs and two threads costs 4x."""


def combine_dtype(device: torch.device) -> torch.dtype:
    """float64 on CPU and CUDA, float32 elsewhere (MPS and some XPUs have no double): the
    square of a float32 norm past 1.8e19 (or below 1e-19) leaves float32's range, though
    the norm itself does not."""
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype to pass to ``vector_norm``: float32 for half types, None to keep it."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return None


_WIDE = (torch.float64, torch.complex128)


def range_dtype(dtype: torch.dtype, p: float, device: torch.device) -> torch.dtype | None:
    """The dtype to take ``dtype``'s p-th powers in: wide enough for their range.

    A float32 (or bfloat16) element past 1.8e19 squares to inf in float32, and one below
    1e-19 to 0 (less than 1e-23 for subnormals), though the norm is fine; float64 holds
    every p-th power of every float32, subnormals included, for p up to 7. The 1- and
    inf-norms take no powers (a sum of magnitudes cannot pass the norm it adds up to),
    nor do orders below 1 leave the range, and float16's powers fit in float32. Off CPU
    and CUDA (no float64) it is the accumulation dtype alone.

    Returns:
      float64 (complex128 for complex64) where float32 accumulation would leave the
      range, else :func:`accumulate_dtype`'s answer.
    """
    acc = accumulate_dtype(dtype)
    if p <= 1.0 or p == math.inf or combine_dtype(device) != torch.float64:
        return acc
    if dtype in (torch.float32, torch.bfloat16):
        return torch.float64
    if dtype == torch.complex64:
        return torch.complex128
    return acc


_CPU = torch.device("cpu")


def _widens(dtype: torch.dtype, p: float) -> bool:
    """Whether CPU ``dtype`` grads take their p-th powers in a wider dtype than float32."""
    return dtype not in _WIDE and range_dtype(dtype, p, _CPU) in _WIDE


def _is_real_inf(p: float, dtype: torch.dtype) -> bool:
    """The inf-norm of a real dtype: a max reduction, no powers, no accumulation."""
    return p == math.inf and not dtype.is_complex


def _abs_max(t: Tensor) -> Tensor:
    """max |t| of a real tensor as a 1-element tensor, without materialising ``abs``.

    One ``aminmax`` pass; NaN propagates, and for half types the result is exact.
    """
    lo, hi = torch.aminmax(t)
    return torch.maximum(hi, -lo).reshape(1)


def _row_norms(flat: Tensor, p: float) -> Tensor:
    """p-norms of the ``ROW``-element rows of a 1-D tensor whose length they divide."""
    rows = flat.view(-1, ROW)
    norms: Tensor = torch.linalg.vector_norm(rows, p, dim=1, dtype=accumulate_dtype(flat.dtype))
    return norms


class Scratch:
    """Scratch buffers of at most ``CHUNK`` elements, one per dtype, for one group.

    Allocated once per group: a fresh buffer per tensor is a fresh mapping of its pages,
    whose faults cost a transformer's 2-norm a third more.
    """

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A 1-D buffer of ``dtype`` with at least ``min(numel, CHUNK)`` elements."""
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < min(numel, CHUNK):
            buffer = self._buffers[dtype] = torch.empty(min(numel, CHUNK), dtype=dtype)
        return buffer


def _widened_row_norms(flat: Tensor, p: float, scratch: Scratch) -> list[Tensor]:
    """Row norms of a half-precision 1-D tensor, widened to float32 a chunk at a time.

    ``vector_norm(dtype=float32)`` would first copy the whole tensor to float32.
    """
    buffer = scratch.get(flat.numel(), torch.float32)
    norms = []
    for start in range(0, flat.numel(), CHUNK):
        piece = flat[start : start + CHUNK]
        wide = buffer[: piece.numel()]
        wide.copy_(piece)
        norms.append(_row_norms(wide, p))
    return norms


def _pieces(t: Tensor) -> Iterator[Tensor]:
    """Views that cover ``t`` once, each of at most ``CHUNK`` elements (for any strides)."""
    if t.dim() <= 1:
        for start in range(0, t.numel(), CHUNK):
            yield t[start : start + CHUNK]
        return
    inner = t.numel() // t.shape[0]
    if inner > CHUNK:
        for sub in t.unbind(0):
            yield from _pieces(sub)
        return
    step = CHUNK // inner
    for start in range(0, t.shape[0], step):
        yield t[start : start + step]


def _widened_partials(t: Tensor, p: float, scratch: Scratch) -> list[Tensor]:
    """Partial norms of any CPU tensor, its pieces copied to a float64 (or complex128)
    scratch of at most ``CHUNK`` elements, one norm per piece.

    Double sums of 2**18 terms are accurate to about 1e-13, and hold every power that
    :func:`range_dtype` widens for; ``vector_norm(dtype=float64)`` would first copy the
    whole tensor. The 2-norm squares the scratch in place and sums it, two thirds of a
    double ``vector_norm``'s cost; a BLAS ``dot`` would be cheaper still, but MKL's
    threads stalled for milliseconds a call on a busy 2-core machine.
    """
    wide = range_dtype(t.dtype, p, _CPU)
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


def _body_partials(flat: Tensor, p: float, scratch: Scratch) -> list[Tensor]:
    """Partial norms of a dense 1-D tensor whose length ``ROW`` divides."""
    if flat.numel() == 0:
        return []
    if _is_real_inf(p, flat.dtype):
        return [_abs_max(flat)]
    if _widens(flat.dtype, p):
        return _widened_partials(flat, p, scratch)
    if accumulate_dtype(flat.dtype) is not None:
        return _widened_row_norms(flat, p, scratch)
    return [_row_norms(flat, p)]


def _flat_partials(flat: Tensor, p: float, scratch: Scratch) -> list[Tensor]:
    """Partial norms of any dense 1-D tensor: the row-aligned body, then the tail."""
    body = flat.numel() - flat.numel() % ROW
    parts = _body_partials(flat[:body], p, scratch)
    if body < flat.numel():
        tail = flat[body:]
        if _is_real_inf(p, flat.dtype):
            parts.append(_abs_max(tail))
        else:
            acc = range_dtype(flat.dtype, p, _CPU)
            parts.append(torch.linalg.vector_norm(tail, p, dtype=acc).reshape(1))
    return parts


def strided_partials(t: Tensor, p: float, scratch: Scratch) -> Tensor:
    """Partial norms of a tensor with gaps in memory, read in place (no copy).

    Its last dim is split into rows of ``ROW`` (a view for any strides) and each row
    reduced; the ragged ends form one more set of rows. Where float32 powers would leave
    float32's range, pieces are copied to a double scratch instead.
    """
    if _is_real_inf(p, t.dtype):
        return _abs_max(t)
    if _widens(t.dtype, p):
        return torch.cat(_widened_partials(t, p, scratch))
    acc = accumulate_dtype(t.dtype)
    length = t.shape[-1]
    body = length - length % ROW
    parts = []
    if body:
        rows = t[..., :body].view(*t.shape[:-1], body // ROW, ROW)
        parts.append(torch.linalg.vector_norm(rows, p, dim=-1, dtype=acc).reshape(-1))
    if body < length:
        parts.append(torch.linalg.vector_norm(t[..., body:], p, dim=-1, dtype=acc).reshape(-1))
    return torch.cat(parts)


def _packed_partials(run: list[Tensor], p: float, scratch: Scratch) -> list[Tensor]:
    """Partial norms of tensors that ``torch.cat`` joins: one copy, one reduction."""
    return _flat_partials(torch.cat(run).reshape(-1), p, scratch)  # cat keeps channels-last


class _Packer:
    """Small tensors of two or more dims (or none) packed in runs of <= ``PACK_RUN`` elements.

    Tensors whose shapes agree past dim 0 concatenate along it without a per-tensor
    ``view``; a full run is reduced at once, so at most one run's copy is alive.
    """

    def __init__(self, p: float, scratch: Scratch) -> None:
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
        if run is None or self._sizes[key] + numel > PACK_RUN:
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


def _large_partials(t: Tensor, p: float, scratch: Scratch) -> tuple[list[Tensor], Tensor | None]:
    """Partial norms of a large tensor read in place, and its tail to pack (or None)."""
    flat = _cpu.dense_flat_view(t)
    if flat is None:
        return [strided_partials(t, p, scratch)], None
    ragged = flat.numel() % ROW
    if not ragged:  # the usual case: no slicing, which costs as much as a small kernel
        return _body_partials(flat, p, scratch), None
    body = flat.numel() - ragged
    return _body_partials(flat[:body], p, scratch), flat[body:]


def torch_cpu_partials(tensors: list[Tensor], p: float) -> list[Tensor]:
    """Partial norms of one dense CPU group from torch ops: large tensors in place, small
    ones packed. The real inf-norm is one ``aminmax`` per tensor or packed run; powers
    that would leave float32's range are taken in double (:func:`range_dtype`).

    Small 1-D tensors (the usual biases and norms) take the short path through this
    loop: on thousands of them the Python cost per tensor is what shows.
    """
    parts: list[Tensor] = []
    scratch = Scratch()
    others = _Packer(p, scratch)
    run: list[Tensor] = []
    run_size = 0
    # Last to first: the pass that usually follows (the scale, or a fused optimizer step)
    # runs first to last, and then finds the grads it starts with still in cache.
    for t in reversed(tensors):
        numel = t.numel()
        if numel >= PACK_BELOW:
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
        if run_size + numel > PACK_RUN:
            parts.extend(_packed_partials(run, p, scratch))
            run, run_size = [], 0
        run.append(t)
        run_size += numel
    if run:
        parts.extend(_packed_partials(run, p, scratch))
    return parts + others.flush()
