"""Groups and plans: how a list of grads splits into kernel calls, made once and reused.

A clip groups its grads by device and dtype, splits each CPU group into the grads the C
kernel reads (dense in memory) and the others, and counts their elements: on thousands
of small grads that costs more Python per grad than the kernels spend reading them. A
:class:`Plan` is that work done once. It holds no tensor, so it keeps no grad alive, and
it serves any list of tensors with the metadata it was made for:
``zero_grad(set_to_none=True)`` makes new grads every step, with the same metadata.

A plan is reused only while every tensor has the dtype, device, layout, dispatch keys
(inference tensors and conjugate or negative views have their own), ``requires_grad``,
shape and strides it was made for, and the list its length. One
``TensorGuards.check`` call (the C++ check ``torch.compile`` guards tensors with) says
so for the whole list, at about one attribute read's cost per tensor, where making the
plan reads six. Data pointers and storage offsets are not in a plan: they are read
again by every clip. Sparse tensors get no plan, and under ``torch.compile`` (which
traces the plan's making into its graph) or without ``TensorGuards`` (a torch that
lacks it) each call makes an unguarded plan, used once.

A guard costs about ten attribute reads per tensor to make, so one is made only for a
list whose length was seen unplanned before: a one-off call pays nothing extra.

:func:`group` gives a clip its :class:`Groups`, by a plan where there is one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from clipopt import _torch_internals
from clipopt._kernels import _cpu

__all__ = [
    "CAPACITY",
    "GroupKey",
    "Groups",
    "Plan",
    "clear",
    "group",
    "kept",
    "make_plan",
    "plan_for",
]

GroupKey = tuple[torch.device, torch.dtype]

CAPACITY = 8
"""Plans kept, most recently used first: a few models (a GAN's two) clipped in turn."""

CpuSplit = tuple[_cpu.Run, list[Tensor]]
"""A dense CPU group: the tensors the C kernel reads, and those with gaps in memory."""


@dataclass(frozen=True, eq=False)
class Groups:
    """Tensors split by (device, dtype), as one clip's norm and then its scale take them.

    Attributes:
      dense: the dense groups, in order of first appearance, each in the given order.
      sparse: the sparse COO groups with values.
      cpu: for dense CPU groups, what the C kernels read and what they leave to torch;
        made on first use, or from a plan.
      inference: whether any dense tensor is an inference tensor; None: not known yet.
    """

    dense: dict[GroupKey, list[Tensor]]
    sparse: dict[GroupKey, list[Tensor]]
    cpu: dict[GroupKey, CpuSplit]
    inference: bool | None

    def split(self, key: GroupKey) -> CpuSplit:
        """The C kernels' share of the dense CPU group ``key``, and the rest."""
        found = self.cpu.get(key)
        if found is None:
            dense, gappy = _cpu.split_dense(self.dense[key])
            found = self.cpu[key] = (_cpu.Run(dense), gappy)
        return found


@dataclass(frozen=True, eq=False)
class Plan:
    """Where each tensor of a dense list goes, by position.

    Attributes:
      count: the list's length.
      groups: (device, dtype) groups in order of first appearance: the key and the
        positions of its tensors, in order (None: every tensor of the list).
      dense: per group, the positions within the group of the tensors whose elements
        fill ``numel()`` slots from ``data_ptr()`` on (None: all of them).
      gappy: per group, the positions within the group of the others.
      numels: per group, the element counts of its dense tensors.
      first_with_values: the position of the first tensor with elements, -1 if none.
      inference_mode: whether inference mode was on when the plan was made.
      has_inference_tensors: whether any tensor is an inference tensor.
      plain: whether every tensor is a strided ``torch.Tensor`` (no subclass) with
        storage, whose address the C layout may read by torch's own C function.
      guard: the check that a list has this plan's metadata; None: used once.
    """

    count: int
    groups: tuple[tuple[GroupKey, tuple[int, ...] | None], ...]
    dense: tuple[tuple[int, ...] | None, ...]
    gappy: tuple[tuple[int, ...], ...]
    numels: tuple[list[int], ...]
    first_with_values: int
    inference_mode: bool
    has_inference_tensors: bool
    plain: bool = False
    guard: Any = None

    def fits(self, tensors: Sequence[Tensor], inference_mode: bool) -> bool:
        """Whether ``tensors`` have the metadata this plan was made for."""
        if (
            self.guard is None
            or self.count != len(tensors)
            or self.inference_mode != inference_mode
        ):
            return False
        return bool(self.guard.check(*tensors))


def _positions(indices: list[int], total: int) -> tuple[int, ...] | None:
    """``indices`` as a tuple, or None when they are 0 .. total - 1 (all, in order)."""
    return None if len(indices) == total else tuple(indices)


def _is_dense(t: Tensor) -> bool:
    return t.is_contiguous() or _cpu.dense_flat_view(t) is not None


def _by_group(tensors: Sequence[Tensor]) -> dict[GroupKey, list[int]]:
    """Positions of ``tensors`` by (device, dtype), groups in order of first appearance."""
    grouped = _torch_internals.group_by_device_and_dtype(tensors)
    return {key: indices for key, (_, indices) in grouped.items()}


def _plain(t: Tensor) -> bool:
    """A strided ``torch.Tensor`` with storage: not a subclass (fake, functional), not a
    wrapper without storage (functorch's batched tensors), not sparse, MKL-DNN or nested.
    The guard keeps it so: it checks the type, layout and dispatch keys."""
    return (
        type(t) is Tensor
        and t.layout == torch.strided
        and not t.is_nested
        and _torch_internals.has_storage(t)
    )


def make_plan(tensors: Sequence[Tensor], guarded: bool = False) -> Plan:
    """The plan of dense ``tensors`` (none sparse), with a guard if ``guarded``."""
    groups, dense, gappy, numels = [], [], [], []
    for key, indices in _by_group(tensors).items():
        members = [tensors[i] for i in indices]
        on_cpu = key[0].type == "cpu"
        flags = [not on_cpu or _is_dense(t) for t in members]
        dense_at = [k for k, ok in enumerate(flags) if ok]
        groups.append((key, _positions(indices, len(tensors))))
        dense.append(_positions(dense_at, len(members)))
        gappy.append(tuple(k for k, ok in enumerate(flags) if not ok))
        numels.append([members[k].numel() for k in dense_at])
    first = -1
    for i, t in enumerate(tensors):  # not next(..., -1): torch 2.6's dynamo cannot trace it
        if t.numel() > 0:
            first = i
            break
    # torch.compile traces neither, and an unguarded plan is never matched again.
    traced = torch.compiler.is_compiling()
    return Plan(
        len(tensors),
        tuple(groups),
        tuple(dense),
        tuple(gappy),
        tuple(numels),
        first,
        not traced and torch.is_inference_mode_enabled(),
        not traced and any(t.is_inference() for t in tensors),
        not traced and all(map(_plain, tensors)),
        _torch_internals.tensor_guard(tensors) if guarded else None,
    )


_plans: list[Plan] = []
_unplanned: list[int] = []  # lengths of recent lists that got an unguarded plan


def plan_for(tensors: Sequence[Tensor]) -> Plan | None:
    """A plan for ``tensors``: a kept one if one fits, else a new one; None if any is sparse.

    Each kept plan is checked in full before it is returned, so another thread changing
    which plans are kept can cost a plan, never a wrong one.
    """
    if torch.compiler.is_compiling():  # traced into the graph: nothing to keep
        return None if any(t.is_sparse for t in tensors) else make_plan(tensors)
    mode = torch.is_inference_mode_enabled()
    for plan in list(_plans):
        if plan.fits(tensors, mode):
            if _plans and _plans[0] is not plan:
                _plans[:] = [plan, *(q for q in _plans if q is not plan)]
            return plan
    if any(t.is_sparse for t in tensors):
        return None
    count = len(tensors)
    guarded = count in _unplanned
    plan = make_plan(tensors, guarded)
    if plan.guard is not None:
        _plans[:] = [plan, *_plans[: CAPACITY - 1]]
    else:
        _unplanned[:] = [count, *(n for n in _unplanned[: CAPACITY - 1] if n != count)]
    return plan


def clear() -> None:
    """Forget every kept plan (tests, and benchmarks timing the planning itself)."""
    _plans.clear()
    _unplanned.clear()


@contextlib.contextmanager
def kept() -> Iterator[list[Plan]]:
    """The kept plans, for tests to look at; cleared before and after."""
    clear()
    try:
        yield _plans
    finally:
        clear()


def _group_in_cpp(tensors: Sequence[Tensor]) -> dict[GroupKey, list[Tensor]]:
    """(device, dtype) groups by torch's C++ helper (as in ``torch.nn.utils``).

    Groups come in order of first appearance, and each keeps its tensors' order: the
    helper's own dict order is unspecified, but it reports each tensor's index.
    """
    grouped = _torch_internals.group_by_device_and_dtype(tensors)
    return {key: members for key, (members, _) in grouped.items()}


def _with_sparse(tensors: Sequence[Tensor]) -> Groups:
    """Dense and sparse groups of tensors of which some are sparse; those without values
    are dropped."""
    dense: dict[GroupKey, list[Tensor]] = {}
    sparse: dict[GroupKey, list[Tensor]] = {}
    for t in tensors:
        if not t.is_sparse:
            dense.setdefault((t.device, t.dtype), []).append(t)
        elif t._nnz() > 0:
            sparse.setdefault((t.device, t.dtype), []).append(t)
    return Groups(dense, sparse, {}, None)


def _planned(plan: Plan, tensors: Sequence[Tensor]) -> Groups:
    """The groups ``plan`` puts ``tensors`` in, with the C kernels' share of each CPU one."""
    dense: dict[GroupKey, list[Tensor]] = {}
    cpu: dict[GroupKey, CpuSplit] = {}
    parts = zip(plan.groups, plan.dense, plan.gappy, plan.numels, strict=True)
    for (key, at), dense_at, gappy_at, numels in parts:
        members = list(tensors) if at is None else [tensors[i] for i in at]
        dense[key] = members
        if key[0].type == "cpu":
            readable = members if dense_at is None else [members[k] for k in dense_at]
            run = _cpu.Run(readable, numels, plan.plain)
            cpu[key] = (run, [members[k] for k in gappy_at])
    return Groups(dense, {}, cpu, plan.has_inference_tensors)


def group(tensors: Sequence[Tensor]) -> Groups:
    """Dense and sparse (device, dtype) groups in order of first appearance, none empty.

    Dense tensors with no elements may remain in a group; sparse ones without values
    are dropped. The order is fixed so that eager and compiled runs add the same
    partial norms in the same order. All-dense lists take a plan (:mod:`clipopt._kernels._plan`),
    kept and reused while their metadata does not change.
    """
    plan = plan_for(tensors) if tensors else None
    if plan is not None:
        return _planned(plan, tensors)
    if not any(t.is_sparse for t in tensors):
        return Groups(_group_in_cpp(tensors), {}, {}, None)
    return _with_sparse(tensors)
