"""AGC's units (dim-0 rows of a tensor of 2+ dims, else the whole) and their norms across ranks."""

from __future__ import annotations

import functools
import itertools
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from clipopt._dist import _mesh
from clipopt._dist._mesh import REDUCE_DTYPE
from clipopt._kernels import _scale
from clipopt._kernels._norms import accumulate_dtype, combine_dtype, per_tensor_norms

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement


@dataclass(frozen=True)
class Rows:
    """This rank's units of a tensor: ``count`` of the whole's ``units`` from ``start``."""

    units: int
    start: int
    count: int


def _layout_error(t: DTensor, why: str) -> ValueError:
    return ValueError(
        f"AGC cannot measure the units of a parameter of shape {tuple(t.shape)} with "
        f"placements {t.placements} on {t.device_mesh}: {why}"
    )


def local_rows(t: Tensor) -> Rows:
    """This rank's units of ``t``; a ValueError where a DTensor's are not one range."""
    if not _mesh.dtensors([t]):
        units = t.shape[0] if t.dim() >= 2 else 1
        return Rows(units, 0, units)
    grad, mesh = cast("DTensor", t), cast("DTensor", t).device_mesh
    for placement in grad.placements:
        if placement.is_partial():
            why = "a Partial tensor has no norm until it is reduced; redistribute it first"
            raise _layout_error(grad, why)
        if not placement.is_replicate() and not hasattr(placement, "dim"):
            raise _layout_error(grad, "only Shard and Replicate say where its units are")
    if grad.dim() <= 1:
        return Rows(1, 0, 1)
    at = tuple(mesh.get_coordinate() or ())
    rows = rows_at(tuple(grad.shape), tuple(mesh.shape), at, tuple(grad.placements))
    if rows is None:
        why = (
            "its rows are strided across ranks; exclude it (AGC(exclude=...)) or shard it otherwise"
        )
        raise _layout_error(grad, why)
    if grad._local_tensor.shape[0] != rows.count:
        raise _layout_error(
            grad, f"its shard holds {grad._local_tensor.shape[0]} rows, not {rows.count}"
        )
    return rows


