"""AdaGC (Wang et al., 2026): clip each tensor against an EMA of its own clipped norms."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from clipopt._kernels._norms import combine_dtype
from clipopt.rules._base import ClipRule, Evaluation, State, checked, integer, number


class AdaGC(ClipRule):
    """AdaGC (Wang et al., 2026): clip each tensor against an EMA of its own clipped norms,
    as the authors' Megatron patch does (docs/adaptive.md).

    Args:
      ratio: the relative threshold, > 0. beta: the EMA factor, in [0, 1).
      warmup_steps: the steps clipped globally at ``warmup_max_norm`` first, >= 0.
      warmup_max_norm: in (0, inf). eps: added to the norm in each division, >= 0.

    Example:
      >>> import torch, clipopt
      >>> w, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
      >>> rule = clipopt.AdaGC(ratio=1.5, beta=0.5, warmup_steps=1, warmup_max_norm=6.5)
      >>> opt = clipopt.ClippedOptimizer(torch.optim.SGD([w, b], lr=0.0), max_norm=rule)
      >>> for gw, gb in (([3.0, 4.0], [12.0]), ([6.0, 8.0], [3.0])):
      ...     w.grad, b.grad = torch.tensor(gw), torch.tensor(gb)
      ...     opt.step()
      >>> rule.last_threshold, w.grad, b.grad
      (tensor([3.7500, 9.0000]), tensor([2.2500, 3.0000]), tensor([3.]))
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
        gamma = state["gamma"]
        checked("gamma", gamma, None, floating=True)
        if gamma.dim() != 1:
            raise ValueError(f"AdaGC gamma must be 1-D (one value per grad), got {gamma!r}")
        checked("count", state["count"], (), floating=False)

    def evaluate(
        self, norms: Tensor, state: State, *, norm_type: float, total_norm: Tensor | None
    ) -> Evaluation:
        gamma, count = state["gamma"], state["count"]
        self._same_grads(gamma.numel(), norms.numel())
        n = norms.to(gamma.dtype)
        warming = count < self.warmup_steps
        # Warm-up clips the total norm; a tensor's threshold gives that coefficient.
        total = torch.linalg.vector_norm(n, norm_type) if total_norm is None else total_norm.to(n)
        raw = self.warmup_max_norm / (total + self.eps)
        shares = torch.where(total + self.eps > 0, raw * (n + self.eps), math.inf)
        counted = torch.isfinite(total)
        lowest = torch.where(counted, torch.minimum(gamma, n * raw.clamp(max=1.0)), gamma)
        # After: clip at ratio * gamma, then move the EMA; a gamma of inf starts at the norm.
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
