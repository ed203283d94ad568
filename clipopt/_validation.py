"""Argument checks shared by the functional API and ClippedOptimizer.

Each raises a ``TypeError``/``ValueError`` naming the argument and the value, and reads
no tensor's value (that would wait on its device).
"""

from __future__ import annotations

import math
import numbers
from typing import TypeAlias

import torch
from torch import Tensor

__all__ = [
    "MaxNorm",
    "NormType",
    "check_foreach",
    "check_norm_type",
    "check_not_skip_step",
    "check_positive",
]

NormType: TypeAlias = float | int | str
MaxNorm: TypeAlias = float | int | Tensor


def check_norm_type(norm_type: NormType) -> float:
    """Validate a norm order and return it as a float (``math.inf`` for ``'inf'``)."""
    if isinstance(norm_type, str):
        if norm_type.lower() in ("inf", "+inf", "infinity"):
            return math.inf
        raise ValueError(f"norm_type must be a positive number or 'inf', got {norm_type!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real):
        raise TypeError(f"norm_type must be a number or 'inf', got {norm_type!r}")
    p = float(norm_type)
    if not p > 0:  # also catches NaN; math.isnan would break a torch.compile graph
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
    return p


def check_positive(name: str, value: MaxNorm, allow_tensor: bool = True) -> None:
    """Raise unless ``value`` is a number > 0 (``inf`` allowed) or a 0-dim real tensor.

    A tensor's value is not inspected: that would wait on its device. Any real number
    type is accepted (numpy scalars too), as torch does.
    """
    if isinstance(value, Tensor) and allow_tensor:
        if value.dim() != 0 or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} tensor must be a 0-dim real tensor, got {value!r}")
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive number, got {value!r}")
    if not value > 0:  # also catches NaN; math.isnan would break a torch.compile graph
        raise ValueError(f"{name} must be > 0 (inf allowed), got {value!r}")


def check_foreach(foreach: object) -> None:
    """Raise unless ``foreach`` is True, False or None (a truthy string is not a choice)."""
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"foreach must be a bool or None, got {foreach!r}")


def check_not_skip_step(optimizer: object) -> None:
    """Refuse an OLMo-core ``SkipStepOptimizer`` (``SkipStepAdamW``, ``SkipStepLion``).

    It skips a spike only from the loss and grad norm that OLMo-core's train module
    hands it before each step, and only when ``isinstance(optim, SkipStepOptimizer)``
    holds for the train module's optimizer, which a wrapper is not: wrapped, it would
    silently never skip. Recognised by its classes' names and modules, so without
    importing olmo_core.

    Raises:
      TypeError: naming the optimizer and what to use instead.
    """
    for kind in type(optimizer).__mro__:
        if kind.__name__ == "SkipStepOptimizer" and kind.__module__.startswith("olmo_core."):
            raise TypeError(
                f"optimizer is OLMo-core's {type(optimizer).__name__}, a SkipStepOptimizer: "
                "OLMo-core feeds it the loss and grad norm only when it is the train "
                "module's optimizer itself, so wrapped it would never skip a step. Wrap the "
                "plain optimizer (torch.optim.AdamW for SkipStepAdamW) and pass "
                "skip_spikes=clipopt.SpikeSkip() to skip spikes of the grad norm instead"
            )
