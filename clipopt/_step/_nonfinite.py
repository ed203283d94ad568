"""A non-finite norm's (or a spike's) verdict, on the host or the device; the lagged skip streak."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

from clipopt._errors import NonFiniteNormError

_compiler: Any = torch.compiler  # its disable() is untyped


def host_copy(like: Tensor) -> tuple[Tensor, Callable[[], None], Callable[[], None]]:
    """A pinned buffer for copies of the CUDA ``like``, a mark of a copy queued, a wait."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    device = like.device
    buffer = torch.empty((), dtype=like.dtype, pin_memory=True)
    return buffer, lambda: event.record(torch.cuda.current_stream(device)), event.synchronize


class LaggedCount:
    """A device counter read one step late, from a copy made without waiting."""

    _host: Tensor | None
    _marks: tuple[Callable[[], None], Callable[[], None], torch.device] | None  # mark, wait

    def __init__(self, value: int = 0) -> None:
        self.set(value)

    def publish(self, count: Tensor) -> None:
        if count.device.type != "cuda":
            self._host, self._marks = count.detach().to("cpu", copy=True), None
            return
        if self._marks is None or self._host is None or self._marks[2] != count.device:
            self._host, mark, wait = host_copy(count)
            self._marks = (mark, wait, count.device)
        self._host.copy_(count, non_blocking=True)
        self._marks[0]()

    def set(self, value: int) -> None:
        self._value, self._host, self._marks = value, None, None

    def read(self) -> int:
        if self._host is None:
            return self._value
        if self._marks is not None:
            self._marks[1]()
        return int(self._host.item())  # the user asked for the limit; a copy: no wait

    def __reduce__(self) -> tuple[type[LaggedCount], tuple[int]]:
        return LaggedCount, (self.read(),)


def _finite(norms: Tensor, coefficients: Tensor) -> Tensor:
    return torch.isfinite(norms).all() & torch.isfinite(coefficients).all()


def assert_finite(norms: Tensor, coefficients: Tensor) -> None:
    """``nonfinite="assert"``: a device-side assertion, no host read."""
    # No double quote in the message: inductor pastes it into a C++ string literal.
    message = "clipopt: the gradient norm or clip coefficient is non-finite, nonfinite=assert"
    torch._assert_async(_finite(norms, coefficients), message)


def _what(norms: Tensor) -> str:  # read on the host: it is raising
    values = norms.tolist()
    if all(math.isfinite(v) for v in (values if isinstance(values, list) else [values])):
        return (
            f"the clip coefficient is NaN (norm {values}): a tensor max_norm that is not "
            "> 0, or a norm past the dtype's range times max_norm"
        )
    return f"the gradient norm is non-finite ({values})"


# Outside any compiled graph: torch 2.7's dynamo cannot branch on what tolist gives.
_read_on_host = cast(Callable[[Tensor], list[int]], _compiler.disable(lambda f: f.tolist()))


def host_verdict(
    norms: Tensor,
    coefficients: Tensor,
    streak_now: Tensor,
    mode: str,
    limit: int | None,
    may_skip: bool,
    spike: Tensor | None = None,
) -> int | None:
    """One host read: None to step, else the skips in a row before this one; may raise."""
    nonfinite = torch.logical_not(_finite(norms, coefficients)).to(torch.int64)
    spiked = torch.zeros_like(nonfinite) if spike is None else spike.to(nonfinite)
    flags = torch.stack([nonfinite, streak_now.to(nonfinite.device), spiked])
    is_bad, streak, is_spike = _read_on_host(flags)
    if not is_bad or mode in ("propagate", "assert"):  # asserted on the device already
        return streak if is_spike else None
    if mode == "raise" or not may_skip:
        raise NonFiniteNormError(f"{_what(norms)}; nonfinite={mode!r}, so nothing was changed")
    if limit is not None and streak >= limit:
        raise NonFiniteNormError(
            f"{_what(norms)} after {streak} skipped steps in a row "
            f"(max_consecutive_skips={limit}); training is not recovering"
        )
    return streak


def device_verdict(
    norms: Tensor, coefficients: Tensor, mode: str, spike: Tensor | None, dtype: torch.dtype
) -> Tensor:
    """:func:`host_verdict`'s skip on the device (1: skip), in ``dtype``."""
    flag = torch.logical_not(_finite(norms, coefficients)).to(dtype) if mode == "skip" else None
    if spike is not None:
        flag = spike.to(dtype) if flag is None else torch.maximum(flag, spike.to(flag))
    return torch.zeros((), dtype=dtype, device=norms.device) if flag is None else flag


def _lagged_streak_check(lagged: LaggedCount, limit: int) -> None:
    if (streak := lagged.read()) > limit:
        lagged.set(0)
        raise NonFiniteNormError(
            f"the gradient norm was non-finite for {streak} steps in a row "
            f"(max_consecutive_skips={limit}); training is not recovering"
        )


# Outside any compiled graph: a graph that read the count would guard on its value.
check_lagged_streak = cast(
    Callable[[LaggedCount, int], None], _compiler.disable(_lagged_streak_check)
)
