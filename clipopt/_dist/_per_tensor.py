"""Each grad's whole-tensor norm across ranks in ONE float64 all_reduce."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from clipopt._dist import _mesh
from clipopt._dist._mesh import REDUCE_DTYPE
from clipopt._kernels import _norms


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
            norms = _norms.per_tensor_norms(shards, p, foreach).to(REDUCE_DTYPE)
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
