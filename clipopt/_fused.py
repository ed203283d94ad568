"""Fold the clip into a fused optimizer's own pass over the grads.

torch's ``Adam``, ``AdamW``, ``SGD`` and ``Adagrad`` with ``fused=True`` (CPU and CUDA)
read two optional tensors off the optimizer in ``step()``, the hook ``GradScaler`` uses:
``grad_scale`` (every grad is divided by it inside the fused kernel, and the divided
grad is written back to ``.grad``) and ``found_inf`` (non-zero: parameters and state
are left as they were, decided on the device). So instead of a pass that multiplies
every grad by the clip coefficient ``c``, :class:`~clipopt.ClippedOptimizer` hands the
kernel ``grad_scale = 1 / c``: the grads are read once for the norm and once by the
update, which reads them anyway. After the step ``.grad`` holds the clipped grads, as
on the explicit path; a skipped step leaves grads, parameters and state untouched, as
the explicit path does.

Parameters agree with the explicit path to rounding: ``g / (1 / c)`` and ``g * c``
differ by at most an ulp or two of a float32 ``g``; bfloat16 parameters by about one
bfloat16 ulp, since the explicit path rounds the clipped grad to bfloat16 before the
update and the kernel does not. With ``c = 1`` (no clipping) they are bit-identical.

With ``nonfinite="skip"`` the skip goes through ``found_inf``, so nothing waits for the
device. The skip counters are updated on the device too; ``max_consecutive_skips`` is
checked against the count of the *previous* step, read from a copy made then, so the
error comes one ``step()`` later than on the explicit path (after ``limit + 1`` skipped
steps rather than at the step that would be the ``limit + 1``-th). That step changes
nothing, and the next one is decided afresh, as on the explicit path: finite grads step
(and clear the streak), while non-finite ones are skipped once more before it raises again.
Loading a state dict replaces the counters and drops the lagged copy with them; so
does a step on the explicit path (a closure, fused SGD's first momentum step), which
checks the live count itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from clipopt.functional import NonFiniteNormError

if TYPE_CHECKING:
    from clipopt._clip_state import Threshold
    from clipopt.optimizer import ClippedOptimizer

__all__ = ["FoldPlan", "fold_plan", "folded_step"]

_FUSABLE: tuple[type[Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
)
_ATTRIBUTES = ("grad_scale", "found_inf")


def _fused_kernel_takes_scale(optimizer: Optimizer) -> bool:
    """A torch optimizer (not a subclass: it may override ``step``) with ``fused=True``."""
    if type(optimizer) not in _FUSABLE:
        return False
    return all(group.get("fused") for group in optimizer.param_groups)


def _scale_attributes_free(optimizer: Optimizer) -> bool:
    """Nobody else (e.g. GradScaler driving the inner optimizer) has set them."""
    return all(getattr(optimizer, name, None) is None for name in _ATTRIBUTES)


class FoldPlan(NamedTuple):
    """What :func:`fold_plan` read for a step that folds, handed on to :func:`folded_step`."""

    thresholds: list[Threshold]
    norm_types: list[float]
    grads: list[list[Tensor]]


def fold_plan(opt: ClippedOptimizer, closure: Any) -> FoldPlan | None:
    """The settings and grads of a step whose clip can ride on the fused kernel, or None.

    It can when the inner optimizer is a fused torch Adam/AdamW/SGD/Adagrad, the step
    has no closure, one coefficient scales every group (one global norm and one
    threshold) and no grad is float64 (``grad_scale`` is a float32 tensor, and double
    grads deserve a double coefficient). What was read to decide is returned, so the
    step reads the group settings and collects the grads once.
    """
    inner = opt.optimizer
    if closure is not None or opt.per_group or not _fused_kernel_takes_scale(inner):
        return None
    if not _scale_attributes_free(inner):
        return None
    thresholds, norm_types = opt._group_settings()
    if len({t if isinstance(t, float) else id(t) for t in thresholds}) != 1:
        return None
    grads = opt._grads_per_group()
    if any(g.dtype == torch.float64 for group in grads for g in group):
        return None
    return FoldPlan(thresholds, norm_types, grads)


@contextlib.contextmanager
def _scaled_step(
    optimizer: Optimizer, grad_scale: Tensor | None, found_inf: Tensor | None
) -> Iterator[None]:
    """Set ``grad_scale`` / ``found_inf`` on ``optimizer`` for one step, then restore them."""
    missing = object()
    saved = {name: getattr(optimizer, name, missing) for name in _ATTRIBUTES}
    for name, value in zip(_ATTRIBUTES, (grad_scale, found_inf), strict=True):
        if value is not None:
            setattr(optimizer, name, value)
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is missing:
                optimizer.__dict__.pop(name, None)
            else:
                setattr(optimizer, name, previous)


def _skips_cleanly(optimizer: Optimizer) -> bool:
    """``found_inf`` leaves the state as it was, except on fused SGD's first momentum step.

    There torch creates each momentum buffer with ``empty_like`` and relies on the
    kernel to fill it; a skipped kernel leaves it uninitialised, and the next step
    would read garbage. Such a step decides on the host instead.
    """
    if type(optimizer) is not torch.optim.SGD:
        return True
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue
        for p in group["params"]:
            if p.grad is not None and optimizer.state.get(p, {}).get("momentum_buffer") is None:
                return False
    return True


class _LaggedCount:
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
        self._event: torch.cuda.Event | None = None
        self._host_device: torch.device | None = None

    def publish(self, count: Tensor) -> None:
        if count.device.type != "cuda":
            self._host, self._event = count.detach().to("cpu", copy=True), None
            return
        if self._event is None or self._host is None or self._host_device != count.device:
            self._host = torch.empty((), dtype=count.dtype, pin_memory=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._host_device = count.device
        # The copy runs on the current stream of count's device, which need not be the
        # current device: the event must be recorded on that same stream.
        self._host.copy_(count, non_blocking=True)
        self._event.record(torch.cuda.current_stream(count.device))

    def read(self) -> int:
        if self._host is None:
            return 0
        if self._event is not None:
            self._event.synchronize()
        return int(self._host.item())

    def __getstate__(self) -> dict[str, Any]:
        return {"value": self.read()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._host = torch.tensor(state["value"], dtype=torch.int64)
        self._event, self._host_device = None, None


_LAGGED_ATTRIBUTE = "_lagged_consecutive_skips"


def _lagged_skips(opt: ClippedOptimizer) -> _LaggedCount:
    """The wrapper's lagged copy of ``consecutive_skips``, created on first use."""
    lagged: _LaggedCount | None = getattr(opt, _LAGGED_ATTRIBUTE, None)
    if lagged is None:
        lagged = _LaggedCount()
        setattr(opt, _LAGGED_ATTRIBUTE, lagged)
    return lagged


