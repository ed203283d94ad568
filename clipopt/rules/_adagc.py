"""AdaGC (Wang et al., 2026): clip each tensor against an EMA of its own clipped norms."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from clipopt.rules._base import ClipRule, checked, integer, number, saved, state_dtype

__all__ = ["AdaGC"]


class _Step(NamedTuple):
    """One step of the rule, in the state's dtype: what it does and the state after it."""

    coefficients: Tensor
    thresholds: Tensor
    gamma: Tensor
    warmed: Tensor  # warm-up steps done, this one included


def _global_clip(
    norms: Tensor, p: float, max_norm: float, eps: float, total: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Warm-up's clip of the total p-norm at ``max_norm``.

    Returns:
      The coefficient ``min(1, max_norm / (total + eps))``; each tensor's threshold
      ``max_norm * (n + eps) / (total + eps)``, at which ``threshold / (n + eps)`` is
      that coefficient (inf if ``total + eps`` is 0); and whether the total is finite.
    """
    if total is None:
        total = torch.linalg.vector_norm(norms, p)
    else:  # the whole model's, where ``norms`` are one pipeline stage's
        total = total.to(device=norms.device, dtype=norms.dtype)
    raw = max_norm / (total + eps)
    shares = torch.where(total + eps > 0, raw * (norms + eps), math.inf)
    return raw.clamp(max=1.0), shares, torch.isfinite(total)


def _ema_clip(
    norms: Tensor, gamma: Tensor, ratio: float, beta: float, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """After warm-up: clip each norm above ``ratio * gamma`` to it, then move the EMA.

    A ``gamma`` of inf (none yet: ``warmup_steps=0``) starts from the norm itself, as the
    authors' code does for a tensor without state.

    Returns:
      The coefficients, the thresholds ``ratio * gamma`` and the EMA after the step.
    """
    reference = torch.where(torch.isinf(gamma), norms, gamma)
    limit = ratio * reference
    clip = norms > limit
    coefficients = torch.where(clip, limit / (norms + eps), 1.0)
    kept = torch.where(clip, limit, norms)
    return coefficients, limit, beta * reference + (1.0 - beta) * kept


class AdaGC(ClipRule):
    """AdaGC (Wang et al., 2026): clip each tensor against an EMA of its own clipped norms.

    Wang, Li, Chen, Zeng, Yang, Yu, Ma and Shen, *AdaGC: Enhancing LLM Pretraining
    Stability via Adaptive Gradient Clipping* (ICML 2026), as the authors' Megatron patch
    (``megatron/optimizer/clip_grads.py``, class ``AdaGC``) applies it, with ``n`` each
    tensor's norm (of the optimizer's ``norm_type``) and ``gamma`` its state:

    - warm-up, the first ``warmup_steps`` steps: every grad is scaled by
      ``min(1, warmup_max_norm / (total + eps))``, ``total`` the p-norm of all grads
      before the clip, and ``gamma`` is the minimum of the tensor's clipped norm over
      these steps (the first one's to start). ``last_threshold`` holds each tensor's
      ``warmup_max_norm * (n + eps) / (total + eps)``, at which torch's
      ``threshold / (n + eps)`` is the global coefficient.
    - after: a tensor with ``n > ratio * gamma`` is scaled by
      ``ratio * gamma / (n + eps)`` and counts as ``n = ratio * gamma``; then
      ``gamma = beta * gamma + (1 - beta) * n``. ``last_threshold`` is ``ratio * gamma``
      of before the step. With ``warmup_steps=0`` a tensor's first norm starts ``gamma``.

    Non-finite norms never enter the state: a warm-up step whose total is not finite
    changes nothing and does not count as one of the ``warmup_steps`` (its coefficient
    is 0 or NaN, and the wrapper's ``nonfinite`` policy decides the step); after warm-up
    a tensor with a non-finite norm keeps its ``gamma``. The state is one value per grad
    (float64 where the device has it) and a warm-up counter, on the grads' device;
    every step must have the same grads.

    Args:
      ratio: the relative threshold ``lambda_rel``, > 0 (below 1, ``gamma`` can only
        fall, and a norm equal to it is clipped).
      beta: the EMA factor, in [0, 1).
      warmup_steps: the steps clipped globally first, >= 0.
      warmup_max_norm: warm-up's global threshold, in (0, inf).
      eps: added to the norm in each division, >= 0.

    Example:
      >>> import torch, clipopt
      >>> w, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
      >>> rule = clipopt.AdaGC(ratio=1.5, beta=0.5, warmup_steps=1, warmup_max_norm=6.5)
      >>> opt = clipopt.ClippedOptimizer(torch.optim.SGD([w, b], lr=0.0), max_norm=rule)
      >>> for gw, gb in (([3.0, 4.0], [12.0]), ([6.0, 8.0], [3.0])):
      ...     w.grad, b.grad = torch.tensor(gw), torch.tensor(gb)
      ...     opt.step()
      ...     print(rule.last_threshold, w.grad, b.grad)
      tensor([2.5000, 6.0000]) tensor([1.5000, 2.0000]) tensor([6.0000])
      tensor([3.7500, 9.0000]) tensor([2.2500, 3.0000]) tensor([3.])
      >>> rule.rule_state()["gamma"], rule.clipped_count, opt.last_norm
      (tensor([3.1250, 4.5000], dtype=torch.float64), tensor(2), tensor(10.4403))
    """

    per_tensor = True

    def __init__(
        self,
        ratio: float = 1.04,
        beta: float = 0.99,
        warmup_steps: int = 100,
        warmup_max_norm: float = 1.0,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.ratio = number("ratio", ratio, 0.0, math.inf, low_open=True, high_open=True)
        self.beta = number("beta", beta, 0.0, 1.0, high_open=True)
        self.warmup_steps = integer("warmup_steps", warmup_steps, 0)
        self.warmup_max_norm = number(
            "warmup_max_norm", warmup_max_norm, 0.0, math.inf, low_open=True, high_open=True
        )
        self.eps = number("eps", eps, 0.0, math.inf, high_open=True)
        self._gamma: Tensor | None = None  # [grads]: inf until a tensor's first norm
        self._count: Tensor | None = None  # 0-dim int64: warm-up steps done

    def config(self) -> dict[str, Any]:
        return {
            "ratio": self.ratio,
            "beta": self.beta,
            "warmup_steps": self.warmup_steps,
            "warmup_max_norm": self.warmup_max_norm,
            "eps": self.eps,
        }

    def _ensure(self, norms: Tensor) -> tuple[Tensor, Tensor]:
        if norms.dim() != 1:
            raise ValueError("AdaGC is a per-tensor rule: it takes one norm per grad")
        if self._gamma is None or self._count is None:
            dtype = state_dtype(norms.device)
            gamma = torch.full(norms.shape, math.inf, dtype=dtype, device=norms.device)
            return gamma, torch.zeros((), dtype=torch.int64, device=norms.device)
        if self._gamma.shape != norms.shape:
            raise ValueError(
                f"AdaGC has a state for {self._gamma.shape[0]} grads but this step has "
                f"{norms.shape[0]}: a per-tensor rule needs the same grads every step"
            )
        return self._gamma, self._count

    def _evaluate(self, norms: Tensor) -> _Step:
        gamma, count = self._ensure(norms)
        n = norms.to(gamma.dtype)
        warming = count < self.warmup_steps
        scale, shares, counted = _global_clip(
            n, self.norm_type, self.warmup_max_norm, self.eps, self.total_norm
        )
        lowest = torch.where(counted, torch.minimum(gamma, n * scale), gamma)
        after, limits, ema = _ema_clip(n, gamma, self.ratio, self.beta, self.eps)
        return _Step(
            coefficients=torch.where(warming, scale, after),
            thresholds=torch.where(warming, shares, limits),
            gamma=torch.where(warming, lowest, torch.where(torch.isfinite(n), ema, gamma)),
            warmed=count + (warming & counted).to(torch.int64),
        )

    def decide(self, norms: Tensor) -> tuple[Tensor, Tensor]:
        step = self._evaluate(norms)
        return step.coefficients.to(norms.dtype), step.thresholds.to(norms.dtype)

    def threshold(self, norms: Tensor) -> Tensor:
        return self._evaluate(norms).thresholds

    def coefficient(self, norms: Tensor, threshold: Tensor) -> Tensor:
        return self._evaluate(norms).coefficients

    def update(self, norms: Tensor) -> None:
        step = self._evaluate(norms)
        self._gamma, self._count = step.gamma, step.warmed

    def rule_state(self) -> dict[str, Any]:
        if self._gamma is None or self._count is None:
            return {}
        return {"gamma": self._gamma.clone(), "count": self._count.clone()}

    def load_rule_state(self, state: Mapping[str, Any]) -> None:
        if not saved("AdaGC", state, ("gamma", "count")):
            self._gamma = self._count = None
            return
        gamma = checked("gamma", state["gamma"], None, floating=True)
        if gamma.dim() != 1:
            raise ValueError(f"AdaGC gamma must be 1-D (one value per grad), got {gamma!r}")
        count = checked("count", state["count"], (), floating=False)
        self._gamma, self._count = gamma.clone(), count.clone()
