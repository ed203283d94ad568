"""Clip coefficients and in-place scaling of grouped gradients, on their devices.

:func:`clip_coefficient` turns a norm into ``min(1, max_norm / (norm + EPS))`` without a
host sync; :func:`scale_` and :func:`scale_groups_` multiply every grad by it, one
``torch._foreach_mul_`` with the 0-dim coefficient per (device, dtype) group (``mul_``
per grad with ``foreach=False``), sparse grads' values one by one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from clipopt._kernels._norms import Groups, group

__all__ = ["EPS", "clip_coefficient", "coefficient", "grad_scale_of", "scale_", "scale_groups_"]

EPS = 1e-6
"""Added to the norm before dividing, as torch.nn.utils does."""


def coefficient(threshold: float | Tensor, norm: Tensor) -> Tensor:
    """torch's ``min(1, threshold / (norm + EPS))``, unguarded: a rule's thresholds, for
    which 0 (AutoClip's after zero norms) zeroes the grads, as torch's clip does."""
    return torch.clamp(threshold / (norm + EPS), max=1.0)


def clip_coefficient(max_norm: float | Tensor, norm: Tensor) -> Tensor:
    """:func:`coefficient` for a user's ``max_norm``, on ``norm``'s device, no host sync.

    A tensor ``max_norm`` of inf gives exactly 1.0, as a float inf scales nothing:
    ``inf / (inf + EPS)`` would otherwise turn an inf norm's grads into NaN. Two
    coefficients are NaN, so that the grads turn NaN (or a ``nonfinite`` policy skips or
    raises) rather than change silently:

    - a tensor ``max_norm`` that is not > 0 (negative, zero, NaN; a float one is refused
      before anything runs), which would flip or zero every grad;
    - a coefficient below the dtype's smallest normal number (``norm / max_norm`` past
      8.5e37 in float32), whose reciprocal, the ``grad_scale`` a fused optimizer divides
      by, overflows: the folded step and the explicit one then agree.

    An infinite norm still gives 0, as in torch.
    """
    coef = coefficient(max_norm, norm)
    invalid = (coef > 0) & (coef < torch.finfo(coef.dtype).tiny)
    if isinstance(max_norm, Tensor):
        limit = _beside(max_norm, coef)
        coef = torch.where(limit == math.inf, 1.0, coef)
        invalid = invalid | torch.logical_not(limit > 0)
    return torch.where(invalid, math.nan, coef)


def _beside(value: Tensor, other: Tensor) -> Tensor:
    """``value`` on ``other``'s device; a CPU scalar is read by an add, never copied.

    ``torch.where`` would copy a CPU condition to the device, a blocking transfer.
    """
    if value.device == other.device:
        return value
    return other.new_zeros(()) + value


def scale_(tensors: Sequence[Tensor], coef: Tensor, foreach: bool | None = None) -> None:
    """Multiply every tensor in place by the 0-dim ``coef`` (moved to each device once)."""
    scale_groups_(group(tensors), coef, foreach)


def _refuse_inference_tensors(tensors: list[Tensor]) -> None:
    """Raise before any grad is written where ``mul_`` would refuse one midway."""
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return
    for t in tensors:
        if t.is_inference():
            raise RuntimeError(
                f"cannot scale a grad of shape {tuple(t.shape)} in place: it is an inference "
                "tensor and inference mode is off (torch's mul_ refuses this too); clone it "
                "outside torch.inference_mode() first"
            )


def scale_groups_(groups: Groups, coef: Tensor, foreach: bool | None = None) -> None:
    """:func:`scale_` over tensors already grouped, e.g. by
    :func:`~clipopt._kernels._norms.grouped_total_norm`."""
    coef_on: dict[torch.device, Tensor] = {}
    for (device, _), tensors in groups.dense.items():
        _refuse_inference_tensors(tensors)
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
    """A fused optimizer's ``grad_scale``, ``max(1, (norm + EPS) / max_norm)``: the grads
    divided by it are the grads times :func:`clip_coefficient`, without the coefficient.

    It is ``1 / clip_coefficient(max_norm, norm)``, NaN where that is: a tensor
    ``max_norm`` that is not > 0, and a finite norm whose coefficient falls below the
    dtype's smallest normal number (the scale past its reciprocal); an infinite norm
    gives inf (``1 / 0``). One difference: a non-finite norm with an infinite tensor
    ``max_norm`` gives NaN (``inf / inf``) where the coefficient is 1.
    """
    scale = torch.clamp((norm + EPS) / max_norm, min=1.0)
    info = torch.finfo(scale.dtype)
    # Past 1 / tiny: NaN for a finite norm (sqrt of a negative), inf for an infinite one.
    scale = torch.where(scale > 1 / info.tiny, torch.sqrt(norm - info.max), scale)
    if isinstance(max_norm, Tensor):
        scale = torch.where(_beside(max_norm, scale) > 0, scale, math.nan)
    return scale
