"""Apply a step's decision: run the inner step on the scaled grads, or fold the scale in.

A decision is applied in exactly one of two ways: the grads are multiplied by their
coefficients (by :func:`clipopt._step._decide.decide_and_scale`, in the graph that
measured them) and the inner step runs (:func:`_step_scaled`); or the scale, and a skip
decided on the device, ride into a fused inner optimizer's kernel
(:func:`clipopt._step._fold.apply_folded`). A skip
decided on the host applies nothing. What the step keeps of it is committed afterwards
(:func:`clipopt._step._decide.commit`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from clipopt import _hooks
from clipopt._step import _fold
from clipopt._step._nonfinite import StepRecord, check_lagged_streak
from clipopt._step._parts import ClipDecision, Measurement
from clipopt._wrapper import Closure

__all__ = ["apply_decision"]


def apply_decision(
    optimizer: Optimizer,
    decision: ClipDecision,
    fold: bool,
    record: StepRecord,
    closure: Closure | None,
    loss: Any,
    redecide: Callable[[], ClipDecision],
) -> tuple[Any, Measurement]:
    """Apply ``decision`` to ``optimizer``; return the step's result and its last norms.

    Args:
      optimizer: the inner optimizer.
      decision: what to apply, made before anything changed; unless folded, its
        coefficients already scale the grads.
      fold: apply it inside the fused inner kernel (only without a closure).
      record: the step record, whose lagged skip streak a skip decided on the device
        is checked against first.
      closure: the user's closure, already evaluated once (its result is ``loss``).
      loss: what the closure's first evaluation returned, or None.
      redecide: a new decision on the grads a later evaluation of the closure leaves
        (LBFGS evaluates it many times), applied to them; it may not skip, since the
        step has begun.

    Returns:
      What the inner step returns (``loss`` for a skipped step), and the measurement of
      the grads it stepped with: the closure's last evaluation's.

    Raises:
      NonFiniteNormError: a skip decided on the device follows more than
        ``max_consecutive_skips`` skipped steps; nothing was changed.
    """
    if decision.skip:
        return loss, decision.measurement
    if fold:
        if decision.streak_limit is not None:
            check_lagged_streak(record, decision.streak_limit)
        coefficient = decision.coefficients[0]
        assert not isinstance(coefficient, tuple)  # can_fold refuses per-grad coefficients
        result = _fold.apply_folded(optimizer, coefficient, decision.found_inf, decision.grad_scale)
        return result, decision.measurement
    return _step_scaled(optimizer, decision, closure, loss, redecide)


def _step_scaled(
    optimizer: Optimizer,
    decision: ClipDecision,
    closure: Closure | None,
    loss: Any,
    redecide: Callable[[], ClipDecision],
) -> tuple[Any, Measurement]:
    """Run the inner step on the scaled grads.

    The inner optimizer gets a closure that returns ``loss`` once and afterwards
    re-evaluates, measures and clips; the norms of its last evaluation are the step's.
    """
    if closure is None:
        return _hooks.inner_step(optimizer, None), decision.measurement
    pending = [loss]
    latest = [decision.measurement]

    def clipped_closure() -> Any:
        if pending:
            return pending.pop()
        with torch.enable_grad():
            again = closure()
        latest.append(redecide().measurement)
        return again

    return _hooks.inner_step(optimizer, clipped_closure), latest[-1]
