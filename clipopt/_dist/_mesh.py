"""DTensor grads: which are DTensors, their local shards, and the mesh to reduce them over.

A DTensor grad's norm counts each element once: its local shard's contribution is
weighted by ``1 / (product of the mesh sizes over its Replicate dims)``, and grads on
several meshes (FSDP2 over tensor parallel, MoE's dense and expert meshes) are reduced
over the one that holds the others' ranks (matched by ranks, not dimension names), or
over the part of their common root they span when they are named sub-meshes of one.
Nothing here imports ``torch.distributed.tensor``: it costs about a second, and no grad
can be a DTensor until the user has imported it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from clipopt import _torch_internals

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = [
    "all_plain",
    "check_unmixed",
    "dtensors",
    "local_tensors",
    "mesh_groups",
    "mesh_ranks",
    "reduction_mesh",
    "replica_count",
    "weighted_dtensor_shards",
]


def _dtensor_type() -> type[DTensor] | None:
    """The DTensor class if it has been imported, else None: no grad can be one then.

    Importing ``torch.distributed.tensor`` costs about a second, so it is never imported
    here just to answer "is this a DTensor?".
    """
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def dtensors(tensors: Sequence[Tensor]) -> list[DTensor]:
    dtensor = _dtensor_type()
    if dtensor is None or all_plain(tensors):
        return []
    return [t for t in tensors if isinstance(t, dtensor)]


def all_plain(tensors: Sequence[Tensor]) -> bool:
    """True if no tensor is a DTensor: measuring them needs no mesh and no collective."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return True
    if torch.compiler.is_compiling():
        return not any(isinstance(t, dtensor) for t in tensors)
    # By type, each distinct one once: thousands of grads share one or two types.
    return not any(issubclass(kind, dtensor) for kind in set(map(type, tensors)))


def check_unmixed(tensors: Sequence[Tensor], found: Sequence[DTensor], what: str = "grads") -> None:
    """Raise a ValueError unless every one of ``tensors`` is among ``found``, their DTensors.

    Called where DTensors are reduced: a plain tensor carries no placement saying whether
    it is a shard or a replica, so it cannot be reduced together with them. ``what`` names
    the tensors in the message.
    """
    if len(found) != len(tensors):
        raise ValueError(
            f"{len(found)} of {len(tensors)} {what} are DTensors: DTensor and plain {what} "
            "cannot be reduced together (the plain ones have no placement saying whether "
            "they are sharded or replicated); shard every parameter or none"
        )


def local_tensors(tensors: Sequence[Tensor]) -> list[Tensor]:
    """``tensors`` with every DTensor replaced by its local shard (the same storage).

    Scaling grads in place works shard by shard: it needs no communication, and DTensor
    ops refuse operands on different meshes (FSDP2 + TP puts the parameters left out of
    tensor parallelism on the data-parallel sub-mesh).
    """
    dtensor = _dtensor_type()
    if dtensor is None or all_plain(tensors):
        return list(tensors)
    return [t._local_tensor if isinstance(t, dtensor) else t for t in tensors]


def replica_count(grad: DTensor, reduction_mesh: DeviceMesh) -> int:
    """How many ranks of ``reduction_mesh`` hold a copy of each element of ``grad``'s shard.

    The product of the mesh sizes over ``grad``'s Replicate dims, times the size of the
    reduction mesh's dims that ``grad``'s mesh lacks (a parameter left out of tensor
    parallelism lives on the data-parallel sub-mesh and is the same on every TP rank).

    Raises:
      ValueError: ``grad`` has a Partial placement: its local values are summands of the
        gradient, not a shard of it, so no local norm is meaningful.
    """
    mesh = grad.device_mesh
    count, rest = divmod(reduction_mesh.size(), mesh.size())
    if rest:
        raise ValueError(
            f"a gradient of shape {tuple(grad.shape)} lives on {mesh}, whose size does not "
            f"divide that of the mesh it is reduced over, {reduction_mesh}"
        )
    for dim, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise ValueError(
                f"a gradient of shape {tuple(grad.shape)} has placements {grad.placements} "
                f"on {mesh}: a Partial grad has no norm until it is reduced; "
                "redistribute it to Shard or Replicate first"
            )
        if placement.is_replicate():
            count *= mesh.size(dim)
    return count


def _distinct_meshes(grads: Sequence[DTensor]) -> list[DeviceMesh]:
    meshes: list[DeviceMesh] = []
    for g in grads:
        mesh = g.device_mesh
        if not any(mesh is known or mesh == known for known in meshes):
            meshes.append(mesh)
    return meshes


def mesh_ranks(mesh: DeviceMesh) -> list[int]:
    """The global ranks of ``mesh`` (the part of it this rank is in), sorted."""
    # DeviceMesh.mesh is a CPU tensor of rank numbers, whatever the device type: reading
    # it waits on no accelerator.
    return sorted(int(rank) for rank in mesh.mesh.flatten().tolist())


