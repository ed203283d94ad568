"""A step's norms beyond one local norm: per group, per tensor, from squares, across ranks."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias, TypeVar

import torch
from torch import Tensor

from clipopt._dist import _mesh, _reduce, _stages, _units
from clipopt._kernels import _norms

_T = TypeVar("_T")

# A group's clip coefficient: None (scale nothing), 0-dim, or one per grad (or None)
Coefficient: TypeAlias = Tensor | tuple[Tensor | None, ...] | None


class Orders(NamedTuple):
    """Each group's norm type, the norm type of the group norms, and whether each has one."""

    types: list[float]
    default: float
    per_group: bool


@dataclass(frozen=True)
class Measurement:
    """One step's pre-clip norms (``groups``: the grads as the kernels grouped them)."""

    norm: Tensor
    group_norms: list[Tensor]
    stacked: Tensor | None
    tensor_norms: Tensor | None = None
    tensor_names: tuple[str, ...] = ()
    groups: _norms.Groups | None = None


def flatten(grads: list[list[_T]]) -> list[_T]:
    """Every group's items in one list (the one group's own list, not copied)."""
    return grads[0] if len(grads) == 1 else [g for group in grads for g in group]


def grad_names(groups: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Each group's ``param_names`` (else indices over all groups) of the params with a grad."""
    names: list[list[str]] = []
    index = 0
    for group in groups:
        params = group["params"]
        own = group.get("param_names")
        listed = own if own is not None else [str(i) for i in range(index, index + len(params))]
        names.append([n for p, n in zip(params, listed, strict=True) if p.grad is not None])
        index += len(params)
    return names


def _combined(norms: Tensor, p: float, dtype: torch.dtype) -> Tensor:
    # 0 for none: an inf-norm of nothing raises
    if norms.numel() == 0:
        return norms.new_zeros((), dtype=dtype)
    combined: Tensor = torch.linalg.vector_norm(norms.to(_norms.combine_dtype(norms.device)), p)
    return combined.to(dtype)


def _assembled(
    totals: list[Tensor],
    norms: Tensor | None,
    count: int,
    orders: Orders,
    names: tuple[str, ...] = (),
    pp_group: Any = None,
) -> Measurement:
    if pp_group is not None:  # the totals combined over the pipeline stages
        totals = _stages.combine_stages(totals, orders.types[: len(totals)], pp_group)
    if not orders.per_group:
        return Measurement(totals[0], [totals[0]] * count, None, norms, names)
    stacked = torch.stack(totals)
    default = orders.default
    return Measurement(_combined(stacked, default, stacked.dtype), totals, stacked, norms, names)


def measure(
    grads: list[list[Tensor]],
    orders: Orders,
    scope: _reduce.NormScope,
    foreach: bool | None,
    params: Callable[[], Sequence[Tensor]],
) -> Measurement:
    """The global norm, or each group's, across ranks and stages (``params``: for DTensors)."""
    norm_types = orders.types
    if not orders.per_group:
        flat = flatten(grads)
        if scope.process_group is None and flat and _mesh.all_plain(flat):
            norm, grouped = _norms.grouped_total_norm(flat, norm_types[0], foreach)
            norm = _stages.combine_stages([norm], norm_types[:1], scope.pp_group)[0]
            return Measurement(norm, [norm] * len(grads), None, groups=grouped)
        norm = scope.global_norms([flat], norm_types[:1], foreach, params())[0]
        return Measurement(norm, [norm] * len(grads), None)
    own = scope.global_norms(grads, norm_types, foreach, params())
    devices = [g[0].device for g in grads if len(g) > 0]  # not next(): torch 2.6's dynamo
    device = devices[0] if len(devices) > 0 else own[0].device
    dtype = _norms.result_dtype([n.dtype for n in own])
    # A group without grads here gets its zero made here (moving a CPU zero would block)
    group_norms = [
        n.to(device=device, dtype=dtype)
        if bucket or n.device == device
        else torch.zeros((), device=device, dtype=dtype)
        for n, bucket in zip(own, grads, strict=True)
    ]
    return _assembled(group_norms, None, len(grads), orders)


def measure_per_tensor(
    grads: list[list[Tensor]],
    names: list[list[str]] | None,
    orders: Orders,
    foreach: bool | None,
    params: Callable[[], list[list[Tensor]]] = lambda: [],
    strict: bool = False,
    pp_group: Any = None,
) -> Measurement:
    """:func:`measure` (no process group) from each grad's norm (``strict``: NaN if unmatched)."""
    flat, norm_types, per_group = flatten(grads), orders.types, orders.per_group
    flat_names = () if names is None else tuple(n for group in names for n in group)
    dtype = _norms.result_dtype([g.dtype for g in flat])
    slots = [] if flat and _mesh.all_plain(flat) else params()
    types = norm_types if per_group else norm_types[:1]
    if not _mesh.all_plain(flat) or (
        not flat and any(q.requires_grad for q in _mesh.dtensors(flatten(slots)))
    ):
        held: list[list[Tensor | None]] = [[q.grad for q in group] for group in slots]
        if not per_group:
            held = [flatten(held)]
        powers = _units.global_tensor_powers(
            held, types, foreach, params=flatten(slots), strict=strict
        )
        triples = list(zip(powers, held, types, strict=True))
        norms = torch.cat([_units.root(_units.held(w, h), p) for w, h, p in triples])
        totals = [_units.total_root(w, p).to(dtype) for w, _, p in triples]
        norms = norms.to(dtype)
    elif flat:
        if len(set(norm_types)) == 1:
            norms = _norms.per_tensor_norms(flat, norm_types[0], foreach)
        else:
            norms = torch.cat(
                [
                    _norms.per_tensor_norms(group, p, foreach).to(flat[0].device, dtype)
                    for group, p in zip(grads, norm_types, strict=True)
                    if group
                ]
            )
        parts = torch.split(norms, [len(group) for group in grads]) if per_group else [norms]
        totals = [_combined(part, p, norms.dtype) for part, p in zip(parts, types, strict=True)]
    else:  # the parameters' dtype, as the norms of the ranks (and stages) with grads
        zero = torch.zeros((), dtype=_norms.result_dtype([q.dtype for q in flatten(slots)]))
        if pp_group is None:
            return Measurement(zero, [zero] * len(grads), None, zero.new_zeros(0), flat_names)
        totals, norms = [zero] * len(types), zero.new_zeros(0)  # the stages still combine
    return _assembled(totals, norms, len(grads), orders, flat_names, pp_group)


def measure_from_squares(
    grads: list[list[Tensor]],
    names: list[list[str]] | None,
    squares: Sequence[Tensor],
    orders: Orders,
    tensor_norms: bool,
    check: Tensor | None = None,
    pp_group: Any = None,
) -> Measurement:
    """:func:`measure_per_tensor`'s L2 norms from ``squares``; ``check`` added to every total."""
    flat_names = () if names is None else tuple(n for group in names for n in group)
    per_group = orders.per_group
    dtype = _norms.result_dtype([g.dtype for group in grads for g in group])
    sizes = [len(group) for group in grads] if per_group else [len(squares)]
    ends = [0, *itertools.accumulate(sizes)]
    like = check if check is not None else torch.zeros((), dtype=torch.float64)
    like = squares[0] if squares else like
    totals = []
    for start, end in itertools.pairwise(ends):
        part = squares[start:end]
        total = _units.total_root(torch.cat(list(part)) if part else like.new_zeros(0), 2.0)
        totals.append((total if check is None else total + check).to(dtype))
    norms = None
    if tensor_norms and squares:  # their 1-norm is their sum
        norms = _units.root(torch.stack(torch._foreach_norm(list(squares), 1.0)), 2.0)
        norms = norms.to(dtype)
    elif tensor_norms:
        norms = like.new_zeros(0, dtype=dtype)
    return _assembled(totals, norms, len(grads), orders, flat_names, pp_group)
