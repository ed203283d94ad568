"""What a non-finite norm does to a step, and the record every step leaves: its norms and
the counters of steps taken and skipped.

Three policies (``nonfinite=``): ``"propagate"`` looks at nothing; ``"raise"`` and a
``"skip"`` decided on the host read one flag per step (:func:`host_verdict`); a ``"skip"``
that rides on a fused kernel's ``found_inf`` is decided on the device
(:func:`device_verdict`), and ``max_consecutive_skips`` is then checked
(:func:`check_lagged_streak`, outside any compiled graph) against the count of the
*previous* step, read from a copy made then without waiting (:class:`LaggedCount`).
So on that path the error comes one ``step()`` later than on the host path (after
``limit + 1`` skipped steps rather than at the step that would be the ``limit + 1``-th).
That step changes nothing, and the next one is decided afresh: finite grads step (and
clear the streak), while non-finite ones are skipped once more before it raises again.

:meth:`StepRecord.record` is the one place the record changes, once the step has run. It
is an object of its own, not attributes of the wrapper: ``torch.compile`` drops attribute
writes on an ``Optimizer`` instance, but keeps those on the objects it holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

from clipopt._errors import NonFiniteNormError

__all__ = [
    "COUNTER_NAMES",
    "LaggedCount",
    "StepRecord",
    "check_lagged_streak",
    "device_verdict",
    "host_verdict",
    "skip_flag",
    "spike_verdict",
]

COUNTER_NAMES = ("step_count", "skip_count", "consecutive_skips")


def host_copy(like: Tensor) -> tuple[Tensor, Callable[[], None], Callable[[], None]]:
    """A pinned host buffer for copies of the 0-dim CUDA tensor ``like``, a function
    that marks a copy just queued (an event recorded on the current stream of ``like``'s
    device, which runs the copy even where it is not the current device) and one that
    waits for the mark: the CUDA runtime objects of :class:`LaggedCount` in one place,
    which the CUDA dry run (``benchmarks/dryrun.py``) stands in for."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    device = like.device
    buffer = torch.empty((), dtype=like.dtype, pin_memory=True)
    return buffer, lambda: event.record(torch.cuda.current_stream(device)), event.synchronize


