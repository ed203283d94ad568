"""AGC's units (a slice along dim 0 of a tensor of 2 dims or more, or the whole of a 0-
or 1-D one): where each lies on this rank, and their L2 norms across ranks. Each rank
puts its squared shares of its rows (one contiguous range), divided by their replica
count, at the units' global positions: one float64 ``all_reduce`` gives every unit's norm.
"""

from __future__ import annotations

import functools
import math
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

__all__ = [
    "Rows",
    "UnitNorms",
    "local_rows",
    "rows_at",
    "slot_unit_norms",
    "unit_norms",
    "unit_shape",
    "whole_unit_norms",
]


def unit_shape(t: Tensor) -> tuple[int, ...]:
    """One coefficient per unit of ``t``, broadcastable to it: ``(rows, 1, ...)`` for 2
    dims or more, ``()`` for 0 or 1."""
    return (t.shape[0],) + (1,) * (t.dim() - 1) if t.dim() >= 2 else ()


@dataclass(frozen=True)
class Rows:
    """This rank's units of a tensor: ``count`` of the whole's ``units`` from ``start``."""

    units: int
    start: int
    count: int


def _plain_rows(t: Tensor) -> Rows:
    units = t.shape[0] if t.dim() >= 2 else 1
    return Rows(units, 0, units)


def _strided_shard_types() -> tuple[type, ...]:
    """``(_StridedShard,)``, the placement FSDP2 gives dim 0 over TP; ``()`` if absent."""
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return ()
    return (_StridedShard,)


def _layout_error(t: DTensor, why: str) -> str:
    return (
        f"AGC cannot measure the units of a parameter of shape {tuple(t.shape)} with "
        f"placements {t.placements} on {t.device_mesh}: {why}"
    )


def local_rows(t: Tensor) -> Rows:
    """This rank's units of ``t`` (all of a plain tensor's); a ValueError for a DTensor
    whose rows are not one range, or placed otherwise than Shard, _StridedShard or
    Replicate."""
    if not _mesh.dtensors([t]):
        return _plain_rows(t)
    grad = cast("DTensor", t)
    from torch.distributed.tensor.placement_types import Replicate, Shard

    for placement in grad.placements:
        if type(placement) not in (Shard, Replicate, *_strided_shard_types()):
            why = "only Shard and Replicate say where its units are"
            if placement.is_partial():
                why = "a Partial tensor has no norm until it is reduced; redistribute it first"
            elif type(placement).__name__ == "_StridedShard":
                why = f"torch {torch.__version__} has no layout rule for a strided shard"
            raise ValueError(_layout_error(grad, why))
    if grad.dim() <= 1:
        return Rows(1, 0, 1)
    rows = _dtensor_rows(tuple(grad.shape), grad.device_mesh, tuple(grad.placements))
    if grad._local_tensor.shape[0] != rows.count:
        held = grad._local_tensor.shape[0]
        raise ValueError(_layout_error(grad, f"its shard holds {held} rows, not {rows.count}"))
    return rows


def _shard_dim(placement: Placement) -> int | None:
    """The tensor dim a Shard or strided shard splits, None for Replicate."""
    from torch.distributed.tensor.placement_types import Shard

    sharding = (Shard, *_strided_shard_types())
    return int(cast(Shard, placement).dim) if isinstance(placement, sharding) else None


