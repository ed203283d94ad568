"""Fold the clip into a fused optimizer's own pass over the grads.

torch's ``Adam``, ``AdamW`` and ``SGD`` with ``fused=True`` (CPU and CUDA; ``Adagrad``
on CPU only) read two optional tensors off the optimizer in ``step()``, the hook
``GradScaler`` uses: ``grad_scale`` (every grad is divided by it inside the fused
kernel, and the divided grad is written back to ``.grad``) and ``found_inf`` (non-zero:
parameters and state are left as they were, decided on the device). So instead of a
pass that multiplies every grad by the clip coefficient ``c``,
:class:`~clipopt.ClippedOptimizer` hands the kernel ``grad_scale = 1 / c``: the grads are
read once for the norm and once by the update, which reads them anyway. After the step
``.grad`` holds the clipped grads, as on the explicit path; a skipped step leaves grads,
parameters and state untouched, as the explicit path does.

Parameters agree with the explicit path to rounding: ``g / (1 / c)`` and ``g * c``
differ by at most an ulp or two of a float32 ``g``; bfloat16 parameters by about one
bfloat16 ulp, since the explicit path rounds the clipped grad to bfloat16 before the
update and the kernel does not. With ``c = 1`` (no clipping) they are bit-identical.

With ``nonfinite="skip"`` the skip goes through ``found_inf``, so nothing waits for the
device (see :mod:`clipopt._step._nonfinite` for when ``max_consecutive_skips`` raises then).

``grad_scale`` and ``found_inf`` are torch's own attributes, set by ``GradScaler`` and
read by the fused kernels in every release 2.6 to 2.14; this is the one module that
sets them (the matrix runs the fused tests on each release).

This module knows only ``torch.optim.Optimizer``: the wrapper decides (measure, verdict,
coefficient) and asks :func:`can_fold` whether :func:`apply_folded` may apply it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from clipopt import _hooks

__all__ = ["apply_folded", "can_fold", "grad_scale_of", "skips_cleanly"]

_FUSABLE: tuple[type[Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
)
_ATTRIBUTES = ("grad_scale", "found_inf")


def _fused_kernel_takes_scale(optimizer: Optimizer) -> bool:
    """A torch optimizer (not a subclass: it may override ``step``) with ``fused=True``."""
    if type(optimizer) not in _FUSABLE:
        return False
    return all(group.get("fused") for group in optimizer.param_groups)


def _scale_attributes_free(optimizer: Optimizer) -> bool:
    """Nobody else (e.g. GradScaler driving the inner optimizer) has set them."""
    return all(getattr(optimizer, name, None) is None for name in _ATTRIBUTES)


def can_fold(
    optimizer: Optimizer,
    grad_dtypes: Callable[[], Collection[torch.dtype]],
    coefficients: Sequence[Any],
) -> bool:
    """Whether a step's clip can ride on ``optimizer``'s fused kernel.

    It can when the optimizer is a fused torch Adam/AdamW/SGD/Adagrad whose
    ``grad_scale`` / ``found_inf`` nobody else has set, one 0-dim coefficient object (or
    None everywhere) scales every group, and no grad is float64 (``grad_scale`` is a
    float32 tensor, and double grads deserve a double coefficient). ``grad_dtypes``
    gives the grads' dtypes, asked only when the rest holds.
    """
    if not _fused_kernel_takes_scale(optimizer) or not _scale_attributes_free(optimizer):
        return False
    if len({id(c) for c in coefficients}) != 1 or isinstance(coefficients[0], tuple):
        return False
    return torch.float64 not in grad_dtypes()


@contextlib.contextmanager
def _scaled_step(
    optimizer: Optimizer, grad_scale: Tensor | None, found_inf: Tensor | None
) -> Iterator[None]:
    """Set ``grad_scale`` / ``found_inf`` on ``optimizer`` for one step, then restore them."""
    missing = object()
    saved = {name: getattr(optimizer, name, missing) for name in _ATTRIBUTES}
    for name, value in zip(_ATTRIBUTES, (grad_scale, found_inf), strict=True):
        if value is not None:
            setattr(optimizer, name, value)
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is missing:
                optimizer.__dict__.pop(name, None)
            else:
                setattr(optimizer, name, previous)


def skips_cleanly(optimizer: Optimizer) -> bool:
    """``found_inf`` leaves the state as it was, except on a parameter's first step.

    There torch creates the state before the kernel runs: fused SGD each momentum buffer
    with ``empty_like`` (a skipped kernel leaves it uninitialised, and the next step would
    read garbage), fused Adam and AdamW a ``step`` and zero moments (a skipped step would
    leave state that the step without the fold does not). Such a step decides on the host
    instead; Adagrad makes its state at construction.
    """
    kind = type(optimizer)
    if kind not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        return True
    for group in optimizer.param_groups:
        if kind is torch.optim.SGD and group["momentum"] == 0:
            continue
        for p in group["params"]:
            if p.grad is not None and not _has_state(optimizer, p, kind is torch.optim.SGD):
                return False
    return True


def _has_state(optimizer: Optimizer, p: Tensor, momentum_only: bool) -> bool:
    state = optimizer.state.get(p, {})
    return state.get("momentum_buffer") is not None if momentum_only else bool(state)


def grad_scale_of(coefficient: Tensor) -> Tensor:
    """The fused kernel's ``grad_scale`` that scales every grad by ``coefficient``."""
    return coefficient.float().reciprocal()


def apply_folded(
    optimizer: Optimizer,
    coefficient: Tensor | None,
    found_inf: Tensor | None,
    grad_scale: Tensor | None = None,
) -> Any:
    """Run ``optimizer``'s step with the clip (and a skip) inside its fused kernel.

    Args:
      optimizer: one for which :func:`can_fold` holds.
      coefficient: the clip coefficient of every grad; None scales nothing.
      found_inf: non-zero to skip the step on the device; None to step.
      grad_scale: :func:`grad_scale_of` ``coefficient``, where already made.

    Returns:
      What the optimizer's step returns.
    """
    if grad_scale is None and coefficient is not None:
        grad_scale = grad_scale_of(coefficient)
    with _scaled_step(optimizer, grad_scale, found_inf):
        return _hooks.inner_step(optimizer, None)
