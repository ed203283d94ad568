"""The collectives norms are reduced with: float64 values, summed or maxed (NaN kept).

:mod:`clipopt._reduce` (one norm per bucket) and :mod:`clipopt._per_tensor` (one norm
per tensor) send their local shares through these, so both agree on the dtype every
rank sends and on how a NaN survives a ``MAX``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["REDUCE_DTYPE", "all_reduce", "collective_device", "reduce_max", "reduce_sum"]

REDUCE_DTYPE = torch.float64
"""The dtype every rank sends: fixed, so ranks agree; wide, so ``norm**p`` cannot overflow."""


def collective_device(tensors: Sequence[Tensor], groups: Sequence[Any]) -> torch.device:
    """The device the reduction runs on: the grads', or the group's when a rank has none."""
    if tensors:
        return tensors[0].device
    device_types = getattr(groups[0] or dist.group.WORLD, "_device_types", [])
    if not device_types or torch.device("cpu") in device_types:
        return torch.device("cpu")
    kind = device_types[0].type
    module = getattr(torch, kind)
    return torch.device(kind, module.current_device())


def all_reduce(values: Tensor, op: dist.ReduceOp.RedOpType, groups: Sequence[Any]) -> None:
    """``values`` reduced in place over each group in turn (one group: one collective)."""
    for group in groups:
        dist.all_reduce(values, op=op, group=group)


def reduce_sum(contributions: list[Tensor], groups: Sequence[Any], device: torch.device) -> Tensor:
    """The 1-D ``contributions`` concatenated on ``device`` and summed across the groups."""
    values = torch.cat([c.to(device) for c in contributions])
    all_reduce(values, dist.ReduceOp.SUM, groups)
    return values


def reduce_max(contributions: list[Tensor], groups: Sequence[Any], device: torch.device) -> Tensor:
    """MAX that keeps NaN: reduction backends may drop it, and then ranks would disagree.

    The values and a NaN flag per value travel in one tensor, so it is one collective.
    """
    values = torch.cat([c.to(device) for c in contributions])
    is_nan = values.isnan()
    packed = torch.cat([values.nan_to_num(nan=math.inf), is_nan.to(values.dtype)])
    all_reduce(packed, dist.ReduceOp.MAX, groups)
    count = values.numel()
    return torch.where(packed[count:] > 0, math.nan, packed[:count])
