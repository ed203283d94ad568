"""Norm kernels over lists of gradients, grouped by device and dtype (the scales that
use their norms are :mod:`clipopt._kernels._scale`).

Everything here stays on the tensors' devices: no value is read on the host, and no
Python branch depends on one. Callers validate arguments first: the functional API, the
cross-rank reduction and the wrapper's step.

A total p-norm is the p-norm of partial p-norms, so every path reduces each
(device, dtype) group to short vectors of partial norms and combines those with one
``sum`` of p-th powers (``torch.sum`` is a cascade sum, accurate to a few ulp).

CPU, p in (1, 2, inf) and float32, float64, bfloat16 or float16 grads: every grad
whose memory is dense (contiguous, or contiguous up to a permutation of its dims, e.g.
channels-last) is read by one call into the C reduction of :mod:`clipopt._kernels._cpu`,
on torch's own threads, at the speed of ``torch.sum`` (float16's 1- and 2-norm at
about half of it on CPUs without F16C); grads with gaps in memory (a strided slice) are
reduced in place by torch ops, their last dim split into rows.

CPU, any other p or dtype (complex), strided grads, or any case where the C kernel is
not in use (not built, or ``CLIPOPT_DISABLE_NATIVE``): blocked and packed torch ops, in
:mod:`clipopt._kernels._torch_norms`, with powers that would leave float32's range taken in
double.

Other devices (CUDA): one torch's foreach norm per (device, dtype) group (one
``vector_norm`` per grad with ``foreach=False``), accumulating in :func:`range_dtype`:
float32 for half types, float64 for float32 and bfloat16 powers on CUDA.

Its length (about 300 lines) is the dispatch above: one place chooses the path of each
(device, dtype, layout) group, as torch's ``clip_grad.py`` chooses foreach in one place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor

from clipopt import _torch_internals
from clipopt._kernels import _cpu
from clipopt._kernels._plan import GroupKey, Groups, group
from clipopt._kernels._torch_norms import (
    Scratch,
    combine_dtype,
    range_dtype,
    strided_partials,
    torch_cpu_partials,
)

__all__ = [
    "Groups",
    "combine_dtype",
    "group",
    "group_by_device_and_dtype",
    "grouped_total_norm",
    "per_tensor_norms",
    "result_dtype",
    "total_norm",
]

_INF = math.inf


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


def _sparse_values(t: Tensor) -> Tensor:
    """The values that define a sparse COO tensor's norm (duplicates summed first)."""
    return t.coalesce().values()


def _uses_foreach(device: torch.device, foreach: bool | None) -> bool:
    """foreach=None means: multi-tensor kernels where the device has fast ones (not CPU)."""
    if foreach is None:
        return device.type != "cpu"
    return foreach


def _cpu_partials(groups: Groups, key: GroupKey, p: float) -> list[Tensor]:
    """Partial norms of one dense CPU group: the C reduction where it applies, else torch's."""
    tensors = groups.dense[key]
    if not _cpu.supports(p, key[1]):
        return torch_cpu_partials(tensors, p)
    run, gappy = groups.split(key)
    parts = [_cpu.norm_partial(run, p)] if run.tensors else []
    scratch = Scratch()
    return parts + [strided_partials(t, p, scratch) for t in gappy]


def _sparse_partial_norms(tensors: list[Tensor], p: float) -> list[Tensor]:
    """Partial p-norms of one sparse (device, dtype) group, by their values."""
    device = tensors[0].device
    acc = range_dtype(tensors[0].dtype, p, device)
    values = [_sparse_values(t) for t in tensors]
    if device.type == "cpu":
        return torch_cpu_partials(values, p)
    return [torch.linalg.vector_norm(v, p, dtype=acc).reshape(1) for v in values]


def _dense_partial_norms(
    groups: Groups, key: GroupKey, p: float, foreach: bool | None
) -> list[Tensor]:
    """Partial p-norms of one dense (device, dtype) group, each tensor's contribution once."""
    device, dtype = key
    if device.type == "cpu":
        return _cpu_partials(groups, key, p)
    acc = range_dtype(dtype, p, device)
    tensors = groups.dense[key]
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return []
    # float32 grads take float64 partials here: _foreach_norm accumulates in its output
    # dtype; vector_norm first copies the tensor to it.
    if _uses_foreach(device, foreach):
        return [torch.stack(_torch_internals.foreach_norm(tensors, p, dtype=acc))]
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
    # Loops, not next(..., default): torch 2.6's dynamo cannot trace the default.
    out_device = None
    for t in tensors:
        if _holds_values(t):
            out_device = t.device
            break
    if out_device is None:  # nothing to measure: a zero where a norm would have been
        device = tensors[0].device if tensors else None
        zero = torch.zeros((), dtype=result_dtype([t.dtype for t in tensors]), device=device)
        return zero, Groups({}, {}, {}, False)
    groups = group(tensors)
    run = _one_run(groups, p)
    if run is not None:
        return _run_norm(run, p), groups
    out_dtype = result_dtype([dtype for _, dtype in (*groups.dense, *groups.sparse)])
    wide = combine_dtype(out_device)
    partials: list[Tensor] = []
    for key in groups.dense:
        partials += _dense_partial_norms(groups, key, p, foreach)
    for tensors_of_key in groups.sparse.values():
        partials += _sparse_partial_norms(tensors_of_key, p)
    moved = [part.to(device=out_device, dtype=wide) for part in partials]
    return _combine(torch.cat(moved), p).to(out_dtype), groups


