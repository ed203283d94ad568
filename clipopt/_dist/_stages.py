"""Pipeline stages: each stage's own norm, then the stages' p-th powers combined.

Under pipeline parallelism each stage (a set of ranks: one rank, or a DDP / FSDP2 / TP
mesh of its own) holds other parameters. A stage's reduction (:mod:`clipopt._dist._reduce`)
gives the norm of its own grads, the same on every rank of the stage; the model's norm
is ``(sum over stages of norm_s**p) ** (1/p)``, or the stages' maximum for the inf-norm.
``pp_mesh`` (torchtitan's name) is what joins one rank of every stage: a 1-D
``DeviceMesh`` or a ``ProcessGroup``. Its sum is one more ``all_reduce`` (``SUM``, or a
``MAX`` that keeps NaN) of float64 values; a NaN or inf on any stage reaches every one,
and every rank receives the same bits, so every stage takes the same decision.

Where the stage's reduction already sends p-th powers (:func:`clipopt._dist._reduce.global_norms`)
the pipeline group is one more group to reduce over (:func:`stage_groups`), before any
root is taken. Where a stage's norms come from elsewhere (per-tensor norms, a unit-wise
rule's squares), :func:`combine_stages` raises them to ``p`` again in float64.

The stages' sums line up by position, so the stages must agree on what they send:
:func:`check_layout`, at a wrapper's first step, refuses stages whose clip settings
differ (with ``per_group``, their param groups' count, orders and thresholds, in order),
on every rank, before any stage enters a collective the others would not.
"""

from __future__ import annotations

import math
import sys
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from clipopt._dist._collective import REDUCE_DTYPE, collective_device, reduce_max, reduce_sum

__all__ = ["check_disjoint", "check_layout", "combine_stages", "stage_group", "stage_groups"]


def _device_mesh_type() -> type | None:
    """DeviceMesh if ``torch.distributed.device_mesh`` is imported (no mesh exists before)."""
    module = sys.modules.get("torch.distributed.device_mesh")
    return None if module is None else getattr(module, "DeviceMesh", None)


def stage_group(pp_mesh: object) -> dist.ProcessGroup | None:
    """The process group joining the pipeline stages, from ``pp_mesh``; None for none.

    Args:
      pp_mesh: None, a 1-D ``DeviceMesh`` over one rank of each stage (torchtitan's
        ``parallel_dims.world_mesh["pp"]``), or a ``ProcessGroup`` of those ranks.

    Returns:
      The group, or None where there is no ``pp_mesh`` or it holds only this rank (the
      one stage is the whole model: nothing to combine).

    Raises:
      TypeError: ``pp_mesh`` is neither.
      ValueError: a ``DeviceMesh`` of more than one dimension.
    """
    if pp_mesh is None:
        return None
    mesh_type = _device_mesh_type()
    if mesh_type is not None and isinstance(pp_mesh, mesh_type):
        mesh: Any = pp_mesh
        if mesh.ndim != 1:
            raise ValueError(
                f"pp_mesh must be a 1-D DeviceMesh over the pipeline stages, got {mesh} "
                f"with {mesh.ndim} dims; pass the stages' dimension, mesh['pp']"
            )
        group = mesh.get_group()
    elif dist.is_available() and isinstance(pp_mesh, dist.ProcessGroup):
        group = pp_mesh
    else:
        raise TypeError(
            "pp_mesh must be a 1-D torch.distributed.DeviceMesh, a ProcessGroup or None, "
            f"got {pp_mesh!r}"
        )
    return None if dist.get_world_size(group) == 1 else group


def check_disjoint(pp_group: Any, stage_ranks: Sequence[int], what: str) -> None:
    """Raise a ValueError unless the pipeline group meets the stage's ranks only here.

    A pipeline group holding another rank of this stage (``pp_mesh`` the data-parallel
    dimension, say) would add the stage's own norm to itself.

    Args:
      pp_group: the pipeline group.
      stage_ranks: the global ranks this stage's grads are reduced over, this one included.
      what: names them in the message.
    """
    pp_ranks = set(dist.get_process_group_ranks(pp_group))
    shared = sorted(pp_ranks & set(stage_ranks))
    if shared != [dist.get_rank()]:
        raise ValueError(
            f"pp_mesh spans ranks {sorted(pp_ranks)}, which share {shared} with {what} "
            f"{sorted(stage_ranks)}: pp_mesh must hold one rank of each pipeline stage, "
            "this one and no other rank of its stage"
        )


