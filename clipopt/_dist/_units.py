"""The L2 norms of a tensor's units, of the whole unit across ranks: what AGC measures.

A unit (Brock et al., 2021, the NFNets paper) is a slice along dim 0 of a tensor of 2
dims or more (a row of a linear weight, an output channel of a conv kernel), or the
whole of a 0- or 1-D tensor. On a DTensor (FSDP2, HSDP, tensor parallel) a rank may hold
whole units (Shard(0) rows), parts of units (a 1-D tensor sharded on dim 0, a weight
sharded on dim 1 by row-parallel TP) or copies (Replicate). Every unit's squared norm is
the sum over the ranks of the reduction mesh of each rank's share: the squared norm of
the part it holds, divided by how many ranks hold that part (as
:mod:`clipopt._dist._per_tensor` weighs replicas). Each rank puts its shares of each tensor's
units at those units' global positions (zeros elsewhere), so one float64 ``all_reduce``
of one 1-D tensor gives every rank every unit's norm, whatever the layout, as long as
the rows a rank holds are one contiguous range (:mod:`clipopt._dist._unit_rows` finds them,
and refuses other layouts). Laid out over every parameter's units, whatever grads a rank
holds (:func:`slot_unit_norms`), it is the same collective on a rank without some grads,
or any, and it carries each rank's count of grads, so that ranks holding different grads
get NaN everywhere instead of a hang.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from clipopt._dist import _mesh
from clipopt._dist._collective import (
    REDUCE_DTYPE,
    collective_device,
    count_tail,
    counts_differ,
    reduce_sum,
)
from clipopt._dist._unit_rows import Rows, check_pairs, local_rows, plain_rows
from clipopt._kernels import _norms
from clipopt._kernels._norms import accumulate_dtype, combine_dtype

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "UnitNorms",
    "slot_unit_norms",
    "unit_norms",
    "whole_unit_norms",
]


def unit_norms(
    tensors: Sequence[Tensor],
    device: torch.device,
    dtype: torch.dtype,
    whole: Sequence[Tensor] = (),
) -> Tensor:
    """The L2 norm of every unit of every tensor, then of each of ``whole``, in one 1-D
    tensor in order.

    A tensor of 2 dims or more has one unit per index of dim 0, measured over all its
    other dims by one ``vector_norm`` (no copy, whatever the strides); 0- and 1-D tensors,
    and every tensor of ``whole`` (whatever its dims), are one unit each, measured by one
    torch's foreach norm per device and dtype (a sparse one of ``whole`` by its values).
    Half types accumulate in float32, others in their own dtype, as timm's
    ``unitwise_norm`` (``Tensor.norm``) does; the result is on ``device`` in ``dtype``.

    Example:
      >>> import torch
      >>> from clipopt._dist._units import unit_norms
      >>> unit_norms([torch.tensor([[3.0, 4.0], [0.0, 1.0]]), torch.tensor([6.0, 8.0])],
      ...            torch.device("cpu"), torch.float32, whole=[torch.ones(2, 2)])
      tensor([ 5.,  1., 10.,  2.])
    """
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
        group = [every[i] for i in indices]
        norms = torch._foreach_norm(group, 2.0, dtype=accumulate_dtype(kind))
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
    """What :func:`whole_unit_norms` measures, the same on every rank.

    Attributes:
      grads: every unit's norm of every grad, 1-D in order.
      weights: the same of their weights.
      rows: each grad's :class:`Rows`, this rank's units among them.
      grad_squares: the squares ``grads`` are the roots of, float64 (float32 on a device
        without it): whole sums across ranks before any root.
      whole_squares: each tensor of ``whole``'s squared norm, the same way.
      check: from :func:`slot_unit_norms`, a 0-dim tensor: NaN where the ranks held
        different numbers of grads, else 0; None otherwise.
    """

    grads: Tensor
    weights: Tensor
    rows: list[Rows]
    grad_squares: Tensor
    whole_squares: Tensor
    check: Tensor | None = None


def whole_unit_norms(
    grads: Sequence[Tensor],
    weights: Sequence[Tensor],
    dtype: torch.dtype,
    whole: Sequence[Tensor] = (),
) -> UnitNorms:
    """Every unit's norm of every grad and of its weight, whole across ranks, and the
    squared norm of each tensor of ``whole`` (AGC's excluded grads) in the same pass.

    Plain tensors are measured on this rank (DDP: whole on every rank), with no
    collective. DTensors are measured as the module says, the shares of the grads, the
    weights and ``whole`` in ONE float64 ``all_reduce`` over the reduction mesh (one per
    mesh dim on an N-D mesh over only some of the ranks, as
    :func:`clipopt._dist._mesh.mesh_groups` says). Every rank of the mesh must call this with
    the same parameters in the same order.

    Args:
      grads: grads, all plain or all DTensors, and ``whole`` alike; at least one
        tensor between them.
      weights: their parameters, each laid out as its grad.
      dtype: the dtype of the unit norms returned.
      whole: tensors measured as one unit each, whatever their dims or layout (a sparse
        plain one too), with no weight.

    Returns:
      The norms and squares, each 1-D with every unit of every tensor in order (the same
      on every rank), on the first tensor's local device.

    Raises:
      ValueError: a DTensor mixed with a plain tensor, a Partial one, a grad laid out
        otherwise than its weight, rows not one range (see :func:`local_rows`), or
        meshes that cannot be reduced together. Raised on every rank alike,
        before anything is sent.

    Example:
      >>> import torch
      >>> from clipopt._dist._units import whole_unit_norms
      >>> g, w = torch.tensor([[3.0, 4.0], [0.0, 1.0]]), torch.ones(2, 2)
      >>> found = whole_unit_norms([g], [w], torch.float32, whole=[torch.tensor([2.0])])
      >>> found.grads, found.weights
      (tensor([5., 1.]), tensor([1.4142, 1.4142]))
      >>> found.grad_squares, found.whole_squares
      (tensor([25.,  1.], dtype=torch.float64), tensor([4.], dtype=torch.float64))
    """
    tensors = [*grads, *weights, *whole]
    found = _mesh.dtensors(tensors)
    if not found:
        device = tensors[0].device
        rows = [plain_rows(g) for g in grads]
        measured = [*grads, *(w.detach() for w in weights)]
        norms = unit_norms(measured, device, combine_dtype(device), whole)
        own, theirs, rest = _split_units(norms, rows, len(whole))
        return UnitNorms(own.to(dtype), theirs.to(dtype), rows, own.square(), rest.square())
    rows = [local_rows(g) for g in grads]
    _mesh.check_unmixed(tensors, found, "grads and weights")
    check_pairs(found[: len(grads)], found[len(grads) : 2 * len(grads)])
    return _reduced_unit_norms(grads, weights, whole, rows, dtype, strict=False)


def slot_unit_norms(
    grads: Sequence[Tensor | None],
    weights: Sequence[Tensor],
    dtype: torch.dtype,
    whole: Sequence[Tensor | None] = (),
) -> UnitNorms:
    """:func:`whole_unit_norms` of DTensor parameters, each with its grad or None where
    this rank holds none, so that a rank without some grads, or any, joins the other
    ranks' ``all_reduce``: the reduced vector has the units of every weight given,
    whatever grads are here, a missing grad's shares being zeros.

    Units cannot line up where the ranks hold different grads, so the count of grads
    (of ``grads`` and ``whole``) travels in the same collective (two values more), and
    where the counts differ every value is NaN, on every rank, and ``check`` is NaN (0
    where they agree): a rank without grads has no norm of its own to carry the NaN.

    Args:
      grads: each weight's grad or None; those given laid out as their weights.
      weights: DTensor parameters, the same ones in the same order on every rank.
      dtype: the dtype of the unit norms returned.
      whole: as for :func:`whole_unit_norms`, None where this rank has no such grad.

    Returns:
      As :func:`whole_unit_norms`, with the units of every weight (those of a missing
      grad: the others' sums, or 0), and ``check``.

    Raises:
      ValueError: as :func:`whole_unit_norms`, or no DTensor among the tensors.

    Example:
      >>> import torch
      >>> from clipopt._dist._units import slot_unit_norms
      >>> slot_unit_norms([None], [torch.ones(2, 2)], torch.float32)
      Traceback (most recent call last):
      ...
      ValueError: slot_unit_norms measures DTensor parameters, got plain ones
    """
    present = [g for g in grads if g is not None]
    tensors = [*present, *weights, *(t for t in whole if t is not None)]
    found = _mesh.dtensors(tensors)
    if not found:
        raise ValueError("slot_unit_norms measures DTensor parameters, got plain ones")
    _mesh.check_unmixed(tensors, found, "grads and weights")
    pairs = [(g, w) for g, w in zip(grads, weights, strict=True) if g is not None]
    check_pairs(_mesh.dtensors([g for g, _ in pairs]), _mesh.dtensors([w for _, w in pairs]))
    rows = [local_rows(w) for w in weights]
    return _reduced_unit_norms(grads, weights, whole, rows, dtype, strict=True)


def _reduced_unit_norms(
    grads: Sequence[Tensor | None],
    weights: Sequence[Tensor],
    whole: Sequence[Tensor | None],
    rows: list[Rows],
    dtype: torch.dtype,
    strict: bool,
) -> UnitNorms:
    """:func:`whole_unit_norms` of DTensors (grads, weights, then ``whole`` more), checked:
    each rank's squared shares placed among all units (zeros for a None), in one
    ``all_reduce``; with ``strict``, the ranks' count of tensors too (NaN if they differ)."""
    slots = [*grads, *weights, *whole]
    placed = [*rows, *rows, *[Rows(1, 0, 1)] * len(whole)]
    held = cast("list[DTensor]", [t for t in slots if t is not None])
    device = held[0].device
    mesh = _mesh.reduction_mesh(held)
    groups = _mesh.mesh_groups(mesh, None)
    measured = [t for t in slots[: 2 * len(rows)] if t is not None]
    extra_shards = [t._local_tensor.detach() for t in held[len(measured) :]]
    shards = [t._local_tensor.detach() for t in cast("list[DTensor]", measured)]
    squares = unit_norms(shards, device, REDUCE_DTYPE, extra_shards).square()
    counts = [r.count for t, r in zip(slots, placed, strict=True) if t is not None]
    parts = iter(torch.split(squares, counts))
    shares = [
        squares.new_zeros(r.units)
        if t is None
        else _placed(next(parts), r, _mesh.replica_count(cast("DTensor", t), mesh))
        for t, r in zip(slots, placed, strict=True)
    ]
    grads_here = len(held) - len(weights)
    tail = [count_tail(grads_here, True, squares.device)] if strict else []
    reduced = reduce_sum([*shares, *tail], groups, collective_device(shares, groups))
    wide = combine_dtype(device)
    check = None
    if strict:
        differ = counts_differ(reduced[-2:], True, mesh.size())
        reduced = torch.where(differ, math.nan, reduced[:-2])
        check = torch.where(differ, math.nan, reduced.new_zeros(())).to(device=device, dtype=wide)
    own, theirs, rest = _split_units(reduced, rows, len(whole))
    return UnitNorms(
        own.sqrt().to(device=device, dtype=dtype),
        theirs.sqrt().to(device=device, dtype=dtype),
        rows,
        own.to(device=device, dtype=wide),
        rest.to(device=device, dtype=wide),
        check,
    )


def _split_units(values: Tensor, rows: Sequence[Rows], whole: int) -> tuple[Tensor, ...]:
    """``values`` of the grads' units, their weights' and ``whole`` more, split in three."""
    units = sum(r.units for r in rows)
    return torch.split(values, [units, units, whole])
