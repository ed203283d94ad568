"""The true global gradient norm under ``torch.distributed``, and checkpoints that keep it.

Three layouts, one rule: every element of the model's gradient counts exactly once.

- **DDP** (and anything else that leaves every rank with the full, already averaged
  grads, such as ``ZeroRedundancyOptimizer``): the local norm is the global norm; nothing
  here is needed and no communication is added.
- **DTensor grads** (FSDP2 ``fully_shard``, HSDP meshes, tensor parallel): the norm of
  each grad's local shard is raised to ``p`` and weighted by ``1 / (product of the mesh
  sizes over its Replicate dims)``, so replicas count once; one ``all_reduce(SUM)``
  (``MAX`` for the inf-norm) over the mesh gives the total. Shard and ``_StridedShard``
  dims count as sharded; a Partial grad is an error (its local values are not a shard of
  the gradient). Grads on several meshes (FSDP2 over tensor parallel, MoE's dense and
  expert meshes, torchtitan's meshes unflattened from a 1-D root) are reduced over the
  one that holds the others' ranks, or over the part of their common root they span
  when they are named sub-meshes of one; a grad on a smaller mesh also counts as
  replicated over the ranks its mesh lacks.
- **Plain tensors split across a process group** (model parallel): pass
  ``process_group``; each rank's ``norm**p`` is summed across the group, and tensors
  declared replicated across it (tied embeddings, layer norms under tensor parallel)
  are weighted by ``1 / group size`` so they count once.

Pipeline stages, each any of the above, pass ``pp_mesh`` (the 1-D mesh or group of one
rank per stage): each stage's norm is reduced as above, then the stages' ``norm**p``
are summed over it (max for inf) in one more ``all_reduce``
(:mod:`clipopt._dist._stages`).

A per-tensor clip rule (``AutoClip(per_tensor=True)``, ``AdaGC``) clips each grad by its
whole tensor's norm: local under DDP; for DTensor grads each shard's share, weighted as
above, in the step's one ``all_reduce``, which carries every grad's and gives the global
norm too (:mod:`clipopt._dist._per_tensor`). It refuses a ``process_group``: plain tensors
split across a group are other tensors on each rank.

The reduction runs in float64 whatever the grads' dtype: every rank must send the same
dtype (gloo aborts otherwise), and ``norm**p`` of a float32 norm overflows float32 from
``norm > 1.8e19`` at ``p = 2``. The result is a plain tensor, identical on every rank.

Gradient norm clipping: Pascanu et al., 2013, "On the difficulty of training recurrent
neural networks"; global norms over sharded and replicated parameters as in Megatron-LM
(Shoeybi et al., 2019) and FSDP (Zhao et al., 2023).

The user API here is :func:`get_optimizer_state_dict`, :func:`set_optimizer_state_dict`
and :class:`ClippedOptimizerState`. ``NormScope``, ``total_norm``, ``total_norms`` and
``local_tensors`` are the reduction's internals, re-exported from ``clipopt._dist._reduce`` so
that code written against 0.1.0 keeps importing; they are not covered by semver.

DCP checkpoints of a :class:`clipopt.ClippedOptimizer` keep its clip state:
``torch.distributed.checkpoint.state_dict`` saves and loads the inner optimizer (FQN
keys, FSDP2 DTensor state); the clip state rides beside it under ``"clip"`` as one
opaque bytes leaf, identical on every rank. Both loaders (this one and
:meth:`clipopt.ClippedOptimizer.load_state_dict`) validate through the wrapper's one
check before anything is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from clipopt import _torch_dcp
from clipopt._dist._mesh import local_tensors
from clipopt._dist._reduce import NormScope, global_norm, global_norms
from clipopt._step._clip_state import CLIP_KEY
from clipopt.optimizer import ClippedOptimizer

__all__ = [
    "ClippedOptimizerState",
    "NormScope",
    "get_optimizer_state_dict",
    "local_tensors",
    "set_optimizer_state_dict",
    "total_norm",
    "total_norms",
]

# The names this module exported in 0.1.0, kept importable for one release. They are the
# cross-rank plumbing of the wrapper and the functional API, not covered by semver.
total_norm = global_norm
total_norms = global_norms


def _checked_wrapper(optimizer: object) -> ClippedOptimizer:
    if not isinstance(optimizer, ClippedOptimizer):
        raise TypeError(
            f"optimizer must be a clipopt.ClippedOptimizer, got {type(optimizer).__name__}; "
            "for a plain optimizer use torch.distributed.checkpoint.state_dict directly"
        )
    return optimizer


def _encode_clip_state(clip_state: Mapping[str, Any]) -> bytes:
    """The clip state as one opaque leaf, so DCP's load needs no template of its shape.

    DCP loads tensors in place into a template of the same structure, which a fresh
    optimizer cannot provide (``last_norm`` is None before the first step). The clip
    state is small and identical on every rank, so it travels as bytes that DCP writes
    once and every rank reads.
    """
    return _torch_dcp.entry_bytes(clip_state)


def _decode_clip_state(blob: object) -> dict[str, Any]:
    if not isinstance(blob, bytes):
        raise TypeError(
            f"optim_state_dict[{CLIP_KEY!r}] must be the bytes written by "
            f"clipopt.distributed.get_optimizer_state_dict, got {type(blob).__name__}"
        )
    state = _torch_dcp.entry_from_bytes(blob)
    if not isinstance(state, dict):
        raise TypeError(f"the encoded clip state must be a dict, got {type(state).__name__}")
    return state


def get_optimizer_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    options: Any = None,
) -> dict[str, Any]:
    """``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` that keeps "clip".

    The inner optimizer goes through torch's function (FQN keys, FSDP2 DTensor state,
    and its initialisation ``step()`` on zero grads, which therefore never reaches the
    clipping wrapper and leaves its counters and ``last_norm`` untouched); the clip state
    is added under ``"clip"`` as one opaque leaf.

    Args:
      model: the module the optimizer trains.
      optimizer: a :class:`clipopt.ClippedOptimizer`.
      options: a ``torch.distributed.checkpoint.state_dict.StateDictOptions``.

    Returns:
      torch's optimizer state dict plus ``"clip"``; pass it to ``dcp.save``.
    """
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    wrapper = _checked_wrapper(optimizer)
    clip_state = wrapper._extra_state()
    state = dcp_state_dict.get_optimizer_state_dict(model, wrapper.optimizer, options=options)
    return {**state, CLIP_KEY: _encode_clip_state(clip_state)}


def set_optimizer_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    optim_state_dict: Mapping[str, Any],
    *,
    options: Any = None,
) -> None:
    """Load what :func:`get_optimizer_state_dict` made (after ``dcp.load``) into ``optimizer``.

    The clip entry and the groups' ``clip_max_norm`` / ``clip_norm_type`` are validated before
    anything is loaded, as :meth:`clipopt.ClippedOptimizer.load_state_dict` does; then the
    inner optimizer's state goes through torch's ``set_optimizer_state_dict`` and the clip
    state through the wrapper. A dict without ``"clip"`` (a run that started unwrapped)
    loads the inner state and leaves the clip state as it is; groups loaded without
    ``clip_max_norm`` / ``clip_norm_type`` get the wrapper's defaults.

    Args:
      model: the module the optimizer trains.
      optimizer: a :class:`clipopt.ClippedOptimizer`.
      optim_state_dict: the loaded dict.
      options: a ``torch.distributed.checkpoint.state_dict.StateDictOptions``.
    """
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    wrapper = _checked_wrapper(optimizer)
    raw = None
    if CLIP_KEY in optim_state_dict:
        raw = _decode_clip_state(optim_state_dict[CLIP_KEY])
    inner_state = {k: v for k, v in optim_state_dict.items() if k != CLIP_KEY}
    to_load, prepared = wrapper._check_load(inner_state, raw)
    wrapper._load_atomically(
        lambda: dcp_state_dict.set_optimizer_state_dict(
            model, wrapper.optimizer, dict(to_load), options=options
        ),
        prepared,
    )


class ClippedOptimizerState:
    """A DCP ``Stateful`` for a :class:`clipopt.ClippedOptimizer`, clip state included.

    ``dcp.save`` and ``dcp.load`` call ``state_dict`` / ``load_state_dict`` on it, which
    go through :func:`get_optimizer_state_dict` / :func:`set_optimizer_state_dict`.

    Args:
      model: the module the optimizer trains.
      optimizer: a :class:`clipopt.ClippedOptimizer`.
      options: a ``torch.distributed.checkpoint.state_dict.StateDictOptions``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        options: Any = None,
    ) -> None:
        _checked_wrapper(optimizer)
        self.model = model
        self.optimizer = optimizer
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=self.options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=self.options)
