"""The parts of a clipped step: read the settings, measure, decide, scale.

A step is measure -> decide -> apply. This module holds the first two and the explicit
scale; :mod:`clipopt._step._fold` holds the other way to apply (folded into a fused kernel).
A :class:`ClipDecision` is everything a step needs to apply the clip and record it, so
that the two ways to apply it take the same thing.

A coefficient is given per param group: None (scale nothing), a 0-dim tensor (the whole
group), or a tuple with one entry per grad of the group, each a tensor broadcastable to
its grad or None to leave that grad alone (per-tensor or unit-wise rules). A clip
rule's coefficients are made in :func:`threshold_coefficients`' place, by
:mod:`clipopt._step._rule_step`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import torch
from torch import Tensor

from clipopt._dist import _mesh, _reduce, _stages
from clipopt._kernels import _norms, _scale
from clipopt._step._clip_state import (
    MAX_NORM_KEY,
    NORM_TYPE_KEY,
    Threshold,
    check_one_norm_type,
    group_max_norm,
)

_T = TypeVar("_T")

__all__ = [
    "ClipDecision",
    "Coefficient",
    "GroupSettings",
    "Measurement",
    "coefficient_values",
    "collect_grads",
    "flatten",
    "grad_dtypes",
    "measure",
    "read_group_settings",
    "scale",
    "threshold_coefficients",
]

Coefficient: TypeAlias = Tensor | tuple[Tensor | None, ...] | None


@dataclass(frozen=True)
class GroupSettings:
    """Each param group's validated threshold and norm order, read fresh every step."""

    thresholds: list[Threshold]
    norm_types: list[float]


@dataclass(frozen=True)
class Measurement:
    """The norms of one step, before any clipping.

    ``norm`` is what ``last_norm`` records. Without ``per_group`` every entry of
    ``group_norms`` is ``norm`` itself and ``stacked`` is None; with it they are the
    groups' own norms on one device and dtype, ``stacked`` is them in one 1-D tensor and
    ``norm`` is its norm with the default order. ``tensor_norms`` is each grad's own norm
    (1-D, in :func:`collect_grads`' order) where the step measured them
    (:mod:`clipopt._step._monitor`), ``tensor_names`` their names where asked for. ``groups``:
    the grads of a norm local to this rank, as the kernels grouped them, for the scale
    to take as they are.
    """

    norm: Tensor
    group_norms: list[Tensor]
    stacked: Tensor | None
    tensor_norms: Tensor | None = None
    tensor_names: tuple[str, ...] = ()
    groups: _norms.Groups | None = None


@dataclass(frozen=True)
class ClipDecision:
    """What a step applies and records: made once, by the wrapper, before anything changes.

    Attributes:
      grads: each param group's grads, as measured.
      measurement: the pre-clip norms.
      coefficients: one :data:`Coefficient` per param group.
      skip: the step is skipped, decided on the host (``nonfinite="skip"``).
      streak: with ``skip``, the skips in a row before this step.
      found_inf: a skip decided on the device: a 0-dim float32 tensor, 1.0 to skip,
        for a fused kernel's ``found_inf``; None when the host decides.
      rule_outcome: with a clip rule, the norms it saw and the coefficients and
        thresholds it chose, for it to commit once the step has run.
      spike: with ``skip_spikes``, whether the norm is a spike (0-dim bool), if judged.
      skip_flag: in a compiled step, ``skip`` as a 0-dim tensor on the device, which
        the record counts with (:func:`clipopt._step._nonfinite.skip_flag`).
      grad_scale: for a folded step, the fused kernel's ``grad_scale`` (``1 / c``),
        made with the decision (in its graph, under ``torch.compile``).
      streak_limit: for a skip decided on the device, ``max_consecutive_skips``, which
        the previous steps' streak is checked against before this one is applied.
      final: this call ends the step, so the wrapper records it and commits its rules;
        False for all but the last of the calls DeepSpeed's ZeRO optimizer makes, one
        per param group, in one step of its own (they decide alike: nothing is
        committed in between).
    """

    grads: list[list[Tensor]]
    measurement: Measurement
    coefficients: list[Coefficient]
    skip: bool = False
    streak: int = 0
    found_inf: Tensor | None = None
    rule_outcome: tuple[Tensor, Tensor, Tensor] | None = None
    spike: Tensor | None = None
    skip_flag: Tensor | None = None
    grad_scale: Tensor | None = None
    streak_limit: int | None = None
    final: bool = True


