"""A step called by DeepSpeed's ZeRO optimizer: recognised, and where its norm must come from.

DeepSpeed (0.19) hands a client optimizer to ``DeepSpeedZeroOptimizer``
(``deepspeed/runtime/zero/stage_1_and_2.py``, ZeRO-1 and -2), which rewrites its param
groups: each group's ``params`` becomes one flat fp32 tensor, this rank's partition of
the group's parameters, flattened and split over the data-parallel group. Its ``step``
then computes the global L2 norm of every group's grads over all ranks (kept as
``_global_grad_norm``), unscales (and, with ``gradient_clipping > 0``, clips) each
group's flat grad and calls the client's ``step()`` once per group from
``_optimizer_step(group_no)``, with ``param_groups`` swapped for ``[group_i]``.

So a wrapper stepped there sees one rank's shard of one group. Its local norm is not the
global one; with one group, summing the ranks' ``norm**p`` over the data-parallel group
is (the partitions are disjoint, their padding is zeros); with several groups, no call
sees the others' grads, and the only global norm there is DeepSpeed's own, which it has
computed before the first call.

:func:`zero_step` recognises the call (DeepSpeed's method is among the step's nearest
callers, as :mod:`clipopt._torch_dcp` recognises torch's DCP functions; no import of
deepspeed, no tensor read) and reads what the step needs of DeepSpeed's optimizer;
:func:`zero_scope` refuses what cannot be right there and says what to set instead, and
gives the :class:`~clipopt._dist._reduce.NormScope` to measure one group with.
DeepSpeed's other optimizers that step a client optimizer on flat partitions (ZeRO-3's
sub-groups, the BF16 optimizer of bf16 ZeRO-1) are recognised and refused: untested.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from clipopt._dist._reduce import NormScope

__all__ = ["ZeroStep", "ds_global_norm", "zero_scope", "zero_source", "zero_step"]

ZERO_MODULE = "deepspeed.runtime.zero.stage_1_and_2"
ZERO_METHOD = "_optimizer_step"
UNTESTED = {
    "deepspeed.runtime.zero.stage3": "DeepSpeed ZeRO-3 (it steps one sub-group at a time)",
    "deepspeed.runtime.bf16_optimizer": "DeepSpeed's BF16_Optimizer (bf16 ZeRO-1)",
}
_FRAMES = 10
"""How many callers to look at past the asking function: the wrapper's step methods, an
LR scheduler's patched ``step``, torch's GradScaler on DeepSpeed's autocast path."""

RECOMMENDED = (
    "DeepSpeed ZeRO-1 or -2 with 'gradient_clipping': 0 in its config and the wrapper "
    "as the client optimizer"
)


@dataclass(frozen=True)
class ZeroStep:
    """A client step called by DeepSpeed: what the wrapper needs of its caller.

    Attributes:
      caller: where it was called from, for messages (``"DeepSpeed ZeRO-2"``).
      supported: False for a DeepSpeed optimizer clipopt refuses (see ``caller``).
      group_index: the param group DeepSpeed steps in this call.
      group_count: how many param groups DeepSpeed steps one by one each step.
      dp_group: the data-parallel group this group's partitions are split over.
      clip_grad: DeepSpeed's ``gradient_clipping``.
      expert: whether the group holds MoE expert parameters (other ranks, other groups).
      owner: DeepSpeed's optimizer, whose global norm :func:`ds_global_norm` reads.
    """

    caller: str
    supported: bool
    group_index: int = 0
    group_count: int = 1
    dp_group: Any = None
    clip_grad: float = 0.0
    expert: bool = False
    owner: Any = None

    @property
    def last_call(self) -> bool:
        """Whether this call steps DeepSpeed's last group: the end of its step."""
        return self.group_index == self.group_count - 1


def _ds_frame(frame: FrameType | None) -> tuple[FrameType, str] | None:
    for _ in range(_FRAMES):
        if frame is None:
            return None
        module = frame.f_globals.get("__name__")
        if module == ZERO_MODULE and frame.f_code.co_name == ZERO_METHOD:
            return frame, module
        if module in UNTESTED:
            return frame, module
        frame = frame.f_back
    return None


def zero_step(depth: int = 1) -> ZeroStep | None:
    """The DeepSpeed call the caller's step runs in, or None outside DeepSpeed's optimizers.

    Args:
      depth: how many frames above this function's caller the wrapper's step sits
        (1: the caller's own caller is the step's first frame).

    Returns:
      A :class:`ZeroStep`, ``supported=False`` for an optimizer clipopt refuses; None
      while ``torch.compile`` traces the step, which cannot read frames (a compiled
      step under DeepSpeed is not recognised).
    """
    if torch.compiler.is_compiling():
        return None
    try:
        frame: FrameType | None = sys._getframe(1 + depth)
    except ValueError:
        return None
    found = _ds_frame(frame)
    if found is None:
        return None
    frame, module = found
    if module in UNTESTED:
        return ZeroStep(UNTESTED[module], supported=False)
    owner = frame.f_locals.get("self")
    index = frame.f_locals.get("group_no")
    if owner is None or not isinstance(index, int):
        return ZeroStep(f"DeepSpeed's {ZERO_MODULE}.{ZERO_METHOD}", supported=False)
    stage = 2 if getattr(owner, "partition_gradients", False) else 1
    moe = getattr(owner, "is_moe_param_group", [])
    return ZeroStep(
        f"DeepSpeed ZeRO-{stage}",
        supported=True,
        group_index=index,
        group_count=len(owner.bit16_groups),
        dp_group=owner.real_dp_process_group[index],
        clip_grad=float(getattr(owner, "clip_grad", 0.0) or 0.0),
        expert=bool(moe[index]) if index < len(moe) else False,
        owner=owner,
    )


