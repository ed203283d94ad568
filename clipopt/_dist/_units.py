"""AGC's units (a row along dim 0 of a tensor of 2 dims or more, else the whole tensor):
where each lies on this rank, and their L2 norms across ranks in one float64 all_reduce."""

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
from clipopt._kernels import _norms
from clipopt._kernels._norms import accumulate_dtype, combine_dtype

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
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


def _sharding() -> tuple[type, type]:
    """Shard, and FSDP2's strided shard (the placement it gives dim 0 over TP)."""
    from torch.distributed.tensor import placement_types as kinds

    return kinds.Shard, getattr(kinds, "_StridedShard", kinds.Shard)


def _shard_dim(placement: Placement) -> int | None:
    return int(cast(Any, placement).dim) if isinstance(placement, _sharding()) else None


def local_rows(t: Tensor) -> Rows:
    """This rank's units of ``t``; a ValueError where a DTensor's are not one range."""
    if not _mesh.dtensors([t]):
        units = t.shape[0] if t.dim() >= 2 else 1
        return Rows(units, 0, units)
    grad = cast("DTensor", t)
    for placement in grad.placements:
        if placement.is_partial():
            why = "a Partial tensor has no norm until it is reduced; redistribute it first"
            raise _layout_error(grad, why)
        if not placement.is_replicate() and _shard_dim(placement) is None:
            raise _layout_error(grad, "only Shard and Replicate say where its units are")
    if grad.dim() <= 1:
        return Rows(1, 0, 1)
    rows = _dtensor_rows(tuple(grad.shape), grad.device_mesh, tuple(grad.placements))
    if grad._local_tensor.shape[0] != rows.count:
        held = grad._local_tensor.shape[0]
        raise _layout_error(grad, f"its shard holds {held} rows, not {rows.count}")
    return rows