def read_group_settings(
    groups: Sequence[Mapping[str, Any]], defaults: Mapping[str, Any], per_group: bool
) -> GroupSettings:
    """Each group's ``clip_max_norm`` and ``clip_norm_type``, the defaults where it has none.

    Raises:
      TypeError, ValueError: a group's setting is invalid, or the groups' orders differ
        without ``per_group``.
    """
    thresholds = [
        group_max_norm(index, group.get(MAX_NORM_KEY, defaults[MAX_NORM_KEY]))
        for index, group in enumerate(groups)
    ]
    norm_types = check_one_norm_type(groups, float(defaults[NORM_TYPE_KEY]), per_group)
    return GroupSettings(thresholds, norm_types)


def collect_grads(groups: Sequence[Mapping[str, Any]]) -> list[list[Tensor]]:
    """Each group's grads, parameters without one left out."""
    return [[g for g in [p.grad for p in group["params"]] if g is not None] for group in groups]


def grad_dtypes(grads: list[list[Tensor]], measured: Measurement) -> set[torch.dtype]:
    """The dtypes of the grads: from the measurement's groups where it has them."""
    if measured.groups is not None:
        return {dtype for _, dtype in (*measured.groups.dense, *measured.groups.sparse)}
    return {g.dtype for group in grads for g in group}


def flatten(grads: list[list[_T]]) -> list[_T]:
    """Every group's grads (or parameters, or slots) in one list: the one group's own
    list when there is one (the caller does not change it), since a copy of 2000 grads
    cost 40 us a step."""
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
      scope: the process group and replicated parameters of the reduction, and the
        pipeline stages' group that the stages' norms are combined over.
      foreach: as in :func:`clipopt.get_total_norm`.
      params: every parameter, when asked; their DTensor meshes decide the reduction's,
        so a rank holding no grad, or grads on only some meshes, joins the same
        collective as the other ranks.
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
    # across ranks (then it is on the device, and others' grads count): moving the CPU
    # zero the kernel returns for it would be a blocking host-to-device copy every step.
    group_norms = [
        n.to(device=device, dtype=dtype)
        if bucket or n.device == device
        else torch.zeros((), device=device, dtype=dtype)
        for n, bucket in zip(own, grads, strict=True)
    ]
    stacked = torch.stack(group_norms)
    wide = _norms.combine_dtype(stacked.device)
    norm = torch.linalg.vector_norm(stacked, default_norm_type, dtype=wide).to(dtype)
    return Measurement(norm, group_norms, stacked)


def _scales_nothing(threshold: Threshold) -> bool:
    """A float threshold of inf: the norm is measured, nothing is scaled."""
    return isinstance(threshold, float) and math.isinf(threshold)


def threshold_coefficients(
    group_norms: list[Tensor], thresholds: list[Threshold]
) -> list[Coefficient]:
    """Per group, ``min(1, max_norm / (norm + eps))`` on device; None: scale nothing.

    Groups that share a norm object and an equal threshold share one coefficient, so
    that a global clip has one coefficient (and can fold into a fused kernel).
    """
    coefficients: list[Coefficient] = []
    # Matched by identity in a list, not by id() keys: torch 2.6's dynamo cannot trace
    # id() of a tensor made in the graph.
    shared: list[tuple[Tensor, Threshold, Tensor]] = []
    for norm, threshold in zip(group_norms, thresholds, strict=True):
        if _scales_nothing(threshold):
            coefficients.append(None)
            continue
        found = None
        for seen_norm, seen_threshold, coefficient in shared:
            same = seen_threshold is threshold or (
                isinstance(threshold, float)
                and isinstance(seen_threshold, float)
                and seen_threshold == threshold
            )
            if seen_norm is norm and same:
                found = coefficient
                break
        if found is None:
            found = _scale.clip_coefficient(threshold, norm)
            shared.append((norm, threshold, found))
        coefficients.append(found)
    return coefficients


