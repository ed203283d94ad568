"""Each grad's own norm, of the whole tensor across ranks: what a per-tensor rule sees.

A per-tensor rule (``AutoClip(per_tensor=True)``, Seetharaman et al., 2020; AdaGC, Wang
et al., 2025) clips each grad by its own norm. Under DDP every rank holds whole grads
and each norm is local. A DTensor grad (FSDP2, HSDP, tensor parallel) holds a shard, and
its norm is that of the whole tensor: as for the global norm in :mod:`clipopt._dist._reduce`,
each grad's local shard norm is raised to ``p`` and divided by its replica count (the
mesh sizes over its Replicate dims, and the reduction mesh's dims its mesh lacks), and
the sums over the ranks of the reduction mesh give ``norm**p`` of each grad; for the
inf-norm the maximum is taken, with no weight. Every grad's share travels in ONE 1-D
float64 tensor, so a step makes one ``all_reduce`` (``SUM``, or ``MAX`` for the
inf-norm) over the mesh, whatever the number of grads; or one per mesh dimension when
the mesh is an N-D strict subset of the world (:func:`clipopt._dist._mesh.mesh_groups`). Grads
on several meshes (FSDP2 over TP) are reduced over the one holding the others' ranks
(:func:`clipopt._dist._mesh.reduction_mesh`), in that same one collective.

The reduced sums are kept before their roots are taken (:func:`global_tensor_powers`):
the step's global norm is their sum's root, so the per-tensor norms and the total come
from the one collective without a digit lost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from clipopt._dist import _mesh
from clipopt._dist._collective import (
    REDUCE_DTYPE,
    collective_device,
    count_tail,
    counts_differ,
    reduce_max,
    reduce_sum,
)
from clipopt._kernels import _norms

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = ["global_per_tensor_norms", "global_tensor_powers", "held", "root", "total_root"]


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
        norms = _norms.per_tensor_norms(shards, p, foreach).to(REDUCE_DTYPE)
        if p != math.inf:
            norms = norms.pow(p)
            norms = norms.div(count) if count > 1 else norms
        shares.append(norms)
        order.extend(indices)
    return shares, order


def _placed(values: Tensor, positions: Sequence[int], size: int) -> Tensor:
    """A 1-D tensor of ``size`` with ``values[k]`` at ``positions[k]`` and zeros elsewhere
    (no index tensor, which would be a host-to-device copy)."""
    if list(positions) == list(range(size)):
        return values
    where = dict(zip(positions, values.unbind(), strict=True))
    zero = values.new_zeros(())
    return torch.stack([where.get(slot, zero) for slot in range(size)])


def held(values: Tensor, slots: Sequence[Tensor | None]) -> Tensor:
    """The entries of ``values`` (one per slot) whose slot holds a tensor, in order.

    Example:
      >>> import torch
      >>> held(torch.tensor([1.0, 2.0, 3.0]), [torch.ones(1), None, torch.ones(1)])
      tensor([1., 3.])
    """
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
    """This rank's share of each slot's ``norm**p`` (max for inf) on ``device``; 0 where
    the slot is None here."""
    positions = [slot for slot, t in enumerate(slots) if t is not None]
    if not positions:
        return torch.zeros(len(slots), dtype=REDUCE_DTYPE, device=device)
    grads = _mesh.dtensors([t for t in slots if t is not None])
    shares, order = _local_shares(grads, mesh, p, foreach)
    values = torch.cat([share.to(device) for share in shares])
    return _placed(values, [positions[k] for k in order], len(slots))


def _reduced(
    contributions: list[Tensor],
    summed: bool,
    groups: Sequence[object],
    device: torch.device,
    tail: Tensor | None,
    ranks: int,
) -> list[Tensor]:
    """The contributions reduced in one collective, split back; all NaN when ``tail``
    (the ranks' counts) says the ranks disagree."""
    sizes = [c.numel() for c in contributions]
    sent = contributions if tail is None else [*contributions, tail]
    values = (reduce_sum if summed else reduce_max)(sent, groups, device)
    if tail is not None:
        differ = counts_differ(values[-2:], summed, ranks)
        values = torch.where(differ, math.nan, values[:-2])
    return list(torch.split(values, sizes))


def global_tensor_powers(
    buckets: Sequence[Sequence[Tensor | None]],
    norm_types: Sequence[float],
    foreach: bool | None = None,
    *,
    params: Sequence[Tensor] = (),
    strict: bool = False,
) -> list[Tensor]:
    """Each slot's whole-tensor ``norm**p`` across ranks (its max ``|x|`` for the inf-norm).

    A bucket is a list of slots, one per parameter (its grad, or None where this rank has
    none), measured in one order. Every finite-order bucket travels in one
    ``all_reduce(SUM)``, every inf-order one in one ``all_reduce(MAX)``: one collective
    unless the orders mix finite and inf. Slots, not grads, are what line up across
    ranks, so a rank that lacks some grads, or has none, joins with zeros there and every
    sum is still the sum of the grads that exist.

    Args:
      buckets: the slots of each bucket; every rank must pass as many slots per bucket,
        in the same order. The tensors are DTensors (on meshes that reduce together).
      norm_types: each bucket's validated order, ``> 0`` or ``math.inf``.
      foreach: as in :func:`clipopt.get_total_norm`.
      params: the parameters; those that are DTensors and require grad decide the mesh
        with the grads present, so a rank without grads reduces over the same ranks.
      strict: the ranks must hold the same number of grads (a per-tensor rule's norms
        must line up on every rank): where they do not, every value is NaN, on every
        rank. Two more values travel in each collective.

    Returns:
      One 1-D float64 tensor per bucket, one value per slot, on the grads' (local)
      device, identical on every rank. Not the roots: :func:`root` and
      :func:`total_root` take them.

    Raises:
      ValueError: DTensors mixed with plain tensors, no DTensor among the grads and
        ``params``, a Partial DTensor, or meshes that cannot be reduced together
        (:func:`clipopt._dist._mesh.reduction_mesh`).
    """
    flat = [t for bucket in buckets for t in bucket if t is not None]
    grads = _mesh.dtensors(flat)
    if flat:
        _mesh.check_unmixed(flat, grads)
    spanned = grads + [q for q in _mesh.dtensors(params) if q.requires_grad]
    if not spanned:
        raise ValueError("global_tensor_powers needs DTensor grads or parameters")
    mesh = _mesh.reduction_mesh(spanned)
    groups = _mesh.mesh_groups(mesh, None)
    device = collective_device(flat, groups)
    shares = [
        _slot_shares(bucket, mesh, p, foreach, device)
        for bucket, p in zip(buckets, norm_types, strict=True)
    ]
    reduced: dict[int, Tensor] = {}
    for summed in (True, False):
        at = [i for i, p in enumerate(norm_types) if (p != math.inf) == summed]
        if at:
            tail = count_tail(len(flat), summed, device) if strict else None
            parts = _reduced([shares[i] for i in at], summed, groups, device, tail, mesh.size())
            reduced.update(zip(at, parts, strict=True))
    return [reduced[i] for i in range(len(buckets))]


def root(powers: Tensor, p: float) -> Tensor:
    """Each norm from its ``norm**p`` (the inf-norm's values are norms already).

    Example:
      >>> import torch
      >>> root(torch.tensor([25.0, 4.0], dtype=torch.float64), 2.0)
      tensor([5., 2.], dtype=torch.float64)
    """
    return powers if p == math.inf else powers.pow(1.0 / p)


def total_root(powers: Tensor, p: float) -> Tensor:
    """The p-norm of all the tensors ``powers`` measured: the root of their sum (max), 0
    for none; a NaN among them is a NaN here. The sum is of the reduced float64 powers,
    so no precision is lost to the per-tensor roots.

    Example:
      >>> import torch
      >>> total_root(torch.tensor([9.0, 16.0], dtype=torch.float64), 2.0)
      tensor(5., dtype=torch.float64)
    """
    if p != math.inf:
        return powers.sum().pow(1.0 / p)
    return powers.amax() if powers.numel() else powers.new_zeros(())


def global_per_tensor_norms(
    tensors: Sequence[Tensor], p: float, foreach: bool | None = None
) -> Tensor:
    """The p-norm of each whole tensor, across the ranks its shards live on.

    Plain tensors are measured locally by :func:`clipopt._kernels._norms.per_tensor_norms`, with
    no collective: under DDP each rank holds whole (averaged) grads. DTensors are measured
    as the module says, in one collective (:func:`global_tensor_powers`). Every rank of
    the mesh must call this with grads of the same parameters in the same order (FSDP2
    and TP give every rank a grad, an empty shard included, for each parameter that got
    one), since it is a collective.

    Args:
      tensors: grads, all plain or all DTensors (on meshes that reduce together);
        at least one.
      p: a validated norm order, ``> 0`` or ``math.inf``.
      foreach: as in :func:`clipopt.get_total_norm`.

    Returns:
      A 1-D plain tensor with one norm per tensor, in the order given, on the first
      tensor's (local) device, float32 (float64 if any tensor is), identical on every
      rank. An empty shard adds nothing; a NaN on any rank is a NaN on every rank.

    Raises:
      ValueError: no tensors, DTensors mixed with plain tensors, a Partial DTensor, or
        DTensors on meshes that cannot be reduced together.

    Example:
      >>> import torch
      >>> from clipopt._dist._per_tensor import global_per_tensor_norms
      >>> global_per_tensor_norms([torch.tensor([3.0, 4.0]), torch.tensor([-2.0])], 2.0)
      tensor([5., 2.])
    """
    if not _mesh.dtensors(tensors):
        return _norms.per_tensor_norms(tensors, p, foreach)
    powers = global_tensor_powers([tensors], [p], foreach)[0]
    device = _mesh.local_tensors(tensors[:1])[0].device
    dtype = _norms.result_dtype([t.dtype for t in tensors])
    return root(powers, p).to(device=device, dtype=dtype)
