"""Each grad's whole norm across ranks, and AGC's units' (dim-0 rows of a tensor of 2+ dims,
else the whole), each in ONE float64 all_reduce."""

from __future__ import annotations

import functools
import itertools
import math
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


def held(values: Tensor, slots: Sequence[Tensor | None]) -> Tensor:
    """The entries of ``values`` (one per slot) whose slot holds a tensor, in order."""
    if all(t is not None for t in slots):
        return values
    parts = [v for v, t in zip(values.unbind(), slots, strict=True) if t is not None]
    return torch.stack(parts) if parts else values.new_zeros(0)


def global_tensor_powers(
    buckets: Sequence[Sequence[Tensor | None]],
    norm_types: Sequence[float],
    foreach: bool | None = None,
    *,
    params: Sequence[Tensor] = (),
    strict: bool = False,
) -> list[Tensor]:
    """Each slot's (a DTensor grad or None) whole ``norm**p`` (inf: max) across ranks, per
    bucket; with ``strict``, all NaN where the ranks' counts of grads differ."""
    flat = [t for bucket in buckets for t in bucket if t is not None]
    reduction = _mesh.reduction_for(flat, params)
    if reduction is None:
        raise ValueError("global_tensor_powers needs DTensor grads or parameters")
    mesh, groups = reduction
    device = _mesh.collective_device(flat, groups)
    shares = []
    for slots, p in zip(buckets, norm_types, strict=True):
        positions = [slot for slot, t in enumerate(slots) if t is not None]
        grads = _mesh.dtensors([t for t in slots if t is not None])
        order: list[int] = []
        values: list[Tensor] = []
        for replicas, indices in _mesh.by_replicas(grads, mesh).items():  # one norm call each
            shards = [grads[i]._local_tensor for i in indices]
            norms = per_tensor_norms(shards, p, foreach).to(REDUCE_DTYPE)
            if p != math.inf:
                norms = norms.pow(p).div(replicas) if replicas > 1 else norms.pow(p)
            values.append(norms.to(device))
            order.extend(positions[i] for i in indices)
        if not values:
            shares.append(torch.zeros(len(slots), dtype=REDUCE_DTYPE, device=device))
        elif order == list(range(len(slots))):
            shares.append(torch.cat(values))
        else:  # zeros where this rank has no grad; no index tensor (a host-to-device copy)
            zero = torch.zeros((), dtype=REDUCE_DTYPE, device=device)
            found = dict(zip(order, torch.cat(values).unbind(), strict=True))
            shares.append(torch.stack([found.get(slot, zero) for slot in range(len(slots))]))
    count = len(flat) if strict else None
    return _mesh.reduce_by_order(shares, norm_types, groups, device, count, mesh.size())


def root(powers: Tensor, p: float) -> Tensor:
    """Each norm from its ``norm**p`` (the inf-norm's values are norms already)."""
    return powers if p == math.inf else powers.pow(1.0 / p)


def total_root(powers: Tensor, p: float) -> Tensor:
    """The p-norm of all that ``powers`` measured (0 for none)."""
    if p != math.inf:
        return powers.sum().pow(1.0 / p)
    return powers.amax() if powers.numel() else powers.new_zeros(())


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
    if any(p.is_partial() for p in grad.placements):
        why = "a Partial tensor has no norm until it is reduced; redistribute it first"
    elif not all(p.is_replicate() or hasattr(p, "dim") for p in grad.placements):
        why = "only Shard and Replicate say where its units are"
    elif grad.dim() <= 1:
        return Rows(1, 0, 1)
    else:
        at = tuple(mesh.get_coordinate() or ())
        rows = rows_at(tuple(grad.shape), tuple(mesh.shape), at, tuple(grad.placements))
        local = grad._local_tensor.shape[0]
        if rows is not None and local == rows.count:
            return rows
        why = (
            "its rows are strided across ranks; exclude it (AGC(exclude=...)) or shard it otherwise"
        )
        why = why if rows is None else f"its shard holds {local} rows, not {rows.count}"
    raise _layout_error(grad, why)


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

    def span(at: Sequence[int]) -> tuple[int, int]:
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
        moved = dict(zip(splitting, indices, strict=True))
        start, count = span([moved.get(m, at) for m, at in enumerate(coordinate)])
        ranges += [(start, start + count)] if count else []
    edges = [edge for pair in sorted(ranges) for edge in pair]
    if edges[1:-1:2] != edges[2::2] or edges[:1] + edges[-1:] not in ([], [0, shape[0]]):
        return None
    return Rows(shape[0], *span(coordinate))


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
    pairs = [(g, w) for g, w in zip(grads, weights, strict=True) if g is not None]
    for grad, w in cast("list[tuple[DTensor, DTensor]]", pairs):
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
    every = [*rows, *rows, *[Rows(1, 0, 1)] * len(whole)]
    slots = list(zip([*grads, *weights, *whole], every, strict=True))
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
    roots, wide = (own.sqrt().to(dtype), theirs.sqrt().to(dtype)), combine_dtype(device)
    check = reduced[-1].to(wide) if strict else None  # all_reduce put them on ``device``
    return UnitNorms(*roots, rows, own.to(wide), rest.to(wide), check)