class LaggedCount:
    """A device counter read one step late, from a copy made without waiting.

    On CUDA the copy goes to a pinned host buffer with ``non_blocking=True`` and an
    event recorded on the stream that copies marks it; by the next step the event has
    long completed, so reading never stalls. The buffer and the event are made once per
    device and reused, so each :meth:`publish` overwrites the previous copy: call
    :meth:`read` first. A copy (``copy.deepcopy``, pickle) holds the value read, not the
    buffer and event.
    """

    def __init__(self) -> None:
        self._host: Tensor | None = None
        self._marks: tuple[Callable[[], None], Callable[[], None]] | None = None
        self._host_device: torch.device | None = None

    def publish(self, count: Tensor) -> None:
        if count.device.type != "cuda":
            self._host, self._marks = count.detach().to("cpu", copy=True), None
            return
        if self._marks is None or self._host is None or self._host_device != count.device:
            self._host, *marks = host_copy(count)
            self._marks, self._host_device = (marks[0], marks[1]), count.device
        self._host.copy_(count, non_blocking=True)
        self._marks[0]()

    def set(self, value: int) -> None:
        """Hold ``value``, a count already known on the host."""
        self._host = torch.tensor(value, dtype=torch.int64)
        self._marks, self._host_device = None, None

    def read(self) -> int:
        if self._host is None:
            return 0
        if self._marks is not None:
            self._marks[1]()
        return int(self._host.item())  # the user asked for the limit; a copy: no wait

    def __getstate__(self) -> dict[str, Any]:
        return {"value": self.read()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.set(state["value"])


def _new_counter() -> Tensor:
    return torch.zeros((), dtype=torch.int64)


class StepRecord:
    """The last step's norms, and inner steps taken, skipped, and skipped in a row.

    The counters are 0-dim int64 tensors on the grads' device, so updating them never
    syncs. ``lagged`` holds ``consecutive_skips`` as of the end of the previous step,
    readable without waiting: known on the host after a step decided there or a load,
    copied without blocking after a step decided on the device.
    """

    def __init__(self) -> None:
        self.last_norm: Tensor | None = None
        self.last_group_norms: Tensor | None = None
        self.step_count = _new_counter()
        self.skip_count = _new_counter()
        self.consecutive_skips = _new_counter()
        self.lagged = LaggedCount()
        # False while consecutive_skips is known to be 0 without reading it, so that a
        # step that is not skipped need not zero it (one launch fewer a step).
        self._streak_may_be_set = False

    def record(
        self, norm: Tensor, group_norms: Tensor | None, skipped: bool | Tensor, streak: int = 0
    ) -> None:
        """Record a step that has run (or was skipped) without raising.

        Args:
          norm: its pre-clip norm, on the grads' device, where the counters move.
          group_norms: its per-group norms (``per_group``), else None.
          skipped: decided on the host (a bool), or on the device (``found_inf``: a
            0-dim tensor, non-zero for a skip).
          streak: for a skip decided on the host, the skips in a row before it, as
            :func:`host_verdict` read them.
        """
        self.last_norm, self.last_group_norms = norm, group_norms
        device = norm.device
        if self.step_count.device != device:
            for name in COUNTER_NAMES:
                setattr(self, name, getattr(self, name).to(device))
        if isinstance(skipped, Tensor):
            bad = skipped.to(torch.int64)
            self.skip_count.add_(bad)
            self.consecutive_skips.add_(1).mul_(bad)
            self.step_count.add_(1 - bad)
            self.lagged.publish(self.consecutive_skips)
        elif skipped:
            self.skip_count.add_(1)
            self.consecutive_skips.add_(1)
            self.lagged.set(streak + 1)
        else:
            self.step_count.add_(1)
            if torch.compiler.is_compiling() or self._streak_may_be_set:  # no guard on it
                self.consecutive_skips.zero_()
            self._streak_may_be_set = False
            self.lagged.set(0)
            return
        self._streak_may_be_set = True

    def state(self) -> dict[str, Tensor]:
        """Copies of the three counters, by name."""
        return {name: getattr(self, name).clone() for name in COUNTER_NAMES}

    def load(
        self,
        counters: dict[str, Tensor],
        last_norm: Tensor | None = None,
        last_group_norms: Tensor | None = None,
    ) -> None:
        """Replace the record (validated by the caller, so reading a counter is safe)."""
        self.last_norm, self.last_group_norms = last_norm, last_group_norms
        self.step_count = counters["step_count"]
        self.skip_count = counters["skip_count"]
        self.consecutive_skips = counters["consecutive_skips"]
        self._streak_may_be_set = True
        self.lagged.set(int(self.consecutive_skips))  # a load, not a step: this read may wait


def _nonfinite(norms: Tensor, coefficients: Tensor) -> Tensor:
    """1 (int64) if any norm or clip coefficient is NaN or infinite, else 0, on the device."""
    finite = torch.isfinite(norms).all() & torch.isfinite(coefficients).all()
    return torch.logical_not(finite).to(torch.int64)


def _what(norms: Tensor) -> str:
    """What was non-finite, for an error message (read on the host: it is raising)."""
    values = norms.tolist()  # raising, as the user asked
    if all(math.isfinite(v) for v in (values if isinstance(values, list) else [values])):
        return (
            f"the clip coefficient is NaN (norm {values}): a tensor max_norm that is not "
            "> 0, or a norm past the dtype's range times max_norm"
        )
    return f"the gradient norm is non-finite ({values})"


def _flags_as_ints(flags: Tensor) -> tuple[int, int, int]:
    """The three flags as Python ints: the one host read, which the user asked for."""
    # The host read the user asked for: nonfinite='raise' or 'skip' on a non-fused step.
    bad, streak, spike = (int(v) for v in flags.tolist())
    return bad, streak, spike


# Outside any compiled graph: torch 2.7's dynamo traces ``tolist`` into data-dependent
# symbols it then cannot branch on; a graph break here is what every release does.
_compiler: Any = torch.compiler  # its disable() is untyped
_read_on_host = cast(Callable[[Tensor], tuple[int, int, int]], _compiler.disable(_flags_as_ints))


def host_verdict(
    norms: Tensor,
    coefficients: Tensor,
    counters: StepRecord,
    mode: str,
    limit: int | None,
    may_skip: bool,
    spike: Tensor | None = None,
) -> int | None:
    """One host read: None if ``norms`` and ``coefficients`` are finite (and ``spike``,
    where given, is false), else the skips in a row before this step, which is to be
    skipped.

    With ``mode == "propagate"`` only a spike skips. A spike (``skip_spikes``) skips
    whatever ``max_consecutive_skips`` says: that limit is for non-finite norms.

    Raises:
      NonFiniteNormError: a non-finite value and ``mode == "raise"``, or one that
        cannot skip (``may_skip`` is False inside a step that has started), or ``limit``
        steps were skipped in a row already.
    """
    nonfinite = _nonfinite(norms, coefficients)
    streak_here = counters.consecutive_skips.to(nonfinite.device)
    spiked = torch.zeros_like(nonfinite) if spike is None else spike.to(nonfinite)
    is_bad, streak, is_spike = _read_on_host(torch.stack([nonfinite, streak_here, spiked]))
    if mode == "propagate":
        is_bad = 0
    if not is_bad:
        return streak if is_spike else None
    if mode == "raise" or not may_skip:
        raise NonFiniteNormError(f"{_what(norms)}; nonfinite={mode!r}, so nothing was changed")
    if limit is not None and streak >= limit:
        raise NonFiniteNormError(
            f"{_what(norms)} after {streak} skipped steps in a row "
            f"(max_consecutive_skips={limit}); training is not recovering"
        )
    return streak


def skip_flag(norms: Tensor, coefficients: Tensor, mode: str, spike: Tensor | None) -> Tensor:
    """:func:`host_verdict`'s skip as a 0-dim int64 tensor on the device (1: skip), for a
    compiled step's record: a Python bool there is a value dynamo guards on, so the
    first skipped step would compile the record again. (A verdict that raises records
    nothing.)"""
    bad = _nonfinite(norms, coefficients)
    flag = bad if mode == "skip" else torch.zeros_like(bad)
    return flag if spike is None else flag | spike.to(flag)


def device_verdict(norms: Tensor, coefficients: Tensor) -> Tensor:
    """``found_inf`` for this step (float32, 1.0 to skip), decided on the device.
    ``max_consecutive_skips`` is checked apart, by :func:`check_lagged_streak`."""
    return _nonfinite(norms, coefficients).to(torch.float32)


def _lagged_streak_check(counters: StepRecord, limit: int) -> None:
    """Raise if the previous steps skipped more than ``limit`` in a row on the device
    (read from the copy the previous step made), before a step that skips on the device
    changes anything; raising, drop the lagged count, so the next step is decided afresh.

    Raises:
      NonFiniteNormError: as said.
    """
    if (streak := counters.lagged.read()) > limit:
        counters.lagged.set(0)
        raise NonFiniteNormError(
            f"the gradient norm was non-finite for {streak} steps in a row "
            f"(max_consecutive_skips={limit}); training is not recovering"
        )


# Outside any compiled graph, read and judged there: a compiled step that read the count
# itself would guard on its value and compile again after the first skipped step.
check_lagged_streak = cast(
    Callable[[StepRecord, int], None], _compiler.disable(_lagged_streak_check)
)


def spike_verdict(found_inf: Tensor | None, spike: Tensor) -> Tensor:
    """``found_inf`` that also skips a spike (``skip_spikes``), on the device."""
    flag = spike.to(torch.float32)
    return flag if found_inf is None else torch.maximum(found_inf, flag.to(found_inf.device))
