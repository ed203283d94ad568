"""Per-tensor norms measured in the step's one pass over the grads, and their names.

With ``track_tensor_norms=True`` (or a per-tensor rule) the step reads every grad once,
by one batched :func:`clipopt._kernels.per_tensor_norms` call, and derives the global
norm (and each group's) from those norms: a p-norm is the p-norm of its parts' p-norms.
A name is the group's ``param_names`` entry, which torch (>= 2.6) stores when the
optimizer is built from ``model.named_parameters()``, else the parameter's index over
all groups, as the optimizer's ``state_dict()["state"]`` numbers it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from clipopt import _kernels, _mesh, _per_tensor
from clipopt._step import Measurement

__all__ = ["TensorNorms", "grad_names", "measure_per_tensor", "with_tensor_norms"]

Norms = Callable[[Sequence[Tensor], float, bool | None], Tensor]


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
    wide = _kernels.combine_dtype(norms.device)
    combined: Tensor = torch.linalg.vector_norm(norms.to(wide), p)
    return combined.to(dtype)


def measure_per_tensor(
    grads: list[list[Tensor]],
    names: list[list[str]] | None,
    norm_types: list[float],
    default_norm_type: float,
    per_group: bool,
    foreach: bool | None,
) -> Measurement:
    """:func:`clipopt._step.measure` (local grads only) with each grad's norm kept, and
    its name where ``names`` (from :func:`grad_names`) are given.

    One :func:`~clipopt._kernels.per_tensor_norms` call (one per distinct group order
    with ``per_group``); the global and group norms are derived from its output, so
    every grad is read once. The per-tensor norms are float32 (float64 for double
    grads), so a float32 global norm can differ from the direct one by an ulp.

    Raises:
      ValueError: a DTensor grad (a shard's norm is not the tensor's): see
        :func:`with_tensor_norms`.
    """
    flat = [g for group in grads for g in group]
    if not _mesh.all_plain(flat):
        raise ValueError("measure_per_tensor takes plain grads; with_tensor_norms DTensors")
    flat_names = () if names is None else tuple(n for group in names for n in group)
    if not flat:
        zero = torch.zeros((), dtype=torch.float32)
        return Measurement(zero, [zero] * len(grads), None, zero.new_zeros(0), flat_names)
    norms = _each_norm(grads, norm_types, foreach, _kernels.per_tensor_norms)
    if not per_group:
        norm = _combined(norms, norm_types[0], norms.dtype)
        return Measurement(norm, [norm] * len(grads), None, norms, flat_names)
    parts = torch.split(norms, [len(group) for group in grads])
    pairs = zip(parts, norm_types, strict=True)
    group_norms = [_combined(part, p, norms.dtype) for part, p in pairs]
    stacked = torch.stack(group_norms)
    norm = _combined(stacked, default_norm_type, norms.dtype)
    return Measurement(norm, group_norms, stacked, norms, flat_names)


def _each_norm(
    grads: list[list[Tensor]], norm_types: list[float], foreach: bool | None, norms_of: Norms
) -> Tensor:
    """Each grad's norm, by one call of ``norms_of`` (one per group where their orders
    differ), on the first grad's device."""
    flat = [g for group in grads for g in group]
    if len(set(norm_types)) == 1:
        return norms_of(flat, norm_types[0], foreach)
    device = _mesh.local_tensors(flat[:1])[0].device
    dtype = _kernels.result_dtype([g.dtype for g in flat])
    return torch.cat(
        [
            norms_of(group, p, foreach).to(device, dtype)
            for group, p in zip(grads, norm_types, strict=True)
            if group
        ]
    )


def with_tensor_norms(
    measured: Measurement,
    grads: list[list[Tensor]],
    names: list[list[str]],
    norm_types: list[float],
    foreach: bool | None,
) -> Measurement:
    """``measured`` with each whole grad's norm across ranks added, for DTensor grads,
    whose global norm comes from the usual reduction: one more pass over the grads and
    one collective (:func:`clipopt._per_tensor.global_per_tensor_norms`)."""
    flat_names = tuple(n for group in names for n in group)
    if not any(grads):
        return dataclasses.replace(measured, tensor_norms=measured.norm.new_zeros(0))
    norms = _each_norm(grads, norm_types, foreach, _per_tensor.global_per_tensor_norms)
    return dataclasses.replace(measured, tensor_norms=norms, tensor_names=flat_names)


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
