"""AutoClip (Seetharaman et al., 2020): clip at a percentile of the past norms."""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping

import torch
from torch import Tensor

from clipopt.rules._base import ClipRule, Evaluation, State, checked, flag, integer, number

# torch.quantile's rank q * (n - 1) is in float64 from torch 2.14 on, the values' before.
_RANKS_IN_FLOAT64 = float(torch.quantile(torch.tensor([0.0, 0.0, 1.0, 1.0]), 0.4)) != float(
    torch.tensor(3.0) * 0.4 - 1.0
)


def _ranks(filled: Tensor, q: float, dtype: torch.dtype) -> Tensor:
    """``q * (n - 1)`` as this torch's ``torch.quantile`` computes it."""
    steps = (filled - 1).clamp(min=0)
    if not _RANKS_IN_FLOAT64 or dtype != torch.float32:
        return steps.to(dtype) * q
    return steps.to(torch.float64) * float(struct.unpack("f", struct.pack("f", q))[0])


def replace_sorted(ordered: Tensor, leaving: Tensor, entering: Tensor) -> Tensor:
    """Sorted rows with ``leaving[r]`` out and ``entering[r]`` (not NaN) in, by two shifted
    copies; a row needs a ``+inf`` once ``leaving`` is out."""
    columns = torch.arange(ordered.shape[1], device=ordered.device)
    spare, result = torch.empty_like(ordered), torch.empty_like(ordered)
    # Shifts over the flat rows (dynamo takes only contiguous `out=`); last slots reset.
    flat, scratch, into_flat = ordered.reshape(-1), spare.view(-1), result.view(-1)
    out = torch.searchsorted(ordered, leaving[:, None])
    torch.where((columns >= out).view(-1)[:-1], flat[1:], flat[:-1], out=scratch[:-1])
    spare[:, -1].fill_(math.inf)
    into = torch.searchsorted(spare, entering[:, None])
    torch.where((columns > into).view(-1)[1:], scratch[:-1], scratch[1:], out=into_flat[1:])
    into_flat[:1].copy_(scratch[:1])
    return result.scatter_(1, into, entering[:, None])


class AutoClip(ClipRule):
    """AutoClip (Seetharaman et al., 2020): clip at the ``percentile`` of the last ``history``
    finite norms, as ``autoclip.torch.QuantileClip`` does.

    Args:
      percentile: in [0, 100]. history: how many past norms count, >= 1.
      per_tensor: one history and threshold per grad.

    Example:
      >>> import torch, clipopt
      >>> w = torch.nn.Parameter(torch.zeros(2))
      >>> rule = clipopt.AutoClip(percentile=50.0)
      >>> opt = clipopt.ClippedOptimizer(torch.optim.SGD([w], lr=0.0), max_norm=rule)
      >>> for g in ([3.0, 4.0], [6.0, 8.0], [0.6, 0.8]):
      ...     w.grad = torch.tensor(g)
      ...     opt.step()
      >>> rule.last_threshold, opt.clipped_count, w.grad
      (tensor(7.5000), tensor(1), tensor([0.6000, 0.8000]))
    """

    settings = ("percentile", "history", "per_tensor")
    state_keys = ("buffer", "count")  # [rows, history] ring, [rows] finite norms seen

    def __init__(
        self, percentile: float = 10.0, history: int = 10_000, per_tensor: bool = False
    ) -> None:
        super().__init__()
        self.percentile = number("percentile", percentile, "[0, 100]")
        self.history = integer("history", history, 1)
        self.per_tensor = flag("per_tensor", per_tensor)

    def init_state(self, norms: Tensor) -> State:
        buffer = norms.new_zeros((norms.numel() if self.per_tensor else 1, self.history))
        count = torch.zeros(buffer.shape[0], dtype=torch.int64, device=norms.device)
        return {"buffer": buffer, "count": count, "sorted": torch.full_like(buffer, math.inf)}

    def check_state(self, state: Mapping[str, Tensor]) -> None:
        buffer, count = state["buffer"], state["count"]
        rows = buffer.shape[0] if self.per_tensor and buffer.dim() == 2 else 1
        checked("buffer", buffer, (rows, self.history), floating=True)
        checked("count", count, (rows,), floating=False)
        # A load reads these values on the host; a step never does.
        filled = torch.arange(self.history) < count.cpu().clamp(max=self.history)[:, None]
        bad = torch.logical_and(filled, torch.logical_not(torch.isfinite(buffer.cpu())))
        for row in (count < 0).nonzero()[:1, 0].tolist():
            raise ValueError(f"AutoClip count must be >= 0, got {int(count[row])} in row {row}")
        for row, slot in bad.nonzero()[:1].tolist():
            raise ValueError(
                f"AutoClip buffer holds {float(buffer[row, slot])} in filled slot {slot} of row "
                f"{row}; the rule keeps finite norms only"
            )

    def evaluate(
        self, norms: Tensor, state: State, *, norm_type: float, total_norm: Tensor | None
    ) -> Evaluation:
        buffer, count = state["buffer"], state["count"]
        rows = norms.reshape(-1).to(buffer.dtype)
        self._same_grads(buffer.shape[0], rows.shape[0])
        filled = torch.clamp(count, max=self.history)
        if "sorted" in state:
            ordered = state["sorted"]
        else:  # after a load: each row's filled values ascending, then +inf
            columns = torch.arange(self.history, device=buffer.device)
            ordered = torch.where(columns < filled[:, None], buffer, math.inf).sort(dim=1).values
        # torch.quantile's lerp; unfilled rows lerp 0s: inductor fails folding inf - inf.
        ranks = _ranks(filled, self.percentile / 100.0, buffer.dtype)
        below, above = ranks.to(torch.int64), ranks.ceil().to(torch.int64)
        some = filled > 0
        ends = torch.where(some[:, None], ordered.gather(1, torch.stack((below, above), 1)), 0)
        value = torch.lerp(ends[:, 0], ends[:, 1], (ranks - below.to(ranks.dtype)).to(buffer.dtype))
        thresholds = torch.where(some, value, math.inf).reshape(norms.shape)
        # A finite norm enters; a full row's oldest leaves (else a +inf leaves and returns).
        finite = torch.isfinite(rows)
        position = (count % self.history)[:, None]
        old = buffer.gather(1, position)[:, 0]
        leaving = torch.where(count >= self.history, old, math.inf)
        after = {
            "buffer": buffer.scatter(1, position, torch.where(finite, rows, old)[:, None]),
            "count": count + finite.to(torch.int64),
            "sorted": replace_sorted(ordered, leaving, torch.where(finite, rows, leaving)),
        }
        return Evaluation(thresholds, after)
