"""torch's private DTensor helpers that clipopt's distributed code needs, each looked up
where torch 2.6 to 2.14 keep it; where one is missing, the layout it serves is refused
with an error. (The norms call torch's ``_foreach_*`` ops directly, as its clip does.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["local_shape_and_offset", "root_mesh", "strided_shard_types"]


def strided_shard_types() -> tuple[type, ...]:
    """``(_StridedShard,)``, the placement FSDP2 gives dim 0 over TP; ``()`` if absent."""
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return ()
    return (_StridedShard,)


def root_mesh(mesh: Any) -> Any:
    """The mesh ``mesh`` was sliced from (itself if it was not); None if torch cannot say."""
    method = getattr(mesh, "_get_root_mesh", None)  # torch 2.10 on
    if method is not None:
        return method()
    from torch.distributed import device_mesh

    lookup = getattr(getattr(device_mesh, "_mesh_resources", None), "get_root_mesh", None)
    return None if lookup is None else lookup(mesh)


class _MeshAt:
    """What torch 2.6's ``compute_local_shape_and_global_offset`` reads of a mesh."""

    def __init__(self, shape: tuple[int, ...], coordinate: list[int]) -> None:
        self._shape, self._coordinate = shape, coordinate
        self.ndim = len(shape)

    def size(self, mesh_dim: int) -> int:
        return self._shape[mesh_dim]

    def get_coordinate(self) -> list[int]:
        return self._coordinate


def local_shape_and_offset(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: list[int],
    placements: Sequence[Any],
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The local shape and global offset, by torch's own rule, of a DTensor of ``shape``
    on the rank at ``coordinate`` of a mesh of ``mesh_shape``; None without such a rule."""
    from torch.distributed.tensor import _utils

    compute = getattr(_utils, "_compute_local_shape_and_global_offset", None)  # 2.7 on
    if compute is not None:
        local, offset = compute(shape, mesh_shape, list(coordinate), placements)
    else:
        older = getattr(_utils, "compute_local_shape_and_global_offset", None)
        if older is None:
            return None
        local, offset = older(shape, _MeshAt(mesh_shape, coordinate), placements)
    return tuple(local), tuple(offset)
