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
  the gradient). Grads on named sub-meshes of one root mesh (FSDP2 over tensor parallel)
  are reduced over the part of the root they span; a grad on a smaller mesh also counts
  as replicated over the dims its mesh lacks.
- **Plain tensors split across a process group** (model parallel): pass
  ``process_group``; each rank's ``norm**p`` is summed across the group, and tensors
  declared replicated across it (tied embeddings, layer norms under tensor parallel)
  are weighted by ``1 / group size`` so they count once.

A per-tensor clip rule (``AutoClip(per_tensor=True)``, ``AdaGC``) clips each grad by its
whole tensor's norm: local under DDP; for DTensor grads each shard's share, weighted as
above, in the step's one ``all_reduce``, which carries every grad's and gives the global
norm too (:mod:`clipopt._per_tensor`). It refuses a ``process_group``: plain tensors
split across a group are other tensors on each rank.

The reduction runs in float64 whatever the grads' dtype: every rank must send the same
dtype (gloo aborts otherwise), and ``norm**p`` of a float32 norm overflows float32 from
``norm > 1.8e19`` at ``p = 2``. The result is a plain tensor, identical on every rank.

Gradient norm clipping: Pascanu et al., 2013, "On the difficulty of training recurrent
neural networks"; global norms over sharded and replicated parameters as in Megatron-LM
(Shoeybi et al., 2019) and FSDP (Zhao et al., 2023).

The user API here is :func:`get_optimizer_state_dict`, :func:`set_optimizer_state_dict`
and :class:`ClippedOptimizerState`. ``NormScope``, ``total_norm``, ``total_norms`` and
``local_tensors`` are the reduction's internals, re-exported from ``clipopt._reduce`` so
that code written against 0.1.0 keeps importing; they are not covered by semver.
"""

from __future__ import annotations

from clipopt._checkpoint import (
    ClippedOptimizerState,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from clipopt._mesh import local_tensors
from clipopt._reduce import NormScope, global_norm, global_norms

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
