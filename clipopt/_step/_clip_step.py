"""One ``ClippedOptimizer.step()``, top to bottom: decide -> scale or fold -> apply -> commit.

:func:`step` fires the step hooks around it all. :func:`decide` measures and chooses the
scale, changing nothing (a raise there leaves everything as it was); the grads are then
multiplied in place and the inner step runs, or the scale (and a skip decided on the
device) rides into a fused torch optimizer's kernel (:mod:`clipopt._step._fold`);
:func:`commit` keeps the :class:`StepRecord` and the rules' state. A fixed threshold over
plain grads takes the shortest path: one grouped norm, one coefficient or ``grad_scale``,
one scale; other steps measure in :mod:`clipopt._step._measure` and decide by
:mod:`clipopt._step._rule_step`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.optim import Optimizer

from clipopt._dist import _deepspeed, _mesh
from clipopt._dist._deepspeed import Watch
from clipopt._dist._reduce import NormScope
from clipopt._kernels import _norms, _scale
from clipopt._step import _fold, _measure, _nonfinite, _rule_step
from clipopt._step._measure import Coefficient, Measurement
from clipopt._validation import (
    CLIP_GROUP_KEY,
    MAX_NORM_KEY,
    NORM_TYPE_KEY,
    Layout,
    NonFinite,
    check_groups,
    clip_layout,
    same_threshold,
)
from clipopt._wrapper import Closure, inner_step, post_hooks, pre_hooks
from clipopt.rules._base import ClipRule
from clipopt.rules._spike_skip import SpikeSkip
from clipopt.rules._unit import UnitWiseRule

__all__ = ["ClipConfig", "ClipDecision", "StepRecord", "check_rule_groups", "step"]

_COUNTERS = ("step_count", "skip_count", "consecutive_skips")


class GroupView:
    """The param groups' clip settings as last validated, and what they were read from:
    a step validates them again only when a group, its parameter list or its
    ``clip_max_norm``/``clip_norm_type``/``clip_group`` is another object than at the
    last check. With clip groups named (``layout``), the step measures and scales each
    clip group's grads as one group: ``thresholds``, ``norm_types`` are theirs."""

    def __init__(self) -> None:
        self.seen: list[object] = []
        self.thresholds: list[float | Tensor] = []
        self.norm_types: list[float] = []
        self.layout: Layout | None = None
        self.per_group = False  # each of the step's groups has a norm of its own
        self.one: float | Tensor | None = None  # the threshold all groups share
        self.fusable = False


@dataclass(frozen=True)
class ClipConfig:
    """What a step reads of the wrapper: its rules and settings (a load replaces it)."""

    rule: ClipRule | None
    skip_spikes: SpikeSkip | None
    per_group: bool
    nonfinite: NonFinite
    max_consecutive_skips: int | None
    foreach: bool | None
    norm_scope: NormScope
    track_tensor_norms: bool
    deepspeed: Watch
    view: GroupView = field(default_factory=GroupView, compare=False)


class _Clipped(Protocol):
    """The wrapper as :func:`step` sees it."""

    optimizer: Optimizer
    _clip: ClipConfig
    _record: StepRecord
    _optimizer_step_pre_hooks: dict[int, Any]
    _optimizer_step_post_hooks: dict[int, Any]


@dataclass(frozen=True)
class ClipDecision:
    """What a step applies and records, made before anything changes.

    Attributes:
      grads: each param group's grads (each clip group's, where they are named), as
        measured.
      measurement: the pre-clip norms.
      coefficients: one :data:`~clipopt._step._measure.Coefficient` per group (empty
        when folded by a threshold: ``grad_scale`` is made without them).
      fold: the scale rides on the fused inner kernel as ``grad_scale``.
      skip: the step is skipped, decided on the host; ``streak``: the skips in a row
        before it.
      found_inf: a skip decided on the device, for a fused kernel (float32, 1.0: skip).
      rule_outcome: what a rule decided, for it to commit after the step.
      spike: with ``skip_spikes``, whether the norm is a spike (0-dim bool), if judged.
      skip_flag: in a compiled step, ``skip`` as a 0-dim tensor the record counts with.
      streak_limit: for a skip decided on the device, ``max_consecutive_skips``, which
        the previous steps' streak is checked against first.
      final: this call ends the step (False for all but the last of the calls
        DeepSpeed's ZeRO optimizer makes, one per group, and its start-up step).
    """

    grads: list[list[Tensor]]
    measurement: Measurement
    coefficients: list[Coefficient]
    fold: bool = False
    grad_scale: Tensor | None = None
    skip: bool = False
    streak: int = 0
    found_inf: Tensor | None = None
    rule_outcome: tuple[Tensor, Tensor, Tensor] | None = None
    spike: Tensor | None = None
    skip_flag: Tensor | None = None
    streak_limit: int | None = None
    final: bool = True


