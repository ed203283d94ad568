"""Where each unit of a tensor lies: the rows a rank holds, of a plain tensor or a DTensor.

A unit (Brock et al., 2021, the NFNets paper) is a slice along dim 0 of a tensor of 2
dims or more (a row of a linear weight, an output channel of a conv kernel), or the
whole of a 0- or 1-D tensor. On a DTensor (FSDP2, HSDP, tensor parallel) a rank may hold
whole units (Shard(0) rows), parts of units (a 1-D tensor sharded on dim 0, a weight
sharded on dim 1 by row-parallel TP) or copies (Replicate). What a rank holds of each
unit is worked out from the tensor's layout alone, as one contiguous range of rows among
the whole tensor's (another layout is refused): :mod:`clipopt._dist._units` measures the units
from it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

from clipopt import _torch_internals
from clipopt._dist import _mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "Rows",
    "check_pairs",
    "local_rows",
    "plain_rows",
    "rows_at",
    "unit_shape",
]


def unit_shape(t: Tensor) -> tuple[int, ...]:
    """The shape of one coefficient per unit of ``t``, broadcastable to it: ``(rows, 1,
    ...)`` for a tensor of 2 dims or more (a unit is a slice along dim 0: a row of a
    linear weight, an output channel of a conv kernel), ``()`` for the whole of a 0- or
    1-D tensor."""
    return (t.shape[0],) + (1,) * (t.dim() - 1) if t.dim() >= 2 else ()


@dataclass(frozen=True)
class Rows:
    """Where this rank's units of a tensor lie among the whole tensor's ``units``: the
    ``count`` of them from ``start`` (a 0- or 1-D tensor: its one unit)."""

    units: int
    start: int
    count: int


def local_rows(t: Tensor) -> Rows:
    """This rank's units of ``t``: all of them for a plain tensor.

    Raises:
      ValueError: the rows a DTensor's shard holds are not one contiguous range of the
        whole tensor's (a ``_StridedShard`` of dim 0 other than FSDP2's over TP), or not
        as many as its layout says, or a placement is Partial (or not Shard,
        _StridedShard or Replicate).
    """
    if not _mesh.dtensors([t]):
        return plain_rows(t)
    grad = cast("DTensor", t)
    _check_placements(grad)
    if grad.dim() <= 1:
        return Rows(1, 0, 1)
    rows = _dtensor_rows(tuple(grad.shape), grad.device_mesh, tuple(grad.placements))
    if grad._local_tensor.shape[0] != rows.count:
        held = grad._local_tensor.shape[0]
        raise ValueError(_layout_error(grad, f"its shard holds {held} rows, not {rows.count}"))
    return rows


def plain_rows(t: Tensor) -> Rows:
    """Every unit of a plain tensor: its rows, or the one unit of a 0- or 1-D tensor."""
    units = t.shape[0] if t.dim() >= 2 else 1
    return Rows(units, 0, units)


def _check_placements(t: DTensor) -> None:
    """Only Shard, FSDP2's strided shard and Replicate say which part of each unit a rank
    holds; a placement of another type (a subclass included) is refused, not guessed."""
    from torch.distributed.tensor.placement_types import Replicate, Shard

    known = (Shard, Replicate, *_torch_internals.strided_shard_types())
    for placement in t.placements:
        if placement.is_partial():
            why = "a Partial tensor has no norm until it is reduced; redistribute it first"
            raise ValueError(_layout_error(t, why))
        if type(placement) not in known:
            why = "only Shard and Replicate say where its units are"
            if type(placement).__name__ == "_StridedShard":
                why = (
                    "a strided shard (FSDP2 over TP) needs torch's own layout rule, which "
                    f"torch {torch.__version__} does not offer here"
                )
            raise ValueError(_layout_error(t, why))


def _shard_dim(placement: Placement) -> int | None:
    """The tensor dim a Shard or strided shard splits, None for Replicate."""
    from torch.distributed.tensor.placement_types import Shard

    sharding = (Shard, *_torch_internals.strided_shard_types())
    return int(cast(Shard, placement).dim) if isinstance(placement, sharding) else None


def _chunk(size: int, chunks: int, index: int) -> tuple[int, int]:
    """The start and length of chunk ``index`` of ``size`` rows cut into ``chunks`` as
    ``torch.chunk`` cuts them (DTensor's Shard and FSDP2 do): the last ones may be
    shorter or empty."""
    length = -(-size // chunks)
    start = min(index * length, size)
    return start, min(start + length, size) - start


@functools.lru_cache(maxsize=4096)
def _dtensor_rows(
    shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> Rows:
    """This rank's rows of a DTensor of ``shape`` (2 dims or more), from its layout alone;
    the same layout gives the same rows every step, so it is worked out once."""
    coordinate = tuple(cast(list[int], mesh.get_coordinate()))
    rows = rows_at(shape, tuple(mesh.shape), coordinate, placements)
    if rows is None:
        raise ValueError(
            f"AGC needs each rank's rows of a parameter to be one contiguous range; a "
            f"parameter of shape {shape} with placements {placements} on {mesh} has "
            "rows strided across ranks; exclude it (AGC(exclude=...)) or shard it otherwise"
        )
    return rows


def rows_at(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[Placement, ...],
) -> Rows | None:
    """The rows of a tensor of ``shape`` (2 dims or more) the rank at ``coordinate`` of a
    mesh of ``mesh_shape`` holds, or None when some rank's rows are not one range."""
    strided = _torch_internals.strided_shard_types()
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


def _local_shape_and_offset(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: list[int],
    placements: tuple[Placement, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    found = _torch_internals.local_shape_and_offset(shape, mesh_shape, coordinate, placements)
    if found is None:  # _check_placements admits a strided shard only where torch has both
        raise RuntimeError(f"torch {torch.__version__} has no layout rule for {placements}")
    return found


def _rows_are_ranges(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    dims: list[int | None],
) -> bool:
    """Whether every rank's rows are ``[offset, offset + count)``, torch's first offset
    and count: true when those ranges, over the mesh coordinates that split dim 0, tile
    the rows (a rank's rows are a set of ``count`` rows, the least of them ``offset``,
    and the ranks' sets tile them too)."""
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


def _layout_error(t: DTensor, why: str) -> str:
    return (
        f"AGC cannot measure the units of a parameter of shape {tuple(t.shape)} with "
        f"placements {t.placements} on {t.device_mesh}: {why}"
    )


def check_pairs(grads: Sequence[DTensor], weights: Sequence[DTensor]) -> None:
    """Each grad must be laid out as its weight: their units are matched shard by shard."""
    for g, w in zip(grads, weights, strict=True):
        if tuple(g.placements) != tuple(w.placements) or g.device_mesh != w.device_mesh:
            raise ValueError(
                _layout_error(w, f"its grad has placements {g.placements} on {g.device_mesh}")
            )
        if g._local_tensor.shape != w._local_tensor.shape:
            raise ValueError(
                _layout_error(
                    w,
                    f"its grad's shard is {tuple(g._local_tensor.shape)}, not "
                    f"{tuple(w._local_tensor.shape)}",
                )
            )