def _chunk(size: int, chunks: int, index: int) -> tuple[int, int]:
    """The start and length of chunk ``index`` of ``size`` rows, as ``torch.chunk`` cuts."""
    length = -(-size // chunks)
    start = min(index * length, size)
    return start, min(start + length, size) - start


@functools.lru_cache(maxsize=4096)
def _dtensor_rows(
    shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> Rows:
    """This rank's rows of a DTensor of ``shape`` (2 dims or more), once per layout."""
    coordinate = tuple(cast(list[int], mesh.get_coordinate()))
    rows = rows_at(shape, tuple(mesh.shape), coordinate, placements)
    if rows is None:
        raise ValueError(
            f"AGC needs each rank's rows of a parameter to be one contiguous range; a "
            f"parameter of shape {shape} with placements {placements} on {mesh} has "
            "rows strided across ranks; exclude it (AGC(exclude=...)) or shard it otherwise"
        )
    return rows


class _MeshAt:
    """What torch 2.6's ``compute_local_shape_and_global_offset`` reads of a mesh."""

    def __init__(self, shape: tuple[int, ...], coordinate: list[int]) -> None:
        self._shape, self._coordinate = shape, coordinate
        self.ndim = len(shape)

    def size(self, mesh_dim: int) -> int:
        return self._shape[mesh_dim]

    def get_coordinate(self) -> list[int]:
        return self._coordinate


def _local_shape_and_offset(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: list[int], placements: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The local shape and global offset, by torch's own rule (a private one)."""
    from torch.distributed.tensor import _utils

    compute = getattr(_utils, "_compute_local_shape_and_global_offset", None)  # 2.7 on
    if compute is not None:
        local, offset = compute(shape, mesh_shape, list(coordinate), placements)
    else:
        at: Any = _MeshAt(mesh_shape, coordinate)
        local, offset = _utils.compute_local_shape_and_global_offset(shape, at, placements)
    return tuple(local), tuple(offset)


def rows_at(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[Placement, ...],
) -> Rows | None:
    """The rows of a tensor of ``shape`` (2 dims or more) the rank at ``coordinate`` of a
    mesh of ``mesh_shape`` holds, or None when some rank's rows are not one range."""
    strided = _strided_shard_types()
    dims = [_shard_dim(p) for p in placements]
    if any(isinstance(p, strided) and d == 0 for p, d in zip(placements, dims, strict=True)):
        if not _rows_are_ranges(shape, mesh_shape, placements, dims):
            return None
        local, offset = _local_shape_and_offset(shape, mesh_shape, list(coordinate), placements)
        return Rows(shape[0], offset[0] if local[0] else shape[0], local[0])
    start, count = 0, shape[0]
    for mesh_dim, dim in enumerate(dims):  # left to right, as DTensor places them
        if dim == 0:
            begin, count = _chunk(count, mesh_shape[mesh_dim], coordinate[mesh_dim])
            start += begin
    return Rows(shape[0], start, count)


def _rows_are_ranges(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    dims: list[int | None],
) -> bool:
    """Whether torch's ``[offset, offset + count)`` of every rank splitting dim 0 tile
    the rows (then each rank's rows are that range)."""
    splitting = [m for m, d in enumerate(dims) if d == 0]
    ranges = []
    for flat in range(math.prod(mesh_shape[m] for m in splitting)):
        coordinate = [0] * len(mesh_shape)
        for m in reversed(splitting):
            flat, coordinate[m] = divmod(flat, mesh_shape[m])
        local, offset = _local_shape_and_offset(shape, mesh_shape, coordinate, placements)
        if local[0]:
            ranges.append((offset[0], offset[0] + local[0]))
    if not ranges:
        return True  # no rows at all
    ranges.sort()
    starts, ends = [start for start, _ in ranges], [end for _, end in ranges]
    return starts[:1] == [0] and starts[1:] == ends[:-1] and ends[-1:] == [shape[0]]


def _check_pairs(grads: Sequence[DTensor], weights: Sequence[DTensor]) -> None:
    """Each grad must be laid out as its weight: their units are matched shard by shard."""
    for g, w in zip(grads, weights, strict=True):
        if tuple(g.placements) != tuple(w.placements) or g.device_mesh != w.device_mesh:
            why = f"its grad has placements {g.placements} on {g.device_mesh}"
            raise ValueError(_layout_error(w, why))
        if g._local_tensor.shape != w._local_tensor.shape:
            why = (
                f"its grad's shard is {tuple(g._local_tensor.shape)}, not "
                f"{tuple(w._local_tensor.shape)}"
            )
            raise ValueError(_layout_error(w, why))


def unit_norms(
    tensors: Sequence[Tensor],
    device: torch.device,
    dtype: torch.dtype,
    whole: Sequence[Tensor] = (),
) -> Tensor:
    """The L2 norm of every unit of every tensor, then of each of ``whole`` (one unit
    each, a sparse one by its values), 1-D in order, on ``device`` in ``dtype``. Half
    types accumulate in float32, others in their own dtype, as timm's ``unitwise_norm``."""
    every = [*tensors, *whole]
    parts: list[Tensor | None] = [None] * len(every)
    batched: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(every):
        one = i >= len(tensors) or t.dim() <= 1
        if t.is_sparse:  # only a whole one: AGC refuses sparse grads it clips
            parts[i] = _norms.per_tensor_norms([t], 2.0)
        elif one and t.numel() > 0:
            batched.setdefault((t.device, t.dtype), []).append(i)
        else:
            dims = None if one else tuple(range(1, t.dim()))
            parts[i] = torch.linalg.vector_norm(t, 2.0, dim=dims, dtype=accumulate_dtype(t.dtype))
    for (_, kind), indices in batched.items():
        norms = torch._foreach_norm([every[i] for i in indices], 2.0, dtype=accumulate_dtype(kind))
        for i, norm in zip(indices, norms, strict=True):
            parts[i] = norm
    found = [cast(Tensor, part).reshape(-1) for part in parts]
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
    """What :func:`whole_unit_norms` measures, the same on every rank: each unit's norm
    of the ``grads`` and ``weights`` (1-D, in order), each grad's :class:`Rows`, the
    ``grad_squares`` and ``whole_squares`` summed across ranks before any root (float64,
    float32 on a device without it), and ``check`` (``strict`` only): 0-dim, NaN where
    the ranks held different numbers of grads, else 0."""

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
    """Every unit's norm of every grad and of its weight, whole across ranks, and each of
    ``whole``'s squared norm (AGC's excluded grads, one unit each): plain tensors locally,
    DTensors in ONE float64 ``all_reduce``, every rank passing the same parameters in the
    same order. A None (DTensors, ``strict``) is no grad on this rank: zero shares. With
    ``strict`` the ranks' counts of grads travel along: where they differ every value and
    ``check`` are NaN. Layouts it cannot measure raise a ValueError on every rank alike,
    before anything is sent.
    """
    present = [g for g in grads if g is not None]
    tensors = [*present, *weights, *(t for t in whole if t is not None)]
    found = _mesh.dtensors(tensors)
    if strict and not found:
        raise ValueError("slot_unit_norms measures DTensor parameters, got plain ones")
    if not found:
        device = tensors[0].device
        rows = [_plain_rows(g) for g in present]
        measured = [*present, *(w.detach() for w in weights)]
        norms = unit_norms(measured, device, combine_dtype(device), tensors[len(measured) :])
        own, theirs, rest = _split_units(norms, rows, len(whole))
        return UnitNorms(own.to(dtype), theirs.to(dtype), rows, own.square(), rest.square())
    _mesh.check_unmixed(tensors, found, "grads and weights")
    pairs = [(g, w) for g, w in zip(grads, weights, strict=True) if g is not None]
    _check_pairs(_mesh.dtensors([g for g, _ in pairs]), _mesh.dtensors([w for _, w in pairs]))
    rows = [local_rows(w) for w in weights]
    slots = [*grads, *weights, *whole]
    placed = [*rows, *rows, *[Rows(1, 0, 1)] * len(whole)]
    device = found[0].device
    mesh = _mesh.reduction_mesh(found)
    groups = _mesh.mesh_groups(mesh, None)
    shards = [t._local_tensor.detach() for t in found]
    measured_count = len(present) + len(weights)
    squares = unit_norms(shards[:measured_count], device, REDUCE_DTYPE, shards[measured_count:])
    counts = [r.count for t, r in zip(slots, placed, strict=True) if t is not None]
    parts = iter(torch.split(squares.square(), counts))
    shares = [
        squares.new_zeros(r.units)
        if t is None
        else _placed(next(parts), r, _mesh.replica_count(cast("DTensor", t), mesh))
        for t, r in zip(slots, placed, strict=True)
    ]
    count = len(present) + len(found) - measured_count if strict else None
    at = _mesh.collective_device(shares, groups)
    reduced = _mesh.all_reduce(shares, True, groups, at, count, mesh.size())
    wide = combine_dtype(device)
    check = reduced[-1].to(device=device, dtype=wide) if strict else None
    own, theirs, rest = _split_units(reduced[:-1] if strict else reduced, rows, len(whole))
    return UnitNorms(
        own.sqrt().to(device=device, dtype=dtype),
        theirs.sqrt().to(device=device, dtype=dtype),
        rows,
        own.to(device=device, dtype=wide),
        rest.to(device=device, dtype=wide),
        check,
    )


def slot_unit_norms(
    grads: Sequence[Tensor | None],
    weights: Sequence[Tensor],
    dtype: torch.dtype,
    whole: Sequence[Tensor | None] = (),
) -> UnitNorms:
    """:func:`whole_unit_norms` of DTensor parameters, ``strict``."""
    return whole_unit_norms(grads, weights, dtype, whole, strict=True)


def _split_units(values: Tensor, rows: Sequence[Rows], whole: int) -> tuple[Tensor, ...]:
    """``values`` split into the grads' units, their weights' and ``whole``'s."""
    units = sum(r.units for r in rows)
    return torch.split(values, [units, units, whole])
