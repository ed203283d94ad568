"""What a non-finite norm (or a spike) does to a step: the verdicts, and the lagged count.

``"propagate"`` looks at nothing; ``"assert"`` asserts on the device
(:func:`assert_finite`). ``"raise"``, and a ``"skip"`` decided on the host, read
three flags per step in one copy (:func:`host_verdict`). A ``"skip"`` that rides on a
fused kernel's ``found_inf`` is decided on the device (:func:`device_verdict`), and
``max_consecutive_skips`` is then checked (:func:`check_lagged_streak`, outside any
compiled graph) against the count of the *previous* step, read from a copy made then
without waiting (:class:`LaggedCount`): the error comes one ``step()`` later than on the
host path. That step changes nothing, and the next is decided afresh.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

from clipopt._errors import NonFiniteNormError

__all__ = [
    "LaggedCount",
    "assert_finite",
    "check_lagged_streak",
    "device_verdict",
    "host_verdict",
    "skip_flag",
    "spike_verdict",
]


def host_copy(like: Tensor) -> tuple[Tensor, Callable[[], None], Callable[[], None]]:
    """A pinned host buffer for copies of the 0-dim CUDA tensor ``like``, a function that
    marks a copy just queued (an event on ``like``'s device's current stream) and one
    that waits for the mark: the CUDA runtime objects in one place, which the CUDA dry
    run (``benchmarks/dryrun.py``) stands in for."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    device = like.device
    buffer = torch.empty((), dtype=like.dtype, pin_memory=True)
    return buffer, lambda: event.record(torch.cuda.current_stream(device)), event.synchronize


class LaggedCount:
    """A device counter read one step late, from a copy made without waiting.

    On CUDA the copy goes to a pinned host buffer with ``non_blocking=True``, marked by
    an event; by the next step it has long completed, so reading never stalls. Each
    :meth:`publish` overwrites the previous copy. A copy (``copy.deepcopy``, pickle)
    holds the value read, not the buffer and event.
    """

    def __init__(self) -> None:
        self._value = 0
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
        self._value, self._host, self._marks, self._host_device = value, None, None, None

    def read(self) -> int:
        if self._host is None:
            return self._value
        if self._marks is not None:
            self._marks[1]()
        return int(self._host.item())  # the user asked for the limit; a copy: no wait

    def __getstate__(self) -> dict[str, Any]:
        return {"value": self.read()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.set(state["value"])


def _finite(norms: Tensor, coefficients: Tensor) -> Tensor:
    """Whether every norm and clip coefficient is finite (0-dim bool), on the device."""
    return torch.isfinite(norms).all() & torch.isfinite(coefficients).all()


def _nonfinite(norms: Tensor, coefficients: Tensor) -> Tensor:
    """1 (int64) if any norm or clip coefficient is NaN or infinite, else 0, on the device."""
    return torch.logical_not(_finite(norms, coefficients)).to(torch.int64)


def assert_finite(norms: Tensor, coefficients: Tensor) -> None:
    """``nonfinite="assert"``: a device-side assertion that ``norms`` and
    ``coefficients`` are finite, with no host read. On CPU a failure raises
    ``RuntimeError`` at once; on CUDA the kernel fails and the error surfaces at the next
    synchronisation, leaving the CUDA context unusable (the process must restart)."""
    # No double quote in the message: inductor pastes it into a C++ string literal.
    message = "clipopt: the gradient norm or clip coefficient is non-finite, nonfinite=assert"
    torch._assert_async(_finite(norms, coefficients), message)


def _what(norms: Tensor) -> str:
    """What was non-finite, for an error message (read on the host: it is raising)."""
    values = norms.tolist()
    if all(math.isfinite(v) for v in (values if isinstance(values, list) else [values])):
        return (
            f"the clip coefficient is NaN (norm {values}): a tensor max_norm that is not "
            "> 0, or a norm past the dtype's range times max_norm"
        )
    return f"the gradient norm is non-finite ({values})"


def _flags_as_ints(flags: Tensor) -> tuple[int, int, int]:
    """The three flags as Python ints: the one host read, which the user asked for."""
    bad, streak, spike = (int(v) for v in flags.tolist())
    return bad, streak, spike


# Outside any compiled graph: torch 2.7's dynamo traces ``tolist`` into data-dependent
# symbols it then cannot branch on; a graph break here is what every release does.
_compiler: Any = torch.compiler  # its disable() is untyped
_read_on_host = cast(Callable[[Tensor], tuple[int, int, int]], _compiler.disable(_flags_as_ints))


def host_verdict(
    norms: Tensor,
    coefficients: Tensor,
    streak_now: Tensor,
    mode: str,
    limit: int | None,
    may_skip: bool,
    spike: Tensor | None = None,
) -> int | None:
    """One host read: None if ``norms`` and ``coefficients`` are finite (and ``spike``,
    where given, is false), else the skips in a row before this step (``streak_now``),
    which is to be skipped. With ``mode`` ``"propagate"`` or ``"assert"`` only a spike
    skips, whatever ``limit`` (``max_consecutive_skips``) says.

    Raises:
      NonFiniteNormError: a non-finite value and ``mode == "raise"``, or one that
        cannot skip (``may_skip`` False inside a step that has started), or ``limit``
        steps were skipped in a row already.
    """
    nonfinite = _nonfinite(norms, coefficients)
    spiked = torch.zeros_like(nonfinite) if spike is None else spike.to(nonfinite)
    flags = torch.stack([nonfinite, streak_now.to(nonfinite.device), spiked])
    is_bad, streak, is_spike = _read_on_host(flags)
    if mode in ("propagate", "assert"):  # asserted on the device already
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
    """:func:`host_verdict`'s skip as a 0-dim int64 tensor (1: skip), for a compiled
    step's record: a Python bool there is a value dynamo guards on."""
    bad = _nonfinite(norms, coefficients)
    flag = bad if mode == "skip" else torch.zeros_like(bad)
    return flag if spike is None else flag | spike.to(flag)


def device_verdict(norms: Tensor, coefficients: Tensor) -> Tensor:
    """``found_inf`` for this step (float32, 1.0 to skip), decided on the device."""
    return _nonfinite(norms, coefficients).to(torch.float32)


def spike_verdict(found_inf: Tensor | None, spike: Tensor) -> Tensor:
    """``found_inf`` that also skips a spike (``skip_spikes``), on the device."""
    flag = spike.to(torch.float32)
    return flag if found_inf is None else torch.maximum(found_inf, flag.to(found_inf.device))


def _lagged_streak_check(lagged: LaggedCount, limit: int) -> None:
    """Raise if the previous steps skipped more than ``limit`` in a row on the device,
    before a step that skips on the device changes anything; raising, drop the count,
    so the next step is decided afresh.

    Raises:
      NonFiniteNormError: as said.
    """
    if (streak := lagged.read()) > limit:
        lagged.set(0)
        raise NonFiniteNormError(
            f"the gradient norm was non-finite for {streak} steps in a row "
            f"(max_consecutive_skips={limit}); training is not recovering"
        )


# Outside any compiled graph: a compiled step that read the count itself would guard on
# its value and compile again after the first skipped step.
check_lagged_streak = cast(
    Callable[[LaggedCount, int], None], _compiler.disable(_lagged_streak_check)
)
