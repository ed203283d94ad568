"""AutoClip (Seetharaman et al., 2020): clip at a percentile of the past norms."""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from clipopt.rules._base import ClipRule, checked, integer, number, saved


def _ranks_by_quantile_of_this_torch(filled: Tensor, q: float, dtype: torch.dtype) -> Tensor:
    """``q * (n - 1)`` as this torch's ``torch.quantile`` computes it: up to 2.13 in the
    values' dtype; from 2.14 in float64, of ``q`` rounded to that dtype."""
    steps = (filled - 1).clamp(min=0)
    if not _RANKS_IN_FLOAT64 or dtype != torch.float32:  # float64 norms: the same either way
        return steps.to(dtype) * q
    q_in_float32: float = struct.unpack("f", struct.pack("f", q))[0]  # no tensor, no read
    return steps.to(torch.float64) * q_in_float32


def _quantile_ranks_in_float64() -> bool:
    """Which rank arithmetic this torch's quantile uses, read once from torch itself on
    values where the two differ in float32: 40% of [0, 0, 1, 1] is 0.2 + 2e-8 in float64
    ranks and 0.2 + 5e-8 in float32 ones."""
    values = torch.tensor([0.0, 0.0, 1.0, 1.0])
    found = float(torch.quantile(values, 0.4))
    in_float32 = float(torch.tensor(3.0) * 0.4 - 1.0)
    return found != in_float32


_RANKS_IN_FLOAT64 = _quantile_ranks_in_float64()
_ranks = _ranks_by_quantile_of_this_torch

__all__ = ["AutoClip", "replace_sorted_", "sorted_history"]


def sorted_history(buffer: Tensor, count: Tensor) -> Tensor:
    """Each row's filled values of a ring buffer in ascending order, then ``+inf`` for
    the unfilled slots: one sort.

    Args:
      buffer: ``[rows, history]``, the ring; slot ``s`` of a row is filled once its
        ``count`` passes ``s``.
      count: ``[rows]`` int64, the values written to each row so far.

    Returns:
      ``[rows, history]``, what :func:`replace_sorted_` keeps up to date.

    Example:
      >>> sorted_history(torch.tensor([[3.0, 1.0, 2.0]]), torch.tensor([2]))
      tensor([[1., 3., inf]])
    """
    columns = torch.arange(buffer.shape[1], device=buffer.device)
    filled = torch.clamp(count, max=buffer.shape[1])
    return torch.where(columns < filled[:, None], buffer, math.inf).sort(dim=1).values


def replace_sorted_(ordered: Tensor, spare: Tensor, leaving: Tensor, entering: Tensor) -> None:
    """Take ``leaving`` out of each ascending row of ``ordered`` and put ``entering`` in,
    in place, keeping the rows ascending; no host read, no loop over rows.

    AutoClip's history changes by one value a step: this replaces the sort of the whole
    history (``O(history log history)`` a row) by two shifted copies (``O(history)``).
    Values are moved, never computed, so the rows hold exactly what a sort of the new
    values would. ``leaving[r]`` must be in row ``r`` (``+inf`` takes out an unfilled
    slot); ``entering[r]`` equal to it leaves the row as it was.

    Args:
      ordered: ``[rows, history]``, contiguous, each row ascending, at least one
        ``+inf`` a row after ``leaving`` is taken out.
      spare: contiguous scratch of ``ordered``'s shape, dtype and device (overwritten).
      leaving: ``[rows]``, a value of each row.
      entering: ``[rows]``, not NaN.

    Example:
      >>> ordered = torch.tensor([[1.0, 2.0, 3.0], [5.0, math.inf, math.inf]])
      >>> replace_sorted_(ordered, torch.empty(2, 3), torch.tensor([1.0, math.inf]),
      ...                 torch.tensor([2.5, 4.0]))
      >>> ordered
      tensor([[2.0000, 2.5000, 3.0000],
              [4.0000, 5.0000,    inf]])
    """
    columns = torch.arange(ordered.shape[1], device=ordered.device)
    # The shifts run over the flat rows, so that every `out=` is contiguous (dynamo
    # takes no other); a row's last slot reads the next row's first, then is reset.
    flat, scratch = ordered.view(-1), spare.view(-1)
    # Out: from the first slot holding `leaving` on, each slot takes its right neighbour.
    out = torch.searchsorted(ordered, leaving[:, None])
    shift = (columns >= out).view(-1)[:-1]
    torch.where(shift, flat[1:], flat[:-1], out=scratch[:-1])
    spare[:, -1].fill_(math.inf)
    # In: after the slot `entering` goes to, each slot takes its left neighbour.
    into = torch.searchsorted(spare, entering[:, None])
    shift = (columns > into).view(-1)[1:]
    torch.where(shift, scratch[:-1], scratch[1:], out=flat[1:])
    flat[:1].copy_(scratch[:1])
    ordered.scatter_(1, into, entering[:, None])


