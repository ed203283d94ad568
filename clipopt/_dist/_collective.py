"""The collectives norms are reduced with: float64 values, summed or maxed (NaN kept).

:mod:`clipopt._dist._reduce` (one norm per bucket), :mod:`clipopt._dist._per_tensor` (one norm
per tensor) and :mod:`clipopt._dist._units` (one per unit) send their local shares through
these, so they agree on the dtype every rank sends, on how a NaN survives a ``MAX``, and
on how the ranks' counts of grads travel with the values (:func:`count_tail`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "REDUCE_DTYPE",
    "all_reduce",
    "collective_device",
    "count_tail",
    "counts_differ",
    "reduce_max",
    "reduce_sum",
]

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


def count_tail(count: int, summed: bool, device: torch.device) -> Tensor:
    """Two slots that say, once reduced, whether the ranks hold the same number of
    tensors: ``[n, n**2]`` summed (all equal iff ``ranks * sum(n**2) == sum(n)**2``), or
    ``[n, -n]`` maxed (all equal iff ``max(n) == min(n)``).

    Example:
      >>> import torch
      >>> count_tail(3, True, torch.device("cpu"))
      tensor([3., 9.], dtype=torch.float64)
    """
    second = count * count if summed else -count
    return torch.cat(
        [
            torch.full((1,), float(count), dtype=REDUCE_DTYPE, device=device),
            torch.full((1,), float(second), dtype=REDUCE_DTYPE, device=device),
        ]
    )


def counts_differ(tail: Tensor, summed: bool, ranks: int) -> Tensor:
    """From a reduced :func:`count_tail`: a 0-dim bool, True where the counts differ.

    Example:
      >>> import torch
      >>> cpu = torch.device("cpu")
      >>> summed = count_tail(3, True, cpu) + count_tail(0, True, cpu)
      >>> counts_differ(summed, True, 2), counts_differ(2 * count_tail(3, True, cpu), True, 2)
      (tensor(True), tensor(False))
    """
    first, second = tail.unbind()
    if summed:
        return second * ranks != first * first
    return first + second != 0
