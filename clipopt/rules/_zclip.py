"""ZClip (Kumar et al., 2025): clip norms that are outliers of an EMA of past norms."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from clipopt._kernels._scale import EPS
from clipopt.rules._base import ClipRule, checked, integer, number, saved, state_dtype

__all__ = ["ZClip", "ZClipMode", "ZClipOption"]


ZClipMode = Literal["zscore", "percentile"]
ZClipOption = Literal["adaptive_scaling", "mean"]


class ZClip(ClipRule):
    """ZClip (Kumar et al., 2025): clip norms that are outliers of an EMA of past norms.

    With the argument names, defaults and semantics of the ``zclip`` 1.0.0 package's
    ``ZClip``, step for step, on the device:

    - warm-up: the first ``warmup_steps`` norms are collected (and clipped at
      ``max_grad_norm`` only, as ``torch.nn.utils.clip_grad_norm_`` does); then the
      mean and (population) variance of those norms start the EMAs.
    - after: with ``mode="zscore"``, ``z = (norm - mean) / (std + eps)``; a norm with
      ``z > z_thresh`` is clipped to ``mean + z_thresh * std / (z / z_thresh)`` times
      ``clip_factor`` (``clip_option="adaptive_scaling"``) or to ``mean`` (``"mean"``).
      With ``mode="percentile"`` a norm above ``mean + z_thresh * std`` is clipped to it.
      The threshold is capped at ``max_grad_norm`` (None: no cap), and a grad is scaled
      by ``threshold / (norm + 1e-6)`` only where ``norm > threshold``.
    - the EMAs then take the clipped value (the uncapped threshold) for a spike, the norm
      otherwise, ``mean = alpha * mean + (1 - alpha) * x`` and then
      ``var = alpha * var + (1 - alpha) * (x - mean) ** 2`` with the new mean; with
      ``skip_update_on_spike`` a spike leaves them as they were.

    Args:
      alpha: the EMA factor, in (0, 1).
      z_thresh: > 0.
      max_grad_norm: a cap > 0 on every threshold, warm-up included, or None.
      eps: added to the std, >= 0.
      warmup_steps: >= 1 (the package treats 0 as 1).
      mode: ``"zscore"`` or ``"percentile"``.
      clip_option: ``"adaptive_scaling"`` or ``"mean"`` (``"zscore"`` mode only).
      clip_factor: > 0.
      skip_update_on_spike: leave the EMAs unchanged on a spike.

    Example:
      >>> import torch, clipopt
      >>> w = torch.nn.Parameter(torch.zeros(1))
      >>> rule = clipopt.ZClip(warmup_steps=3, max_grad_norm=None)
      >>> opt = clipopt.ClippedOptimizer(torch.optim.SGD([w], lr=0.0), max_norm=rule)
      >>> for g in (1.0, 1.1, 0.9, 1.0, 50.0):
      ...     w.grad = torch.tensor([g])
      ...     opt.step()
      >>> rule.clipped_count, w.grad
      (tensor(1), tensor([1.0008]))
    """

    def __init__(
        self,
        alpha: float = 0.97,
        z_thresh: float = 2.5,
        max_grad_norm: float | None = 1.0,
        eps: float = 1e-6,
        warmup_steps: int = 25,
        mode: ZClipMode = "zscore",
        clip_option: ZClipOption = "adaptive_scaling",
        clip_factor: float = 1.0,
        skip_update_on_spike: bool = False,
    ) -> None:
        super().__init__()
        self.alpha = number("alpha", alpha, 0.0, 1.0, low_open=True, high_open=True)
        self.z_thresh = number("z_thresh", z_thresh, 0.0, math.inf, low_open=True)
        self.max_grad_norm = (
            None
            if max_grad_norm is None
            else number("max_grad_norm", max_grad_norm, 0.0, math.inf, low_open=True)
        )
        self.eps = number("eps", eps, 0.0, math.inf)
        self.warmup_steps = integer("warmup_steps", warmup_steps, 1)
        if not isinstance(mode, str) or mode.lower() not in ("zscore", "percentile"):
            raise ValueError(f"mode must be 'zscore' or 'percentile', got {mode!r}")
        self.mode = mode.lower()
        if not isinstance(clip_option, str) or clip_option.lower() not in (
            "adaptive_scaling",
            "mean",
        ):
            raise ValueError(
                f"clip_option must be 'adaptive_scaling' or 'mean', got {clip_option!r}"
            )
        self.clip_option = clip_option.lower()
        self.clip_factor = number("clip_factor", clip_factor, 0.0, math.inf, low_open=True)
        if not isinstance(skip_update_on_spike, bool):
            raise TypeError(f"skip_update_on_spike must be a bool, got {skip_update_on_spike!r}")
        self.skip_update_on_spike = skip_update_on_spike
        self._buffer: Tensor | None = None  # the warm-up norms
        self._count: Tensor | None = None  # warm-up norms seen, up to warmup_steps
        self._mean: Tensor | None = None
        self._var: Tensor | None = None

    def config(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "z_thresh": self.z_thresh,
            "max_grad_norm": self.max_grad_norm,
            "eps": self.eps,
            "warmup_steps": self.warmup_steps,
            "mode": self.mode,
            "clip_option": self.clip_option,
            "clip_factor": self.clip_factor,
            "skip_update_on_spike": self.skip_update_on_spike,
        }

    def _ensure(self, norms: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if norms.dim() != 0:
            raise ValueError("ZClip is a global rule: it takes the 0-dim global norm")
        if self._buffer is None or self._count is None or self._mean is None or (self._var is None):
            dtype = state_dtype(norms.device)
            zero = torch.zeros((), dtype=dtype, device=norms.device)
            buffer = torch.zeros(self.warmup_steps, dtype=dtype, device=norms.device)
            return buffer, torch.zeros((), dtype=torch.int64, device=norms.device), zero, zero
        return self._buffer, self._count, self._mean, self._var

    def _evaluate(self, norms: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(warm-up?, spike?, the clip value, the capped threshold) for ``norms``."""
        _, count, mean, var = self._ensure(norms)
        norm = norms.to(mean.dtype)
        warming = count < self.warmup_steps
        std = var.sqrt()
        if self.mode == "percentile":
            clip_val = mean + self.z_thresh * std
            spike = norm > clip_val
        else:
            z = (norm - mean) / (std + self.eps)
            spike = z > self.z_thresh
            if self.clip_option == "adaptive_scaling":
                eta = z / self.z_thresh
                clip_val = (mean + (self.z_thresh * std) / eta) * self.clip_factor
            else:
                clip_val = mean
        spike = spike & ~warming
        cap = math.inf if self.max_grad_norm is None else self.max_grad_norm
        threshold = torch.clamp(torch.where(spike, clip_val, math.inf), max=cap)
        return warming, spike, clip_val, threshold

    def threshold(self, norms: Tensor) -> Tensor:
        return self._evaluate(norms)[3]

    def coefficient(self, norms: Tensor, threshold: Tensor) -> Tensor:
        warming = self._evaluate(norms)[0]
        norm = norms.to(threshold.dtype)
        torch_rule = torch.clamp(threshold / (norm + EPS), max=1.0)  # clip_grad_norm_
        strict = torch.where(norm > threshold, threshold / (norm + EPS), 1.0)
        return torch.where(warming, torch_rule, strict)

    def update(self, norms: Tensor) -> None:
        buffer, count, mean, var = self._ensure(norms)
        warming, spike, clip_val, _ = self._evaluate(norms)
        norm = norms.to(mean.dtype)
        finite = torch.isfinite(norm)
        # Warm-up: collect the norm; the last warm-up step starts the EMAs.
        slot = torch.clamp(count, max=self.warmup_steps - 1).reshape(1)
        collect = warming & finite
        buffer = buffer.scatter(0, slot, torch.where(collect, norm, buffer.gather(0, slot)))
        count_after = count + collect.to(torch.int64)
        starts = collect & (count_after == self.warmup_steps)
        first_mean = buffer.mean()
        first_var = ((buffer - first_mean) ** 2).mean()
        # After: the EMAs take the clip value on a spike, the norm otherwise.
        x = torch.where(spike, clip_val, norm)
        ema_mean = self.alpha * mean + (1 - self.alpha) * x
        ema_var = self.alpha * var + (1 - self.alpha) * (x - ema_mean) ** 2
        moves = ~warming & finite
        if self.skip_update_on_spike:
            moves = moves & ~spike
        self._mean = torch.where(starts, first_mean, torch.where(moves, ema_mean, mean))
        self._var = torch.where(starts, first_var, torch.where(moves, ema_var, var))
        self._buffer, self._count = buffer, count_after

    def rule_state(self) -> dict[str, Any]:
        if self._buffer is None or self._count is None or self._mean is None or (self._var is None):
            return {}
        return {
            "buffer": self._buffer.clone(),
            "count": self._count.clone(),
            "mean": self._mean.clone(),
            "var": self._var.clone(),
        }

    def load_rule_state(self, state: Mapping[str, Any]) -> None:
        if not saved("ZClip", state, ("buffer", "count", "mean", "var")):
            self._buffer = self._count = self._mean = self._var = None
            return
        buffer = checked("buffer", state["buffer"], (self.warmup_steps,), floating=True)
        count = checked("count", state["count"], (), floating=False)
        mean = checked("mean", state["mean"], (), floating=True)
        var = checked("var", state["var"], (), floating=True)
        self._buffer, self._count = buffer.clone(), count.clone()
        self._mean, self._var = mean.clone(), var.clone()
