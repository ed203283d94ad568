"""AdaGC (Wang et al., 2026): clip each tensor against an EMA of its own clipped norms."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from clipopt._kernels._norms import combine_dtype
from clipopt.rules._base import ClipRule, Evaluation, State, checked, integer, number

__all__ = ["AdaGC"]


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
      >>> rule.state["gamma"], opt.clipped_count, opt.last_norm
      (tensor([3.1250, 4.5000], dtype=torch.float64), tensor(2), tensor(10.4403))
    """

    per_tensor = True
    settings = ("ratio", "beta", "warmup_steps", "warmup_max_norm", "eps")
    state_keys = ("gamma", "count")  # [grads], inf until a tensor's first norm; warm-up steps

    def __init__(
        self,
        ratio: float = 1.04,
        beta: float = 0.99,
        warmup_steps: int = 100,
        warmup_max_norm: float = 1.0,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.ratio = number("ratio", ratio, "(0, inf)")
        self.beta = number("beta", beta, "[0, 1)")
        self.warmup_steps = integer("warmup_steps", warmup_steps, 0)
        self.warmup_max_norm = number("warmup_max_norm", warmup_max_norm, "(0, inf)")
        self.eps = number("eps", eps, "[0, inf)")

    def init_state(self, norms: Tensor) -> State:
        if norms.dim() != 1:
            raise ValueError("AdaGC is a per-tensor rule: it takes one norm per grad")
        dtype = combine_dtype(norms.device)
        gamma = torch.full(norms.shape, math.inf, dtype=dtype, device=norms.device)
        return {"gamma": gamma, "count": torch.zeros((), dtype=torch.int64, device=norms.device)}

    def check_state(self, state: Mapping[str, Tensor]) -> None:
        checked("gamma", state["gamma"], None, floating=True)
        if state["gamma"].dim() != 1:
            raise ValueError(
                f"AdaGC gamma must be 1-D (one value per grad), got {state['gamma']!r}"
            )
        checked("count", state["count"], (), floating=False)

    def evaluate(
        self, norms: Tensor, state: State, *, norm_type: float, total_norm: Tensor | None
    ) -> Evaluation:
        gamma, count = state["gamma"], state["count"]
        self._same_grads(gamma.numel(), norms.numel())
        n = norms.to(gamma.dtype)
        warming = count < self.warmup_steps
        # Warm-up: the total p-norm clipped at warmup_max_norm; each tensor's threshold is
        # where threshold / (n + eps) is that coefficient (inf if total + eps is 0).
        total = torch.linalg.vector_norm(n, norm_type) if total_norm is None else total_norm.to(n)
        raw = self.warmup_max_norm / (total + self.eps)
        shares = torch.where(total + self.eps > 0, raw * (n + self.eps), math.inf)
        counted = torch.isfinite(total)
        lowest = torch.where(counted, torch.minimum(gamma, n * raw.clamp(max=1.0)), gamma)
        # After: clip each norm above ratio * gamma to it, then move the EMA; a gamma of
        # inf (warmup_steps=0) starts from the norm, as the authors' code does.
        reference = torch.where(torch.isinf(gamma), n, gamma)
        limit = self.ratio * reference
        clip = n > limit
        ema = self.beta * reference + (1.0 - self.beta) * torch.where(clip, limit, n)
        after = {
            "gamma": torch.where(warming, lowest, torch.where(torch.isfinite(n), ema, gamma)),
            "count": count + torch.logical_and(warming, counted).to(torch.int64),
        }
        coefficients = torch.where(
            warming, raw.clamp(max=1.0), torch.where(clip, limit / (n + self.eps), 1.0)
        )
        return Evaluation(torch.where(warming, shares, limit), after, coefficients)
