"""The clip folded into a fused torch optimizer's ``grad_scale`` and ``found_inf``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from clipopt._kernels._norms import Groups
from clipopt._wrapper import inner_step

_FUSABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
_ATTRIBUTES = ("grad_scale", "found_inf")


def takes_scale(optimizer: Optimizer) -> bool:
    """A torch optimizer (not a subclass: it may override ``step``) with ``fused=True``."""
    return type(optimizer) in _FUSABLE and all(g.get("fused") for g in optimizer.param_groups)


def can_fold(optimizer: Optimizer, grads: list[Tensor], groups: Groups | None) -> bool:
    """Nobody else (``GradScaler``) set the attributes; no grad is float64 (the scale's float32)."""
    if any(getattr(optimizer, name, None) is not None for name in _ATTRIBUTES):
        return False
    if groups is not None:
        return torch.float64 not in {dtype for _, dtype in (*groups.dense, *groups.sparse)}
    return torch.float64 not in {g.dtype for g in grads}


def skips_cleanly(optimizer: Optimizer) -> bool:
    """``found_inf`` leaves the state as it was (fused SGD, Adam, AdamW make it first)."""
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
    """``optimizer``'s step with ``grad_scale`` / ``found_inf`` (None: not set) set on it."""
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