def step(wrapper: _Clipped, closure: Closure | None = None) -> Any:
    """Clip the grads, then run the inner optimizer's step; return what it returns.

    With a ``closure``, it is evaluated (with grad enabled) before the inner step and its
    grads are clipped; the inner optimizer gets a closure that returns that first loss
    once and afterwards re-evaluates and clips, so optimizers that call it many times
    (LBFGS) always see clipped grads. With ``nonfinite="skip"`` a non-finite norm in
    those later evaluations cannot skip a step that has already started, so it raises
    :class:`clipopt.NonFiniteNormError`, as ``"raise"`` does.

    Step hooks fire in torch's order around this whole clipped step (global ones once,
    with the wrapper as the optimizer); hooks on the inner optimizer fire around the
    inner step.
    """
    inner, config, record = wrapper.optimizer, wrapper._clip, wrapper._record
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(wrapper).__name__}.step"):
        args, kwargs, closure = pre_hooks(wrapper, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        decision = decide(inner, config, record, closure is None, True)
        if not (decision.skip or decision.fold):
            scale(decision, config.foreach)  # in the graph that measured (see apply)
        result, latest = apply(inner, config, record, decision, closure, loss)
        commit(config, record, decision, latest)
        post_hooks(wrapper, args, kwargs)
    return result


def decide(
    optimizer: Optimizer, config: ClipConfig, record: StepRecord, may_fold: bool, may_skip: bool
) -> ClipDecision:
    """Measure, choose the scale and rule on a non-finite norm or a spike; change nothing.
    ``may_fold``: no closure; ``may_skip``: not a closure's re-evaluation (the step has
    begun).

    Raises:
      NonFiniteNormError: as ``nonfinite`` and ``max_consecutive_skips`` say.
      ValueError, TypeError: a group's settings, changed since the last step, are bad.
    """
    view = config.view
    zero, final = _check_groups(optimizer, config)
    with torch.no_grad():
        grads = [
            [p.grad for p in g["params"] if p.grad is not None] for g in optimizer.param_groups
        ]
        if view.layout is not None:
            grads = _regrouped(grads, view.layout)
        flat = grads[0] if len(grads) == 1 else [g for group in grads for g in group]
        coefficients: list[Coefficient] = []
        outcome = None
        if _plain(config, zero, flat):
            norm, grouped = _norms.grouped_total_norm(flat, view.norm_types[0], config.foreach)
            measured = Measurement(norm, [norm] * len(grads), None, groups=grouped)
        else:
            measured, coefficients, outcome = _measure_and_rule(optimizer, config, grads, zero)
        fold, grad_scale = False, None
        if config.rule is None:
            shared = None if view.per_group else view.one
            if shared is None:
                coefficients = _threshold_coefficients(measured.group_norms, view.thresholds)
            else:
                fold = (
                    may_fold
                    and view.fusable
                    and _fold.can_fold(optimizer, _dtypes(grads, measured))
                )
                if _scales_nothing(shared):
                    coefficients = [] if fold else [None] * len(grads)
                elif fold:
                    grad_scale = _scale.grad_scale_of(shared, measured.norm)
                else:
                    coefficients = [_scale.clip_coefficient(shared, measured.norm)] * len(grads)
        else:
            one_coefficient = _shared(coefficients)
            fold = (
                may_fold
                and view.fusable
                and one_coefficient is not False
                and _fold.can_fold(optimizer, _dtypes(grads, measured))
            )
            if fold and isinstance(one_coefficient, Tensor):
                grad_scale = torch.reciprocal(one_coefficient.float())
        decision = ClipDecision(
            grads, measured, coefficients, fold, grad_scale, rule_outcome=outcome, final=final
        )
        spike = None
        spikes = config.skip_spikes
        # Compiled, the verdict is judged from the first step (false on the device until
        # min_history norms are in): a graph that judged only once may_trigger() turned
        # true would recompile then. Eager, no read until it can fire.
        if (
            may_skip
            and spikes is not None
            and (torch.compiler.is_compiling() or spikes.may_trigger())
        ):
            spike = spikes.verdict(measured.norm)
        if config.nonfinite == "propagate" and spike is None:
            return decision
        norms = measured.norm if measured.stacked is None else measured.stacked
        values = _coefficient_values(coefficients, grad_scale, norms)
        if config.nonfinite == "assert":
            _nonfinite.assert_finite(norms, values)
            if spike is None:
                return decision
        limit = config.max_consecutive_skips
        if fold and config.nonfinite != "raise" and _fold.skips_cleanly(optimizer):
            found_inf = streak_limit = None
            if config.nonfinite == "skip":
                found_inf, streak_limit = _nonfinite.device_verdict(norms, values), limit
            if spike is not None:
                found_inf = _nonfinite.spike_verdict(found_inf, spike)
            return dataclasses.replace(
                decision, found_inf=found_inf, spike=spike, streak_limit=streak_limit
            )
        flag = None
        if torch.compiler.is_compiling():
            flag = _nonfinite.skip_flag(norms, values, config.nonfinite, spike)
        streak = _nonfinite.host_verdict(
            norms, values, record.consecutive_skips, config.nonfinite, limit, may_skip, spike
        )
        return dataclasses.replace(
            decision, skip=streak is not None, streak=streak or 0, spike=spike, skip_flag=flag
        )


def apply(
    optimizer: Optimizer,
    config: ClipConfig,
    record: StepRecord,
    decision: ClipDecision,
    closure: Closure | None,
    loss: Any,
) -> tuple[Any, ClipDecision]:
    """Apply ``decision``: nothing (a skip decided on the host), the fused step with the
    scale folded in, or the inner step on the grads :func:`scale` scaled. Returns what
    the inner step returns (``loss`` when skipped) and the decision the grads it stepped
    with were measured and scaled by (a closure's last).

    Compiled, each way breaks the graph in here (the inner step breaks it; a skip breaks
    it on purpose), so that what follows is traced in one resumed frame, and nothing
    here precedes the break (dynamo compiles the code of a call that breaks before the
    break as a graph of its own: the scale is made before the call).
    """
    if decision.skip:
        return _skipped(loss), decision
    if decision.fold:
        if decision.streak_limit is not None:
            _nonfinite.check_lagged_streak(record.lagged, decision.streak_limit)
        return _fold.apply_folded(optimizer, decision.grad_scale, decision.found_inf), decision
    if closure is None:
        return inner_step(optimizer, None), decision
    return _step_with_closure(optimizer, config, record, closure, loss, decision)


def _skip(loss: Any) -> Any:
    return loss


# A compiled skipped step breaks the graph in apply() as a stepped one does, so that
# commit() is traced in one frame and its Python counters, made dynamic at warm-up, do
# not recompile at the first skips.
_compiler: Any = torch.compiler  # its disable() is untyped
_skipped: Any = _compiler.disable(_skip)


@torch.no_grad()
def scale(decision: ClipDecision, foreach: bool | None) -> None:
    """Multiply each group's grads by its coefficient in place.

    Groups sharing a 0-dim coefficient are scaled by one kernel call (on the norm's
    grouping of the grads, where it has one); per-grad coefficients one ``_foreach_mul_``
    per device and dtype. Without grad: grads made with ``create_graph=True`` must not
    record the scale (Adahessian differentiates them).
    """
    grads, coefficients = decision.grads, decision.coefficients
    grouped = decision.measurement.groups
    shared = _shared(coefficients, grads)
    if shared is None:
        return
    # Not compiled: the grouping is keyed by device, which dynamo cannot guard cheaply.
    if grouped is not None and isinstance(shared, Tensor) and not torch.compiler.is_compiling():
        _scale.scale_groups_(grouped, shared, foreach)
        return
    # Shared coefficients found by identity, not id(): torch.compile guards on an id,
    # and a step's new coefficient would then recompile every step.
    buckets: list[tuple[Tensor, list[Tensor]]] = []
    each: list[tuple[Tensor, Tensor]] = []
    for group_grads, coefficient in zip(grads, coefficients, strict=True):
        if isinstance(coefficient, tuple):
            pairs = zip(group_grads, coefficient, strict=True)
            each.extend((grad, own) for grad, own in pairs if own is not None)
        elif coefficient is not None and group_grads:
            for held, tensors in buckets:  # not next(..., None): torch 2.6's dynamo
                if held is coefficient:
                    tensors.extend(group_grads)
                    break
            else:
                buckets.append((coefficient, list(group_grads)))
    for coefficient, tensors in buckets:
        _scale.scale_(_local(tensors), coefficient, foreach)
    if each:
        _scale_each_(_local([g for g, _ in each]), [c for _, c in each], foreach)


def commit(
    config: ClipConfig, record: StepRecord, decision: ClipDecision, latest: ClipDecision
) -> None:
    """Keep what a step that ran (or was skipped) leaves: the record and the rules' state.
    ``latest``: the decision the grads the inner step used were measured and scaled by
    (a closure's last). A call that does not end the step keeps nothing."""
    if not decision.final:
        return
    skipped: bool | Tensor | None = decision.skip_flag  # compiled: the verdict, as a tensor
    if skipped is None:
        skipped = decision.skip if decision.found_inf is None else decision.found_inf
    applied = None if skipped is True else _applied(config, latest)
    record.record(latest.measurement, skipped, decision.streak, config.track_tensor_norms)
    record.record_clip(applied, skipped)
    if config.rule is not None and decision.rule_outcome is not None:
        config.rule.commit(*decision.rule_outcome)
    if config.skip_spikes is not None:
        config.skip_spikes.commit(decision.measurement.norm, decision.spike)


@dataclass(frozen=True)
class Applied:
    """How the clip scaled the grads the inner step used, from which :class:`StepRecord`
    derives the post-clip norm when asked: the pre-clip norm(s) times ``factor`` (per
    group with ``per_group``), divided by it where ``divides`` (the folded
    ``grad_scale``), or from a per-tensor or unit-wise rule's ``units`` (their norms and
    coefficients, 1-D) in the order ``norm_type``.
    ``clipped``: whether it scaled some grad (0-dim bool, 1-D with ``per_group``).
    Not ``known`` without ``per_group`` where groups of other thresholds were scaled each
    by its own coefficient of the one norm: their own norms were not measured.
    ``saved``: the post-clip norm a checkpoint held. ``skipped``: the skip decided on the
    device (non-zero: the grads were left as they were)."""

    clipped: Tensor | None
    factor: Tensor | None = None
    divides: bool = False
    known: bool = True
    saved: Tensor | None = None
    skipped: Tensor | None = None
    units: tuple[Tensor, Tensor] | None = None
    norm_type: float = 2.0

    def post_clip(self, pre: Tensor) -> Tensor | None:
        """The norm(s) of the scaled grads, from the pre-clip ``pre``; None: not known."""
        if self.saved is not None or not self.known:
            return self.saved
        if self.skipped is not None:
            post = dataclasses.replace(self, skipped=None).post_clip(pre)
            return None if post is None else torch.where(self.skipped != 0, pre, post)
        if self.factor is not None:
            return pre / self.factor if self.divides else pre * self.factor
        if self.units is None:
            return pre
        scaled = self.units[0].double() * self.units[1].double()
        norm: Tensor = torch.linalg.vector_norm(scaled, self.norm_type)
        return norm.to(pre.dtype)


def _applied(config: ClipConfig, latest: ClipDecision) -> Applied | None:
    """How ``latest``'s clip scaled the grads, None where it scaled nothing; the flag is
    made here (one launch), the post-clip norm only when read."""
    if latest.grad_scale is not None:
        return Applied(latest.grad_scale > 1, latest.grad_scale, divides=True)
    outcome = latest.rule_outcome
    if outcome is not None and outcome[1].dim() > 0:  # per tensor, or per unit
        p = config.view.norm_types[0]
        return Applied((outcome[1] < 1).any(), units=outcome[:2], norm_type=p)
    shared = _shared(latest.coefficients)
    if shared is None:
        return None
    if isinstance(shared, Tensor) and not config.view.per_group:
        return Applied(shared < 1, shared)
    norm = latest.measurement.norm  # a group scaled by nothing: 1
    factors = torch.stack(
        [c if isinstance(c, Tensor) else norm.new_ones(()) for c in latest.coefficients]
    )
    if not config.view.per_group:
        return Applied((factors < 1).any(), known=False)
    return Applied(factors < 1, factors)


class StepRecord:
    """The last step's norms, and inner steps taken, skipped, and skipped in a row.

    The counters are 0-dim int64 tensors on the grads' device, so updating them never
    syncs. ``lagged`` holds ``consecutive_skips`` as of the end of the previous step,
    readable without waiting. An object of its own, not attributes of the wrapper:
    ``torch.compile`` drops attribute writes on an ``Optimizer``, not on what it holds.
    """

    def __init__(self) -> None:
        self.last_norm: Tensor | None = None
        self.last_group_norms: Tensor | None = None
        self.tensor_norms: Tensor | None = None
        self.tensor_names: tuple[str, ...] = ()
        self.step_count = torch.zeros((), dtype=torch.int64)
        self.skip_count = torch.zeros((), dtype=torch.int64)
        self.consecutive_skips = torch.zeros((), dtype=torch.int64)
        self.lagged = _nonfinite.LaggedCount()
        # False while consecutive_skips is known to be 0 without reading it, so that a
        # step that is not skipped need not zero it (one launch fewer a step).
        self._streak_may_be_set = False
        self.applied: Applied | None = None
        self.clipped_count = torch.zeros((), dtype=torch.int64)

    def record_clip(self, applied: Applied | None, skipped: bool | Tensor) -> None:
        """Keep how the clip of the step :meth:`record` recorded scaled the grads (None:
        it scaled nothing, or the step was skipped on the host) and count a clip: a skip
        decided on the device (``skipped``, a tensor) is no clip."""
        flag = None if applied is None else applied.clipped
        on_device = skipped if isinstance(skipped, Tensor) else None
        if flag is not None:
            if on_device is not None:
                flag = flag & (on_device == 0)
            count = self.clipped_count.to(flag.device)
            if count.shape != flag.shape:  # per group: the first step, or a group added
                kept = count.reshape(-1)[: flag.numel()]
                fill = kept.new_zeros(flag.numel() - kept.numel())
                count = torch.cat([kept, fill]).reshape(flag.shape)
            self.clipped_count = count.add_(flag)
        applied = Applied(None) if applied is None else applied
        # Built whole, not by dataclasses.replace, which torch 2.6's dynamo cannot trace.
        self.applied = Applied(
            flag,
            applied.factor,
            applied.divides,
            applied.known,
            applied.saved,
            on_device,
            applied.units,
            applied.norm_type,
        )

    def last_clipped_norm(self) -> Tensor | None:
        """The post-clip norm(s) of the last step, derived now (see :class:`Applied`)."""
        pre = self.last_norm if self.last_group_norms is None else self.last_group_norms
        return None if pre is None or self.applied is None else self.applied.post_clip(pre)

    def last_clipped(self) -> Tensor | None:
        """Whether the last step's clip scaled the grads: a bool tensor, None before."""
        pre = self.last_norm if self.last_group_norms is None else self.last_group_norms
        if pre is None or self.applied is None:
            return None
        flag = self.applied.clipped
        return torch.zeros(pre.shape, dtype=torch.bool, device=pre.device) if flag is None else flag

    def record(
        self, measured: Measurement, skipped: bool | Tensor, streak: int, track: bool
    ) -> None:
        """Record a step that has run (or was skipped) without raising: its norms, and
        ``skipped`` decided on the host (a bool; ``streak`` the skips in a row before it)
        or on the device (a 0-dim tensor, non-zero for a skip)."""
        norm = measured.norm
        self.last_norm, self.last_group_norms = norm, measured.stacked
        if track and measured.tensor_norms is not None:
            self.tensor_norms, self.tensor_names = measured.tensor_norms, measured.tensor_names
        if self.step_count.device != norm.device:
            for name in _COUNTERS:
                setattr(self, name, getattr(self, name).to(norm.device))
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
                self.lagged.set(0)
            self._streak_may_be_set = False
            return
        self._streak_may_be_set = True

    def state(self) -> dict[str, Tensor | None]:
        """The norms and the counters, by their names in the ``"clip"`` entry."""
        return {
            "last_norm": self.last_norm,
            "last_group_norms": self.last_group_norms,
            "last_clipped_norm": self.last_clipped_norm(),
            "last_clipped": self.last_clipped(),
            **{name: getattr(self, name) for name in (*_COUNTERS, "clipped_count")},
        }

    def load(
        self,
        counters: dict[str, Tensor],
        last: dict[str, Tensor | None],
    ) -> None:
        """Replace the record (validated by the caller, so reading a counter is safe):
        ``counters`` by name, ``last``: ``last_norm``, ``last_group_norms``,
        ``last_clipped_norm`` and ``last_clipped`` (None: not saved)."""
        self.last_norm, self.last_group_norms = last["last_norm"], last["last_group_norms"]
        self.tensor_norms, self.tensor_names = None, ()
        for name in (*_COUNTERS, "clipped_count"):
            setattr(self, name, counters[name])
        flag, post = last["last_clipped"], last["last_clipped_norm"]
        self.applied = None if flag is None else Applied(flag, known=post is not None, saved=post)
        self._streak_may_be_set = True
        self.lagged.set(int(self.consecutive_skips))  # a load, not a step: this may wait


def check_rule_groups(groups: list[dict[str, Any]], rule: ClipRule | None) -> None:
    """With a rule, no group may carry a threshold of its own: the rule sets them all;
    and one clip group at most (others left unclipped): a rule keeps one history."""
    if rule is None:
        return
    layout = clip_layout(groups)
    if layout is not None and len(layout[1]) > 1:
        raise ValueError(
            f"param groups name the clip groups {layout[1]} in {CLIP_GROUP_KEY!r}, but "
            f"max_norm is {rule!r}, which keeps one history of one norm: one clip group "
            "(the others None), or a number as max_norm"
        )
    for index, group in enumerate(groups):
        value = group.get(MAX_NORM_KEY, math.inf)
        if not (isinstance(value, (int, float)) and value == math.inf):
            raise ValueError(
                f"param_groups[{index}][{MAX_NORM_KEY!r}] is {value!r}, but max_norm is "
                f"{rule!r}, which sets the threshold of every group; remove the group's own"
            )


# ---------------------------------------------------------------------------- helpers


def _check_groups(optimizer: Optimizer, config: ClipConfig) -> tuple[Any, bool]:
    """Validate the groups' settings where they changed since the last step, and ask
    DeepSpeed's watch about this call where it must be asked (attached, or the groups
    changed). Returns the ZeRO call (or None) and whether the call ends the step."""
    view, groups, defaults = config.view, optimizer.param_groups, optimizer.defaults
    # Compiled, every check is traced into the graph's guards (free at run time) and the
    # cache is neither read nor written: a cache filled by the first compiled step would
    # send the second down another path, a recompile.
    compiling = torch.compiler.is_compiling()
    now: list[object] = []
    same = False
    if not compiling:
        now = [groups, defaults.get(MAX_NORM_KEY), defaults.get(NORM_TYPE_KEY)]
        for g in groups:
            now += [g, g["params"], len(g["params"]), g.get(MAX_NORM_KEY), g.get(NORM_TYPE_KEY)]
            now.append(g.get(CLIP_GROUP_KEY))
        same = len(now) == len(view.seen)
        for a, b in zip(now, view.seen, strict=False):
            if a is not b and not (type(a) is int and a == b):
                same = False
                break
    watch = config.deepspeed
    if same and watch.binding is None:
        return None, True
    if not same:
        max_norm, norm_type = defaults[MAX_NORM_KEY], defaults[NORM_TYPE_KEY]
        thresholds, norm_types, layout = check_groups(groups, max_norm, norm_type, config.per_group)
        check_rule_groups(groups, config.rule)
        names = [] if layout is None else layout[1]
        per_group = config.per_group or len(names) > 1
        if config.norm_scope.pp_group is not None:
            config.norm_scope.check_stages(per_group, norm_types, thresholds, names)
        view.thresholds, view.norm_types, view.layout = thresholds, norm_types, layout
        view.per_group, view.one = per_group, _one_threshold(thresholds)
        # a fused kernel's grad_scale scales every grad: not with a group left unclipped
        view.fusable = _fold.takes_scale(optimizer) and (layout is None or None not in layout[0])
        view.seen = now
    zero, final = watch.call(groups)
    if zero is not None and view.layout is not None:
        raise ValueError(
            f"{zero.caller} steps flat partitions of its own param groups, one per call, "
            f"so the wrapper cannot tell its clip groups apart: remove {CLIP_GROUP_KEY!r}"
        )
    if not final and zero is None:
        view.seen = []  # DeepSpeed's start-up step: the next one is watched again
    return zero, final


def _plain(config: ClipConfig, zero: Any, flat: list[Tensor]) -> bool:
    """A fixed threshold's global norm of plain grads on this rank alone."""
    scope = config.norm_scope
    simple = config.rule is None and not config.view.per_group and not config.track_tensor_norms
    local = zero is None and scope.process_group is None and scope.pp_group is None
    return simple and local and len(flat) > 0 and all(type(g) is Tensor for g in flat)


def _measure_and_rule(
    optimizer: Optimizer, config: ClipConfig, grads: list[list[Tensor]], zero: Any
) -> tuple[Measurement, list[Coefficient], tuple[Tensor, Tensor, Tensor] | None]:
    """The step's norms and, with a rule, its coefficients and what it decided.

    A unit-wise rule decides first: its squares give the norms (no grad read again, no
    collective more; its ``check`` NaN where the ranks' grads do not line up). With
    per-tensor norms wanted (tracked, or a per-tensor rule) all come from one per-tensor
    pass (one collective for DTensor grads). Under pipeline stages the totals are then
    combined over the stages. Under DeepSpeed's ZeRO optimizer the norm may be its own.
    """
    rule, track, groups = config.rule, config.track_tensor_norms, optimizer.param_groups
    view, scope, given = config.view, config.norm_scope, None
    norm_types, per_group, layout = view.norm_types, view.per_group, view.layout
    params = [group["params"] for group in groups]
    names = _measure.grad_names(groups) if track else None
    if layout is not None:
        params = _regrouped(params, layout)
        names = None if names is None else _regrouped(names, layout)
    if zero is not None:  # DeepSpeed's ZeRO optimizer: its group, or its norm of them all
        each = track or isinstance(rule, UnitWiseRule) or (rule is not None and rule.per_tensor)
        scope, given = _deepspeed.zero_source(zero, scope, norm_types, per_group, each)
    default = float(optimizer.defaults[NORM_TYPE_KEY])
    if isinstance(rule, UnitWiseRule):
        coefficients, outcome, squares, check = _rule_step.unit_rule_coefficients(
            rule, params, grads, norm_types[0]
        )
        if squares is not None and all(p == 2.0 for p in norm_types):
            measured = _measure.measure_from_squares(
                grads, names, squares, default, per_group, track, check
            )
            measured = _measure.across_stages(
                measured, norm_types, default, per_group, scope.pp_group
            )
        else:
            measured = _measure_grads(config, grads, params, scope, names, default)
        return measured, coefficients, outcome
    if given is not None:
        measured = Measurement(given, [given] * len(grads), None)
    else:
        measured = _measure_grads(config, grads, params, scope, names, default)
    if rule is None:
        return measured, [], None
    stages = scope.pp_group is not None
    coefficients, outcome = _rule_step.rule_coefficients(
        rule, grads, measured, norm_types[0], stages
    )
    return measured, coefficients, outcome


def _measure_grads(
    config: ClipConfig,
    grads: list[list[Tensor]],
    params: list[list[Tensor]],
    scope: NormScope,
    names: list[list[str]] | None,
    default: float,
) -> Measurement:
    """The norms from the grads (and ``params``, each group's): per tensor where wanted,
    else the global or group norms."""
    norm_types, per_group = config.view.norm_types, config.view.per_group
    per_rule = config.rule is not None and config.rule.per_tensor
    if scope.process_group is None and (config.track_tensor_norms or per_rule):
        measured = _measure.measure_per_tensor(
            grads,
            names,
            norm_types,
            default,
            per_group,
            config.foreach,
            lambda: params,
            strict=per_rule,
        )
        return _measure.across_stages(measured, norm_types, default, per_group, scope.pp_group)
    return _measure.measure(
        grads,
        norm_types,
        default,
        per_group,
        scope,
        config.foreach,
        lambda: _measure.flatten(params),
    )


def _step_with_closure(
    optimizer: Optimizer,
    config: ClipConfig,
    record: StepRecord,
    closure: Closure,
    loss: Any,
    first: ClipDecision,
) -> tuple[Any, ClipDecision]:
    """Run the inner step with a closure that returns ``loss`` once and afterwards
    re-evaluates, measures and clips (no skip, no fold: the step has begun); the norms of
    its last evaluation are the step's."""
    pending, latest = [loss], [first]

    def clipped_closure() -> Any:
        if pending:
            return pending.pop()
        with torch.enable_grad():
            again = closure()
        redone = decide(optimizer, config, record, False, False)
        scale(redone, config.foreach)
        latest.append(redone)
        return again

    return inner_step(optimizer, clipped_closure), latest[-1]


def _regrouped(items: list[list[Any]], layout: Layout) -> list[list[Any]]:
    """Each param group's ``items`` (grads, parameters, names) joined by clip group, those
    of groups left unclipped left out."""
    joined: list[list[Any]] = [[] for _ in layout[1]]
    for own, at in zip(items, layout[0], strict=True):
        if at is not None:
            joined[at].extend(own)
    return joined


def _scales_nothing(threshold: float | Tensor | None) -> bool:
    """A float threshold of inf: the norm is measured, nothing is scaled."""
    return isinstance(threshold, float) and math.isinf(threshold)


def _one_threshold(thresholds: list[float | Tensor]) -> float | Tensor | None:
    """The threshold every group has (equal numbers, or one tensor), else None."""
    first = thresholds[0]
    for t in thresholds[1:]:
        if not same_threshold(t, first):
            return None
    return first


def _threshold_coefficients(
    group_norms: list[Tensor], thresholds: list[float | Tensor]
) -> list[Coefficient]:
    """Per group, ``min(1, max_norm / (norm + eps))`` on the device; None: scale nothing.
    Groups that share a norm object and an equal threshold share one coefficient."""
    coefficients: list[Coefficient] = []
    # Matched by identity in a list, not by id() keys: torch 2.6's dynamo cannot trace
    # id() of a tensor made in the graph.
    made: list[tuple[Tensor, float | Tensor, Tensor]] = []
    for norm, threshold in zip(group_norms, thresholds, strict=True):
        if _scales_nothing(threshold):
            coefficients.append(None)
            continue
        found = None
        for seen_norm, seen_threshold, coefficient in made:
            if seen_norm is norm and _one_threshold([seen_threshold, threshold]) is not None:
                found = coefficient
                break
        if found is None:
            found = _scale.clip_coefficient(threshold, norm)
            made.append((norm, threshold, found))
        coefficients.append(found)
    return coefficients


def _shared(
    coefficients: list[Coefficient], grads: list[list[Tensor]] | None = None
) -> Coefficient | bool:
    """The coefficient every group (with grads, where ``grads`` are given) shares: None
    (scale nothing) or a 0-dim tensor; False where they differ or one is per grad."""
    found: list[Coefficient] = []
    for index, c in enumerate(coefficients):
        if grads is not None and not grads[index]:
            continue
        for seen in found:  # identity, as above
            if c is seen:
                break
        else:
            found.append(c)
    if not found:
        return None
    return found[0] if len(found) == 1 and not isinstance(found[0], tuple) else False


def _dtypes(grads: list[list[Tensor]], measured: Measurement) -> set[torch.dtype]:
    """The dtypes of the grads: from the measurement's grouping where it has one."""
    if measured.groups is not None:
        return {dtype for _, dtype in (*measured.groups.dense, *measured.groups.sparse)}
    return {g.dtype for group in grads for g in group}


def _coefficient_values(
    coefficients: list[Coefficient], grad_scale: Tensor | None, like: Tensor
) -> Tensor:
    """Every coefficient (or the folded ``grad_scale``) in one 1-D tensor, for a
    finiteness check; a shared one is in it once per group (telling them apart by id()
    made torch.compile guard on each step's new coefficient)."""
    values = [] if grad_scale is None else [grad_scale.reshape(-1)]
    for coefficient in coefficients:
        for c in coefficient if isinstance(coefficient, tuple) else (coefficient,):
            if c is not None:
                values.append(c.reshape(-1))
    return torch.cat(values) if values else like.new_zeros(0)


def _local(tensors: list[Tensor]) -> list[Tensor]:
    """DTensor grads' local shards (the scale is elementwise), plain ones as they are."""
    if all(type(t) is Tensor for t in tensors):
        return tensors
    return _mesh.local_tensors(tensors)


def _scale_each_(grads: list[Tensor], coefficients: list[Tensor], foreach: bool | None) -> None:
    """Multiply each grad in place by its own coefficient (broadcastable to it): one
    ``_foreach_mul_`` per device and dtype unless ``foreach=False``, sparse grads one by
    one. (On CUDA torch has no foreach op scaling each tensor by its own device scalar:
    ATen runs it grad by grad.)"""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, grad in enumerate(grads):
        if grad.is_sparse or foreach is False:
            grad.mul_(coefficients[i].to(grad.device))
        else:
            groups.setdefault((grad.device, grad.dtype), []).append(i)
    for (device, _), indices in groups.items():
        torch._foreach_mul_(
            [grads[i] for i in indices], [coefficients[i].to(device) for i in indices]
        )