def forget_lagged_skips(opt: ClippedOptimizer) -> None:
    """Drop the lagged count: the counters were replaced, or the limit has just raised."""
    opt.__dict__.pop(_LAGGED_ATTRIBUTE, None)


def _skip_on_device(opt: ClippedOptimizer, norms: Tensor) -> Tensor:
    """``found_inf`` for this step; the skip counters move on the device.

    Raises:
      NonFiniteNormError: the previous steps skipped more than ``max_consecutive_skips``
        in a row (read from the copy the previous step made; see the module docstring).
        Nothing is changed and the lagged count is dropped, so the next step is decided
        afresh: finite grads step, as after the explicit path's raise.
    """
    lagged = _lagged_skips(opt)
    limit = opt.max_consecutive_skips
    # Read before publish: the publish below overwrites the buffer the read comes from.
    if limit is not None and (streak := lagged.read()) > limit:
        forget_lagged_skips(opt)
        raise NonFiniteNormError(
            f"the gradient norm was non-finite for {streak} steps in a row "
            f"(max_consecutive_skips={limit}); training is not recovering"
        )
    bad = (~torch.isfinite(norms).all()).to(opt._step_count.dtype)
    opt._skip_count.add_(bad)
    opt._consecutive_skips.add_(1).mul_(bad)
    opt._step_count.add_(1 - bad)
    lagged.publish(opt._consecutive_skips)
    return bad.to(torch.float32)


@torch.no_grad()
def _measure_and_fold(
    opt: ClippedOptimizer, plan: FoldPlan
) -> tuple[bool, Tensor | None, Tensor | None]:
    """Measure the norm and decide what the fused kernel gets.

    Returns:
      ``(run, grad_scale, found_inf)``: ``run`` is False when a host check already
      decided to skip the step (``nonfinite="raise"`` raises instead).
    """
    norm, group_norms, _ = opt._measure(plan.grads, plan.norm_types)
    opt._move_counters(norm.device)
    on_device = opt.nonfinite == "skip" and _skips_cleanly(opt.optimizer)
    if not on_device:  # the host check below reads the live count: a lagged copy is stale
        forget_lagged_skips(opt)
    if opt.nonfinite != "propagate" and not on_device and not opt._finite_or_raise(norm, True):
        opt._last_norm, opt._last_group_norms = norm, None
        return False, None, None
    found_inf = _skip_on_device(opt, norm) if on_device else None
    opt._last_norm, opt._last_group_norms = norm, None
    coefficient = opt._clip_coefficients(group_norms, plan.thresholds)[0]
    grad_scale = None if coefficient is None else coefficient.float().reciprocal()
    return True, grad_scale, found_inf


def folded_step(opt: ClippedOptimizer, plan: FoldPlan) -> Any:
    """One clipped step with the scale (and a skip) inside the inner fused kernel.

    ``plan`` is what :func:`fold_plan` returned for this step.
    """
    run, grad_scale, found_inf = _measure_and_fold(opt, plan)
    if not run:
        return None
    with _scaled_step(opt.optimizer, grad_scale, found_inf):
        result = opt.optimizer.step()
    if found_inf is None:
        opt._step_count.add_(1)
        opt._consecutive_skips.zero_()
    return result