@functools.lru_cache(maxsize=4096)
def rows_at(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[Placement, ...],
) -> Rows | None:
    """The rows the rank at ``coordinate`` holds; None when some rank's are not one range."""
    from torch.distributed.tensor import _utils
    from torch.distributed.tensor import placement_types as kinds

    def held(at: Sequence[int]) -> tuple[int, int]:
        compute = getattr(_utils, "_compute_local_shape_and_global_offset", None)  # 2.7 on
        if compute is not None:
            local, offset = compute(shape, mesh_shape, list(at), placements)
        else:  # what torch 2.6 reads of a mesh
            mesh: Any = types.SimpleNamespace(
                ndim=len(mesh_shape), size=mesh_shape.__getitem__, get_coordinate=lambda: list(at)
            )
            local, offset = _utils.compute_local_shape_and_global_offset(shape, mesh, placements)
        return offset[0] if local[0] else shape[0], local[0]

    splitting = [m for m, p in enumerate(placements) if getattr(p, "dim", None) == 0]
    strided = getattr(kinds, "_StridedShard", kinds.Shard)
    if not any(isinstance(placements[m], strided) for m in splitting):
        start, count = 0, shape[0]
        for m in splitting:
            length = -(-count // mesh_shape[m])
            begin = min(coordinate[m] * length, count)
            start, count = start + begin, min(begin + length, count) - begin
        return Rows(shape[0], start, count)
    ranges = []
    for indices in itertools.product(*(range(mesh_shape[m]) for m in splitting)):
        other = list(coordinate)
        for m, index in zip(splitting, indices, strict=True):
            other[m] = index
        start, count = held(other)
        ranges += [(start, start + count)] if count else []
    edges = [edge for pair in sorted(ranges) for edge in pair]
    if edges[1:-1:2] != edges[2::2] or edges[:1] + edges[-1:] not in ([], [0, shape[0]]):
        return None
    return Rows(shape[0], *held(coordinate))


def unit_norms(
    tensors: Sequence[Tensor],
    device: torch.device,
    dtype: torch.dtype,
    whole: Sequence[Tensor] = (),
) -> Tensor:
    """The L2 norm of every unit of every tensor, then of each of ``whole``, 1-D in order
    (half types accumulate in float32, as timm's ``unitwise_norm``)."""
    every = [*tensors, *whole]
    parts: dict[int, Tensor] = {}
    grouped: dict[tuple[torch.device, torch.dtype, bool], list[int]] = {}
    for i, t in enumerate(every):
        one = i >= len(tensors) or t.dim() <= 1
        segmented = _scale.batched(t.device) and t.is_contiguous() and not t.is_complex()
        if t.is_sparse:  # only a whole one: AGC refuses sparse grads it clips
            parts[i] = per_tensor_norms([t], 2.0)
        elif segmented or (one and t.numel() > 0):  # one foreach norm per device and dtype
            grouped.setdefault((t.device, t.dtype, segmented), []).append(i)
        else:
            dims = None if one else tuple(range(1, t.dim()))
            parts[i] = torch.linalg.vector_norm(t, 2.0, dim=dims, dtype=accumulate_dtype(t.dtype))
    for (here, kind, segmented), at in grouped.items():
        group = [every[i] for i in at]
        if not segmented:
            norms = torch._foreach_norm(group, 2.0, dtype=accumulate_dtype(kind))
            parts.update(zip(at, norms, strict=True))
            continue
        units = [
            t.shape[0] if i < len(tensors) and t.dim() >= 2 else 1
            for i, t in zip(at, group, strict=True)
        ]
        lengths = _scale.runs(
            [(t.numel() // u if u else 0, u) for t, u in zip(group, units, strict=True)], here
        )
        flat = torch.cat([t.view(-1) for t in group]).to(accumulate_dtype(kind) or kind)
        sums = torch.segment_reduce(flat.mul_(flat), "sum", lengths=lengths, unsafe=True)
        parts.update(zip(at, torch.split(sums.sqrt(), units), strict=True))
    found = [parts[i].reshape(-1) for i in range(len(every))]
    if len({(part.device, part.dtype) for part in found}) == 1:  # one cast, not one a tensor
        return torch.cat(found).to(device=device, dtype=dtype)
    return torch.cat([part.to(device=device, dtype=dtype) for part in found])


def _placed(share: Tensor, rows: Rows, replicas: int) -> Tensor:
    share = share.div(replicas) if replicas > 1 else share
    if rows.count == rows.units:
        return share
    return F.pad(share, (rows.start, rows.units - rows.start - rows.count))


@dataclass(frozen=True)
class UnitNorms:
    """``check`` (``strict`` only): NaN where the ranks' counts of grads differ, else 0."""

    grads: Tensor
    weights: Tensor
    rows: list[Rows]
    grad_squares: Tensor
    whole_squares: Tensor
    check: Tensor | None = None


def whole_unit_norms(
    grads: Sequence[Tensor | None],
    weights: Sequence[Tensor],
    dtype: torch.dtype,
    whole: Sequence[Tensor | None] = (),
    strict: bool = False,
) -> UnitNorms:
    """Every unit's norm of every grad (None: none on this rank) and its weight, and each of
    ``whole``'s squared norm, across ranks in ONE float64 ``all_reduce``."""
    present = [g for g in grads if g is not None]
    tensors = [*present, *(w.detach() for w in weights), *(t for t in whole if t is not None)]
    measured = len(present) + len(weights)
    found = _mesh.dtensors(tensors)
    if not found:
        if strict:
            raise ValueError("strict whole_unit_norms measures DTensor parameters, got plain ones")
        device = tensors[0].device
        rows = [local_rows(g) for g in present]
        norms = unit_norms(tensors[:measured], device, combine_dtype(device), tensors[measured:])
        own, theirs, rest = torch.split(norms, [sum(r.units for r in rows)] * 2 + [len(whole)])
        return UnitNorms(own.to(dtype), theirs.to(dtype), rows, own.square(), rest.square())
    _mesh.check_unmixed(tensors, found, "grads and weights")
    for g, w in zip(grads, cast("list[DTensor]", weights), strict=True):
        grad = cast("DTensor | None", g)
        if grad is None:
            continue
        if (grad.placements, grad.device_mesh) != (w.placements, w.device_mesh):
            raise _layout_error(
                w, f"its grad has placements {grad.placements} on {grad.device_mesh}"
            )
        mine, its = tuple(grad._local_tensor.shape), tuple(w._local_tensor.shape)
        if mine != its:
            raise _layout_error(w, f"its grad's shard is {mine}, not {its}")
    rows = [local_rows(w) for w in weights]
    mesh, device = _mesh.reduction_mesh(found), found[0].device
    shards = [t._local_tensor for t in found]
    squares = unit_norms(shards[:measured], device, REDUCE_DTYPE, shards[measured:]).square()
    slots = list(
        zip([*grads, *weights, *whole], [*rows, *rows, *[Rows(1, 0, 1)] * len(whole)], strict=True)
    )
    parts = iter(torch.split(squares, [r.count for t, r in slots if t is not None]))
    shares = [
        _placed(next(parts), r, _mesh.replica_count(cast("DTensor", t), mesh))
        if t is not None
        else squares.new_zeros(r.units)
        for t, r in slots
    ]
    count = len(tensors) - len(weights) if strict else None
    reduced = _mesh.all_reduce(shares, True, _mesh.mesh_groups(mesh), device, count, mesh.size())
    units = [sum(r.units for r in rows)] * 2 + [len(whole)]
    own, theirs, rest = torch.split(reduced[:-1] if strict else reduced, units)
    wide = combine_dtype(device)
    return UnitNorms(
        own.sqrt().to(device=device, dtype=dtype),
        theirs.sqrt().to(device=device, dtype=dtype),
        rows,
        own.to(device=device, dtype=wide),
        rest.to(device=device, dtype=wide),
        reduced[-1].to(device=device, dtype=wide) if strict else None,
    )
