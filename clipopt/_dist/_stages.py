"""Pipeline stages: the model's norm is the p-norm of the stages' norms over ``pp_mesh``."""

from __future__ import annotations

import math
import sys
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from clipopt._dist._mesh import REDUCE_DTYPE, collective_device, reduce_by_order


def stage_group(pp_mesh: object) -> dist.ProcessGroup | None:
    """The group of ``pp_mesh``, None where it holds only this rank."""
    mesh_type = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", ())
    if pp_mesh is None:
        return None
    if isinstance(pp_mesh, mesh_type):  # no mesh exists before its module is imported
        if pp_mesh.ndim != 1:
            raise ValueError(f"pp_mesh must be a 1-D DeviceMesh (as mesh['pp']), got {pp_mesh}")
        group = pp_mesh.get_group()
    elif dist.is_available() and isinstance(pp_mesh, dist.ProcessGroup):
        group = pp_mesh
    else:
        raise TypeError(f"pp_mesh must be a 1-D DeviceMesh, a ProcessGroup or None: {pp_mesh!r}")
    return None if dist.get_world_size(group) == 1 else group


@torch.compiler.disable  # type: ignore[untyped-decorator]
def check_layout(
    pp_group: Any,
    per_group: bool,
    norm_types: Sequence[float],
    thresholds: Sequence[object],
    names: Sequence[str | int] = (),
) -> None:
    """Raise on every rank unless every stage has this clip layout (one ``all_reduce(MAX)``)."""
    if per_group:  # a tensor threshold by kind, not value
        kinds = ["a tensor" if isinstance(t, Tensor) else t for t in thresholds]
        pairs = list(zip(norm_types, kinds, strict=True))
        layout = f"per_group=True, (clip_norm_type, clip_max_norm) of each group {pairs}"
    else:
        layout = f"per_group=False, clip_norm_type {norm_types[0]}"
    layout += f", clip groups {list(names)}" if names else ""
    mine = [float(per_group), float(len(norm_types)), float(zlib.crc32(layout.encode()))]
    device = collective_device([], [pp_group])
    values = torch.tensor([v for m in mine for v in (m, -m)], dtype=REDUCE_DTYPE, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=pp_group)
    bounds = values.tolist()  # once, on the host
    per_group_differs, counts_differ, layouts_differ = (
        bounds[i] != -bounds[i + 1] for i in (0, 2, 4)
    )
    if per_group_differs:
        raise ValueError(f"pp_mesh: per_group is {per_group} on this stage, not on another")
    if per_group and counts_differ:
        raise ValueError(
            f"pp_mesh with per_group=True: the stages hold {int(-bounds[3])} and "
            f"{int(bounds[2])} param groups (this one {len(norm_types)})"
        )
    if layouts_differ:
        raise ValueError(f"pp_mesh: the stages' clip settings differ (this stage: {layout})")


def combine_stages(
    norms: Sequence[Tensor], norm_types: Sequence[float], pp_group: Any
) -> list[Tensor]:
    """Each of a stage's 0-dim ``norms`` combined with the other stages'."""
    if pp_group is None or not norms:
        return list(norms)
    device = norms[0].device  # a stage without grads has a CPU zero; NCCL needs its device
    device = collective_device([], [pp_group]) if device.type == "cpu" else device
    sent = [
        n.detach().to(device, REDUCE_DTYPE).reshape(1).pow(1.0 if p == math.inf else p)
        for n, p in zip(norms, norm_types, strict=True)
    ]
    reduced = reduce_by_order(sent, norm_types, [pp_group], device)
    return [
        (v[0] if p == math.inf else v[0].pow(1.0 / p)).to(device=n.device, dtype=n.dtype)
        for v, p, n in zip(reduced, norm_types, norms, strict=True)
    ]