def _layout(per_group: bool, norm_types: Sequence[float], thresholds: Sequence[object]) -> str:
    """What the stages must agree on, as text: one order without ``per_group``; with it,
    each group's order and threshold in turn (a tensor threshold by kind: its value
    would be a read from the device)."""
    if not per_group:
        return f"per_group=False, clip_norm_type {norm_types[0]}"
    pairs = [
        (p, "a tensor" if isinstance(t, Tensor) else t)
        for p, t in zip(norm_types, thresholds, strict=True)
    ]
    return f"per_group=True, (clip_norm_type, clip_max_norm) of each group {pairs}"


@torch.compiler.disable  # type: ignore[untyped-decorator]
def check_layout(
    pp_group: Any, per_group: bool, norm_types: Sequence[float], thresholds: Sequence[object]
) -> None:
    """Raise a ValueError on every rank unless every stage has this stage's clip layout.

    One ``all_reduce(MAX)`` over the stages of six float64 values (``per_group``, the
    group count and a CRC-32 of the layout, each beside its negation, so that the
    maximum gives the least too), read on the host: the wrapper calls it at its first
    step (again where ``per_group`` and the group count change), not at every step.

    Args:
      pp_group: the stages' group.
      per_group: the wrapper's; every stage must have the same.
      norm_types: each param group's order.
      thresholds: each param group's ``clip_max_norm``.
    """
    layout = _layout(per_group, norm_types, thresholds)
    mine = [float(per_group), float(len(norm_types)), float(zlib.crc32(layout.encode()))]
    device = collective_device([], [pp_group])
    values = torch.tensor([v for m in mine for v in (m, -m)], dtype=REDUCE_DTYPE, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=pp_group)
    bounds = values.tolist()  # once, on the host
    per_group_differs, counts_differ, layouts_differ = (
        bounds[i] != -bounds[i + 1] for i in (0, 2, 4)
    )
    if per_group_differs:
        raise ValueError(
            f"pp_mesh: per_group is {per_group} on this pipeline stage and "
            f"{not per_group} on another; pass the same per_group on every stage"
        )
    if per_group and counts_differ:
        raise ValueError(
            f"pp_mesh with per_group=True: the pipeline stages' optimizers hold "
            f"{int(-bounds[3])} and {int(bounds[2])} param groups (this stage "
            f"{len(norm_types)}); per_group combines the stages' groups by position, so "
            "give every stage as many param groups, with the same clip settings in the "
            "same order, or pass per_group=False"
        )
    if layouts_differ:
        raise ValueError(
            f"pp_mesh: the pipeline stages' clip settings differ (this stage: {layout}); "
            "the stages' norms are combined by position, so every stage needs the same "
            "clip_norm_type and, with per_group=True, its param groups' clip settings in "
            "the same order"
        )


def stage_groups(groups: Sequence[Any], pp_group: Any) -> list[Any]:
    """``groups`` (a stage's reduction, in order), then the pipeline group if any.

    Summing over a stage's ranks and then over the stages' is the sum over every rank of
    the model; the maximum likewise. Each group is one ``all_reduce``.
    """
    return [*groups, pp_group] if pp_group is not None else list(groups)


def combine_stages(
    norms: Sequence[Tensor], norm_types: Sequence[float], pp_group: Any
) -> list[Tensor]:
    """Each of a stage's ``norms`` combined with the other stages': the p-norm of the
    stages' norms, in one collective per reduce op (``SUM`` for finite orders, ``MAX``
    keeping NaN for inf).

    The powers are taken in float64 (``norm**p`` of a float32 norm may overflow
    float32), summed, and the root cast back to each norm's dtype and device.

    Args:
      norms: 0-dim norms, the same on every rank of this stage.
      norm_types: the order of each.
      pp_group: the pipeline group; None returns ``norms`` as they are.

    Returns:
      One 0-dim tensor per norm, identical on every rank of every stage.
    """
    if pp_group is None or not norms:
        return list(norms)
    device = norms[0].device
    if device.type == "cpu":  # a stage without grads has a CPU zero; NCCL needs its device
        device = collective_device([], [pp_group])
    sent = [
        n.detach().to(device=device, dtype=REDUCE_DTYPE).reshape(1).pow(1.0 if p == math.inf else p)
        for n, p in zip(norms, norm_types, strict=True)
    ]
    out: dict[int, Tensor] = {}
    for summed in (True, False):
        at = [i for i, p in enumerate(norm_types) if (p != math.inf) == summed]
        if not at:
            continue
        reduce = reduce_sum if summed else reduce_max
        values = reduce([sent[i] for i in at], [pp_group], device)
        for k, i in enumerate(at):
            p = norm_types[i]
            value = values[k] if p == math.inf else values[k].pow(1.0 / p)
            out[i] = value.to(device=norms[i].device, dtype=norms[i].dtype)
    return [out[i] for i in range(len(norms))]
