"""The clip coefficient ``min(1, max_norm / (norm + EPS))``, defined here only, and the
in-place scales of grads grouped by (device, dtype), on their devices."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from clipopt._kernels._norms import Groups, group

EPS = 1e-6
"""Added to the norm before dividing, as torch.nn.utils does."""


def coefficient(threshold: float | Tensor, norm: Tensor) -> Tensor:
    """``min(1, threshold / (norm + EPS))``, unguarded: for a rule's thresholds."""
    return torch.clamp(threshold / (norm + EPS), max=1.0)


def _beside(value: Tensor, other: Tensor) -> Tensor:
    """``value`` on ``other``'s device; a CPU scalar is read by an add (``torch.where``
    would copy it there, a blocking transfer)."""
    return value if value.device == other.device else other.new_zeros(()) + value


def clip_coefficient(max_norm: float | Tensor, norm: Tensor) -> Tensor:
    """:func:`coefficient` for a user's ``max_norm``: 1 for a tensor ``max_norm`` of inf;
    NaN (the grads turn NaN, not silently wrong) for a tensor one not > 0, and below the
    dtype's smallest normal, where its reciprocal, a fused step's ``grad_scale``, overflows."""
    coef = coefficient(max_norm, norm)
    invalid = (coef > 0) & (coef < torch.finfo(coef.dtype).tiny)
    if isinstance(max_norm, Tensor):
        limit = _beside(max_norm, coef)
        coef = torch.where(limit == math.inf, 1.0, coef)
        invalid = invalid | torch.logical_not(limit > 0)
    return torch.where(invalid, math.nan, coef)


def scale_(tensors: Sequence[Tensor], coef: Tensor, foreach: bool | None = None) -> None:
    """Multiply every tensor in place by the 0-dim ``coef``."""
    scale_groups_(group(tensors), coef, foreach)


def scale_groups_(groups: Groups, coef: Tensor, foreach: bool | None = None) -> None:
    """:func:`scale_` over grouped tensors: one ``_foreach_mul_`` a group."""
    coef_on: dict[torch.device, Tensor] = {}
    for (device, _), tensors in groups.dense.items():
        if not (torch.compiler.is_compiling() or torch.is_inference_mode_enabled()):
            for t in tensors:  # refused before any is written, not midway by mul_
                if t.is_inference():
                    raise RuntimeError(
                        f"cannot scale a grad of shape {tuple(t.shape)} in place: it is an "
                        "inference tensor and inference mode is off (torch's mul_ refuses "
                        "this too); clone it outside torch.inference_mode() first"
                    )
        coef_here = coef_on.setdefault(device, coef.to(device))
        if foreach is False:
            for t in tensors:
                t.mul_(coef_here)
        else:
            torch._foreach_mul_(tensors, coef_here)
    for sparse in groups.sparse.values():
        for t in sparse:  # a sparse mul_ would round coef to t's dtype: fp16 loses 1e-5
            t._values().mul_(coef_on.setdefault(t.device, coef.to(t.device)))


def grad_scale_of(max_norm: float | Tensor, norm: Tensor) -> Tensor:
    """A fused optimizer's ``grad_scale``, ``1 / clip_coefficient(max_norm, norm)`` made
    directly (but NaN for a non-finite norm with a tensor ``max_norm`` of inf)."""
    scale = torch.clamp((norm + EPS) / max_norm, min=1.0)
    info = torch.finfo(scale.dtype)
    # Past 1 / tiny: NaN for a finite norm (sqrt of a negative), inf for an infinite one.
    scale = torch.where(scale > 1 / info.tiny, torch.sqrt(norm - info.max), scale)
    if isinstance(max_norm, Tensor):
        scale = torch.where(_beside(max_norm, scale) > 0, scale, math.nan)
    return scale
