"""A rule's decision in a step: per-tensor and unit-wise coefficients.

A clip rule (:class:`clipopt.ClipRule`) turns the step's measurement into one
:data:`clipopt._step._measure.Coefficient` per param group, in place of the
fixed threshold's: :func:`rule_coefficients` from the
norms the step measured, :func:`unit_rule_coefficients` from the parameters and their
grads for a unit-wise rule (:class:`clipopt.UnitWiseRule`), which decides before the
step measures. Each also returns what the rule decided, for it to commit once the step
has run.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from clipopt._dist import _mesh
from clipopt._step._measure import Coefficient, Measurement
from clipopt.rules._base import ClipRule
from clipopt.rules._unit import UnitDecision, UnitWiseRule

__all__ = ["rule_coefficients", "unit_rule_coefficients"]


def rule_coefficients(
    rule: ClipRule,
    grads: list[list[Tensor]],
    measured: Measurement,
    norm_type: float,
    stages: bool = False,
) -> tuple[list[Coefficient], tuple[Tensor, Tensor, Tensor] | None]:
    """The rule's coefficient per group and what it decided (to commit after the step).

    A global rule gives one shared 0-dim coefficient (so it can fold); a per-tensor
    rule one per grad, from each whole grad's norm: ``measured.tensor_norms``, which
    the step measured with the global norm (one pass, and for DTensor grads one
    collective: :func:`clipopt._step._measure.measure_per_tensor`).

    With ``stages`` (pipeline stages), a per-tensor rule's norms are this stage's grads'
    and ``measured.norm`` is the whole model's: the rule gets it as ``total_norm``.

    Raises:
      ValueError: a per-tensor rule and a measurement without per-tensor norms.
    """
    if not rule.per_tensor:
        coefficient, threshold = rule.decide(measured.norm, norm_type=norm_type)
        shared: list[Coefficient] = [coefficient] * len(grads)
        return shared, (measured.norm, coefficient, threshold)
    if not any(grads):
        return [None] * len(grads), None
    norms = measured.tensor_norms
    if norms is None:
        raise ValueError(f"{rule!r} is per tensor, but the step measured no per-tensor norms")
    total = measured.norm if stages else None
    coefficients, thresholds = rule.decide(norms, norm_type=norm_type, total_norm=total)
    parts = coefficients.unbind()
    per_group: list[Coefficient] = []
    start = 0
    for group in grads:
        per_group.append(tuple(parts[start : start + len(group)]) if group else None)
        start += len(group)
    return per_group, (norms, coefficients, thresholds)


def unit_rule_coefficients(
    rule: UnitWiseRule,
    params: Sequence[Sequence[Tensor]],
    grads: list[list[Tensor]],
    norm_type: float,
) -> tuple[
    list[Coefficient],
    tuple[Tensor, Tensor, Tensor] | None,
    tuple[Tensor, ...] | None,
    Tensor | None,
]:
    """A unit-wise rule's coefficients, what it decided (to commit after the step), the
    squares it measured, from which the step can take its norms (or None), and its
    check of the ranks' grads (or None: :class:`clipopt.UnitDecision`).

    Each group gets a tuple with one coefficient per grad (None: left as it is), or None
    when the rule leaves all its grads alone; such coefficients never fold.

    DTensor grads and parameters are handed over as they are: the rule measures whole
    units across ranks (AGC) or refuses them. Where a parameter is a DTensor the rule
    is first asked to decide over every parameter (:meth:`UnitWiseRule.decide_slots`),
    so that a rank without some grads, or any, still joins its collective.

    Raises:
      ValueError: the rule refuses ``norm_type``, or its grads.
    """
    every = [p for group in params for p in group]
    slotted = _slotted(every)
    decision = _slot_decision(rule, slotted, norm_type) if slotted else None
    flat = [g for group in grads for g in group]
    if decision is not None:
        here = [p.grad is not None for p in slotted]
        per_grad = [c for c, has in zip(decision.per_grad, here, strict=True) if has]
        squares = decision.squares
        if squares is not None:
            squares = tuple(s for s, has in zip(squares, here, strict=True) if has)
    elif not flat:
        return [None] * len(grads), None, None, None
    else:
        held = [p for p in every if p.grad is not None]
        rule.check_norm_type(norm_type)
        decision = rule.decide_units(held, flat, norm_type)
        _check_lengths(rule, decision, len(flat), "grads")
        per_grad, squares = decision.per_grad, decision.squares
    per_group: list[Coefficient] = []
    start = 0
    for group in grads:
        own = tuple(per_grad[start : start + len(group)])
        per_group.append(own if any(c is not None for c in own) else None)
        start += len(group)
    outcome = (decision.norms, decision.coefficients, decision.thresholds) if flat else None
    return per_group, outcome, squares, decision.check


def _slotted(params: list[Tensor]) -> list[Tensor]:
    """The parameters a rule decides over where some are DTensors: those, whether or not
    they have a grad here, and any other with a grad (which the rule then refuses, as
    DTensors mixed with plain tensors); none where no parameter is a DTensor."""
    sharded = {id(q) for q in _mesh.dtensors(params)}
    if not sharded:
        return []
    return [p for p in params if id(p) in sharded or p.grad is not None]


def _slot_decision(
    rule: UnitWiseRule, params: list[Tensor], norm_type: float
) -> UnitDecision | None:
    """The rule's decision over every parameter (None: it makes none, see
    :meth:`UnitWiseRule.decide_slots`), checked for one entry per parameter."""
    rule.check_norm_type(norm_type)
    decision = rule.decide_slots(params, [p.grad for p in params], norm_type)
    if decision is not None:
        _check_lengths(rule, decision, len(params), "parameters")
    return decision


def _check_lengths(rule: UnitWiseRule, decision: UnitDecision, count: int, what: str) -> None:
    """``decision`` has one coefficient (and squares, if any) per one of ``count``."""
    for name, given in (("coefficients", decision.per_grad), ("squares", decision.squares)):
        if given is not None and len(given) != count:
            raise ValueError(f"{rule!r} gave {len(given)} {name} for {count} {what}")