def _check_history(buffer: Tensor, count: Tensor) -> None:
    """Refuse a saved ring the rule could not have written: a negative count, or a
    non-finite norm in a filled slot (the sorted copy, rebuilt from the ring, would not
    match it). A load reads these values on the host; a step never does."""
    negative = (count < 0).nonzero()
    if negative.numel():
        row = int(negative[0, 0])
        raise ValueError(f"AutoClip count must be >= 0, got {int(count[row])} in row {row}")
    slots = torch.arange(buffer.shape[1], device=buffer.device)
    filled = slots < count.clamp(max=buffer.shape[1])[:, None]
    bad = (filled & ~torch.isfinite(buffer)).nonzero()
    if bad.numel():
        row, slot = int(bad[0, 0]), int(bad[0, 1])
        raise ValueError(
            f"AutoClip buffer holds {float(buffer[row, slot])} in filled slot {slot} of row "
            f"{row}; the rule keeps finite norms only"
        )


class AutoClip(ClipRule):
    """AutoClip (Seetharaman et al., 2020): clip at a percentile of the norms seen so far.

    Each step's threshold is the ``percentile`` (linear interpolation, as
    ``torch.quantile``) of the pre-clip norms of the previous steps, at most the last
    ``history`` of them, kept in a ring buffer on the grads' device; the step's own norm
    enters the history after the threshold is taken, so the first step does not clip.
    This is ``autoclip.torch.QuantileClip(quantile=percentile / 100,
    history_length=history, global_threshold=not per_tensor)``, step for step. A sorted
    copy of the history, updated by one removal and one insertion a step, gives the
    percentile without a sort.

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
        self.percentile = number("percentile", percentile, 0.0, 100.0)
        self.history = integer("history", history, 1)
        if not isinstance(per_tensor, bool):
            raise TypeError(f"per_tensor must be a bool, got {per_tensor!r}")
        self.per_tensor = per_tensor
        self._buffer: Tensor | None = None  # [rows, history]: the norms seen, as a ring
        self._count: Tensor | None = None  # [rows] int64: finite norms seen per row
        # Not state (the checkpoint is the ring): the ring's filled values in ascending
        # order, +inf for the rest, made from the ring by one sort when missing; and
        # scratch of its shape for replace_sorted_.
        self._sorted: Tensor | None = None
        self._spare: Tensor | None = None

    def config(self) -> dict[str, Any]:
        return {
            "percentile": self.percentile,
            "history": self.history,
            "per_tensor": self.per_tensor,
        }

    def _rows(self, norms: Tensor) -> Tensor:
        return norms.reshape(-1, 1) if self.per_tensor else norms.reshape(1, 1)

    def _ensure(self, norms: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The ring, the counts and the sorted copy; new ones (unsaved) before the first
        update."""
        rows = self._rows(norms).shape[0]
        if self._buffer is None or self._count is None:
            buffer = norms.new_zeros((rows, self.history))
            count = torch.zeros(rows, dtype=torch.int64, device=norms.device)
            return buffer, count, torch.full_like(buffer, math.inf)
        if self._buffer.shape[0] != rows:
            raise ValueError(
                f"AutoClip(per_tensor=True) has a history for {self._buffer.shape[0]} grads "
                f"but this step has {rows}: a per-tensor rule needs the same grads every step"
            )
        if self._sorted is None:
            self._sorted = sorted_history(self._buffer, self._count)
        return self._buffer, self._count, self._sorted

    def threshold(self, norms: Tensor) -> Tensor:
        if self._buffer is None:
            # Nothing seen: no clip. Not the lerp below over a fresh history of +inf
            # made in the graph: inductor's C++ bounds analysis then folds inf - inf
            # and fails ("sympy expression is NaN"), where eager gives this same +inf.
            return torch.full_like(norms, math.inf)
        buffer, count, ordered = self._ensure(norms)
        filled = torch.clamp(count, max=self.history)  # [rows]
        # torch.quantile's interpolation: rank = q * (n - 1), the value below at the
        # truncated rank, above at its ceiling, lerp by the fraction (in the values'
        # dtype). q is a Python scalar: a tensor made from it on CUDA would be a blocking
        # copy.
        ranks = _ranks(filled, self.percentile / 100.0, buffer.dtype)
        below, above = ranks.to(torch.int64), ranks.ceil().to(torch.int64)
        low = ordered.gather(1, below[:, None])[:, 0]
        high = ordered.gather(1, above[:, None])[:, 0]
        value = torch.lerp(low, high, (ranks - below.to(ranks.dtype)).to(buffer.dtype))
        value = torch.where(filled > 0, value, math.inf)
        return value.reshape(norms.shape)

    def update(self, norms: Tensor) -> None:
        buffer, count, ordered = self._ensure(norms)
        rows = self._rows(norms).to(buffer.dtype)[:, 0]
        finite = torch.isfinite(rows)
        position = (count % self.history)[:, None]
        old = buffer.gather(1, position)[:, 0]
        # A full row's oldest norm leaves the sorted copy, else one of its +inf slots; a
        # non-finite norm enters nowhere (what leaves comes back).
        leaving = torch.where(count >= self.history, old, math.inf)
        if self._spare is None:
            self._spare = torch.empty_like(ordered)
        replace_sorted_(ordered, self._spare, leaving, torch.where(finite, rows, leaving))
        # In place: the history is the rule's own (its state dict holds copies), and an
        # out-of-place scatter copied all rows x history values every step.
        self._buffer = buffer.scatter_(1, position, torch.where(finite, rows, old)[:, None])
        self._count = count + finite.to(torch.int64)
        self._sorted = ordered

    def rule_state(self) -> dict[str, Any]:
        if self._buffer is None or self._count is None:
            return {}
        return {"buffer": self._buffer.clone(), "count": self._count.clone()}

    def load_rule_state(self, state: Mapping[str, Any]) -> None:
        if not saved("AutoClip", state, ("buffer", "count")):
            self._buffer = self._count = self._sorted = self._spare = None
            return
        buffer = checked("buffer", state["buffer"], None, floating=True)
        if buffer.dim() != 2 or buffer.shape[1] != self.history:
            raise ValueError(
                f"AutoClip buffer must be [rows, {self.history}], got {tuple(buffer.shape)}"
            )
        if not self.per_tensor and buffer.shape[0] != 1:
            raise ValueError(f"a global AutoClip buffer has one row, got {buffer.shape[0]}")
        count = checked("count", state["count"], (buffer.shape[0],), floating=False)
        _check_history(buffer, count)
        self._buffer, self._count = buffer.clone(), count.clone()
        self._sorted = self._spare = None  # rebuilt from the ring at the next step