def _ranks(group: Any) -> list[int]:
    return list(dist.get_process_group_ranks(group or dist.group.WORLD))


def zero_scope(
    call: ZeroStep,
    scope: NormScope,
    norm_types: list[float],
    per_group: bool,
    measures_each_grad: bool,
) -> NormScope | None:
    """Refuse a setting that cannot measure the right norm under ``call``; else where to.

    Args:
      call: the DeepSpeed call, from :func:`zero_step`.
      scope: the wrapper's own scope (its ``process_group`` and ``replicated_params``).
      norm_types: each param group's order (the one group stepped in this call).
      per_group: the wrapper's ``per_group``.
      measures_each_grad: the wrapper measures grad by grad or unit by unit
        (``track_tensor_norms``, a per-tensor or unit-wise rule), which a flat
        partition of many parameters cannot give.

    Returns:
      With one group, the scope reducing over DeepSpeed's data-parallel group; with
      several, None: the norm is DeepSpeed's (:func:`ds_global_norm`).

    Raises:
      ValueError: naming the setting to use.
    """
    if not call.supported:
        raise ValueError(
            f"ClippedOptimizer is stepped by {call.caller}, which clipopt has not tested: "
            f"each call sees flat partitions whose global norm it cannot check. Use "
            f"{RECOMMENDED}, or DeepSpeed's own gradient_clipping with a bare optimizer"
        )
    if call.clip_grad > 0:
        raise ValueError(
            f"{call.caller} clips the grads itself (gradient_clipping={call.clip_grad}) "
            "before it steps ClippedOptimizer, which would clip twice and record the "
            "clipped norm as last_norm: set 'gradient_clipping': 0 in the DeepSpeed config"
        )
    if call.expert:
        raise ValueError(
            f"{call.caller} steps a MoE expert param group (param group {call.group_index}), "
            "whose partitions lie on the expert data-parallel ranks: not supported; give "
            "DeepSpeed a bare optimizer and its own gradient_clipping"
        )
    if measures_each_grad:
        raise ValueError(
            f"under {call.caller} each param group is one flat partition of many "
            "parameters, so grads cannot be measured one by one: track_tensor_norms, "
            "per-tensor and unit-wise rules (AGC) are not available; use a global rule "
            "or a number as max_norm"
        )
    if scope.pp_group is not None:
        raise ValueError(
            f"pp_mesh combines pipeline stages' norms, but {call.caller} steps flat "
            "partitions of one data-parallel group (DeepSpeed's pipeline engine is not "
            "supported): remove pp_mesh"
        )
    if scope.replicated_params:
        raise ValueError(
            f"replicated_params name model parameters, but {call.caller} steps flat "
            "partitions of them, partitioned once over the data-parallel group: remove "
            "replicated_params"
        )
    dp_ranks = _ranks(call.dp_group)
    if scope.process_group is not None and _ranks(scope.process_group) != dp_ranks:
        raise ValueError(
            f"process_group spans ranks {_ranks(scope.process_group)}, but {call.caller} "
            f"partitions param group {call.group_index} over ranks {dp_ranks}: remove "
            "process_group (the wrapper reduces over DeepSpeed's data-parallel group)"
        )
    if call.group_count == 1:
        return NormScope(call.dp_group)
    if per_group or any(p != 2.0 for p in norm_types):
        raise ValueError(
            f"{call.caller} steps ClippedOptimizer once per param group "
            f"({call.group_count} groups), so the global norm is DeepSpeed's own, an L2 "
            "norm over all groups: use norm_type=2 and per_group=False, or one param group"
        )
    return None


def zero_source(
    call: ZeroStep,
    scope: NormScope,
    norm_types: list[float],
    per_group: bool,
    measures_each_grad: bool,
) -> tuple[NormScope, Tensor | None]:
    """Where the norm of a step under ``call`` comes from: (the scope to reduce over,
    None) with one group, (``scope``, DeepSpeed's norm) with several; the arguments and
    the refusals are :func:`zero_scope`'s."""
    reduced = zero_scope(call, scope, norm_types, per_group, measures_each_grad)
    if reduced is not None:
        return reduced, None
    return scope, ds_global_norm(call)


def ds_global_norm(call: ZeroStep) -> Tensor:
    """DeepSpeed's global L2 grad norm of this step, computed before its first call.

    Raises:
      ValueError: DeepSpeed did not compute one (``compute_grad_norm`` false).
    """
    norm = getattr(call.owner, "_global_grad_norm", None)
    if isinstance(norm, Tensor):
        return norm.detach().reshape(())
    if isinstance(norm, float) and not math.isnan(norm) and norm >= 0:
        return torch.tensor(norm, dtype=torch.float32)
    raise ValueError(
        f"{call.caller} steps ClippedOptimizer once per param group ({call.group_count} "
        f"groups) and computed no global grad norm this step (got {norm!r}): set "
        "'zero_optimization': {'compute_grad_norm': true} (its default), or use one param group"
    )
