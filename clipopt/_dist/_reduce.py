"""Norms across ranks: each grad element counted exactly once, in one collective per step.

Three layouts, one rule (see :mod:`clipopt.distributed` for the user's view):

- **DDP** (and anything else that leaves every rank with the full, already averaged
  grads): the local norm is the global norm; no communication is added.
- **DTensor grads** (FSDP2, HSDP, tensor parallel): the norm of each grad's local shard
  is raised to ``p`` and weighted by ``1 / (product of the mesh sizes over its Replicate
  dims)``, so replicas count once; one ``all_reduce(SUM)`` (``MAX`` for the inf-norm)
  over the mesh gives the total. A Partial grad is an error. Grads on several meshes
  are reduced over the one holding the others' ranks (:func:`clipopt._dist._mesh.reduction_mesh`).
- **Plain tensors split across a process group** (model parallel): each rank's
  ``norm**p`` is summed across the group; tensors declared replicated count once.

The reduction runs in float64 whatever the grads' dtype: every rank must send the same
dtype (gloo aborts otherwise), and ``norm**p`` of a float32 norm overflows float32 from
``norm > 1.8e19`` at ``p = 2``. The result is a plain tensor, identical on every rank.

Names: :func:`clipopt._kernels._norms.total_norm` is a local norm; :func:`global_norms` /
:func:`global_norm` and :meth:`NormScope.global_norms` are the norms across ranks.

A wrong ``process_group`` or ``replicated`` set is refused before any collective
starts: a rank that raises after its peers entered a collective leaves them waiting.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from clipopt._dist import _mesh, _stages
from clipopt._dist._collective import REDUCE_DTYPE, collective_device, reduce_max, reduce_sum
from clipopt._kernels import _norms

__all__ = [
    "NormScope",
    "check_members",
    "check_process_group",
    "global_norm",
    "global_norms",
]


def check_members(
    name: str, members: Iterable[Tensor], pool: Iterable[Tensor], pool_name: str
) -> None:
    """Raise a ValueError naming ``name`` unless every one of ``members`` is in ``pool``.

    Membership is by identity: a replicated tensor must be the very object measured.
    """
    known = {id(t) for t in pool}
    for t in members:
        if id(t) not in known:
            raise ValueError(
                f"{name} holds a tensor of shape {tuple(t.shape)} that is not among {pool_name}"
            )


def check_process_group(process_group: object) -> None:
    """Raise a TypeError unless ``process_group`` is None or a ``ProcessGroup``."""
    if process_group is None:
        return
    if not dist.is_available() or not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be a torch.distributed.ProcessGroup or None, got {process_group!r}"
        )


# --------------------------------------------------------------------------- plain tensors


def _weighted_plain_tensors(
    tensors: Sequence[Tensor], replicated_ids: set[int], group_size: int
) -> list[tuple[float, list[Tensor]]]:
    """``tensors`` split into (1, sharded) and (1 / group size, replicated)."""
    own = [t for t in tensors if id(t) not in replicated_ids]
    shared = [t for t in tensors if id(t) in replicated_ids]
    return [(1.0, own), (1.0 / group_size, shared)]


def _check_group_for(name: str, replicated: Collection[Tensor], process_group: object) -> None:
    """Raise unless ``replicated`` is empty or has a ``process_group`` to be replicated across."""
    if replicated and process_group is None:
        raise ValueError(f"{name} need a process_group to be replicated across")


def _check_replicated(
    flat: Sequence[Tensor], replicated: Collection[Tensor], process_group: object
) -> None:
    if not replicated:
        return
    _check_group_for("replicated tensors", replicated, process_group)
    check_members("replicated", replicated, flat, "the tensors to measure")


# --------------------------------------------------------------------------- reduction


def _local_contribution(
    classes: Sequence[tuple[float, list[Tensor]]],
    p: float,
    foreach: bool | None,
    device: torch.device,
) -> Tensor:
    """This rank's share of the bucket: ``sum w * norm**p``, or ``max norm`` for inf.

    A 1-element float64 tensor on the first tensor's device; a zero made on ``device``
    (where the reduction runs) when there is none, so it is never copied there.
    Empty shards are skipped by the kernel, which the inf-norm needs.
    """
    parts: list[Tensor] = []
    for weight, tensors in classes:
        if not tensors:
            continue
        norm = _norms.total_norm(tensors, p, foreach).to(REDUCE_DTYPE)
        parts.append(norm if p == math.inf else norm.pow(p).mul(weight))
    if not parts:
        return torch.zeros(1, dtype=REDUCE_DTYPE, device=device)
    stacked = torch.stack([part.to(parts[0].device) for part in parts])
    return (stacked.amax() if p == math.inf else stacked.sum()).reshape(1)


# --------------------------------------------------------------------------- public


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
    """The global p-norm of each bucket of tensors, with at most one collective per reduce op.

    Every bucket's local share is computed first, then all finite-p buckets travel in one
    ``all_reduce(SUM)`` and all inf-norm buckets in one ``all_reduce(MAX)``: a single
    collective per step unless finite and inf orders are mixed across buckets. Without
    DTensors and without ``process_group`` nothing is communicated and the result is
    :func:`clipopt._kernels._norms.total_norm` of each bucket.

    Every rank of the group (or mesh) must call this with the same number of buckets and
    the same norm types, since it is a collective.

    Args:
      buckets: lists of tensors (usually grads); DTensors and plain tensors may not mix.
      norm_types: the validated order of each bucket, ``> 0`` or ``math.inf``.
      foreach: as in :func:`clipopt.get_total_norm`.
      process_group: for plain tensors, the group they are split across; for DTensors,
        optionally a group spanning exactly their mesh (saves one all_reduce per mesh
        dimension when the mesh is an N-D strict subset of the world).
      replicated: plain tensors (by identity) that hold the same values on every rank of
        ``process_group``; they count once instead of once per rank.
      params: the parameters the tensors are grads of. Those that are DTensors and
        require grad decide the mesh together with the grads present, so every rank
        reduces over the same ranks whatever grads it holds: a rank with no grad (FSDP2,
        and no grad reached this rank's parameters this step) joins with a zero, where it
        would otherwise skip the collective that the other ranks wait in, and a rank with
        grads on only some of the meshes (FSDP2 over TP) reduces over the whole of them.
      pp_group: the group joining one rank of each pipeline stage
        (:func:`clipopt._dist._stages.stage_group`): the tensors are this stage's, and
        the stages' sums of p-th powers are summed over it (maxed for inf) before the
        roots are taken, one collective more. It must share no other rank with the
        stage's reduction.

    Returns:
      One 0-dim tensor per bucket on its first tensor's device, float32 (float64 if any
      tensor of the bucket is), plain and identical on every rank.

    Raises:
      TypeError: ``process_group`` is not a ProcessGroup.
      ValueError: DTensors mixed with plain tensors, DTensors on meshes that are not named
        sub-meshes of one root, a Partial
        DTensor, ``replicated`` without ``process_group`` or with DTensors, a group that
        does not span exactly the mesh's ranks, a ``pp_group`` sharing another rank with
        the stage's reduction.
    """
    check_process_group(process_group)
    if len(buckets) != len(norm_types):
        raise ValueError(f"got {len(buckets)} buckets but {len(norm_types)} norm types")
    flat = [t for bucket in buckets for t in bucket]
    _check_replicated(flat, replicated, process_group)
    dtensors = _mesh.dtensors(flat)
    if dtensors or not flat:
        # The mesh comes from the parameters as well as the grads present: a rank holding
        # no grad, or grads on only some of the meshes, must reduce over the same ranks.
        spanned = dtensors + [q for q in _mesh.dtensors(params) if q.requires_grad]
    else:
        spanned = []
    if not spanned and process_group is None and pp_group is None:
        pairs = zip(buckets, norm_types, strict=True)
        return [_norms.total_norm(list(b), p, foreach) for b, p in pairs]
    if spanned:
        if flat:
            _mesh.check_unmixed(flat, dtensors)
        if replicated:
            raise ValueError(
                "replicated applies to plain tensors; a DTensor's replicas follow from its "
                "Replicate placements"
            )
        mesh = _mesh.reduction_mesh(spanned)
        groups = _mesh.mesh_groups(mesh, process_group)
        classes = [_mesh.weighted_dtensor_shards(_mesh.dtensors(list(b)), mesh) for b in buckets]
        if pp_group is not None:
            _stages.check_disjoint(pp_group, _mesh.mesh_ranks(mesh), "the grads' device mesh")
    else:
        groups = [] if process_group is None else [process_group]
        size = 1 if process_group is None else dist.get_world_size(process_group)
        ids = {id(t) for t in replicated}
        classes = [_weighted_plain_tensors(list(b), ids, size) for b in buckets]
        if pp_group is not None and process_group is not None:
            ranks = dist.get_process_group_ranks(process_group)
            _stages.check_disjoint(pp_group, ranks, "process_group")
    groups = _stages.stage_groups(groups, pp_group)
    device = collective_device(flat, groups)
    contributions = [
        _local_contribution(c, p, foreach, device) for c, p in zip(classes, norm_types, strict=True)
    ]
    return _finish(buckets, norm_types, contributions, groups, device, params)


def _finish(
    buckets: Sequence[Sequence[Tensor]],
    norm_types: Sequence[float],
    contributions: list[Tensor],
    groups: Sequence[Any],
    device: torch.device,
    params: Sequence[Tensor],
) -> list[Tensor]:
    """Reduce the local contributions on ``device`` (one collective per op), take p-th
    roots. An empty bucket's norm takes the parameters' dtype, as the grads on the ranks
    (and stages) that hold some do."""
    sum_at = [i for i, p in enumerate(norm_types) if p != math.inf]
    max_at = [i for i, p in enumerate(norm_types) if p == math.inf]
    reduced: dict[int, Tensor] = {}
    if sum_at:
        sums = reduce_sum([contributions[i] for i in sum_at], groups, device)
        for k, i in enumerate(sum_at):
            reduced[i] = sums[k].pow(1.0 / norm_types[i])
    if max_at:
        maxes = reduce_max([contributions[i] for i in max_at], groups, device)
        for k, i in enumerate(max_at):
            reduced[i] = maxes[k]
    results = []
    for i, bucket in enumerate(buckets):
        out_device = bucket[0].device if bucket else device
        out_dtype = _norms.result_dtype([t.dtype for t in bucket or params])
        results.append(reduced[i].to(device=out_device, dtype=out_dtype))
    return results


def global_norm(
    tensors: Sequence[Tensor],
    p: float,
    foreach: bool | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    replicated: Collection[Tensor] = (),
    params: Sequence[Tensor] = (),
    pp_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """The global p-norm of ``tensors`` across ranks: :func:`global_norms` of one bucket.

    Example:
      >>> import torch
      >>> from clipopt._dist._reduce import global_norm
      >>> global_norm([torch.tensor([3.0]), torch.tensor([4.0])], 2.0)
      tensor(5.)
    """
    norms = global_norms(
        [tensors],
        [p],
        foreach,
        process_group=process_group,
        replicated=replicated,
        params=params,
        pp_group=pp_group,
    )
    return norms[0]


class NormScope:
    """Where a clipping norm is reduced: a process group and the parameters replicated on it.

    :class:`clipopt.ClippedOptimizer` holds one. DTensor grads need neither (their
    placements say it all); plain grads split across ranks need the group, and
    parameters that every rank of it holds in full (tied embeddings, layer norms under
    tensor parallel) must be declared so they count once.

    A copy (``copy.deepcopy``) shares the process group, which is a live connection, not
    data; pickling a scope that holds a group raises a TypeError (save a state dict).

    Args:
      process_group: the group the parameters are split across, or None.
      replicated_params: parameters identical on every rank of ``process_group``.
      params: when given, every replicated parameter must be one of these.
      pp_mesh: the pipeline stages' 1-D mesh or group (:func:`clipopt._dist._stages.stage_group`):
        the parameters are one stage's, and the stages' norms are combined over it.

    Raises:
      TypeError: ``process_group`` is not a ProcessGroup, ``pp_mesh`` not a mesh or a
        group, or a replicated entry is not a tensor.
      ValueError: replicated parameters without a group, or not among ``params``; a
        ``pp_mesh`` of more than one dimension.
    """

    pp_group: dist.ProcessGroup | None = None
    """The stages' group; a class default, for scopes pickled before it existed."""
    stages_checked: tuple[bool, int] | None = None
    """``per_group`` and the group count :meth:`check_stages` last checked; None: never."""

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
        for t in replicated:
            if not isinstance(t, Tensor):
                raise TypeError(f"replicated_params must hold tensors, got {t!r}")
        _check_group_for("replicated_params", replicated, process_group)
        if params is not None:
            check_members("replicated_params", replicated, params, "the optimizer's parameters")
        self.process_group = process_group
        self.replicated_params = replicated
        self.pp_group = pp_group

    def global_norms(
        self,
        buckets: Sequence[Sequence[Tensor]],
        norm_types: Sequence[float],
        foreach: bool | None = None,
        params: Sequence[Tensor] = (),
    ) -> list[Tensor]:
        """:func:`global_norms` of the buckets, with the replicated parameters' grads."""
        shared: list[Tensor] = []
        if self.replicated_params:
            present = {id(t) for bucket in buckets for t in bucket}
            shared = [
                q.grad
                for q in self.replicated_params
                if q.grad is not None and id(q.grad) in present
            ]
        return global_norms(
            buckets,
            norm_types,
            foreach,
            process_group=self.process_group,
            replicated=shared,
            params=params,
            pp_group=self.pp_group,
        )

    def check_stages(
        self, per_group: bool, norm_types: Sequence[float], thresholds: Sequence[object]
    ) -> None:
        """Under pipeline stages, refuse stages whose clip layouts differ
        (:func:`clipopt._dist._stages.check_layout`): at the first step, and again where
        ``per_group`` or, with it, the group count changed. A change made on every stage
        at the same step (a load, ``add_param_group``) is checked again; one made on some
        stages only would make the others wait, as it would without the check."""
        key = (per_group, len(norm_types) if per_group else 0)
        if self.pp_group is None or self.stages_checked == key:
            return
        _stages.check_layout(self.pp_group, per_group, norm_types, thresholds)
        self.stages_checked = key

    def __deepcopy__(self, memo: dict[int, Any]) -> NormScope:
        twin = NormScope.__new__(NormScope)
        twin.process_group = self.process_group
        twin.pp_group = self.pp_group
        twin.replicated_params = copy.deepcopy(self.replicated_params, memo)
        return twin

    def __getstate__(self) -> dict[str, Any]:
        for name in ("process_group", "pp_group"):
            if getattr(self, name) is not None:
                raise TypeError(
                    f"a NormScope holding a {name} cannot be pickled: a process group is a "
                    "live connection; save the optimizer's state_dict() instead"
                )
        return dict(self.__dict__)

    def __repr__(self) -> str:
        pp = "" if self.pp_group is None else f", pp_group={self.pp_group!r}"
        return (
            f"NormScope(process_group={self.process_group!r}, "
            f"replicated_params={len(self.replicated_params)}{pp})"
        )
