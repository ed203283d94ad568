"""AGC (Brock, De, Smith and Simonyan, 2021): clip each unit's grad against its weight."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from clipopt._dist._units import Rows, slot_unit_norms, whole_unit_norms
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


def _in_order(*placed: tuple[list[int], Sequence[Tensor]]) -> tuple[Tensor, ...]:
    """The tensors of each ``(positions, tensors)`` pair at their positions, in one tuple."""
    at = {i: t for positions, tensors in placed for i, t in zip(positions, tensors, strict=True)}
    return tuple(at[i] for i in range(len(at)))


def _check_grad(grad: Tensor | None, param: Tensor) -> None:
    """A grad AGC clips must be dense and shaped as its parameter (None: none here)."""
    if grad is not None and (grad.is_sparse or grad.shape != param.shape):
        raise ValueError(
            f"AGC needs dense grads shaped as their parameters, got a grad of "
            f"shape {tuple(grad.shape)} (sparse: {grad.is_sparse}) for a "
            f"parameter of shape {tuple(param.shape)}"
        )


def _given(grads: list[Tensor | None]) -> list[Tensor]:
    """``grads``, every one given (:meth:`AGC.decide_units` is given only grads)."""
    return cast("list[Tensor]", grads)


def _held_units(values: Tensor, rows: Sequence[Rows], present: Sequence[bool]) -> Tensor:
    """The entries of ``values`` (every tensor's units, in order) of the tensors present."""
    if all(present):
        return values
    parts = torch.split(values, [r.units for r in rows])
    kept = [part for part, here in zip(parts, present, strict=True) if here]
    return torch.cat(kept) if kept else values.new_zeros(0)


def _parameters(exclude: Iterable[Tensor]) -> list[Tensor]:
    """``exclude`` as a list of tensors; TypeError naming the first thing that is not one."""
    if isinstance(exclude, (Tensor, str)) or not isinstance(exclude, Iterable):
        raise TypeError(
            f"exclude must be an iterable of parameters (tensors), got {exclude!r}; "
            "for one parameter p, pass exclude=[p]"
        )
    found = list(exclude)
    for item in found:
        if not isinstance(item, Tensor):
            raise TypeError(
                f"exclude must hold parameters (tensors, matched by identity), got {item!r}; "
                "names are not accepted: pass the parameters, e.g. model.fc.parameters()"
            )
    return list({id(t): t for t in found}.values())


class AGC(UnitWiseRule):
    """Adaptive Gradient Clipping (Brock, De, Smith and Simonyan, 2021: *High-Performance
    Large-Scale Image Recognition Without Normalization*, the NFNets paper): each unit's
    grad is clipped against the norm of its weights.

    A unit is a row of a linear weight, an output channel of a conv kernel (a slice along
    dim 0 of any tensor of 2 dims or more), or the whole of a bias, gain or other 0- or
    1-D parameter. With ``W`` a unit's weights and ``G`` its grad, the threshold is
    ``max_norm = clipping * max(||W||, eps)``, and where ``||G|| >= max_norm``, ``G`` is
    scaled by ``max_norm / max(||G||, 1e-6)``: timm's ``adaptive_clip_grad``, operation
    for operation (bit for bit in float32 on CPU).

    Args:
      clipping: the largest ratio of a unit's grad norm to its weight norm, > 0 (the
        paper's lambda; 0.01 is timm's default and the paper's choice at batch size 4096).
      eps: the smallest weight norm that counts, >= 0, so that zero-initialised units can
        move (the paper's 1e-3).
      exclude: parameters left unclipped, matched by identity (the paper does not clip
        the final classifier layer): e.g. ``model.fc.parameters()``. Their weights are
        not read; their grads are measured whole, in the same pass as the others' units,
        for the step's global norm. The rule holds them: a copy of the optimizer excludes
        its copies.

    ``last_threshold`` is every unit's ``max_norm`` of the last step in one 1-D tensor,
    in the order of the param groups and their params, with
    :func:`clipopt._dist._unit_rows.unit_shape` entries per grad (excluded params and params
    without a grad have none); ``clipped_count`` counts the steps in which some unit was
    scaled. Only the L2 norm is supported (``norm_type=2``, the paper's).

    DTensor params and grads (FSDP2, HSDP, tensor parallel, FSDP2 over TP) are measured
    by the whole unit across ranks, every unit's grad and weight shares (and the excluded
    grads') in one float64 ``all_reduce`` (:mod:`clipopt._dist._units`), the step's only one:
    its global norm is the root of the sum of the grads' reduced squares. Each rank
    scales the part of each unit it holds; ``last_threshold`` then still holds every
    unit of every tensor, the same on every rank and as in one process. A parameter
    whose rows a rank holds are not one contiguous range is refused with ``ValueError``
    before any grad changes. The reduction is laid out over the units of every
    (non-excluded) DTensor parameter of the optimizer, whatever grads a rank holds, so
    a rank whose grads are all None joins it with zero grad shares; it carries each
    rank's count of grads, and where the counts differ every norm of the step is NaN on
    every rank, for ``nonfinite`` to act on (``"raise"`` raises on every rank,
    ``"skip"`` skips everywhere).

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
      >>> rule.last_threshold, rule.clipped_count
      (tensor([5.0000e-01, 1.0000e-04]), tensor(1))
    """

    def __init__(
        self, clipping: float = 0.01, eps: float = 1e-3, exclude: Iterable[Tensor] = ()
    ) -> None:
        super().__init__()
        self.clipping = number("clipping", clipping, 0.0, math.inf, low_open=True, high_open=True)
        self.eps = number("eps", eps, 0.0, math.inf, high_open=True)
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
        for i in chosen:
            _check_grad(grads[i], params[i])
        present = [grads[i] is not None for i in chosen]
        dtype = result_dtype([g.dtype for g in grads if g is not None])
        others = [i for i, p in enumerate(params) if id(p) in excluded]
        weights = [params[i] for i in chosen]
        own, whole = [grads[i] for i in chosen], [grads[i] for i in others]
        if slotted:
            found = slot_unit_norms(own, weights, dtype, whole)
        else:
            found = whole_unit_norms(_given(own), weights, dtype, whole=_given(whole))
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
        squares = _in_order(
            (chosen, torch.split(found.grad_squares, [r.units for r in rows])),
            (others, torch.split(found.whole_squares, [1] * len(others))),
        )
        held = [_held_units(t, rows, present) for t in (norms, coefficients, thresholds)]
        return UnitDecision(per_grad, held[0], held[1], held[2], squares, found.check)

    def update(self, norms: Tensor) -> None:
        """AGC has no state: its threshold comes from the weights of this step."""

    def rule_state(self) -> dict[str, Any]:
        return {}

    def load_rule_state(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or state:
            raise ValueError(f"AGC has no state, got {state!r}")
