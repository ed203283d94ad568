"""Adaptive clip rules: objects passed as ``max_norm`` that choose the threshold each step.

A rule turns the step's pre-clip norms into clip coefficients and thresholds, from state
it keeps in tensors on the grads' device, and updates that state from the norms after
the step; nothing in either reads a tensor on the host. :class:`ClipRule` is the
protocol (a base class); :class:`AutoClip` and :class:`ZClip` are rules, and
:class:`SpikeSkip` is not a rule but the ``skip_spikes=`` setting of
:class:`~clipopt.ClippedOptimizer`, which skips whole steps. See ``docs/adaptive.md``.

The wrapper calls, once per ``step()``:

1. ``coefficients, thresholds = rule.decide(norms)``: ``norms`` is the global norm (a
   0-dim tensor), or with ``per_tensor = True`` a 1-D tensor with one norm per grad (in
   the order of the param groups and their params, params without a grad left out).
   The two results have the shape of ``norms``. Nothing changes.
2. the step is applied (or skipped);
3. ``rule.commit(norms, coefficients, thresholds)``: the rule's :meth:`ClipRule.update`
   and the monitoring counters (:attr:`ClipRule.last_threshold`,
   :attr:`ClipRule.clipped_count`).

Non-finite norms never enter a rule's history (the reference packages would keep a NaN
in theirs for good); what such a step does is the wrapper's ``nonfinite`` policy.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from clipopt._kernels import EPS

__all__ = ["AutoClip", "ClipRule", "SpikeSkip", "ZClip"]


def _state_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it (scalars: the cost is nothing), else float32."""
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def _number(
    name: str,
    value: Any,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a float in the interval; ValueError/TypeError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    v = float(value)
    below = v <= low if low_open else v < low
    above = v >= high if high_open else v > high
    if math.isnan(v) or below or above:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be in {left}{low}, {high}{right}, got {value!r}")
    return v


def _integer(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if int(value) < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    return int(value)


def _checked(name: str, value: Any, shape: tuple[int, ...] | None, floating: bool) -> Tensor:
    """A saved tensor of the right kind (and shape, where given), else a ValueError."""
    ok = isinstance(value, Tensor) and (
        value.is_floating_point() if floating else value.dtype == torch.int64
    )
    if not ok or (shape is not None and tuple(value.shape) != shape):
        kind = "floating-point" if floating else "int64"
        raise ValueError(
            f"rule state {name!r} must be a {kind} tensor of shape {shape}, got {value!r}"
        )
    tensor: Tensor = value
    return tensor


def _count(counter: Tensor | None) -> Tensor:
    """A counter made on the grads' device at its first step; a zero before it."""
    return torch.zeros((), dtype=torch.int64) if counter is None else counter


class _OnDevice:
    """What a rule and SpikeSkip share: tensor state moved after a load, and a repr of
    the config."""

    def config(self) -> dict[str, Any]:
        raise NotImplementedError

    def to(self, device: torch.device) -> None:
        """Move the state (and counters) to ``device``, after a load."""
        for name, value in list(vars(self).items()):
            if isinstance(value, Tensor):
                setattr(self, name, value.to(device))

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({settings})"


class ClipRule(_OnDevice):
    """The protocol of an adaptive clip rule; subclass it and pass an instance as
    ``max_norm``.

    A subclass implements :meth:`config`, :meth:`threshold`, :meth:`update`,
    :meth:`rule_state` and :meth:`load_rule_state`; it may override :meth:`coefficient`
    (the default is torch's ``min(1, threshold / (norm + 1e-6))``) and sets
    ``per_tensor = True`` to get one norm per grad instead of the global norm.

    - Settings are validated in ``__init__``: a bad one raises ``ValueError`` (or
      ``TypeError``) naming the argument and the value.
    - State is made lazily, on the device and from the dtype of the first norms seen,
      and changes only in :meth:`update`, which must not read a tensor on the host.
    - :meth:`state_dict` / :meth:`load_state_dict` hold the config, the state and the
      monitoring counters as tensors and plain values; ``ClippedOptimizer`` saves them in
      ``state_dict()["clip"]["rule"]`` and refuses a checkpoint of another rule or other
      settings.

    One rule object belongs to one optimizer: its state is that optimizer's history.
    """

    per_tensor: bool = False

    def __init__(self) -> None:
        self._last_threshold: Tensor | None = None
        self._clipped_count: Tensor | None = None

    # ------------------------------------------------------------ what a rule implements

    def config(self) -> dict[str, Any]:
        """The settings, plain Python values; a checkpoint loads only into equal ones."""
        raise NotImplementedError

    def threshold(self, norms: Tensor) -> Tensor:
        """This step's threshold(s), shaped as ``norms``, from the state before it."""
        raise NotImplementedError

    def update(self, norms: Tensor) -> None:
        """Fold this step's pre-clip ``norms`` into the state, on their device."""
        raise NotImplementedError

    def rule_state(self) -> dict[str, Any]:
        """The state: tensors (copies) and plain values; empty before the first step."""
        raise NotImplementedError

    def load_rule_state(self, state: Mapping[str, Any]) -> None:
        """Install ``state`` from :meth:`rule_state`; validate all of it before changing
        anything, raising ``ValueError``."""
        raise NotImplementedError

    def coefficient(self, norms: Tensor, threshold: Tensor) -> Tensor:
        """The factor each grad (or all of them) is multiplied by; at most 1."""
        return torch.clamp(threshold / (norms + EPS), max=1.0)

    # ------------------------------------------------------------ what the wrapper calls

    def decide(self, norms: Tensor) -> tuple[Tensor, Tensor]:
        """This step's coefficients and thresholds, in ``norms``' dtype; changes nothing."""
        threshold = self.threshold(norms)
        return self.coefficient(norms, threshold).to(norms.dtype), threshold.to(norms.dtype)

    def commit(self, norms: Tensor, coefficients: Tensor, thresholds: Tensor) -> None:
        """After the step: update the state, the last threshold and the clipped count."""
        self.update(norms)
        self._last_threshold = thresholds
        clipped = (coefficients < 1).any().to(torch.int64)
        if self._clipped_count is None or self._clipped_count.device != norms.device:
            self._clipped_count = torch.zeros((), dtype=torch.int64, device=norms.device)
        self._clipped_count = self._clipped_count + clipped

    # ------------------------------------------------------------ monitoring

    @property
    def last_threshold(self) -> Tensor | None:
        """The threshold of the last step (per-tensor rules: one per grad), None before."""
        return self._last_threshold

    @property
    def clipped_count(self) -> Tensor:
        """Steps in which the rule scaled some grad, a 0-dim int64 tensor."""
        return _count(self._clipped_count)

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """``{"type", "config", "state", "last_threshold", "clipped_count"}``: tensors and
        plain values, so ``torch.load(weights_only=True)`` reads it."""
        last = None if self._last_threshold is None else self._last_threshold.detach().clone()
        return {
            "type": type(self).__name__,
            "config": self.config(),
            "state": self.rule_state(),
            "last_threshold": last,
            "clipped_count": self.clipped_count.clone(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict`'s output; everything is checked before anything changes.

        Raises:
          ValueError: another rule's checkpoint, other settings, or a malformed state.
        """
        if not isinstance(state_dict, Mapping) or set(state_dict) != {
            "type",
            "config",
            "state",
            "last_threshold",
            "clipped_count",
        }:
            raise ValueError(
                f"a {type(self).__name__} state dict must be a dict from "
                f"state_dict(), got {state_dict!r}"
            )
        if state_dict["type"] != type(self).__name__ or state_dict["config"] != self.config():
            raise ValueError(
                f"the checkpoint was saved with {state_dict['type']}({state_dict['config']}), "
                f"this optimizer uses {type(self).__name__}({self.config()}); "
                "construct it with the rule it was saved with"
            )
        last = state_dict["last_threshold"]
        if last is not None:
            _checked("last_threshold", last, None, floating=True)
        count = _checked("clipped_count", state_dict["clipped_count"], (), floating=False)
        trial = copy.deepcopy(self)
        trial.load_rule_state(state_dict["state"])  # raises before self changes
        self.load_rule_state(state_dict["state"])
        self._last_threshold = None if last is None else last.clone()
        self._clipped_count = count.clone()


class AutoClip(ClipRule):
    """AutoClip (Seetharaman et al., 2020): clip at a percentile of the norms seen so far.

    Each step's threshold is the ``percentile`` (linear interpolation, as
    ``torch.quantile``) of the pre-clip norms of the previous steps, at most the last
    ``history`` of them, kept in a ring buffer on the grads' device; the step's own norm
    enters the history after the threshold is taken, so the first step does not clip.
    This is ``autoclip.torch.QuantileClip(quantile=percentile / 100,
    history_length=history, global_threshold=not per_tensor)``, step for step.

    Args:
      percentile: in [0, 100].
      history: how many past norms count, >= 1.
      per_tensor: one history and threshold per grad, each clipped by its own norm
        (QuantileClip's default mode); every step must then have the same grads.

    Example:
      >>> import torch, clipopt
      >>> w = torch.nn.Parameter(torch.zeros(2))
      >>> rule = clipopt.AutoClip(percentile=50.0)
      >>> opt = clipopt.ClippedOptimizer(torch.optim.SGD([w], lr=0.0), max_norm=rule)
      >>> for g in ([3.0, 4.0], [6.0, 8.0], [0.6, 0.8]):
      ...     w.grad = torch.tensor(g)
      ...     opt.step()
      >>> rule.last_threshold, rule.clipped_count, w.grad
      (tensor(7.5000), tensor(1), tensor([0.6000, 0.8000]))
    """

    def __init__(
        self, percentile: float = 10.0, history: int = 10_000, per_tensor: bool = False
    ) -> None:
        super().__init__()
        self.percentile = _number("percentile", percentile, 0.0, 100.0)
        self.history = _integer("history", history, 1)
        if not isinstance(per_tensor, bool):
            raise TypeError(f"per_tensor must be a bool, got {per_tensor!r}")
        self.per_tensor = per_tensor
        self._buffer: Tensor | None = None  # [rows, history]: the norms seen, as a ring
        self._count: Tensor | None = None  # [rows] int64: finite norms seen per row

    def config(self) -> dict[str, Any]:
        return {
            "percentile": self.percentile,
            "history": self.history,
            "per_tensor": self.per_tensor,
        }

    def _rows(self, norms: Tensor) -> Tensor:
        return norms.reshape(-1, 1) if self.per_tensor else norms.reshape(1, 1)

    def _ensure(self, norms: Tensor) -> tuple[Tensor, Tensor]:
        rows = self._rows(norms).shape[0]
        if self._buffer is None or self._count is None:
            buffer = norms.new_zeros((rows, self.history))
            count = torch.zeros(rows, dtype=torch.int64, device=norms.device)
            return buffer, count
        if self._buffer.shape[0] != rows:
            raise ValueError(
                f"AutoClip(per_tensor=True) has a history for {self._buffer.shape[0]} grads "
                f"but this step has {rows}: a per-tensor rule needs the same grads every step"
            )
        return self._buffer, self._count

    def threshold(self, norms: Tensor) -> Tensor:
        buffer, count = self._ensure(norms)
        filled = torch.clamp(count, max=self.history)  # [rows]
        columns = torch.arange(self.history, device=buffer.device)
        padded = torch.where(columns < filled[:, None], buffer, math.inf)
        ordered = padded.sort(dim=1).values
        # torch.quantile's interpolation: rank = q * (n - 1) in the values' dtype, the
        # value below at the truncated rank, above at its ceiling, lerp by the fraction.
        # q is a Python scalar: a tensor made from it on CUDA would be a blocking copy.
        ranks = (filled - 1).clamp(min=0).to(buffer.dtype) * (self.percentile / 100.0)
        below, above = ranks.to(torch.int64), ranks.ceil().to(torch.int64)
        low = ordered.gather(1, below[:, None])[:, 0]
        high = ordered.gather(1, above[:, None])[:, 0]
        value = torch.lerp(low, high, ranks - below.to(buffer.dtype))
        value = torch.where(filled > 0, value, math.inf)
        return value.reshape(norms.shape)

    def update(self, norms: Tensor) -> None:
        buffer, count = self._ensure(norms)
        rows = self._rows(norms).to(buffer.dtype)
        finite = torch.isfinite(rows[:, 0])
        position = (count % self.history)[:, None]
        old = buffer.gather(1, position)
        self._buffer = buffer.scatter(1, position, torch.where(finite[:, None], rows, old))
        self._count = count + finite.to(torch.int64)

    def rule_state(self) -> dict[str, Any]:
        if self._buffer is None or self._count is None:
            return {}
        return {"buffer": self._buffer.clone(), "count": self._count.clone()}

    def load_rule_state(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or set(state) not in (set(), {"buffer", "count"}):
            raise ValueError(f"AutoClip state must have the keys buffer and count, got {state!r}")
        if not state:
            self._buffer = self._count = None
            return
        buffer = _checked("buffer", state["buffer"], None, floating=True)
        if buffer.dim() != 2 or buffer.shape[1] != self.history:
            raise ValueError(
                f"AutoClip buffer must be [rows, {self.history}], got {tuple(buffer.shape)}"
            )
        if not self.per_tensor and buffer.shape[0] != 1:
            raise ValueError(f"a global AutoClip buffer has one row, got {buffer.shape[0]}")
        count = _checked("count", state["count"], (buffer.shape[0],), floating=False)
        self._buffer, self._count = buffer.clone(), count.clone()


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
        self.alpha = _number("alpha", alpha, 0.0, 1.0, low_open=True, high_open=True)
        self.z_thresh = _number("z_thresh", z_thresh, 0.0, math.inf, low_open=True)
        self.max_grad_norm = (
            None
            if max_grad_norm is None
            else _number("max_grad_norm", max_grad_norm, 0.0, math.inf, low_open=True)
        )
        self.eps = _number("eps", eps, 0.0, math.inf)
        self.warmup_steps = _integer("warmup_steps", warmup_steps, 1)
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
        self.clip_factor = _number("clip_factor", clip_factor, 0.0, math.inf, low_open=True)
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
            dtype = _state_dtype(norms.device)
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
        keys = {"buffer", "count", "mean", "var"}
        if not isinstance(state, Mapping) or set(state) not in (set(), keys):
            raise ValueError(f"ZClip state must have the keys {sorted(keys)}, got {state!r}")
        if not state:
            self._buffer = self._count = self._mean = self._var = None
            return
        buffer = _checked("buffer", state["buffer"], (self.warmup_steps,), floating=True)
        count = _checked("count", state["count"], (), floating=False)
        mean = _checked("mean", state["mean"], (), floating=True)
        var = _checked("var", state["var"], (), floating=True)
        self._buffer, self._count = buffer.clone(), count.clone()
        self._mean, self._var = mean.clone(), var.clone()


class SpikeSkip(_OnDevice):
    """Skip a step whose pre-clip norm is a spike: ``skip_spikes=`` of ClippedOptimizer.

    A step is skipped (parameters, optimizer state and grads untouched; ``skip_count``
    grows) when ``|norm - mean| / std > sigma`` over the previous up to ``window`` finite
    norms (``std`` unbiased, as ``torch.std_mean``), once at least ``min_history`` of
    them have been seen; every finite norm, a spike's too, then enters the history.
    The rule of OLMo-core's ``SkipStepOptimizer`` for the grad norm.

    Args:
      window: how many previous norms count, >= 2.
      sigma: > 0.
      min_history: norms needed before anything is skipped, in [2, window]; None is
        ``max(20, window // 2)`` (capped at ``window``).

    Example:
      >>> import torch, clipopt
      >>> w = torch.nn.Parameter(torch.zeros(1))
      >>> spikes = clipopt.SpikeSkip(window=8, sigma=3.0, min_history=4)
      >>> opt = clipopt.ClippedOptimizer(
      ...     torch.optim.SGD([w], lr=1.0), max_norm=10.0, skip_spikes=spikes)
      >>> for g in (1.0, 1.1, 0.9, 1.0, 1.05, 9.0):
      ...     w.grad = torch.tensor([g])
      ...     opt.step()
      >>> opt.skip_count, spikes.spike_count, w.data
      (tensor(1), tensor(1), tensor([-5.0500]))
    """

    def __init__(self, window: int = 128, sigma: float = 6.0, min_history: int | None = None):
        self.window = _integer("window", window, 2)
        self.sigma = _number("sigma", sigma, 0.0, math.inf, low_open=True)
        if min_history is None:
            min_history = min(max(20, self.window // 2), self.window)
        self.min_history = _integer("min_history", min_history, 2)
        if self.min_history > self.window:
            raise ValueError(f"min_history must be <= window ({self.window}), got {min_history!r}")
        self._buffer: Tensor | None = None
        self._count: Tensor | None = None
        self._spikes: Tensor | None = None
        self.steps_seen = 0  # on the host: an upper bound of the finite norms seen

    def config(self) -> dict[str, Any]:
        return {"window": self.window, "sigma": self.sigma, "min_history": self.min_history}

    def may_trigger(self) -> bool:
        """Whether a spike is possible yet (known on the host, no read)."""
        return self.steps_seen >= self.min_history

    def _ensure(self, norm: Tensor) -> tuple[Tensor, Tensor]:
        if self._buffer is None or self._count is None:
            dtype = _state_dtype(norm.device)
            buffer = torch.zeros(self.window, dtype=dtype, device=norm.device)
            return buffer, torch.zeros((), dtype=torch.int64, device=norm.device)
        return self._buffer, self._count

    def verdict(self, norm: Tensor) -> Tensor:
        """A 0-dim bool tensor: is ``norm`` a spike? Changes nothing."""
        buffer, count = self._ensure(norm)
        filled = torch.clamp(count, max=self.window)
        mask = torch.arange(self.window, device=buffer.device) < filled
        n = filled.to(buffer.dtype)
        mean = torch.where(mask, buffer, 0.0).sum() / n
        var = torch.where(mask, (buffer - mean) ** 2, 0.0).sum() / (n - 1)
        z = (norm.to(buffer.dtype) - mean).abs() / var.sqrt()
        return (filled >= self.min_history) & (z > self.sigma) & torch.isfinite(norm)

    def commit(self, norm: Tensor, spike: Tensor | None) -> None:
        """After the step: ``norm`` enters the history if finite; a spike is counted."""
        buffer, count = self._ensure(norm)
        value = norm.to(buffer.dtype)
        finite = torch.isfinite(value)
        slot = (count % self.window).reshape(1)
        self._buffer = buffer.scatter(0, slot, torch.where(finite, value, buffer.gather(0, slot)))
        self._count = count + finite.to(torch.int64)
        spikes = self.spike_count.to(norm.device)
        self._spikes = spikes if spike is None else spikes + spike.to(torch.int64)
        self.steps_seen += 1

    @property
    def spike_count(self) -> Tensor:
        """Steps skipped as spikes, a 0-dim int64 tensor."""
        return _count(self._spikes)

    def state_dict(self) -> dict[str, Any]:
        """Config, history and counters: tensors and plain values."""
        state: dict[str, Any] = {}
        if self._buffer is not None and self._count is not None:
            state = {"buffer": self._buffer.clone(), "count": self._count.clone()}
        return {
            "type": "SpikeSkip",
            "config": self.config(),
            "state": state,
            "spike_count": self.spike_count.clone(),
            "steps_seen": self.steps_seen,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict`'s output; checked completely before anything changes."""
        keys = {"type", "config", "state", "spike_count", "steps_seen"}
        if not isinstance(state_dict, Mapping) or set(state_dict) != keys:
            raise ValueError(f"a SpikeSkip state dict must have the keys {sorted(keys)}")
        if state_dict["type"] != "SpikeSkip" or state_dict["config"] != self.config():
            raise ValueError(
                f"the checkpoint was saved with skip_spikes={state_dict['type']}"
                f"({state_dict['config']}), this optimizer has {self!r}"
            )
        state = state_dict["state"]
        if not isinstance(state, Mapping) or set(state) not in (set(), {"buffer", "count"}):
            raise ValueError(f"SpikeSkip state must have the keys buffer and count, got {state!r}")
        buffer = count = None
        if state:
            buffer = _checked("buffer", state["buffer"], (self.window,), floating=True).clone()
            count = _checked("count", state["count"], (), floating=False).clone()
        spikes = _checked("spike_count", state_dict["spike_count"], (), floating=False)
        seen = state_dict["steps_seen"]
        if isinstance(seen, bool) or not isinstance(seen, int) or seen < 0:
            raise ValueError(f"SpikeSkip steps_seen must be an int >= 0, got {seen!r}")
        self._buffer, self._count, self._spikes = buffer, count, spikes.clone()
        self.steps_seen = seen
