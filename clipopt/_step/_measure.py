"""How a step measures its norms, where it is more than one norm of plain grads.

:func:`measure` takes the global norm, or one per group, through the wrapper's
:class:`~clipopt._dist._reduce.NormScope` (one collective when the grads are sharded).
With ``track_tensor_norms=True`` or a per-tensor rule, :func:`measure_per_tensor` reads
every grad once, by one batched per-tensor norm, and derives the global norm (and each
group's) from those norms: a p-norm is the p-norm of its parts' p-norms. A unit-wise
rule's squares give them without reading a grad (:func:`measure_from_squares`). Under
pipeline stages the totals are combined over the stages (:func:`across_stages`).

A name is the group's ``param_names`` entry, which torch stores when the optimizer is
built from ``model.named_parameters()``, else the parameter's index over all groups.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import torch
from torch import Tensor

from clipopt._dist import _mesh, _per_tensor, _reduce, _stages
from clipopt._kernels import _norms

__all__ = [
    "Coefficient",
    "Measurement",
    "across_stages",
    "collect_grads",
    "flatten",
    "grad_names",
    "measure",
    "measure_from_squares",
    "measure_per_tensor",
]

_T = TypeVar("_T")

Coefficient: TypeAlias = Tensor | tuple[Tensor | None, ...] | None
"""A param group's clip coefficient: None (scale nothing), a 0-dim tensor (the whole
group), or one entry per grad of the group, a tensor broadcastable to it or None."""


@dataclass(frozen=True)
class Measurement:
    """The norms of one step, before any clipping.

    ``norm`` is what ``last_norm`` records. Without ``per_group`` every entry of
    ``group_norms`` is ``norm`` itself and ``stacked`` is None; with it they are the
    groups' own norms, ``stacked`` them in one 1-D tensor and ``norm`` its norm with the
    default order. ``tensor_norms``: each grad's own norm (1-D, in :func:`collect_grads`'
    order) where measured, ``tensor_names`` their names where asked for. ``groups``: the
    grads of a norm local to this rank, as the kernels grouped them, for the scale.
    """

    norm: Tensor
    group_norms: list[Tensor]
    stacked: Tensor | None
    tensor_norms: Tensor | None = None
    tensor_names: tuple[str, ...] = ()
    groups: _norms.Groups | None = None


def collect_grads(groups: Sequence[Mapping[str, Any]]) -> list[list[Tensor]]:
    """Each group's grads, parameters without one left out."""
    return [[g for g in [p.grad for p in group["params"]] if g is not None] for group in groups]


def flatten(grads: list[list[_T]]) -> list[_T]:
    """Every group's grads (or parameters) in one list: the one group's own list when
    there is one (the caller does not change it)."""
    return grads[0] if len(grads) == 1 else [g for group in grads for g in group]


def measure(
    grads: list[list[Tensor]],
    norm_types: list[float],
    default_norm_type: float,
    per_group: bool,
    scope: _reduce.NormScope,
    foreach: bool | None,
    params: Callable[[], Sequence[Tensor]],
) -> Measurement:
    """The global norm of all grads, or of each group's, across ranks where needed.

    Args:
      grads: each group's grads.
      norm_types: each group's order (all equal without ``per_group``).
      default_norm_type: the order of the norm of the group norms (``per_group``).
      per_group: measure each group by its own norm.
      scope: the reduction's process group, replicated parameters and pipeline stages.
      foreach: as in :func:`clipopt.get_total_norm`.
      params: every parameter, when asked; their DTensor meshes decide the reduction's,
        so a rank holding no grad joins the same collective as the others.
    """
    if not per_group:
        flat = flatten(grads)
        if scope.process_group is None and flat and _mesh.all_plain(flat):
            # A norm of this rank's grads alone: keep their grouping for the scale.
            norm, grouped = _norms.grouped_total_norm(flat, norm_types[0], foreach)
            norm = _stages.combine_stages([norm], norm_types[:1], scope.pp_group)[0]
            return Measurement(norm, [norm] * len(grads), None, groups=grouped)
        norm = scope.global_norms([flat], norm_types[:1], foreach, params())[0]
        return Measurement(norm, [norm] * len(grads), None)
    own = scope.global_norms(grads, norm_types, foreach, params())
    device = own[0].device
    for g in grads:  # not next(..., default): torch 2.6's dynamo cannot trace it
        if g:
            device = g[0].device
            break
    dtype = _norms.result_dtype([n.dtype for n in own])
    # A group without grads here gets its zero made here, unless its norm was reduced
    # across ranks: moving the CPU zero the kernel returns would block every step.
    group_norms = [
        n.to(device=device, dtype=dtype)
        if bucket or n.device == device
        else torch.zeros((), device=device, dtype=dtype)
        for n, bucket in zip(own, grads, strict=True)
    ]
    stacked = torch.stack(group_norms)
    return Measurement(_combined(stacked, default_norm_type, dtype), group_norms, stacked)


