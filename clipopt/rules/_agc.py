"""AGC (Brock, De, Smith and Simonyan, 2021): clip each unit's grad against its weight."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from clipopt._dist._units import whole_unit_norms
from clipopt._kernels._norms import result_dtype
from clipopt._kernels._scale import EPS
from clipopt.rules._base import number
from clipopt.rules._unit import UnitDecision, UnitWiseRule


class AGC(UnitWiseRule):
    """Adaptive Gradient Clipping: clip each unit's grad (a slice along dim 0, or a whole
    0- or 1-D tensor) at ``clipping * max(||W||, eps)``, as timm's ``adaptive_clip_grad``.

    Args:
      clipping: the largest ratio of a unit's grad norm to its weight norm, > 0.
      eps: the smallest weight norm that counts, >= 0.
      exclude: parameters left unclipped, matched by identity.

    Example:
      >>> import torch, clipopt
      >>> w = torch.nn.Parameter(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
      >>> rule = clipopt.AGC(clipping=0.1)
      >>> opt = clipopt.ClippedOptimizer(torch.optim.SGD([w], lr=0.0), max_norm=rule)
      >>> w.grad = torch.tensor([[0.03, 0.04], [0.0, 1.0]])
      >>> opt.step()
      >>> w.grad  # row 0 (norm 0.05 < 0.1 * 5) untouched; row 1 to 0.1 * eps
      tensor([[0.0300, 0.0400],
              [0.0000, 0.0001]])
      >>> rule.last_threshold, opt.clipped_count
      (tensor([5.0000e-01, 1.0000e-04]), tensor(1))
    """

    def __init__(
        self, clipping: float = 0.01, eps: float = 1e-3, exclude: Iterable[Tensor] = ()
    ) -> None:
        super().__init__()
        self.clipping = number("clipping", clipping, "(0, inf)")
        self.eps = number("eps", eps, "[0, inf)")
        ok = isinstance(exclude, Iterable) and not isinstance(exclude, (Tensor, str))
        found = list(exclude) if ok else []
        if not ok or any(not isinstance(t, Tensor) for t in found):
            got = f"got {exclude!r}; parameters, not names: e.g. exclude=[p]"
            raise TypeError(f"exclude must be an iterable of tensors, {got}")
        self.exclude = list({id(t): t for t in found}.values())

    def config(self) -> dict[str, Any]:
        return {"clipping": self.clipping, "eps": self.eps, "excluded": len(self.exclude)}

    def borrowed(self) -> tuple[object, ...]:
        return tuple(self.exclude)

    def check_norm_type(self, norm_type: float) -> None:
        if norm_type != 2.0:
            raise ValueError(
                f"AGC clips units by their L2 norm (the paper's); norm_type must be 2, "
                f"got {norm_type!r}"
            )

    def decide_units(
        self, params: Sequence[Tensor], grads: Sequence[Tensor], norm_type: float
    ) -> UnitDecision:
        return self.decide_slots(params, grads, norm_type, slotted=False)

    def decide_slots(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor | None],
        norm_type: float,
        slotted: bool = True,
    ) -> UnitDecision:
        """``grads`` holds None, ``slotted`` only, for a grad this rank does not hold."""
        excluded = {id(p) for p in self.exclude}
        chosen = [i for i, p in enumerate(params) if id(p) not in excluded]
        others = [i for i, p in enumerate(params) if id(p) in excluded]
        for grad, param in ((grads[i], params[i]) for i in chosen):
            if grad is not None and (grad.is_sparse or grad.shape != param.shape):
                got = f"{tuple(grad.shape)} (sparse: {grad.is_sparse}) for {tuple(param.shape)}"
                raise ValueError(f"AGC needs dense grads shaped as their parameters, got {got}")
        present = [grads[i] is not None for i in chosen]
        dtype = result_dtype([g.dtype for g in grads if g is not None])
        own, whole = [grads[i] for i in chosen], [grads[i] for i in others]
        found = whole_unit_norms(own, [params[i] for i in chosen], dtype, whole, strict=slotted)
        norms, rows = found.grads, found.rows
        # as timm: g * (max_norm / norm(g).clamp(min=1e-6)) where norm(g) >= max_norm
        thresholds = found.weights.clamp(min=self.eps).mul(self.clipping)
        coefficients = torch.where(norms < thresholds, 1.0, thresholds / norms.clamp(min=EPS))
        per_grad: list[Tensor | None] = [None] * len(grads)
        parts = torch.split(coefficients, [r.units for r in rows])
        for i, r, part, here in zip(chosen, rows, parts, present, strict=True):
            dim = params[i].dim()
            if here:  # a 0- or 1-D grad's one unit; else this rank's rows, shaped to broadcast
                shape = () if dim <= 1 else (r.count,) + (1,) * (dim - 1)
                per_grad[i] = part.narrow(0, r.start, r.count).reshape(shape)
        shares = torch.split(found.grad_squares, [r.units for r in rows])
        whole_shares = torch.split(found.whole_squares, [1] * len(others))
        at = dict(zip(chosen + others, [*shares, *whole_shares], strict=True))
        squares = tuple(at[i] for i in range(len(at)))
        if not all(present):  # only the held tensors' units
            units = [r.units for r in rows]
            norms, coefficients, thresholds = (
                torch.cat(
                    [p for p, here in zip(torch.split(t, units), present, strict=True) if here]
                )
                if any(present)
                else t.new_zeros(0)
                for t in (norms, coefficients, thresholds)
            )
        return UnitDecision(per_grad, norms, coefficients, thresholds, squares, found.check)
