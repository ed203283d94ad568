"""The unit-wise rule protocol (:class:`UnitWiseRule`) and its decision (:class:`UnitDecision`)."""

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
      norms: every unit's pre-clip grad norm in one 1-D tensor, in the grads' order.
      coefficients: each unit's coefficient, at most 1, shaped as ``norms``.
      thresholds: each unit's threshold, shaped as ``norms``.
      squares: optional, one 1-D tensor per grad given of values that sum to its squared
        L2 norm (whole across ranks, float64 where the device has it): the step then
        takes its norms from them and reads no grad again; None: it measures the grads.
      check: optional, a 0-dim float tensor, 0 where the ranks' grads line up and NaN
        where they do not, added to the step's norms.
    """

    per_grad: list[Tensor | None]
    norms: Tensor
    coefficients: Tensor
    thresholds: Tensor
    squares: tuple[Tensor, ...] | None = None
    check: Tensor | None = None


class UnitWiseRule(ClipRule):
    """The protocol of a rule that clips parts ("units") of each grad against its
    parameter, as AGC does; it keeps no state across steps.

    The wrapper calls :meth:`decide_units` instead of :meth:`~ClipRule.decide`, then
    :meth:`~ClipRule.commit` with the units' norms, coefficients and thresholds (1-D). A
    subclass implements :meth:`~ClipRule.config` and :meth:`decide_units`, and may refuse
    a norm order in :meth:`check_norm_type`. Its coefficients never fold into a fused
    kernel's ``grad_scale``.

    Example:
      A rule that scales each row of each grad to a norm of at most 1:

      >>> import torch, clipopt
      >>> class RowClip(clipopt.UnitWiseRule):
      ...     def config(self): return {}
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
      >>> w.grad, opt.clipped_count
      (tensor([[0.6000, 0.8000],
              [0.3000, 0.4000]]), tensor(1))
    """

    def check_norm_type(self, norm_type: float) -> None:
        """Raise ``ValueError`` if the rule cannot measure in this order (default: any)."""

    def decide_units(
        self, params: Sequence[Tensor], grads: Sequence[Tensor], norm_type: float
    ) -> UnitDecision:
        """This step's coefficients, from each grad and its parameter; changes nothing,
        reads nothing on the host.

        Args:
          params: the parameters that have a grad, in the order of the param groups.
          grads: their grads, in that order; DTensors under FSDP2 and tensor parallelism
            (a coefficient then scales the local shard), which a rule that cannot
            measure them refuses with ``ValueError``.
          norm_type: the wrapper's norm order, as :meth:`check_norm_type` accepted.
        """
        raise NotImplementedError

    def decide_slots(
        self, params: Sequence[Tensor], grads: Sequence[Tensor | None], norm_type: float
    ) -> UnitDecision | None:
        """:meth:`decide_units` over every DTensor parameter, with its grad or None where
        this rank holds none, so that a rule measuring across ranks joins the others'
        collective; ``per_grad`` and ``squares`` then have one entry per parameter. None
        (the default): the rule does not, and :meth:`decide_units` is called."""
        return None
