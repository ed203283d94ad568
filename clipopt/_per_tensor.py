"""Each grad's own norm, of the whole tensor across ranks: what a per-tensor rule sees.

A per-tensor rule (``AutoClip(per_tensor=True)``, Seetharaman et al., 2020; AdaGC, Wang
et al., 2025) clips each grad by its own norm. Under DDP every rank holds whole grads
and each norm is local. A DTensor grad (FSDP2, HSDP, tensor parallel) holds a shard, and
its norm is that of the whole tensor: as for the global norm in :mod:`clipopt._reduce`,
each grad's local shard norm is raised to ``p`` and divided by its replica count (the
mesh sizes over its Replicate dims, and the reduction mesh's dims its mesh lacks), and
the sums over the ranks of the reduction mesh give ``norm**p`` of each grad; for the
inf-norm the maximum is taken, with no weight. Every grad's share travels in ONE 1-D
float64 tensor, so a step adds one ``all_reduce`` (``SUM``, or ``MAX`` for the inf-norm)
over the mesh, whatever the number of grads; or one per mesh dimension when the mesh is
an N-D strict subset of the world (:func:`clipopt._mesh.mesh_groups`). Grads on several
named sub-meshes of one root (FSDP2 over TP) are reduced over the part of the root they
span, in that same one collective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from clipopt import _kernels, _mesh
from clipopt._collective import REDUCE_DTYPE, collective_device, reduce_max, reduce_sum

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = ["global_per_tensor_norms"]


def _by_replica_count(grads: Sequence[DTensor], mesh: DeviceMesh) -> dict[int, list[int]]:
    """The grads' indices grouped by how many ranks of ``mesh`` hold each element."""
    groups: dict[int, list[int]] = {}
    for index, grad in enumerate(grads):
        groups.setdefault(_mesh.replica_count(grad, mesh), []).append(index)
    return groups


def _local_shares(
    grads: Sequence[DTensor], mesh: DeviceMesh, p: float, foreach: bool | None
) -> tuple[list[Tensor], list[int]]:
    """This rank's share of each grad's ``norm**p`` (its shard's norm for inf), in float64.

    Returns one 1-D tensor per replica count (one batched norm call each) and the grads'
    indices in the order the shares come in.
    """
    shares: list[Tensor] = []
    order: list[int] = []
    for count, indices in _by_replica_count(grads, mesh).items():
        shards = [grads[i]._local_tensor for i in indices]
        norms = _kernels.per_tensor_norms(shards, p, foreach).to(REDUCE_DTYPE)
        if p != math.inf:
            norms = norms.pow(p)
            norms = norms.div(count) if count > 1 else norms
        shares.append(norms)
        order.extend(indices)
    return shares, order


def _in_given_order(values: Tensor, order: list[int]) -> Tensor:
    """``values[k]`` is the grad ``order[k]``'s: put back in the grads' order (no index
    tensor, which would be a host-to-device copy)."""
    if order == list(range(len(order))):
        return values
    where = {index: k for k, index in enumerate(order)}
    parts = values.unbind()
    return torch.stack([parts[where[index]] for index in range(len(order))])


def global_per_tensor_norms(
    tensors: Sequence[Tensor], p: float, foreach: bool | None = None
) -> Tensor:
    """The p-norm of each whole tensor, across the ranks its shards live on.

    Plain tensors are measured locally by :func:`clipopt._kernels.per_tensor_norms`, with
    no collective: under DDP each rank holds whole (averaged) grads. DTensors are measured
    as the module says, in one collective. Every rank of the mesh must call this with
    grads of the same parameters in the same order (FSDP2 and TP give every rank a grad,
    an empty shard included, for each parameter that got one), since it is a collective.

    Args:
      tensors: grads, all plain or all DTensors (on named sub-meshes of one root mesh);
        at least one.
      p: a validated norm order, ``> 0`` or ``math.inf``.
      foreach: as in :func:`clipopt.get_total_norm`.

    Returns:
      A 1-D plain tensor with one norm per tensor, in the order given, on the first
      tensor's (local) device, float32 (float64 if any tensor is), identical on every
      rank. An empty shard adds nothing; a NaN on any rank is a NaN on every rank.

    Raises:
      ValueError: no tensors, DTensors mixed with plain tensors, a Partial DTensor, or
        DTensors on meshes that are not named sub-meshes of one root.

    Example:
      >>> import torch
      >>> from clipopt._per_tensor import global_per_tensor_norms
      >>> global_per_tensor_norms([torch.tensor([3.0, 4.0]), torch.tensor([-2.0])], 2.0)
      tensor([5., 2.])
    """
    grads = _mesh.dtensors(tensors)
    if not grads:
        return _kernels.per_tensor_norms(tensors, p, foreach)
    _mesh.check_unmixed(tensors, grads)
    mesh = _mesh.reduction_mesh(grads)
    groups = _mesh.mesh_groups(mesh, None)
    shares, order = _local_shares(grads, mesh, p, foreach)
    device = collective_device(shares, groups)
    if p == math.inf:
        reduced = reduce_max(shares, groups, device)
    else:
        reduced = reduce_sum(shares, groups, device).pow(1.0 / p)
    dtype = _kernels.result_dtype([t.dtype for t in tensors])
    return _in_given_order(reduced, order).to(device=shares[0].device, dtype=dtype)
