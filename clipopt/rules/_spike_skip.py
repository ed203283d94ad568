"""SpikeSkip: skip a step whose pre-clip norm is a z-score outlier of the last norms."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from clipopt.rules._base import (
    OnDevice,
    checked,
    count_or_zero,
    integer,
    number,
    saved,
    state_dtype,
)

__all__ = ["SpikeSkip"]


class SpikeSkip(OnDevice):
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
        self.window = integer("window", window, 2)
        self.sigma = number("sigma", sigma, 0.0, math.inf, low_open=True)
        if min_history is None:
            min_history = min(max(20, self.window // 2), self.window)
        self.min_history = integer("min_history", min_history, 2)
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
            dtype = state_dtype(norm.device)
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
        return count_or_zero(self._spikes)

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
        buffer = count = None
        if saved("SpikeSkip", state, ("buffer", "count")):
            buffer = checked("buffer", state["buffer"], (self.window,), floating=True).clone()
            count = checked("count", state["count"], (), floating=False).clone()
        spikes = checked("spike_count", state_dict["spike_count"], (), floating=False)
        seen = state_dict["steps_seen"]
        if isinstance(seen, bool) or not isinstance(seen, int) or seen < 0:
            raise ValueError(f"SpikeSkip steps_seen must be an int >= 0, got {seen!r}")
        self._buffer, self._count, self._spikes = buffer, count, spikes.clone()
        self.steps_seen = seen
