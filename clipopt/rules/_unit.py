"""The unit-wise rule protocol (:class:`UnitWiseRule`) and its decision (:class:`UnitDecision`).

A unit-wise rule (AGC) clips parts ("units") of each grad by their own coefficients,
from the parameters as well as the grads; see :mod:`clipopt.rules._base` for the order
in which the wrapper calls a rule, which this protocol follows but for its first step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from clipopt.rules._base import ClipRule

__all__ = ["UnitDecision", "UnitWiseRule"]


@dataclass(frozen=True)
class UnitDecision:
    """What a :class:`UnitWiseRule` decides for one step; nothing has changed yet.

    Attributes:
      per_grad: one coefficient per grad given, broadcastable to it, or None to leave
        that grad as it is (at no cost).
      norms: every unit's pre-clip grad norm in one 1-D tensor, in the grads' order (a
        grad left as it is has no units here).
      coefficients: each unit's coefficient, at most 1, shaped as ``norms``.
      thresholds: each unit's threshold, shaped as ``norms``.
      squares: optional, one 1-D tensor per grad given (a grad left as it is too), of
        values that sum to its squared L2 norm (its units' squared norms, of the whole
        units across ranks), float64 where the device has it, summed before any root.
        With them the step takes its norms (``last_norm``, tracked norms) from these
        sums, at norm_type 2, and reads no grad again; None: it measures the grads
        itself, a second read of them.
      check: optional, a 0-dim float tensor, 0 where the ranks' grads line up and NaN
        where they do not (:meth:`UnitWiseRule.decide_slots`): added to the step's
        norms, so that a rank without grads sees the NaN too and ``nonfinite`` acts on
        every rank alike.
    """

    per_grad: list[Tensor | None]
    norms: Tensor
    coefficients: Tensor
    thresholds: Tensor
    squares: tuple[Tensor, ...] | None = None
    check: Tensor | None = None


class UnitWiseRule(ClipRule):
    """The protocol of a rule that clips parts of each grad against its parameter.

    AGC (Brock et al., 2021) clips each row of a weight's grad by that row's norm in the
    weight. Such a rule needs the parameters and cannot be told one norm per grad, so the
    wrapper calls :meth:`decide_units` instead of :meth:`~ClipRule.decide`, and
    :meth:`~ClipRule.commit` with the units' norms, coefficients and thresholds (1-D);
    :meth:`~ClipRule.threshold` and :meth:`~ClipRule.coefficient` are not called. A
    subclass implements :meth:`decide_units`, :meth:`~ClipRule.config`,
    :meth:`~ClipRule.update`, :meth:`~ClipRule.rule_state` and
    :meth:`~ClipRule.load_rule_state`, and may refuse a norm order in
    :meth:`check_norm_type`.

    Its coefficients are one per grad, not one for all, so it never folds into a fused
    kernel's single ``grad_scale``: the grads are scaled before the fused step.

    Example:
      A rule that scales each row of each grad to a norm of at most 1:

      >>> import torch, clipopt
      >>> class RowClip(clipopt.UnitWiseRule):
      ...     def config(self): return {}
      ...     def update(self, norms): pass
      ...     def rule_state(self): return {}
      ...     def load_rule_state(self, state): pass
      ...     def decide_units(self, params, grads, norm_type):
      ...         rows = [g.norm(dim=1) if g.dim() == 2 else g.norm().reshape(1) for g in grads]
      ...         norms = torch.cat(rows)
      ...         coefficients = 1.0 / norms.clamp(min=1.0)
      ...         parts = coefficients.split([r.numel() for r in rows])
      ...         shapes = [(-1, 1) if g.dim() == 2 else () for g in grads]
      ...         per_grad = [c.reshape(s) for c, s in zip(parts, shapes)]
      ...         return clipopt.UnitDecision(per_grad, norms, coefficients, torch.ones_like(norms))
      >>> w = torch.nn.Parameter(torch.zeros(2, 2))
      >>> opt = clipopt.ClippedOptimizer(torch.optim.SGD([w], lr=0.0), max_norm=RowClip())
      >>> w.grad = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
      >>> opt.step()
      >>> w.grad, opt.rule.clipped_count
      (tensor([[0.6000, 0.8000],
              [0.3000, 0.4000]]), tensor(1))
    """

    def check_norm_type(self, norm_type: float) -> None:
        """Raise ``ValueError`` if the rule cannot measure in this order; the wrapper
        calls it at construction and before each decision. The default takes any."""

    def decide_units(
        self, params: Sequence[Tensor], grads: Sequence[Tensor], norm_type: float
    ) -> UnitDecision:
        """This step's coefficients, from each grad and its parameter; changes nothing.

        Args:
          params: the parameters that have a grad, in the order of the param groups and
            their params.
          grads: their grads, in the same order; DTensors under FSDP2 and tensor
            parallelism (a coefficient then scales the grad's local shard, so it must be
            broadcastable to that shard), which a rule that cannot measure them refuses
            with ``ValueError``.
          norm_type: the wrapper's norm order, as :meth:`check_norm_type` accepted.

        It must read nothing on the host.
        """
        raise NotImplementedError

    def decide_slots(
        self, params: Sequence[Tensor], grads: Sequence[Tensor | None], norm_type: float
    ) -> UnitDecision | None:
        """:meth:`decide_units` over every parameter, with its grad or None where this
        rank holds none; the wrapper asks it first where a parameter is a DTensor, so
        that a rule measuring across ranks (AGC) joins the other ranks' collective on a
        rank without some grads, or any.

        Args:
          params: every DTensor parameter of the param groups, in order (and any
            plain one with a grad, for the rule to refuse).
          grads: each one's grad, or None.
          norm_type: as for :meth:`decide_units`.

        Returns:
          A decision whose ``per_grad`` and ``squares`` have one entry per parameter
          (``per_grad`` None where there is no grad), whose ``norms``, ``coefficients``
          and ``thresholds`` cover the units of the grads present, and whose ``check``
          says where the ranks' grads do not line up; or None (the default): the rule
          does not, and :meth:`decide_units` is called with the grads present.
        """
        return None
