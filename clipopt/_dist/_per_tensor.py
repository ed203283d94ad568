"""Each grad's own norm, of the whole tensor across ranks: what a per-tensor rule sees.

Under DDP each norm is local. A DTensor grad's shard sends its ``norm**p`` weighted by
``1 / replicas`` (its max for inf), every grad's in ONE 1-D float64 tensor, so a step
makes one ``all_reduce``. The reduced powers are kept before their roots are taken: the
step's global norm is their sum's root, from the same collective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from clipopt._dist import _mesh
from clipopt._dist._mesh import REDUCE_DTYPE
from clipopt._kernels import _norms

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["global_tensor_powers", "held", "root", "total_root"]


def _placed(values: Tensor, positions: Sequence[int], size: int) -> Tensor:
    """A 1-D tensor of ``size``, ``values[k]`` at ``positions[k]``, zeros elsewhere (no
    index tensor, which would be a host-to-device copy)."""
    if list(positions) == list(range(size)):
        return values
    where = dict(zip(positions, values.unbind(), strict=True))
    zero = values.new_zeros(())
    return torch.stack([where.get(slot, zero) for slot in range(size)])


def held(values: Tensor, slots: Sequence[Tensor | None]) -> Tensor:
    """The entries of ``values`` (one per slot) whose slot holds a tensor, in order."""
    positions = [slot for slot, t in enumerate(slots) if t is not None]
    if len(positions) == len(slots):
        return values
    if not positions:
        return values.new_zeros(0)
    parts = values.unbind()
    return torch.stack([parts[slot] for slot in positions])


def _slot_shares(
    slots: Sequence[Tensor | None],
    mesh: DeviceMesh,
    p: float,
    foreach: bool | None,
    device: torch.device,
) -> Tensor:
    """This rank's share of each slot's ``norm**p`` (max for inf) on ``device``, one
    batched norm per replica count; 0 where the slot is None here."""
    positions = [slot for slot, t in enumerate(slots) if t is not None]
    if not positions:
        return torch.zeros(len(slots), dtype=REDUCE_DTYPE, device=device)
    grads = _mesh.dtensors([t for t in slots if t is not None])
    shares: list[Tensor] = []
    order: list[int] = []
    for count, indices in _mesh.by_replicas(grads, mesh).items():
        shards = [grads[i]._local_tensor for i in indices]
        norms = _norms.per_tensor_norms(shards, p, foreach).to(REDUCE_DTYPE)
        if p != math.inf:
            norms = norms.pow(p).div(count) if count > 1 else norms.pow(p)
        shares.append(norms.to(device))
        order.extend(positions[i] for i in indices)
    return _placed(torch.cat(shares), order, len(slots))


def global_tensor_powers(
    buckets: Sequence[Sequence[Tensor | None]],
    norm_types: Sequence[float],
    foreach: bool | None = None,
    *,
    params: Sequence[Tensor] = (),
    strict: bool = False,
) -> list[Tensor]:
    """Each slot's whole-tensor ``norm**p`` across ranks (its max ``|x|`` for inf), every
    finite-order bucket in one ``all_reduce(SUM)``, every inf one in one ``MAX``.

    Args:
      buckets: each a list of slots, one per parameter (its DTensor grad, or None where
        this rank has none), as many in the same order on every rank.
      params: as in :func:`clipopt._dist._mesh.reduction_for`.
      strict: the ranks must hold as many grads; where they do not, every value is NaN.

    Returns:
      One 1-D float64 tensor per bucket, a value per slot, on the grads' device, the same
      on every rank: powers, not roots (:func:`root`, :func:`total_root`).

    Raises:
      ValueError: no DTensor among grads and ``params``, or as
        :func:`clipopt._dist._mesh.reduction_for`.
    """
    flat = [t for bucket in buckets for t in bucket if t is not None]
    reduction = _mesh.reduction_for(flat, params)
    if reduction is None:
        raise ValueError("global_tensor_powers needs DTensor grads or parameters")
    mesh, groups = reduction
    device = _mesh.collective_device(flat, groups)
    shares = [
        _slot_shares(bucket, mesh, p, foreach, device)
        for bucket, p in zip(buckets, norm_types, strict=True)
    ]
    count = len(flat) if strict else None
    return _mesh.reduce_by_order(shares, norm_types, groups, device, count, mesh.size())


def root(powers: Tensor, p: float) -> Tensor:
    """Each norm from its ``norm**p`` (the inf-norm's values are norms already)."""
    return powers if p == math.inf else powers.pow(1.0 / p)


def total_root(powers: Tensor, p: float) -> Tensor:
    """The p-norm of all the tensors ``powers`` measured (0 for none; NaN in, NaN out),
    from the float64 powers, so no precision is lost to the per-tensor roots."""
    if p != math.inf:
        return powers.sum().pow(1.0 / p)
    return powers.amax() if powers.numel() else powers.new_zeros(())
