"""ZClip (Kumar et al., 2025): clip norms that are outliers of an EMA of past norms."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from clipopt._kernels._norms import combine_dtype
from clipopt._kernels._scale import coefficient
from clipopt.rules._base import ClipRule, Evaluation, State, checked, flag, integer, number

ZClipMode = Literal["zscore", "percentile"]
ZClipOption = Literal["adaptive_scaling", "mean"]


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.lower() not in choices:
        raise ValueError(f"{name} must be {' or '.join(map(repr, choices))}, got {value!r}")
    return value.lower()


class ZClip(ClipRule):
    """ZClip (Kumar et al., 2025): clip norms that are z-score outliers of an EMA of past
    norms, as the ``zclip`` 1.0.0 package's ``ZClip`` does, with its arguments.

    Args:
      alpha: the EMA factor, in (0, 1). z_thresh: > 0. eps: added to the std, >= 0.
      max_grad_norm: a cap > 0 on every threshold, warm-up included, or None.
      warmup_steps: >= 1. mode: ``"zscore"`` or ``"percentile"``.
      clip_option: ``"adaptive_scaling"`` or ``"mean"``. clip_factor: > 0.
      skip_update_on_spike: leave the EMAs unchanged on a spike.

    Example:
      >>> import torch, clipopt
      >>> w = torch.nn.Parameter(torch.zeros(1))
      >>> rule = clipopt.ZClip(warmup_steps=3, max_grad_norm=None)
      >>> opt = clipopt.ClippedOptimizer(torch.optim.SGD([w], lr=0.0), max_norm=rule)
      >>> for g in (1.0, 1.1, 0.9, 1.0, 50.0):
      ...     w.grad = torch.tensor([g])
      ...     opt.step()
      >>> opt.clipped_count, w.grad
      (tensor(1), tensor([1.0008]))
    """

    settings: tuple[str, ...] = ("alpha", "z_thresh", "max_grad_norm", "eps", "warmup_steps")
    settings += ("mode", "clip_option", "clip_factor", "skip_update_on_spike")
    state_keys = ("buffer", "count", "mean", "var")  # warm-up norms and count, the EMAs

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
        self.alpha = number("alpha", alpha, "(0, 1)")
        self.z_thresh = number("z_thresh", z_thresh, "(0, inf]")
        cap = max_grad_norm
        self.max_grad_norm = None if cap is None else number("max_grad_norm", cap, "(0, inf]")
        self.eps = number("eps", eps, "[0, inf]")
        self.warmup_steps = integer("warmup_steps", warmup_steps, 1)
        self.mode = _choice("mode", mode, ("zscore", "percentile"))
        self.clip_option = _choice("clip_option", clip_option, ("adaptive_scaling", "mean"))
        self.clip_factor = number("clip_factor", clip_factor, "(0, inf]")
        self.skip_update_on_spike = flag("skip_update_on_spike", skip_update_on_spike)

    def init_state(self, norms: Tensor) -> State:
        if norms.dim() != 0:
            raise ValueError("ZClip is a global rule: it takes the 0-dim global norm")
        zero = torch.zeros((), dtype=combine_dtype(norms.device), device=norms.device)
        buffer, count = zero.new_zeros(self.warmup_steps), zero.to(torch.int64)
        return {"buffer": buffer, "count": count, "mean": zero, "var": zero}

    def check_state(self, state: Mapping[str, Tensor]) -> None:
        for key, shape in zip(self.state_keys, ((self.warmup_steps,), (), (), ()), strict=True):
            checked(key, state[key], shape, floating=key != "count")

    def evaluate(
        self, norms: Tensor, state: State, *, norm_type: float, total_norm: Tensor | None
    ) -> Evaluation:
        buffer, count, mean, var = (state[k] for k in self.state_keys)
        norm = norms.to(mean.dtype)
        warming, std = count < self.warmup_steps, var.sqrt()
        if self.mode == "percentile":
            clip_val = mean + self.z_thresh * std
            spike = norm > clip_val
        else:
            z = (norm - mean) / (std + self.eps)
            spike = z > self.z_thresh
            clip_val = mean
            if self.clip_option == "adaptive_scaling":
                clip_val = (mean + (self.z_thresh * std) / (z / self.z_thresh)) * self.clip_factor
        spike = torch.logical_and(spike, torch.logical_not(warming))
        cap = math.inf if self.max_grad_norm is None else self.max_grad_norm
        threshold = torch.clamp(torch.where(spike, clip_val, math.inf), max=cap)
        # Warm-up clips as clip_grad_norm_ does; after it, only a norm above the threshold.
        scaled = torch.logical_or(warming, norm > threshold)
        coefficients = torch.where(scaled, coefficient(threshold, norm), 1.0)
        # Warm-up collects the finite norm; its last step starts the EMAs.
        finite = torch.isfinite(norm)
        slot = torch.clamp(count, max=self.warmup_steps - 1).reshape(1)
        collect = torch.logical_and(warming, finite)
        buffer = buffer.scatter(0, slot, torch.where(collect, norm, buffer.gather(0, slot)))
        counted = count + collect.to(torch.int64)
        starts = torch.logical_and(collect, counted == self.warmup_steps)
        first_mean = buffer.mean()
        first_var = ((buffer - first_mean) ** 2).mean()
        # After: the EMAs take the clip value on a spike, the norm otherwise.
        x = torch.where(spike, clip_val, norm)
        ema_mean = self.alpha * mean + (1 - self.alpha) * x
        ema_var = self.alpha * var + (1 - self.alpha) * (x - ema_mean) ** 2
        moves = torch.logical_and(torch.logical_not(warming), finite)
        if self.skip_update_on_spike:
            moves = torch.logical_and(moves, torch.logical_not(spike))
        after = {
            "buffer": buffer,
            "count": counted,
            "mean": torch.where(starts, first_mean, torch.where(moves, ema_mean, mean)),
            "var": torch.where(starts, first_var, torch.where(moves, ema_var, var)),
        }
        return Evaluation(threshold, after, coefficients)
