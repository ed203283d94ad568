"""The unit-wise rule protocol and its decision."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from clipopt.rules._base import ClipRule


@dataclass(frozen=True)
class UnitDecision:
    """What a :class:`UnitWiseRule` decides for one step (docs/adaptive.md, "Unit-wise rules").

    Attributes:
      per_grad: a coefficient per grad, broadcastable to it, or None. norms, coefficients,
      thresholds: 1-D, one per unit. squares: optional, a 1-D tensor per grad summing to
      its squared L2 norm. check: optional, 0-dim, added to the norms (NaN: ranks disagree).
    """

    per_grad: list[Tensor | None]
    norms: Tensor
    coefficients: Tensor
    thresholds: Tensor
    squares: tuple[Tensor, ...] | None = None
    check: Tensor | None = None


class UnitWiseRule(ClipRule):
    """A stateless rule that clips parts ("units") of each grad against its parameter, as
    AGC does: the wrapper calls :meth:`decide_units`, not :meth:`~ClipRule.decide`, then
    :meth:`~ClipRule.commit`; never folded into a fused kernel."""

    def check_norm_type(self, norm_type: float) -> None:
        """Raise ``ValueError`` if the rule cannot measure in this order (default: any)."""

    def decide_units(
        self, params: Sequence[Tensor], grads: Sequence[Tensor], norm_type: float
    ) -> UnitDecision:
        """This step's coefficients from each grad and its parameter (in the order of the
        param groups; DTensors as they are); changes nothing, reads nothing on the host."""
        raise NotImplementedError

    def decide_slots(
        self, params: Sequence[Tensor], grads: Sequence[Tensor | None], norm_type: float
    ) -> UnitDecision | None:
        """:meth:`decide_units` over every DTensor parameter (grad or None); None: unsupported."""
        return None
