"""Global norms across ranks in one collective; bad settings raise before it starts."""

from __future__ import annotations

import copy
import math
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from clipopt._dist import _mesh, _stages
from clipopt._dist._mesh import REDUCE_DTYPE
from clipopt._kernels import _norms


def check_members(name: str, members: Iterable[Tensor], pool: Iterable[Tensor], among: str) -> None:
    known = {id(t) for t in pool}
    for t in (t for t in members if id(t) not in known):
        raise ValueError(f"{name} holds a tensor of shape {tuple(t.shape)} not among {among}")


def check_process_group(process_group: object) -> None:
    kind = dist.ProcessGroup if dist.is_available() else ()
    if process_group is not None and not isinstance(process_group, kind):
        raise TypeError(f"process_group must be a ProcessGroup or None, got {process_group!r}")


def _local_contribution(
    classes: Sequence[tuple[float, list[Tensor]]],
    p: float,
    foreach: bool | None,
    device: torch.device,
) -> Tensor:
    """``sum weight * norm**p`` (inf: max) over the (weight, tensors) classes, shape (1,)."""
    parts: list[Tensor] = []
    for weight, tensors in classes:
        if tensors:
            norm = _norms.total_norm(tensors, p, foreach).to(REDUCE_DTYPE)
            parts.append(norm if p == math.inf else norm.pow(p).mul(weight))
    if not parts:
        return torch.zeros(1, dtype=REDUCE_DTYPE, device=device)
    stacked = torch.stack([part.to(parts[0].device) for part in parts])
    return (stacked.amax() if p == math.inf else stacked.sum()).reshape(1)


def global_norms(
    buckets: Sequence[Sequence[Tensor]],
    norm_types: Sequence[float],
    foreach: bool | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    replicated: Collection[Tensor] = (),
    params: Sequence[Tensor] = (),
    pp_group: dist.ProcessGroup | None = None,
) -> list[Tensor]:
    """The global p-norm of each bucket, 0-dim, alike on every rank; ``replicated``: plain
    tensors the same on all ranks of ``process_group``."""
    check_process_group(process_group)
    flat = [t for bucket in buckets for t in bucket]
    if replicated:
        if process_group is None:
            raise ValueError("replicated tensors need a process_group to be replicated across")
        check_members("replicated", replicated, flat, "the tensors to measure")
    reduction = _mesh.reduction_for(flat, params, process_group)
    if reduction is None and process_group is None and pp_group is None:
        pairs = zip(buckets, norm_types, strict=True)
        return [_norms.total_norm(list(b), p, foreach) for b, p in pairs]
    classes: list[list[tuple[float, list[Tensor]]]] = []
    if reduction is not None:
        if replicated:
            raise ValueError("replicated is for plain tensors, not DTensors' Replicate placements")
        mesh, groups = reduction
        for bucket in buckets:
            held = _mesh.dtensors(list(bucket))
            by_count = _mesh.by_replicas(held, mesh).items()
            classes.append([(1.0 / c, [held[i]._local_tensor for i in at]) for c, at in by_count])
        stage, what = _mesh.mesh_ranks(mesh), "the grads' device mesh"
    else:
        groups = [] if process_group is None else [process_group]
        size = 1 if process_group is None else dist.get_world_size(process_group)
        ids = {id(t) for t in replicated}
        for b in buckets:
            shared = [t for t in b if id(t) in ids]
            classes.append([(1.0, [t for t in b if id(t) not in ids]), (1.0 / size, shared)])
        stage, what = _mesh.group_ranks(process_group) if groups else (), "process_group"
    if pp_group is not None:  # meeting this stage's ranks only here, else a norm adds to itself
        pp_ranks = _mesh.group_ranks(pp_group)
        common = sorted(set(pp_ranks) & set(stage))
        if stage and common != [dist.get_rank()]:
            raise ValueError(
                f"pp_mesh spans ranks {list(pp_ranks)}, sharing {common} with {what} "
                f"{sorted(stage)}: it must hold this rank and one of each other stage"
            )
        groups = [*groups, pp_group]
    device = _mesh.collective_device(flat, groups)
    by_order = zip(classes, norm_types, strict=True)
    shares = [_local_contribution(c, p, foreach, device) for c, p in by_order]
    reduced = _mesh.reduce_by_order(shares, norm_types, groups, device)
    results = []
    for value, p, bucket in zip(reduced, norm_types, buckets, strict=True):
        norm = value[0] if p == math.inf else value[0].pow(1.0 / p)
        dtype = _norms.result_dtype([t.dtype for t in bucket or params])
        results.append(norm.to(device=bucket[0].device if bucket else device, dtype=dtype))
    return results


def global_norm(
    tensors: Sequence[Tensor], p: float, foreach: bool | None = None, **scope: Any
) -> Tensor:
    return global_norms([tensors], [p], foreach, **scope)[0]


class NormScope:
    """Where a clipping norm is reduced (a copy shares the groups; a pickle refuses them)."""

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        replicated_params: Iterable[Tensor] | None = None,
        *,
        params: Iterable[Tensor] | None = None,
        pp_mesh: object = None,
    ) -> None:
        check_process_group(process_group)
        pp_group = _stages.stage_group(pp_mesh)
        replicated = [] if replicated_params is None else list(replicated_params)
        if bad := [t for t in replicated if not isinstance(t, Tensor)]:
            raise TypeError(f"replicated_params must hold tensors, got {bad[0]!r}")
        if replicated and process_group is None:
            raise ValueError("replicated_params need a process_group to be replicated across")
        if params is not None:
            check_members("replicated_params", replicated, params, "the optimizer's parameters")
        self.process_group, self.pp_group = process_group, pp_group
        self.replicated_params = replicated
        self.stages_checked: tuple[bool, int, tuple[str | int, ...]] | None = None

    def global_norms(
        self,
        buckets: Sequence[Sequence[Tensor]],
        norm_types: Sequence[float],
        foreach: bool | None = None,
        params: Sequence[Tensor] = (),
    ) -> list[Tensor]:
        present = {id(t) for bucket in buckets for t in bucket} if self.replicated_params else ()
        shared = [
            g for q in self.replicated_params if (g := q.grad) is not None and id(g) in present
        ]
        kw = {"process_group": self.process_group, "pp_group": self.pp_group}
        return global_norms(buckets, norm_types, foreach, replicated=shared, params=params, **kw)

    def check_stages(
        self,
        per_group: bool,
        norm_types: Sequence[float],
        thresholds: Sequence[object],
        names: Sequence[str | int] = (),
    ) -> None:
        key = (per_group, len(norm_types) if per_group else 0, tuple(names))
        if self.pp_group is not None and self.stages_checked != key:
            _stages.check_layout(self.pp_group, per_group, norm_types, thresholds, names)
            self.stages_checked = key

    def __deepcopy__(self, memo: dict[int, Any]) -> NormScope:
        twin = NormScope.__new__(NormScope)
        twin.__dict__.update(self.__dict__, stages_checked=None)
        twin.replicated_params = copy.deepcopy(self.replicated_params, memo)
        return twin

    def __getstate__(self) -> dict[str, Any]:
        for name in ("process_group", "pp_group"):
            if getattr(self, name) is not None:
                raise TypeError(f"a NormScope holding a {name} cannot be pickled")
        return dict(self.__dict__)