def _one_run(groups: Groups, p: float) -> _cpu.Run | None:
    """The run of the C kernel that reads every tensor of ``groups``, if one does: a
    single dense CPU group without gaps. None otherwise, and under ``torch.compile``."""
    if len(groups.dense) != 1 or groups.sparse or torch.compiler.is_compiling():
        return None
    ((device, dtype),) = groups.dense
    if device.type != "cpu" or not _cpu.supports(p, dtype):
        return None
    run, gappy = groups.split((device, dtype))
    return run if run.tensors and not gappy else None


def _run_norm(run: _cpu.Run, p: float) -> Tensor:
    """The total norm of one run's tensors, as one 0-dim tensor.

    The same bits as the general path, which squares the run's one float64 partial,
    sums it (alone), takes the root (for p=2; for 1 and inf the partial is the norm) and
    rounds to the result dtype: here the square is taken on the host, on the float the
    kernel returns (a double product, as torch's), and the root by torch (whose double
    ``sqrt`` is not always ``math.sqrt``'s, correctly rounded, result). After the
    kernel's pass over thousands of small grads each torch op cost 20-30 us (many_small:
    175 us for the general path's six, 80 us for these three).
    """
    value = _cpu.norm_value(run, p)
    dtype = result_dtype([run.tensors[0].dtype])
    if p != 2.0:
        return torch.tensor(value, dtype=dtype)
    return torch.tensor(value * value, dtype=torch.float64).sqrt_().to(dtype)


def per_tensor_norms(tensors: Sequence[Tensor], p: float, foreach: bool | None = None) -> Tensor:
    """The p-norm of each tensor, in one 1-D tensor in the order given (for per-tensor rules).

    One torch's foreach norm per (device, dtype) group (one ``vector_norm`` per
    tensor with ``foreach=False``, and for sparse ones, by their values), accumulating
    as :func:`total_norm` does on CUDA; on the CPU, where the C reduction applies, one
    call into it per group, whatever ``foreach`` says (as :func:`total_norm`), which
    reads every tensor of the group on torch's threads and gives each tensor's norm the
    bits of a call for that tensor alone. The groups' norms are put back in order on the
    host (a list, no index tensor) and stacked once on the first tensor's device, in
    float32 (float64 if any tensor is double). Empty tensors have norm 0.
    """
    if not tensors:
        raise ValueError("per_tensor_norms needs at least one tensor")
    out_device = tensors[0].device
    out_dtype = result_dtype([t.dtype for t in tensors])
    run = _one_readable_group(tensors, p)
    if run is not None:
        return _cpu.tensor_norms(run, p).to(out_dtype)
    norms: list[Tensor | None] = [None] * len(tensors)
    grouped: dict[GroupKey, list[int]] = {}
    for index, t in enumerate(tensors):
        if t.is_sparse or t.numel() == 0:
            values = _sparse_values(t) if t.is_sparse else t
            acc = range_dtype(t.dtype, p, t.device)
            norms[index] = (
                torch.linalg.vector_norm(values, p, dtype=acc)
                if values.numel()
                else torch.zeros((), dtype=t.dtype, device=t.device)
            )
        else:
            grouped.setdefault((t.device, t.dtype), []).append(index)
    for (device, dtype), indices in grouped.items():
        group = [tensors[i] for i in indices]
        acc = range_dtype(dtype, p, device)
        if device.type == "cpu" and _cpu.supports(p, dtype):
            found = _cpu_tensor_norms(group, p, acc)
        elif foreach is False:
            found = [torch.linalg.vector_norm(t, p, dtype=acc) for t in group]
        else:
            found = _torch_internals.foreach_norm(group, p, dtype=acc)
        for i, norm in zip(indices, found, strict=True):
            norms[i] = norm
    ready = [cast(Tensor, n) for n in norms]
    if len({(n.device, n.dtype) for n in ready}) == 1:  # one stack, one cast: not one a tensor
        return torch.stack(ready).to(device=out_device, dtype=out_dtype)
    return torch.stack([n.to(device=out_device, dtype=out_dtype) for n in ready])


def _one_readable_group(tensors: Sequence[Tensor], p: float) -> _cpu.Run | None:
    """The tensors as one run of the C kernel, when it reads them all in eager mode: CPU
    tensors of one dtype it supports, none sparse or with gaps in memory."""
    dtype = tensors[0].dtype
    if torch.compiler.is_compiling() or not _cpu.supports(p, dtype):
        return None
    if any(t.dtype != dtype or t.device.type != "cpu" or t.is_sparse for t in tensors):
        return None
    dense, gappy = _cpu.split_dense(list(tensors))
    return None if gappy else _cpu.Run(dense)


def _cpu_tensor_norms(group: list[Tensor], p: float, acc: torch.dtype | None) -> list[Tensor]:
    """Each CPU tensor's norm: the dense ones by one call into the C reduction
    (``_foreach_norm`` on CPU is a loop of ``vector_norm`` calls, each copying a float32
    tensor to float64 first, 50 times slower), a tensor with gaps in memory by
    ``vector_norm``.

    Under ``torch.compile``, one single-threaded call per tensor, each its own custom op:
    a call per tensor on all threads would wake torch's other threads each time, which
    on a busy machine cost milliseconds per tensor (2-core VM, shared).
    """
    if torch.compiler.is_compiling():
        # Tensor by tensor, not matched by id() as below: torch.compile would guard on
        # each grad's id and recompile whenever zero_grad() made new grads.
        return [
            _cpu.norm_partial([t], p, threads=1).reshape(())
            if _cpu.split_dense([t])[0]
            else torch.linalg.vector_norm(t, p, dtype=acc)
            for t in group
        ]
    dense = _cpu.split_dense(group)[0]
    found = list(_cpu.tensor_norms(_cpu.Run(dense), p).unbind()) if dense else []
    by_id = dict(zip(map(id, dense), found, strict=True))
    return [
        by_id[id(t)] if id(t) in by_id else torch.linalg.vector_norm(t, p, dtype=acc) for t in group
    ]
