"""Per-tensor norms measured in the step's one pass over the grads, and their names.

With ``track_tensor_norms=True`` (or a per-tensor rule) the step reads every grad once,
by one batched :func:`clipopt._kernels._norms.per_tensor_norms` call, and derives the global
norm (and each group's) from those norms: a p-norm is the p-norm of its parts' p-norms.
DTensor grads (FSDP2, tensor parallel) take each whole tensor's norm across ranks in one
collective, and the totals from the same reduced sums of p-th powers.
A name is the group's ``param_names`` entry, which torch (>= 2.6) stores when the
optimizer is built from ``model.named_parameters()``, else the parameter's index over
all groups, as the optimizer's ``state_dict()["state"]`` numbers it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from clipopt._dist import _mesh, _per_tensor, _stages
from clipopt._kernels import _norms
from clipopt._step._parts import Measurement, flatten

__all__ = [
    "TensorNorms",
    "across_stages",
    "grad_names",
    "measure_from_squares",
    "measure_per_tensor",
]


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
    """:func:`clipopt._step._parts.measure` (without a process group) with each grad's norm
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
    like = squares[0] if squares else _zero(check)
    totals = [_checked(_per_tensor.total_root(_joined(b, like), 2.0), check) for b in buckets]
    totals = [total.to(dtype) for total in totals]
    norms = None
    if tensor_norms and squares:
        # squares: their 1-norm is their sum
        sums = torch._foreach_norm(list(squares), 1.0)
        norms = _per_tensor.root(torch.stack(sums), 2.0).to(dtype)
    elif tensor_norms:
        norms = like.new_zeros(0, dtype=dtype)
    return _assembled(totals, norms, len(grads), per_group, default_norm_type, flat_names)


def _zero(check: Tensor | None) -> Tensor:
    """A float64 zero beside ``check`` (on the CPU without one)."""
    if check is None:
        return torch.zeros((), dtype=torch.float64)
    return check.new_zeros(())


def _checked(total: Tensor, check: Tensor | None) -> Tensor:
    """``total`` plus ``check`` (adding 0 changes no bit), or ``total`` without one."""
    return total if check is None else total + check


def _joined(bucket: Sequence[Tensor], like: Tensor) -> Tensor:
    """The tensors of ``bucket`` in one 1-D tensor (a group without grads: empty)."""
    return torch.cat(list(bucket)) if bucket else like.new_zeros(0)


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
    if not per_group:
        norm = _stages.combine_stages([measured.norm], norm_types[:1], pp_group)[0]
        return Measurement(norm, [norm] * len(measured.group_norms), None, *_tensors_of(measured))
    totals = _stages.combine_stages(measured.group_norms, norm_types, pp_group)
    stacked = torch.stack(totals)
    norm = _combined(stacked, default_norm_type, stacked.dtype)
    return Measurement(norm, totals, stacked, *_tensors_of(measured))


def _tensors_of(measured: Measurement) -> tuple[Tensor | None, tuple[str, ...]]:
    return measured.tensor_norms, measured.tensor_names


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


class TensorNorms:
    """The last step's per-tensor norms and names: an object of its own, not attributes
    of the wrapper, since ``torch.compile`` drops attribute writes on an Optimizer."""

    def __init__(self) -> None:
        self.norms: Tensor | None = None
        self.names: tuple[str, ...] = ()

    def record(self, measurement: Measurement) -> None:
        if measurement.tensor_norms is not None:
            self.norms, self.names = measurement.tensor_norms, measurement.tensor_names

    def clear(self) -> None:
        self.norms, self.names = None, ()

    def as_dict(self) -> dict[str, Tensor] | None:
        """``{name: 0-dim norm}`` (views of one 1-D tensor on the grads' device), or None."""
        if self.norms is None:
            return None
        return dict(zip(self.names, self.norms.unbind(), strict=True))
