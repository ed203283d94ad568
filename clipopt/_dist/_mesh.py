"""DTensor meshes and the float64 all_reduce of norms (no DTensor import at run time)."""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

REDUCE_DTYPE = torch.float64  # one dtype on every rank (gloo aborts otherwise), wide enough


def collective_device(tensors: Sequence[Tensor], groups: Sequence[Any]) -> torch.device:
    if tensors:
        return tensors[0].device
    device_types = getattr(groups[0] or dist.group.WORLD, "_device_types", [])
    if not device_types or torch.device("cpu") in device_types:
        return torch.device("cpu")
    kind = device_types[0].type
    return torch.device(kind, getattr(torch, kind).current_device())


def all_reduce(
    parts: Sequence[Tensor],
    summed: bool,
    groups: Sequence[Any],
    device: torch.device,
    count: int | None = None,
    ranks: int = 1,
) -> Tensor:
    """The 1-D ``parts`` summed (or maxed, keeping NaN) over each group; with ``count``,
    all NaN where the ``ranks`` ranks' counts differ, and one value more (0 or NaN)."""
    values = torch.cat([p.to(device) for p in parts])
    if count is not None:  # counts equal iff ranks * sum(n**2) == sum(n)**2, or max(n) == min(n)
        pair = (count, count * count if summed else -count)
        tail = [torch.full((1,), float(v), dtype=REDUCE_DTYPE, device=device) for v in pair]
        values = torch.cat([values, *tail])
    if summed:
        for group in groups:
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    else:  # backends may drop NaN from a max: send it apart
        n = values.numel()
        packed = torch.cat([values.nan_to_num(nan=math.inf), values.isnan().to(values.dtype)])
        for group in groups:
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
        values = torch.where(packed[n:] > 0, math.nan, packed[:n])
    if count is None:
        return values
    first, second = values[-2:].unbind()
    differ = second * ranks != first * first if summed else first + second != 0
    return torch.where(differ, math.nan, torch.cat([values[:-2], values.new_zeros(1)]))


def reduce_by_order(
    parts: Sequence[Tensor],
    norm_types: Sequence[float],
    groups: Sequence[Any],
    device: torch.device,
    count: int | None = None,
    ranks: int = 1,
) -> list[Tensor]:
    """Each of ``parts`` reduced: finite orders' summed in one :func:`all_reduce`, inf's maxed."""
    out: dict[int, Tensor] = {}
    for summed in (True, False):
        at = [i for i, p in enumerate(norm_types) if (p != math.inf) == summed]
        if at:
            values = all_reduce([parts[i] for i in at], summed, groups, device, count, ranks)
            sizes = [parts[i].numel() for i in at]
            out.update(zip(at, torch.split(values[: sum(sizes)], sizes), strict=True))
    return [out[i] for i in range(len(parts))]


def all_plain(tensors: Sequence[Tensor]) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return True
    if torch.compiler.is_compiling():
        return not any(isinstance(t, module.DTensor) for t in tensors)
    return not any(issubclass(kind, module.DTensor) for kind in set(map(type, tensors)))


def dtensors(tensors: Sequence[Tensor]) -> list[DTensor]:
    if all_plain(tensors):
        return []
    dtensor = sys.modules["torch.distributed.tensor"].DTensor
    return [t for t in tensors if isinstance(t, dtensor)]


def local_tensors(tensors: Sequence[Tensor]) -> list[Tensor]:
    return (
        list(tensors) if all_plain(tensors) else [getattr(t, "_local_tensor", t) for t in tensors]
    )


def check_unmixed(tensors: Sequence[Tensor], found: Sequence[DTensor], what: str = "grads") -> None:
    if len(found) != len(tensors):
        raise ValueError(
            f"{len(found)} of {len(tensors)} {what} are DTensors: DTensor and plain mix"
        )


def replica_count(grad: DTensor, reduction_mesh: DeviceMesh) -> int:
    """How many ranks of ``reduction_mesh`` hold each element of ``grad``'s shard."""
    mesh = grad.device_mesh
    count, rest = divmod(reduction_mesh.size(), mesh.size())
    if rest or any(p.is_partial() for p in grad.placements):
        raise ValueError(
            f"a gradient of shape {tuple(grad.shape)} with placements {grad.placements} on "
            f"{mesh} cannot be reduced over {reduction_mesh} (a Partial one has no norm)"
        )
    replicas = [mesh.size(d) for d, p in enumerate(grad.placements) if p.is_replicate()]
    return count * math.prod(replicas)


def by_replicas(grads: Sequence[DTensor], mesh: DeviceMesh) -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for index, grad in enumerate(grads):
        found.setdefault(replica_count(grad, mesh), []).append(index)
    return found


@functools.lru_cache(maxsize=256)
def mesh_ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    return tuple(sorted(int(rank) for rank in mesh.mesh.flatten().tolist()))


@functools.lru_cache(maxsize=256)
def group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(sorted(dist.get_process_group_ranks(group)))


def _root_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    if hasattr(mesh, "_get_root_mesh"):  # torch 2.10 on
        return mesh._get_root_mesh()
    from torch.distributed import device_mesh

    lookup = getattr(getattr(device_mesh, "_mesh_resources", None), "get_root_mesh", None)
    return None if lookup is None else lookup(mesh)


def reduction_mesh(grads: Sequence[DTensor]) -> DeviceMesh:
    """The grads' mesh holding all their meshes' ranks, else the root's dims they use."""
    meshes = list(dict.fromkeys(g.device_mesh for g in grads))
    ranks = [set(mesh_ranks(mesh)) for mesh in meshes]
    widest = max(range(len(meshes)), key=lambda i: len(ranks[i]))
    if all(r <= ranks[widest] for r in ranks):
        return meshes[widest]
    root = _root_mesh(meshes[0])
    root_names = () if root is None else root.mesh_dim_names or ()
    for mesh in meshes:
        names = mesh.mesh_dim_names
        if root is None or _root_mesh(mesh) != root or not set(names or [None]) <= set(root_names):
            raise ValueError(
                f"DTensor grads on {meshes}: no mesh holds the ranks of all the others, "
                "nor are all named sub-meshes of one root"
            )
    assert root is not None
    used = {name for mesh in meshes for name in mesh.mesh_dim_names or ()}
    names = tuple(name for name in root_names if name in used)
    return root if len(names) == len(root_names) else root[names]


def mesh_groups(mesh: DeviceMesh) -> list[Any]:
    whole = mesh.size() == dist.get_world_size()
    return [None] if whole else [mesh.get_group(dim) for dim in range(mesh.ndim)]


def reduction_for(
    tensors: Sequence[Tensor], params: Sequence[Tensor] = (), process_group: Any = None
) -> tuple[DeviceMesh, list[Any]] | None:
    """The mesh and groups to reduce DTensor ``tensors`` (or ``params``) over; None if plain."""
    found = dtensors(tensors)
    if tensors and not found:
        return None
    check_unmixed(tensors, found)
    spanned = found + [q for q in dtensors(params) if q.requires_grad]
    if not spanned:
        return None
    mesh = reduction_mesh(spanned)
    if process_group is None:
        return mesh, mesh_groups(mesh)
    ranks = list(group_ranks(process_group))
    if ranks != list(mesh_ranks(mesh)):
        raise ValueError(
            f"process_group spans ranks {ranks}, the grads' mesh {list(mesh_ranks(mesh))} "
            "(pipeline stages go in pp_mesh)"
        )
    return mesh, [process_group]