def grad_names(groups: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Each group's names of the params that have a grad, in :func:`collect_grads`' order.

    Example:
      >>> import torch
      >>> model = torch.nn.Linear(2, 1)
      >>> model.weight.grad = torch.ones(1, 2)
      >>> grad_names(torch.optim.SGD(model.named_parameters()).param_groups)
      [['weight']]
      >>> grad_names(torch.optim.SGD(model.parameters()).param_groups)
      [['0']]
    """
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
    """The p-norm of ``norms`` (the total norm of what they measured), in ``dtype``;
    0 for none (an inf-norm of nothing would raise)."""
    if norms.numel() == 0:
        return norms.new_zeros((), dtype=dtype)
    wide = _norms.combine_dtype(norms.device)
    combined: Tensor = torch.linalg.vector_norm(norms.to(wide), p)
    return combined.to(dtype)


def measure_per_tensor(
    grads: list[list[Tensor]],
    names: list[list[str]] | None,
    norm_types: list[float],
    default_norm_type: float,
    per_group: bool,
    foreach: bool | None,
    params: Callable[[], list[list[Tensor]]] = lambda: [],
    strict: bool = False,
) -> Measurement:
    """:func:`measure` (without a process group) with each grad's norm
    kept, and its name where ``names`` (from :func:`grad_names`) are given.

    Plain grads: one :func:`~clipopt._kernels._norms.per_tensor_norms` call (one per distinct
    group order with ``per_group``), and the global and group norms derived from its
    output, so every grad is read once. The per-tensor norms are float32 (float64 for
    double grads), so a float32 global norm can differ from the direct one by an ulp.

    DTensor grads (or none here, with DTensor parameters): each whole tensor's norm
    across ranks, in one collective (:func:`clipopt._dist._per_tensor.global_tensor_powers`),
    and the totals from the reduced sums of p-th powers before their roots are taken.

    Args:
      params: each group's parameters, asked for where a grad is a DTensor or there is
        none: one slot each in the reduction, so that ranks line up whatever grads they
        hold (a grad this rank lacks is a zero here), and their mesh.
      strict: with DTensor grads, the ranks must hold as many grads (a per-tensor rule's
        norms must line up): where they do not, every norm is NaN on every rank.

    Raises:
      ValueError: DTensor grads mixed with plain ones, or on meshes that cannot be
        reduced together; a Partial DTensor grad.
    """
    flat = flatten(grads)
    flat_names = () if names is None else tuple(n for group in names for n in group)
    groups = [] if flat and _mesh.all_plain(flat) else params()
    if not _mesh.all_plain(flat) or (not flat and _any_sharded(groups)):
        norms, totals = _sharded_norms(grads, norm_types, per_group, foreach, groups, strict)
    elif flat:
        norms, totals = _local_norms(grads, norm_types, per_group, foreach)
    else:
        # the parameters' dtype, as the norms of the ranks (and stages) with grads
        zero = torch.zeros((), dtype=_norms.result_dtype([q.dtype for q in flatten(groups)]))
        return Measurement(zero, [zero] * len(grads), None, zero.new_zeros(0), flat_names)
    return _assembled(totals, norms, len(grads), per_group, default_norm_type, flat_names)


def measure_from_squares(
    grads: list[list[Tensor]],
    names: list[list[str]] | None,
    squares: Sequence[Tensor],
    default_norm_type: float,
    per_group: bool,
    tensor_norms: bool,
    check: Tensor | None = None,
) -> Measurement:
    """:func:`measure_per_tensor`'s L2 measurement, from squares a unit-wise rule measured
    (AGC: every unit's, whole across ranks, from its one pass and one collective): no
    grad is read. The global norm (each group's) is the root of the sum of its grads'
    squares, taken in their float64 before any root.

    Args:
      grads: each group's grads, for their count and dtypes.
      names: as for :func:`measure_per_tensor`.
      squares: one 1-D tensor per grad, in order, whose values sum to its squared norm
        (:class:`clipopt.UnitDecision`'s ``squares``).
      default_norm_type: the order of the norm of the group norms (``per_group``).
      per_group: measure each group by its own norm.
      tensor_norms: also each grad's norm, the root of its squares' sum.
      check: a 0-dim tensor added to every total (0, or NaN where the ranks' grads do
        not line up: :class:`clipopt.UnitDecision`), so that a rank without grads has a
        NaN norm as the others do.

    Example:
      >>> import torch
      >>> squares = [torch.tensor([9.0, 16.0]), torch.tensor([144.0])]
      >>> got = measure_from_squares([[torch.ones(2, 2), torch.ones(1)]], None, squares,
      ...                            2.0, False, True)
      >>> got.norm, got.tensor_norms
      (tensor(13.), tensor([ 5., 12.]))
    """
    flat_names = () if names is None else tuple(n for group in names for n in group)
    dtype = _norms.result_dtype([g.dtype for group in grads for g in group])
    sizes = [len(group) for group in grads] if per_group else [len(squares)]
    ends = [0, *itertools.accumulate(sizes)]
    buckets = [squares[start:end] for start, end in itertools.pairwise(ends)]
    like = squares[0] if squares else torch.zeros((), dtype=torch.float64)
    if check is not None and not squares:
        like = check.new_zeros(())
    # check: 0 (adding it changes no bit) or NaN, see its Args
    totals = [
        _per_tensor.total_root(torch.cat(list(b)) if b else like.new_zeros(0), 2.0) for b in buckets
    ]
    totals = [(t if check is None else t + check).to(dtype) for t in totals]
    norms = None
    if tensor_norms and squares:
        # squares: their 1-norm is their sum
        sums = torch._foreach_norm(list(squares), 1.0)
        norms = _per_tensor.root(torch.stack(sums), 2.0).to(dtype)
    elif tensor_norms:
        norms = like.new_zeros(0, dtype=dtype)
    return _assembled(totals, norms, len(grads), per_group, default_norm_type, flat_names)


def _assembled(
    totals: list[Tensor],
    norms: Tensor | None,
    groups: int,
    per_group: bool,
    default_norm_type: float,
    names: tuple[str, ...],
) -> Measurement:
    """The measurement of the ``totals`` (the global norm, or each group's) of ``groups``
    param groups, with the per-tensor ``norms`` and their names where measured."""
    if not per_group:
        return Measurement(totals[0], [totals[0]] * groups, None, norms, names)
    stacked = torch.stack(totals)
    norm = _combined(stacked, default_norm_type, stacked.dtype)
    return Measurement(norm, totals, stacked, norms, names)


def across_stages(
    measured: Measurement,
    norm_types: list[float],
    default_norm_type: float,
    per_group: bool,
    pp_group: Any,
) -> Measurement:
    """``measured`` (one pipeline stage's) with its global norm, or each group's, combined
    with the other stages' over ``pp_group`` (:func:`clipopt._dist._stages.combine_stages`):
    one collective more; the per-tensor norms and names stay the stage's own.

    With ``per_group`` the stages' groups are lined up by position: every stage's optimizer
    has as many groups, with the same orders. Without ``pp_group``: ``measured`` itself.
    """
    if pp_group is None:
        return measured
    norms = [measured.norm] if not per_group else measured.group_norms
    totals = _stages.combine_stages(norms, norm_types[: len(norms)], pp_group)
    count = len(measured.group_norms)
    names = measured.tensor_names
    return _assembled(totals, measured.tensor_norms, count, per_group, default_norm_type, names)


def _any_sharded(groups: list[list[Tensor]]) -> bool:
    """Whether a parameter that requires grad is a DTensor: then a rank without grads
    still joins the other ranks' reduction."""
    return any(q.requires_grad for q in _mesh.dtensors(flatten(groups)))


def _local_norms(
    grads: list[list[Tensor]], norm_types: list[float], per_group: bool, foreach: bool | None
) -> tuple[Tensor, list[Tensor]]:
    """Each plain grad's norm, and the total of all (of each group, with ``per_group``)."""
    norms = _each_norm(grads, norm_types, foreach)
    if not per_group:
        return norms, [_combined(norms, norm_types[0], norms.dtype)]
    parts = torch.split(norms, [len(group) for group in grads])
    pairs = zip(parts, norm_types, strict=True)
    return norms, [_combined(part, p, norms.dtype) for part, p in pairs]


def _sharded_norms(
    grads: list[list[Tensor]],
    norm_types: list[float],
    per_group: bool,
    foreach: bool | None,
    params: list[list[Tensor]],
    strict: bool,
) -> tuple[Tensor, list[Tensor]]:
    """Each whole DTensor grad's norm, and the totals, from one reduction of p-th powers."""
    slots: list[list[Tensor | None]] = [[q.grad for q in group] for group in params]
    orders = norm_types
    if not per_group:
        slots, orders = [flatten(slots)], norm_types[:1]
    powers = _per_tensor.global_tensor_powers(
        slots, orders, foreach, params=flatten(params), strict=strict
    )
    dtype = _norms.result_dtype([g.dtype for g in flatten(grads)])
    triples = list(zip(powers, slots, orders, strict=True))
    mine = torch.cat([_per_tensor.root(_per_tensor.held(pw, own), p) for pw, own, p in triples])
    totals = [_per_tensor.total_root(pw, p).to(dtype) for pw, _, p in triples]
    return mine.to(dtype), totals


def _each_norm(grads: list[list[Tensor]], norm_types: list[float], foreach: bool | None) -> Tensor:
    """Each plain grad's norm, by one :func:`~clipopt._kernels._norms.per_tensor_norms` call (one
    per group where their orders differ), on the first grad's device."""
    flat = flatten(grads)
    if len(set(norm_types)) == 1:
        return _norms.per_tensor_norms(flat, norm_types[0], foreach)
    device, dtype = flat[0].device, _norms.result_dtype([g.dtype for g in flat])
    return torch.cat(
        [
            _norms.per_tensor_norms(group, p, foreach).to(device, dtype)
            for group, p in zip(grads, norm_types, strict=True)
            if group
        ]
    )