def _enclosing(meshes: Sequence[DeviceMesh]) -> DeviceMesh | None:
    """The mesh among ``meshes`` whose ranks hold every other's, or None.

    By ranks, not by dimension names: torchtitan unflattens its meshes from a 1-D root
    (``ParallelDims.build_mesh``), so their names are not the root's. A mesh of a
    parameter left out of tensor parallelism (the data-parallel part of a 2-D one) or of
    experts beside dense parameters lies inside the larger mesh; its grads are then
    replicated over the ranks it lacks (:func:`replica_count`).
    """
    ranks = [set(mesh_ranks(mesh)) for mesh in meshes]
    widest = max(range(len(meshes)), key=lambda i: len(ranks[i]))
    if all(r <= ranks[widest] for r in ranks):
        return meshes[widest]
    return None


def reduction_mesh(grads: Sequence[DTensor]) -> DeviceMesh:
    """The mesh to reduce over: the grads' one mesh; the one of their meshes that holds
    the ranks of all the others (FSDP2 + TP: 2-D TP'd params and 1-D others, on meshes
    built by ``init_device_mesh`` or unflattened as torchtitan does; experts beside dense
    parameters); or the part of their common root mesh spanned by the named dims they use.

    Raises:
      ValueError: no mesh holds the others' ranks and the meshes have no common root,
        or a mesh is unnamed or flattened, so which root dims it covers is unknown.
    """
    meshes = _distinct_meshes(grads)
    if len(meshes) == 1:
        return meshes[0]
    enclosing = _enclosing(meshes)
    if enclosing is not None:
        return enclosing
    root: DeviceMesh | None = _torch_internals.root_mesh(meshes[0])
    if root is None:
        raise ValueError(
            f"DTensor grads live on {meshes}, none of which holds the others' ranks: "
            f"reducing them together needs torch's lookup of their root mesh, which torch "
            f"{torch.__version__} does not offer here; compute one norm per mesh instead"
        )
    root_names = root.mesh_dim_names or ()
    for mesh in meshes:
        names = mesh.mesh_dim_names
        same_root = _torch_internals.root_mesh(mesh) == root
        if not same_root or names is None or not set(names) <= set(root_names):
            raise ValueError(
                f"DTensor grads live on {meshes}: they can be reduced together only when "
                "one of the meshes holds the ranks of all the others, or they are named "
                "sub-meshes of one root mesh; compute one norm per mesh instead"
            )
    used = {name for mesh in meshes for name in mesh.mesh_dim_names or ()}
    names = tuple(name for name in root_names if name in used)
    return root if len(names) == len(root_names) else root[names]


def mesh_groups(mesh: DeviceMesh, process_group: dist.ProcessGroup | None) -> list[Any]:
    """The groups to all_reduce over, in order, so that every rank of ``mesh`` is summed.

    One group when possible: ``process_group`` (which must hold exactly the mesh's
    ranks: a group of as many other ranks would mix other ranks' shards in), the
    default group when the mesh spans the world (a mesh's ranks are distinct, so equal
    sizes mean the same ranks), the mesh's own group when it is 1-D. An N-D mesh that is a
    strict subset of the world needs one all_reduce per dimension (sum over dim 0, then
    dim 1, ... is the sum over the mesh); pass a ``process_group`` spanning it to make
    that one.
    """
    if process_group is not None:
        group_ranks = sorted(dist.get_process_group_ranks(process_group))
        ranks = mesh_ranks(mesh)
        if group_ranks != ranks:
            raise ValueError(
                f"process_group spans ranks {group_ranks} but the grads' device mesh {mesh} "
                f"spans ranks {ranks}; pass a group over exactly the mesh's ranks, or None "
                "(for pipeline stages, pass their group as pp_mesh)"
            )
        return [process_group]
    if mesh.size() == dist.get_world_size():
        return [None]
    if mesh.ndim == 1:
        return [mesh.get_group()]
    return [mesh.get_group(dim) for dim in range(mesh.ndim)]


def weighted_dtensor_shards(
    grads: Sequence[DTensor], reduction_mesh: DeviceMesh
) -> list[tuple[float, list[Tensor]]]:
    """The local shards of ``grads`` grouped by weight ``1 / replica count``.

    ``_local_tensor`` rather than ``to_local()``: the latter is an autograd function, and
    its per-call cost adds up over thousands of parameters every step.
    """
    by_count: dict[int, list[Tensor]] = {}
    for g in grads:
        by_count.setdefault(replica_count(g, reduction_mesh), []).append(g._local_tensor)
    return [(1.0 / count, shards) for count, shards in by_count.items()]
