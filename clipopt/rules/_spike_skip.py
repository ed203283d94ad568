"""SpikeSkip: skip a step whose pre-clip norm is a z-score outlier of the last norms."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from clipopt._kernels._norms import combine_dtype
from clipopt.rules._base import State, Stateful, checked, integer, number


class SpikeSkip(Stateful):
    """Skip a step whose pre-clip norm has ``|norm - mean| / std > sigma`` over the last
    ``window`` finite norms (``skip_spikes=``; OLMo-core's rule, docs/adaptive.md).

    Args:
      window: how many previous norms count, >= 2. sigma: > 0.
      min_history: norms seen before anything is skipped, in [2, window]; None:
        ``min(max(20, window // 2), window)``.

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

    settings = ("window", "sigma", "min_history")
    state_keys = ("buffer", "count")  # the last `window` finite norms, as a ring; their count
    extra_keys = ("spike_count", "steps_seen")

    def __init__(self, window: int = 128, sigma: float = 6.0, min_history: int | None = None):
        super().__init__()
        self.window = integer("window", window, 2)
        self.sigma = number("sigma", sigma, "(0, inf)")
        if min_history is None:
            min_history = min(max(20, self.window // 2), self.window)
        self.min_history = integer("min_history", min_history, 2)
        if self.min_history > self.window:
            raise ValueError(f"min_history must be <= window ({self.window}), got {min_history!r}")
        self.spike_count = torch.zeros((), dtype=torch.int64)
        """Steps skipped as spikes, a 0-dim int64 tensor."""
        self.steps_seen = 0  # on the host: an upper bound of the finite norms seen

    def init_state(self, norms: Tensor) -> State:
        buffer = torch.zeros(self.window, dtype=combine_dtype(norms.device), device=norms.device)
        return {"buffer": buffer, "count": torch.zeros((), dtype=torch.int64, device=norms.device)}

    def check_state(self, state: Mapping[str, Tensor]) -> None:
        checked("buffer", state["buffer"], (self.window,), floating=True)
        checked("count", state["count"], (), floating=False)

    def prepare(self, norms: Tensor) -> None:
        super().prepare(norms)
        self.spike_count = self.spike_count.to(norms.device)

    def may_trigger(self) -> bool:
        """Whether a spike is possible yet (known on the host, no read)."""
        return self.steps_seen >= self.min_history

    def verdict(self, norm: Tensor) -> Tensor:
        """A 0-dim bool tensor: is ``norm`` a spike? Changes nothing."""
        state = self.current(norm)
        buffer, filled = state["buffer"], torch.clamp(state["count"], max=self.window)
        mask = torch.arange(self.window, device=buffer.device) < filled
        n = filled.to(buffer.dtype)
        mean = torch.where(mask, buffer, 0.0).sum() / n
        var = torch.where(mask, (buffer - mean) ** 2, 0.0).sum() / (n - 1)
        z = (norm.to(buffer.dtype) - mean).abs() / var.sqrt()
        big = torch.logical_and(filled >= self.min_history, z > self.sigma)
        return torch.logical_and(big, torch.isfinite(norm))

    def commit(self, norm: Tensor, spike: Tensor | None) -> None:
        """After the step: ``norm`` enters the history if finite; a spike is counted."""
        state = self.current(norm)
        buffer, count = state["buffer"], state["count"]
        value = norm.to(buffer.dtype)
        finite = torch.isfinite(value)
        slot = (count % self.window).reshape(1)
        buffer = buffer.scatter(0, slot, torch.where(finite, value, buffer.gather(0, slot)))
        self.state = {"buffer": buffer, "count": count + finite.to(torch.int64)}
        self._stepped = True
        spikes = self.spike_count.to(norm.device)
        self.spike_count = spikes if spike is None else spikes + spike.to(torch.int64)
        self.steps_seen += 1
