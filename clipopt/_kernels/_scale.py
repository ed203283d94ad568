"""Clip coefficients and in-place scaling of grouped gradients, on their devices.

:func:`clip_coefficient` turns a norm into ``min(1, max_norm / (norm + EPS))`` without a
host sync; :func:`scale_` and :func:`scale_groups_` multiply every grad by it: dense CPU
grads of float32, float64 and bfloat16 in one call into the C kernel of
:mod:`clipopt._kernels._cpu` (rounding as ``mul_`` does, writing nothing for a
coefficient of exactly 1), other groups by one ``_foreach_mul_``, sparse ones one by one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from clipopt import _torch_internals
from clipopt._kernels import _cpu
from clipopt._kernels._plan import GroupKey, Groups, group

__all__ = ["EPS", "clip_coefficient", "scale_", "scale_groups_"]

EPS = 1e-6
"""Added to the norm before dividing, as torch.nn.utils does."""


def clip_coefficient(max_norm: float | Tensor, norm: Tensor) -> Tensor:
    """``min(1, max_norm / (norm + EPS))`` on ``norm``'s device, without a host sync.

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
    if not isinstance(max_norm, Tensor):
        found = _cpu.coefficient(max_norm, norm, EPS)  # these ops' bits, in one C call
        if found is not None:
            return found
    coef: Tensor = torch.clamp(max_norm / (norm + EPS), max=1.0)
    invalid = (coef > 0) & (coef < torch.finfo(coef.dtype).tiny)
    if isinstance(max_norm, Tensor):
        limit = _beside(max_norm, coef)
        coef = torch.where(limit == math.inf, 1.0, coef)
        invalid = invalid | ~(limit > 0)
    return torch.where(invalid, math.nan, coef)


def _beside(value: Tensor, other: Tensor) -> Tensor:
    """``value`` on ``other``'s device; a CPU scalar is read by an add, never copied.

    ``torch.where`` would copy a CPU condition to the device, a blocking transfer.
    """
    if value.device == other.device:
        return value
    return other.new_zeros(()) + value


def scale_(tensors: Sequence[Tensor], coef: Tensor, foreach: bool | None = None) -> None:
    """Multiply every tensor in place by the 0-dim ``coef`` (moved to each device once).

    Dense CPU grads of float32, float64 and bfloat16 take one call into the C kernel of
    :mod:`clipopt._kernels._cpu`, whatever ``foreach`` says (it rounds as ``mul_`` does, and
    writes nothing when ``coef`` is exactly 1). Other dense groups use one
    ``_foreach_mul_`` unless ``foreach=False``. Sparse COO tensors are scaled one by one.
    """
    scale_groups_(group(tensors), coef, foreach)


_COEF_DTYPES = (torch.float32, torch.float64)


def _refuse_inference_tensors(tensors: list[Tensor]) -> None:
    if not any(map(Tensor.is_inference, tensors)):
        return
    for t in tensors:
        if t.is_inference():
            raise RuntimeError(
                f"cannot scale a grad of shape {tuple(t.shape)} in place: it is an inference "
                "tensor and inference mode is off (torch's mul_ refuses this too); clone it "
                "outside torch.inference_mode() first"
            )


def _scale_cpu_group_(groups: Groups, key: GroupKey, coef: Tensor, foreach: bool | None) -> None:
    """Scale one dense CPU group: dense grads by one C call, grads with gaps by torch;
    all of them by torch where the C kernel does not scale the group.

    Raises:
      RuntimeError: a grad is an inference tensor and inference mode is off, where
        ``mul_`` would refuse it too; checked before any grad is touched (a plan knows
        whether there is one).
    """
    group = groups.dense[key]
    checks = groups.inference is not False
    if checks and not torch.compiler.is_compiling() and not torch.is_inference_mode_enabled():
        _refuse_inference_tensors(group)
    if not (_cpu.scales(key[1]) and coef.dtype in _COEF_DTYPES):
        _scale_by_torch_(group, coef, foreach)
        return
    run, gappy = groups.split(key)
    if run.tensors:
        _cpu.scale_(run, coef)
    if gappy:
        _torch_internals.foreach_mul_(gappy, coef)


def _scale_by_torch_(group: list[Tensor], coef: Tensor, foreach: bool | None) -> None:
    if foreach is False:
        for t in group:
            t.mul_(coef)
    else:
        _torch_internals.foreach_mul_(group, coef)


def scale_groups_(groups: Groups, coef: Tensor, foreach: bool | None = None) -> None:
    """:func:`scale_` over tensors already grouped, e.g. by :func:`grouped_total_norm`."""
    coef_on: dict[torch.device, Tensor] = {}
    for key, tensors in groups.dense.items():
        device = key[0]
        coef_here = coef_on.setdefault(device, coef.to(device))
        if device.type == "cpu":
            _scale_cpu_group_(groups, key, coef_here, foreach)
        else:
            _scale_by_torch_(tensors, coef_here, foreach)
    for sparse in groups.sparse.values():
        for t in sparse:
            t.mul_(coef_on.setdefault(t.device, coef.to(t.device)))
