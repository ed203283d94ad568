"""DeepSpeed stepping the wrapper: ZeRO-1/2 step it once per param group, on flat partitions."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from clipopt._dist import _mesh
from clipopt._dist._reduce import NormScope


@dataclass(frozen=True)
class Binding:
    caller: str
    owner: Any = None


@dataclass(frozen=True)
class ZeroStep:
    caller: str
    group_index: int
    group_count: int
    dp_group: Any
    owner: Any


class Watch:
    """The wrapper's parameters, whether it stepped, and its engine (not pickled)."""

    def __init__(self, params: Iterable[Tensor]) -> None:
        self.params = list(params)
        self.binding: Binding | None = None
        self.stepped = False

    def add(self, params: Iterable[Tensor]) -> None:
        self.params.extend(params)

    def __getstate__(self) -> dict[str, Any]:
        return {"params": self.params, "binding": None, "stepped": self.stepped}

    def call(self, param_groups: Sequence[dict[str, Any]]) -> tuple[ZeroStep | None, bool]:
        """This step's ZeRO call (None on whole parameters) and whether it is recorded."""
        if self.binding is not None:
            self.stepped, owner = True, self.binding.owner
            if owner is None:
                return None, True
            partitions = owner.single_partition_of_fp32_groups
            held = param_groups[0]["params"] if len(param_groups) == 1 else []
            at = [i for i, t in enumerate(partitions) if len(held) == 1 and t is held[0]]
            if not at:
                raise ValueError(f"{self.binding.caller}: step the engine, not the wrapper")
            group = owner.real_dp_process_group[at[0]]
            call = ZeroStep(self.binding.caller, at[0], len(partitions), group, owner)
            return call, at[0] == len(partitions) - 1
        tensors = [p for group in param_groups for p in group["params"]]
        plain = [p for p in tensors if not isinstance(p, nn.Parameter)]
        known = {id(p) for p in self.params} if plain else set()
        foreign = [p for p in plain if id(p) not in known]
        # Written, not read, on a plain step: a compiled step does not guard on it.
        first, self.stepped = bool(foreign) and not self.stepped, True
        if not foreign:
            return None, True
        if first and [t.shape for t in tensors] == [p.shape for p in self.params]:
            return None, False  # DeepSpeed's start-up step on zero grads
        raise ValueError(
            f"a tensor of shape {tuple(foreign[0].shape)} is not a ClippedOptimizer parameter: "
            "under DeepSpeed call opt.attach_deepspeed(engine) after deepspeed.initialize"
        )


def bind(engine: Any, optimizer: Optimizer) -> Binding:
    """How ``engine`` steps ``optimizer``; a ValueError names a setting giving a wrong norm."""
    import deepspeed.runtime.fp16.unfused_optimizer as unfused  # type: ignore[import-untyped]
    import deepspeed.runtime.zero.stage_1_and_2 as zero12  # type: ignore[import-untyped]

    basic: object = getattr(engine, "basic_optimizer", None)
    if basic is not optimizer:
        raise ValueError(f"the engine steps {type(basic).__name__}, not this wrapper")
    caller = f"DeepSpeed ZeRO-{int(engine.zero_optimization_stage())}"
    clipping = float(engine.gradient_clipping() or 0.0)
    if clipping > 0:
        raise ValueError(f"{caller} clips too: set 'gradient_clipping': 0, not {clipping}")
    if engine.fp16_enabled() and engine.dynamic_loss_scale():
        raise ValueError(
            f"{caller}: set a static 'fp16': {{'loss_scale': 2**k}}, not a dynamic one"
        )
    owner = engine.optimizer
    if owner is optimizer or isinstance(owner, unfused.FP16_UnfusedOptimizer):
        return Binding(caller)  # whole, averaged grads
    if type(owner) is not zero12.DeepSpeedZeroOptimizer or owner.cpu_offload:
        offload = " with CPU offload" if getattr(owner, "cpu_offload", False) else ""
        raise ValueError(
            f"DeepSpeed's {type(owner).__name__}{offload} steps ClippedOptimizer, which "
            "clipopt has not tested: use ZeRO-0, -1 or -2 without offload"
        )
    if owner.has_moe_layers:
        raise ValueError(f"{caller} with MoE expert layers is not supported")
    return Binding(caller, owner)


def _ranks(group: Any) -> list[int]:
    return list(_mesh.group_ranks(group or dist.group.WORLD))


def zero_source(
    call: ZeroStep, scope: NormScope, norm_types: list[float], per_group: bool, each: bool
) -> tuple[NormScope, Tensor | None]:
    """(the scope, DeepSpeed's norm or None) of a step under ``call``; ``each``: a norm of
    each grad or unit is asked, which a flat partition cannot give."""
    flat = f"{call.caller} steps flat partitions of one data-parallel group"
    if each:
        raise ValueError(f"{flat}: track_tensor_norms, per-tensor and unit-wise rules cannot run")
    if scope.pp_group is not None or scope.replicated_params:
        setting = "pp_mesh" if scope.pp_group is not None else "replicated_params"
        raise ValueError(f"{flat}: remove {setting}")
    dp_ranks = _ranks(call.dp_group)
    if scope.process_group is not None and _ranks(scope.process_group) != dp_ranks:
        raise ValueError(
            f"process_group spans ranks {_ranks(scope.process_group)}, ZeRO's ranks {dp_ranks}"
        )
    if call.group_count == 1:
        return NormScope(call.dp_group), None
    if per_group or any(p != 2.0 for p in norm_types):
        raise ValueError(f"{call.caller}'s norm needs norm_type=2 and per_group=False")
    norm = getattr(call.owner, "_global_grad_norm", None)
    if isinstance(norm, Tensor):
        return scope, norm.detach().reshape(())
    if isinstance(norm, float) and not math.isnan(norm) and norm >= 0:
        return scope, torch.tensor(norm, dtype=torch.float32)
    raise ValueError(f"{call.caller} computed no grad norm ({norm!r}): set compute_grad_norm")