@functools.lru_cache(maxsize=4096)
def _dtensor_rows(
    shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> Rows:
    rows = rows_at(shape, tuple(mesh.shape), tuple(mesh.get_coordinate() or ()), placements)
    if rows is None:
        raise ValueError(
            f"AGC needs each rank's rows of a parameter to be one range; a parameter of "
            f"shape {shape} with placements {placements} on {mesh} has rows strided across "
            "ranks; exclude it (AGC(exclude=...)) or shard it otherwise"
        )
    return rows


def _local_shape_and_offset(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: list[int], placements: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The local shape and global offset, by torch's own (private) rule."""
    from torch.distributed.tensor import _utils

    compute = getattr(_utils, "_compute_local_shape_and_global_offset", None)  # 2.7 on
    if compute is not None:
        local, offset = compute(shape, mesh_shape, coordinate, placements)
    else:  # torch 2.6 reads these of a mesh
        mesh: Any = types.SimpleNamespace(
            ndim=len(mesh_shape), size=mesh_shape.__getitem__, get_coordinate=lambda: coordinate
        )
        local, offset = _utils.compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(local), tuple(offset)


def rows_at(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[Placement, ...],
) -> Rows | None:
    """The rows of a tensor of ``shape`` (2 dims or more) the rank at ``coordinate`` holds;
    None when some rank's rows are not one range. Shards cut as ``torch.chunk``; with a
    strided shard, by torch's rule, where all ranks' ranges tile the rows."""
    splitting = [m for m, p in enumerate(placements) if _shard_dim(p) == 0]
    if not any(isinstance(placements[m], _sharding()[1]) for m in splitting):
        start, count = 0, shape[0]
        for m in splitting:
            length = -(-count // mesh_shape[m])
            begin = min(coordinate[m] * length, count)
            start, count = start + begin, min(begin + length, count) - begin
        return Rows(shape[0], start, count)
    ranges: list[tuple[int, int]] = []
    for at in itertools.product(*(range(mesh_shape[m]) for m in splitting)):
        other = list(coordinate)
        for m, index in zip(splitting, at, strict=True):
            other[m] = index
        local, offset = _local_shape_and_offset(shape, mesh_shape, other, placements)
        if local[0]:
            ranges.append((offset[0], offset[0] + local[0]))
    edges = [edge for pair in sorted(ranges) for edge in pair]
    if edges[1:-1:2] != edges[2::2] or edges[:1] + edges[-1:] not in ([], [0, shape[0]]):
        return None
    local, offset = _local_shape_and_offset(shape, mesh_shape, list(coordinate), placements)
    return Rows(shape[0], offset[0] if local[0] else shape[0], local[0])


def unit_norms(
    tensors: Sequence[Tensor],
    device: torch.device,
    dtype: torch.dtype,
    whole: Sequence[Tensor] = (),
) -> Tensor:
    """The L2 norm of every unit of every tensor, then of each of ``whole`` (one unit
    each), 1-D in order; half types accumulate in float32, as timm's ``unitwise_norm``."""
    every = [*tensors, *whole]
    parts: dict[int, Tensor] = {}
    batched: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(every):
        one = i >= len(tensors) or t.dim() <= 1
        if t.is_sparse:  # only a whole one: AGC refuses sparse grads it clips
            parts[i] = _norms.per_tensor_norms([t], 2.0)
        elif one and t.numel() > 0:  # one foreach norm per device and dtype
            batched.setdefault((t.device, t.dtype), []).append(i)
        else:
            dims = None if one else tuple(range(1, t.dim()))
            parts[i] = torch.linalg.vector_norm(t, 2.0, dim=dims, dtype=accumulate_dtype(t.dtype))
    for (_, kind), at in batched.items():
        norms = torch._foreach_norm([every[i] for i in at], 2.0, dtype=accumulate_dtype(kind))
        parts.update(zip(at, norms, strict=True))
    found = [parts[i].reshape(-1) for i in range(len(every))]
    if len({(part.device, part.dtype) for part in found}) == 1:  # one cast, not one a tensor
        return torch.cat(found).to(device=device, dtype=dtype)
    return torch.cat([part.to(device=device, dtype=dtype) for part in found])


def _placed(share: Tensor, rows: Rows, replicas: int) -> Tensor:
    """This rank's shares of a tensor's units, at their positions among all its units."""
    share = share.div(replicas) if replicas > 1 else share
    if rows.count == rows.units:
        return share
    return F.pad(share, (rows.start, rows.units - rows.start - rows.count))


@dataclass(frozen=True)
class UnitNorms:
    """Each unit's norm of the ``grads`` and ``weights``, each grad's :class:`Rows`, the
    ``grad_squares`` and ``whole_squares`` before any root, and ``check`` (``strict``
    only: NaN where the ranks held different numbers of grads, else 0); alike on all ranks."""

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
    """Every unit's norm of every grad and its weight, whole across ranks, and each of
    ``whole``'s squared norm (one unit each): DTensors in ONE float64 ``all_reduce``. A
    None (DTensors) is no grad on this rank. With ``strict`` the ranks' counts of grads
    travel along (:func:`clipopt._dist._mesh.all_reduce`). Layouts it cannot measure raise
    a ValueError on every rank alike, before anything is sent."""
    present = [g for g in grads if g is not None]
    tensors = [*present, *(w.detach() for w in weights), *(t for t in whole if t is not None)]
    measured = len(present) + len(weights)
    found = _mesh.dtensors(tensors)
    units = sum(1 if w.dim() <= 1 else w.shape[0] for w in weights)
    if not found:
        if strict:
            raise ValueError("strict whole_unit_norms measures DTensor parameters, got plain ones")
        device = tensors[0].device
        rows = [local_rows(g) for g in present]
        norms = unit_norms(tensors[:measured], device, combine_dtype(device), tensors[measured:])
        own, theirs, rest = torch.split(norms, [units, units, len(whole)])
        return UnitNorms(own.to(dtype), theirs.to(dtype), rows, own.square(), rest.square())
    _mesh.check_unmixed(tensors, found, "grads and weights")
    for g, w in zip(grads, cast("list[DTensor]", weights), strict=True):
        grad = cast("DTensor | None", g)
        if grad is None:
            continue
        if grad.placements != w.placements or grad.device_mesh != w.device_mesh:
            why = f"its grad has placements {grad.placements} on {grad.device_mesh}"
            raise _layout_error(w, why)
        mine, its = tuple(grad._local_tensor.shape), tuple(w._local_tensor.shape)
        if mine != its:
            raise _layout_error(w, f"its grad's shard is {mine}, not {its}")
    rows = [local_rows(w) for w in weights]
    mesh = _mesh.reduction_mesh(found)
    device = found[0].device
    shards = [t._local_tensor for t in found]
    squares = unit_norms(shards[:measured], device, REDUCE_DTYPE, shards[measured:]).square()
    placed = [*rows, *rows, *[Rows(1, 0, 1)] * len(whole)]
    slots = list(zip([*grads, *weights, *whole], placed, strict=True))
    parts = iter(torch.split(squares, [r.count for t, r in slots if t is not None]))
    shares = [
        squares.new_zeros(r.units)
        if t is None
        else _placed(next(parts), r, _mesh.replica_count(cast("DTensor", t), mesh))
        for t, r in slots
    ]
    count = len(tensors) - len(weights) if strict else None
    groups = _mesh.mesh_groups(mesh, None)
    reduced = _mesh.all_reduce(shares, True, groups, device, count, mesh.size())
    wide = combine_dtype(device)
    own, theirs, rest = torch.split(reduced[:-1] if strict else reduced, [units, units, len(whole)])
    return UnitNorms(
        own.sqrt().to(device=device, dtype=dtype),
        theirs.sqrt().to(device=device, dtype=dtype),
        rows,
        own.to(device=device, dtype=wide),
        rest.to(device=device, dtype=wide),
        reduced[-1].to(device=device, dtype=wide) if strict else None,
    )