def _one_coefficient(grads: list[list[Tensor]], coefficients: list[Coefficient]) -> Tensor | None:
    """The 0-dim coefficient every group with grads shares, if they share one."""
    found: list[Coefficient] = []
    for c, group in zip(coefficients, grads, strict=True):
        if group and not any(c is seen for seen in found):  # identity, as above
            found.append(c)
    only = found[0] if len(found) == 1 else None
    return only if isinstance(only, Tensor) else None


@torch.no_grad()
def scale(
    grads: list[list[Tensor]],
    coefficients: list[Coefficient],
    foreach: bool | None,
    grouped: _norms.Groups | None = None,
) -> None:
    """Multiply each group's grads by its coefficient in place.

    Groups that share a 0-dim coefficient are scaled by one kernel call; per-grad
    coefficients are applied grad by grad. Without grad: grads made with
    ``create_graph=True`` must not record the scale (Adahessian differentiates them).
    ``grouped``: every grad of ``grads``, as the norm's kernels grouped them; used when
    one coefficient scales them all.
    """
    reuse = grouped is not None and not torch.compiler.is_compiling()  # ids: see below
    shared = _one_coefficient(grads, coefficients) if reuse else None
    if grouped is not None and shared is not None:
        _scale.scale_groups_(grouped, shared, foreach)
        return
    # Shared coefficients found by identity, not id(): torch.compile guards on an id,
    # and a step's new coefficient would then recompile this function every step.
    by_coefficient: list[tuple[Tensor, list[Tensor]]] = []
    each: list[tuple[Tensor, Tensor]] = []
    for group_grads, coefficient in zip(grads, coefficients, strict=True):
        if isinstance(coefficient, tuple):
            pairs = zip(group_grads, coefficient, strict=True)
            each.extend((grad, own) for grad, own in pairs if own is not None)
        elif coefficient is not None and group_grads:
            _bucket(by_coefficient, coefficient).extend(group_grads)
    for coefficient, tensors in by_coefficient:
        _scale.scale_(_mesh.local_tensors(tensors), coefficient, foreach)
    if each:
        _scale_each_(_mesh.local_tensors([g for g, _ in each]), [c for _, c in each], foreach)


def _scale_each_(grads: list[Tensor], coefficients: list[Tensor], foreach: bool | None) -> None:
    """Multiply each grad in place by its own coefficient (broadcastable to it): one
    ``_foreach_mul_`` per device and dtype unless ``foreach=False``, sparse grads one by
    one. (On CUDA a coefficient of another shape than its grad still takes ATen's slow
    route, a kernel per grad: torch has no foreach op scaling each tensor by its own
    device scalar.)"""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, grad in enumerate(grads):
        if grad.is_sparse or foreach is False:
            grad.mul_(coefficients[i].to(grad.device))
        else:
            groups.setdefault((grad.device, grad.dtype), []).append(i)
    for (device, _), indices in groups.items():
        torch._foreach_mul_(
            [grads[i] for i in indices], [coefficients[i].to(device) for i in indices]
        )


def _bucket(buckets: list[tuple[Tensor, list[Tensor]]], coefficient: Tensor) -> list[Tensor]:
    """The grads ``coefficient`` (this very tensor) scales, a new bucket if it has none."""
    for held, tensors in buckets:
        if held is coefficient:
            return tensors
    buckets.append((coefficient, []))
    return buckets[-1][1]


def coefficient_values(coefficients: list[Coefficient], like: Tensor) -> Tensor:
    """Every coefficient in one 1-D tensor (empty if none), for a finiteness check.

    A coefficient shared by groups is in it once per group: the check does not care,
    and telling them apart by ``id()`` made ``torch.compile`` guard on the id of each
    step's new coefficient tensor, so that every step recompiled.
    """
    values = [
        c.reshape(-1)
        for coefficient in coefficients
        for c in (coefficient if isinstance(coefficient, tuple) else (coefficient,))
        if c is not None
    ]
    return torch.cat(values) if values else like.new_zeros(0)
