"""AGC (Brock, De, Smith and Simonyan, 2021): clip each unit's grad against its weight."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from clipopt._dist._units import Rows, whole_unit_norms
from clipopt._kernels._norms import result_dtype
from clipopt._kernels._scale import EPS
from clipopt.rules._base import number
from clipopt.rules._unit import UnitDecision, UnitWiseRule

__all__ = ["AGC"]


def _local_part(coefficients: Tensor, rows: Rows, dim: int) -> Tensor:
    """The coefficients of this rank's units of a tensor of ``dim`` dims, broadcastable to
    its local shard: ``(count, 1, ...)`` for 2 dims or more, ``()`` for 0 or 1."""
    if dim <= 1:
        return coefficients.reshape(())
    return coefficients.narrow(0, rows.start, rows.count).reshape((rows.count,) + (1,) * (dim - 1))


def _held_units(values: Tensor, rows: Sequence[Rows], present: Sequence[bool]) -> Tensor:
    """The entries of ``values`` (every tensor's units, in order) of the tensors present."""
    if all(present):
        return values
    parts = torch.split(values, [r.units for r in rows])
    kept = [part for part, here in zip(parts, present, strict=True) if here]
    return torch.cat(kept) if kept else values.new_zeros(0)


def _parameters(exclude: Iterable[Tensor]) -> list[Tensor]:
    """``exclude`` as a list of distinct tensors; TypeError naming what is not one."""
    ok = isinstance(exclude, Iterable) and not isinstance(exclude, (Tensor, str))
    found = list(exclude) if ok else []
    if not ok or any(not isinstance(t, Tensor) for t in found):
        raise TypeError(
            f"exclude must be an iterable of parameters (tensors, matched by identity), got "
            f"{exclude!r} (names are not accepted); e.g. exclude=model.fc.parameters(), or "
            "exclude=[p] for one parameter p"
        )
    return list({id(t): t for t in found}.values())


class AGC(UnitWiseRule):
    """Adaptive Gradient Clipping (Brock, De, Smith and Simonyan, 2021: *High-Performance
    Large-Scale Image Recognition Without Normalization*, the NFNets paper): each unit's
    grad is clipped against the norm of its weights.

    A unit is a slice along dim 0 of a tensor of 2 dims or more (a row of a linear
    weight, an output channel of a conv kernel), or the whole of a 0- or 1-D one. With
    ``W`` a unit's weights and ``G`` its grad, the threshold is
    ``max_norm = clipping * max(||W||, eps)``, and where ``||G|| >= max_norm``, ``G`` is
    scaled by ``max_norm / max(||G||, 1e-6)``: timm's ``adaptive_clip_grad``, operation
    for operation (bit for bit in float32 on CPU).

    Args:
      clipping: the largest ratio of a unit's grad norm to its weight norm, > 0 (the
        paper's lambda; 0.01 is timm's default and the paper's choice at batch size 4096).
      eps: the smallest weight norm that counts, >= 0, so that zero-initialised units can
        move (the paper's 1e-3).
      exclude: parameters left unclipped, matched by identity, e.g.
        ``model.fc.parameters()`` (the paper does not clip the final classifier).

    ``last_threshold`` is every unit's ``max_norm``, grad after grad, in one 1-D tensor.
    Only the L2 norm is supported (the paper's). DTensor grads (FSDP2, HSDP, tensor
    parallel) are measured by the whole unit across ranks, in the step's one
    ``all_reduce`` (:mod:`clipopt._dist._units`); each rank scales the rows it holds.

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
        self.exclude = _parameters(exclude)

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
        return self._decision(params, grads, slotted=False)

    def decide_slots(
        self, params: Sequence[Tensor], grads: Sequence[Tensor | None], norm_type: float
    ) -> UnitDecision:
        return self._decision(params, grads, slotted=True)

    def _decision(
        self, params: Sequence[Tensor], grads: Sequence[Tensor | None], slotted: bool
    ) -> UnitDecision:
        """The decision for ``grads`` (None: a slot without a grad here, ``slotted`` only:
        its units are measured across ranks, and have no coefficient here)."""
        excluded = {id(p) for p in self.exclude}
        chosen = [i for i, p in enumerate(params) if id(p) not in excluded]
        for grad, param in ((grads[i], params[i]) for i in chosen):
            if grad is not None and (grad.is_sparse or grad.shape != param.shape):
                raise ValueError(
                    f"AGC needs dense grads shaped as their parameters, got a grad of shape "
                    f"{tuple(grad.shape)} (sparse: {grad.is_sparse}) for a parameter of "
                    f"shape {tuple(param.shape)}"
                )
        present = [grads[i] is not None for i in chosen]
        dtype = result_dtype([g.dtype for g in grads if g is not None])
        others = [i for i, p in enumerate(params) if id(p) in excluded]
        weights = [params[i] for i in chosen]
        own, whole = [grads[i] for i in chosen], [grads[i] for i in others]
        found = whole_unit_norms(own, weights, dtype, whole, strict=slotted)
        norms, rows = found.grads, found.rows
        # timm: max_norm = norm(p).clamp_(min=eps).mul_(clipping); g * (max_norm /
        # norm(g).clamp(min=1e-6)) where norm(g) >= max_norm, g unchanged elsewhere.
        thresholds = found.weights.clamp(min=self.eps).mul(self.clipping)
        ratio = thresholds / norms.clamp(min=EPS)
        coefficients = torch.where(norms < thresholds, 1.0, ratio)
        per_grad: list[Tensor | None] = [None] * len(grads)
        parts = torch.split(coefficients, [r.units for r in rows])
        for i, w, r, part, here in zip(chosen, weights, rows, parts, present, strict=True):
            per_grad[i] = _local_part(part, r, w.dim()) if here else None
        shares = torch.split(found.grad_squares, [r.units for r in rows])
        whole_shares = torch.split(found.whole_squares, [1] * len(others))
        at = dict(zip(chosen + others, [*shares, *whole_shares], strict=True))
        squares = tuple(at[i] for i in range(len(at)))
        held = [_held_units(t, rows, present) for t in (norms, coefficients, thresholds)]
        return UnitDecision(per_grad, held[0], held[1], held[2], squares, found.check)
