"""Fold the clip into a fused optimizer's own pass over the grads.

torch's ``Adam``, ``AdamW`` and ``SGD`` with ``fused=True`` (CPU and CUDA; ``Adagrad``
on CPU only) read two optional tensors off the optimizer in ``step()``, the hook
``GradScaler`` uses: ``grad_scale`` (every grad is divided by it inside the kernel, and
the divided grad written back to ``.grad``) and ``found_inf`` (non-zero: parameters and
state are left as they were, decided on the device). So instead of a pass multiplying
every grad by the clip coefficient ``c``, the wrapper hands the kernel ``grad_scale``
(``1 / c``, made directly: :func:`clipopt._kernels._scale.grad_scale_of`): the grads are
read once for the norm and once by the update, which reads them anyway.

Parameters agree with the explicit path to rounding: ``g / s`` and ``g * c`` differ by
an ulp or two of a float32 ``g``; bfloat16 parameters by about one bfloat16 ulp, since
the explicit path rounds the clipped grad to bfloat16 before the update. With ``c = 1``
they are bit-identical. ``grad_scale`` and ``found_inf`` are torch's own attributes, read
by the fused kernels in every release 2.6 to 2.14; this is the one module that sets them.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from clipopt._wrapper import inner_step

__all__ = ["apply_folded", "can_fold", "skips_cleanly", "takes_scale"]

_FUSABLE: tuple[type[Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
)
_ATTRIBUTES = ("grad_scale", "found_inf")


def takes_scale(optimizer: Optimizer) -> bool:
    """A torch optimizer (not a subclass: it may override ``step``) with ``fused=True``."""
    return type(optimizer) in _FUSABLE and all(g.get("fused") for g in optimizer.param_groups)


def can_fold(optimizer: Optimizer, dtypes: Collection[torch.dtype]) -> bool:
    """Whether one scale of every grad can ride on the fused kernel of ``optimizer``, one
    that :func:`takes_scale`: nobody else (``GradScaler``) has set its ``grad_scale`` /
    ``found_inf``, and no grad is float64 (``grad_scale`` is float32; double grads
    deserve a double coefficient)."""
    if any(getattr(optimizer, name, None) is not None for name in _ATTRIBUTES):
        return False
    return torch.float64 not in dtypes


def skips_cleanly(optimizer: Optimizer) -> bool:
    """``found_inf`` leaves the state as it was, except on a parameter's first step.

    There torch creates the state before the kernel runs: fused SGD each momentum buffer
    with ``empty_like`` (a skipped kernel leaves it uninitialised), fused Adam and AdamW
    a ``step`` and zero moments (state the unfolded skip would not leave). Such a step
    decides on the host instead; Adagrad makes its state at construction.
    """
    kind = type(optimizer)
    if kind not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        return True
    sgd = kind is torch.optim.SGD
    for group in optimizer.param_groups:
        if sgd and group["momentum"] == 0:
            continue
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            made = state.get("momentum_buffer") is not None if sgd else bool(state)
            if p.grad is not None and not made:
                return False
    return True


def apply_folded(optimizer: Optimizer, grad_scale: Tensor | None, found_inf: Tensor | None) -> Any:
    """Run ``optimizer``'s step with ``grad_scale`` / ``found_inf`` (None: not set) on it,
    then restore them; return what its step returns."""
    missing = object()
    saved = {name: getattr(optimizer, name, missing) for name in _ATTRIBUTES}
    for name, value in zip(_ATTRIBUTES, (grad_scale, found_inf), strict=True):
        if value is not None:
            setattr(optimizer, name, value)
    try:
        return inner_step(optimizer, None)
    finally:
        for name, previous in saved.items():
            if previous is missing:
                optimizer.__dict__.pop(name, None)
            else:
                setattr(optimizer, name, previous)
