"""One ``ClippedOptimizer.step()``: decide (changes nothing), scale or fold, step, commit."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from clipopt._dist import _deepspeed, _mesh
from clipopt._dist._deepspeed import Watch
from clipopt._dist._reduce import NormScope
from clipopt._kernels import _norms, _scale
from clipopt._step import _fold, _measure, _nonfinite
from clipopt._step._measure import Coefficient, Measurement, Orders
from clipopt._step._saved import COUNTERS
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

_compiler: Any = torch.compiler  # its disable() is untyped
Outcome = tuple[Tensor, Tensor, Tensor]  # what a rule decided: norms, coefficients, thresholds


@dataclass(eq=False)
class GroupView:
    """The (clip) groups' settings as last validated from the objects ``seen``."""

    seen: list[object] = field(default_factory=list)
    thresholds: list[float | Tensor] = field(default_factory=list)
    layout: Layout | None = None
    orders: Orders = field(default_factory=lambda: Orders([], 2.0, False))
    one: float | Tensor | None = None  # the threshold all groups share
    fusable: bool = False
    plain: bool = False  # a fixed threshold's global norm on this rank alone


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


@dataclass(frozen=True)
class ClipDecision:
    """A skip decided on the host (``skip``) or device (``found_inf``; compiled: ``skip_flag``)."""

    grads: list[list[Tensor]]
    measurement: Measurement
    coefficients: list[Coefficient]
    fold: bool = False
    grad_scale: Tensor | None = None
    skip: bool = False
    streak: int = 0
    found_inf: Tensor | None = None
    rule_outcome: Outcome | None = None
    spike: Tensor | None = None
    skip_flag: Tensor | None = None
    final: bool = True


def step(wrapper: Any, closure: Closure | None = None) -> Any:
    """``ClippedOptimizer.step``; a closure returns the first loss, then re-evaluates and clips."""
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
    """Measure, choose the scale, rule on a non-finite norm or a spike; change nothing."""
    view, rule, mode = config.view, config.rule, config.nonfinite
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
        # the shortest path: one grouped norm of plain grads
        if view.plain and zero is None and len(flat) > 0 and all(type(g) is Tensor for g in flat):
            norm, grouped = _norms.grouped_total_norm(flat, view.orders.types[0], config.foreach)
            measured = Measurement(norm, [norm] * len(grads), None, groups=grouped)
        else:
            measured, coefficients, outcome = _measure_and_rule(optimizer, config, grads, zero)
        threshold = None if rule is not None or view.orders.per_group else view.one
        one = _shared(coefficients) if rule is not None else None
        if rule is None and threshold is None:
            coefficients = _threshold_coefficients(measured.group_norms, view.thresholds)
        fold = (
            may_fold
            and view.fusable
            and (threshold is not None or (rule is not None and one is not False))
            and _fold.can_fold(optimizer, flat, measured.groups)
        )
        grad_scale = None
        if isinstance(threshold, float) and math.isinf(threshold):  # measured, not scaled
            coefficients = [] if fold else [None] * len(grads)
        elif threshold is not None and fold:
            grad_scale = _scale.grad_scale_of(threshold, measured.norm)
        elif threshold is not None:
            coefficients = [_scale.clip_coefficient(threshold, measured.norm)] * len(grads)
        elif fold and isinstance(one, Tensor):
            grad_scale = torch.reciprocal(one.float())
        spike = found_inf = flag = None
        streak: int | None = None
        limit = config.max_consecutive_skips
        spikes = config.skip_spikes if may_skip else None
        # Compiled, judged from the first step (not recompiled when it may fire)
        if spikes is not None and (torch.compiler.is_compiling() or spikes.may_trigger()):
            spike = spikes.verdict(measured.norm)
        if mode != "propagate" or spike is not None:
            norms = measured.norm if measured.stacked is None else measured.stacked
            parts = [] if grad_scale is None else [grad_scale.reshape(-1)]
            for coefficient in coefficients:
                for c in coefficient if isinstance(coefficient, tuple) else (coefficient,):
                    if c is not None:
                        parts.append(c.reshape(-1))
            values = torch.cat(parts) if parts else norms.new_zeros(0)
            if mode == "assert":
                _nonfinite.assert_finite(norms, values)
            if spike is None and mode == "assert":
                pass  # asserted
            elif fold and mode != "raise" and _fold.skips_cleanly(optimizer):
                found_inf = _nonfinite.device_verdict(norms, values, mode, spike, torch.float32)
            else:
                if torch.compiler.is_compiling():
                    flag = _nonfinite.device_verdict(norms, values, mode, spike, torch.int64)
                past = record.consecutive_skips
                streak = _nonfinite.host_verdict(norms, values, past, mode, limit, may_skip, spike)
        verdict = (streak is not None, streak or 0, found_inf, outcome, spike, flag)
        return ClipDecision(grads, measured, coefficients, fold, grad_scale, *verdict, final)


def apply(
    optimizer: Optimizer,
    config: ClipConfig,
    record: StepRecord,
    decision: ClipDecision,
    closure: Closure | None,
    loss: Any,
) -> tuple[Any, ClipDecision]:
    """Skip, the folded or the inner step (each breaks a graph); its result and last decision."""
    if decision.skip:
        return _skipped(loss), decision
    if decision.fold:
        limit = config.max_consecutive_skips
        if limit is not None and decision.found_inf is not None and config.nonfinite == "skip":
            _nonfinite.check_lagged_streak(record.lagged, limit)
        return _fold.apply_folded(optimizer, decision.grad_scale, decision.found_inf), decision
    if closure is None:
        return inner_step(optimizer, None), decision
    pending, latest = [loss], [decision]

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


# A skip breaks the graph as a step does: commit() is traced in one frame, not recompiled.
_skipped: Any = _compiler.disable(lambda loss: loss)


@torch.no_grad()  # grads made with create_graph=True must not record the scale
def scale(decision: ClipDecision, foreach: bool | None) -> None:
    grads, coefficients = decision.grads, decision.coefficients
    grouped = decision.measurement.groups
    shared = _shared(coefficients, grads)
    if shared is None:
        return
    # Not compiled: the grouping is keyed by device, which dynamo cannot guard cheaply.
    if grouped is not None and isinstance(shared, Tensor) and not torch.compiler.is_compiling():
        _scale.scale_groups_(grouped, shared, foreach)
        return
    # By identity, not id(): torch.compile guards on an id, and would recompile every step.
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
        _scale.scale_each_(_local([g for g, _ in each]), [c for _, c in each], foreach)


def commit(
    config: ClipConfig, record: StepRecord, decision: ClipDecision, latest: ClipDecision
) -> None:
    """Keep the record and the rules' state; ``latest``: the decision the grads were scaled by."""
    if not decision.final:
        return
    skipped: bool | Tensor | None = decision.skip_flag  # compiled: the verdict, as a tensor
    if skipped is None:
        skipped = decision.skip if decision.found_inf is None else decision.found_inf
    on_device = skipped if isinstance(skipped, Tensor) else None
    applied = None if skipped is True else _applied(config, latest, on_device)
    record.record(latest.measurement, skipped, decision.streak, config.track_tensor_norms, applied)
    if config.rule is not None and decision.rule_outcome is not None:
        config.rule.commit(*decision.rule_outcome)
    if config.skip_spikes is not None:
        config.skip_spikes.commit(decision.measurement.norm, decision.spike)


@dataclass(frozen=True)
class Applied:
    """How the clip scaled the grads (``clipped``: some), for the post-clip norm when read."""

    clipped: Tensor | None
    factor: Tensor | None = None  # pre * factor, or pre / factor where it ``divides``
    divides: bool = False
    units: tuple[Tensor, Tensor] | None = None  # a rule's norms and coefficients
    norm_type: float = 2.0
    skipped: Tensor | None = None  # the skip decided on the device
    fixed: bool = False  # the post-clip norm is ``saved``: loaded, or not known
    saved: Tensor | None = None

    def post_clip(self, pre: Tensor) -> Tensor | None:
        if self.fixed:
            return self.saved
        post = pre
        if self.factor is not None:
            post = pre / self.factor if self.divides else pre * self.factor
        elif self.units is not None:
            scaled = self.units[0].double() * self.units[1].double()
            post = torch.linalg.vector_norm(scaled, self.norm_type).to(pre.dtype)
        return post if self.skipped is None else torch.where(self.skipped != 0, pre, post)


def _applied(config: ClipConfig, latest: ClipDecision, skipped: Tensor | None) -> Applied | None:
    factor, divides, fixed, units = None, False, False, None
    outcome, (types, _, per_group) = latest.rule_outcome, config.view.orders
    if latest.grad_scale is not None:
        factor, divides, clipped = latest.grad_scale, True, latest.grad_scale > 1
    elif outcome is not None and outcome[1].dim() > 0:  # per tensor, or per unit
        units, clipped = (outcome[0], outcome[1]), (outcome[1] < 1).any()
    else:
        shared = _shared(latest.coefficients)
        if shared is None:
            return None
        if isinstance(shared, Tensor) and not per_group:
            factor, clipped = shared, shared < 1
        else:
            norm = latest.measurement.norm  # a group scaled by nothing: 1
            factors = torch.stack(
                [c if isinstance(c, Tensor) else norm.new_ones(()) for c in latest.coefficients]
            )
            factor, clipped = (factors, factors < 1) if per_group else (None, (factors < 1).any())
            fixed = not per_group
    if skipped is not None:
        clipped = clipped & (skipped == 0)
    return Applied(clipped, factor, divides, units, types[0], skipped, fixed)


class StepRecord:
    """The last step's norms and counters (compiled, writes onto an Optimizer are dropped)."""

    def __init__(self) -> None:
        self.last_norm: Tensor | None = None
        self.last_group_norms: Tensor | None = None
        self.tensor_norms: Tensor | None = None
        self.tensor_names: tuple[str, ...] = ()
        self.step_count = torch.zeros((), dtype=torch.int64)
        self.skip_count = torch.zeros((), dtype=torch.int64)
        self.consecutive_skips = torch.zeros((), dtype=torch.int64)
        self.lagged = _nonfinite.LaggedCount()
        self._streak_may_be_set = False  # False while consecutive_skips is known to be 0
        self.applied: Applied | None = None
        self.clipped_count = torch.zeros((), dtype=torch.int64)

    def last_clipped_norm(self) -> Tensor | None:
        pre = self.last_norm if self.last_group_norms is None else self.last_group_norms
        return None if pre is None or self.applied is None else self.applied.post_clip(pre)

    def last_clipped(self) -> Tensor | None:
        pre = self.last_norm if self.last_group_norms is None else self.last_group_norms
        if pre is None or self.applied is None:
            return None
        flag = self.applied.clipped
        return torch.zeros(pre.shape, dtype=torch.bool, device=pre.device) if flag is None else flag

    def record(
        self,
        measured: Measurement,
        skipped: bool | Tensor,
        streak: int,
        track: bool,
        applied: Applied | None,
    ) -> None:
        norm, flag = measured.norm, None if applied is None else applied.clipped
        self.last_norm, self.last_group_norms = norm, measured.stacked
        if track and measured.tensor_norms is not None:
            self.tensor_norms, self.tensor_names = measured.tensor_norms, measured.tensor_names
        if self.step_count.device != norm.device:
            for name in COUNTERS:
                setattr(self, name, getattr(self, name).to(norm.device))
        if flag is not None:
            count = self.clipped_count.to(flag.device)
            if count.shape != flag.shape:  # per group: the first step, or a group added
                kept = count.reshape(-1)[: flag.numel()]
                fill = kept.new_zeros(flag.numel() - kept.numel())
                count = torch.cat([kept, fill]).reshape(flag.shape)
            self.clipped_count = count.add_(flag)
        self.applied = Applied(None) if applied is None else applied
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
        self._streak_may_be_set = skipped is not False

    def state(self) -> dict[str, Tensor | None]:
        return {
            "last_norm": self.last_norm,
            "last_group_norms": self.last_group_norms,
            "last_clipped_norm": self.last_clipped_norm(),
            "last_clipped": self.last_clipped(),
            **{name: getattr(self, name) for name in (*COUNTERS, "clipped_count")},
        }

    def load(self, counters: dict[str, Tensor], last: dict[str, Tensor | None]) -> None:
        self.last_norm, self.last_group_norms = last["last_norm"], last["last_group_norms"]
        self.tensor_norms, self.tensor_names = None, ()
        for name in (*COUNTERS, "clipped_count"):
            setattr(self, name, counters[name])
        flag, post = last["last_clipped"], last["last_clipped_norm"]
        self.applied = None if flag is None else Applied(flag, fixed=True, saved=post)
        self._streak_may_be_set = True
        self.lagged.set(int(self.consecutive_skips))  # a load, not a step: this may wait


def check_rule_groups(groups: list[dict[str, Any]], rule: ClipRule | None) -> None:
    """With a rule, no group's own threshold and one clip group at most (one history)."""
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


def _check_groups(optimizer: Optimizer, config: ClipConfig) -> tuple[Any, bool]:
    """Validate the groups where changed; the ZeRO call (or None) and whether it ends the step."""
    view, groups, defaults = config.view, optimizer.param_groups, optimizer.defaults
    # Compiled, the checks are traced into guards, no cache (the second step would recompile)
    now: list[object] = []
    same = False
    if not torch.compiler.is_compiling():
        now = [groups, defaults.get(MAX_NORM_KEY), defaults.get(NORM_TYPE_KEY)]
        for g in groups:
            now += [g, g["params"], len(g["params"]), g.get(MAX_NORM_KEY), g.get(NORM_TYPE_KEY)]
            now.append(g.get(CLIP_GROUP_KEY))
        same = len(now) == len(view.seen)
        for a, b in zip(now, view.seen, strict=False):  # a loop: no generator's frames
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
        scope = config.norm_scope
        if scope.pp_group is not None:
            scope.check_stages(per_group, norm_types, thresholds, names)
        view.thresholds, view.layout, first = thresholds, layout, thresholds[0]
        view.orders = Orders(norm_types, float(norm_type), per_group)
        view.one = first if all(same_threshold(t, first) for t in thresholds) else None
        # a fused kernel's grad_scale scales every grad: not with a group left unclipped
        view.fusable = _fold.takes_scale(optimizer) and (layout is None or None not in layout[0])
        local = scope.process_group is None and scope.pp_group is None
        view.plain = config.rule is None and not (per_group or config.track_tensor_norms) and local
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


def _measure_and_rule(
    optimizer: Optimizer, config: ClipConfig, grads: list[list[Tensor]], zero: Any
) -> tuple[Measurement, list[Coefficient], Outcome | None]:
    rule, track, groups = config.rule, config.track_tensor_norms, optimizer.param_groups
    scope, given, orders, layout = config.norm_scope, None, config.view.orders, config.view.layout
    norm_types = orders.types
    params = [group["params"] for group in groups]
    names = _measure.grad_names(groups) if track else None
    if layout is not None:
        params = _regrouped(params, layout)
        names = None if names is None else _regrouped(names, layout)
    unit = rule if isinstance(rule, UnitWiseRule) else None
    per_rule = rule is not None and rule.per_tensor
    if zero is not None:  # DeepSpeed's ZeRO optimizer: its group, or its norm of them all
        each = track or unit is not None or per_rule
        scope, given = _deepspeed.zero_source(zero, scope, norm_types, orders.per_group, each)
    coefficients: list[Coefficient] = []
    outcome = squares = check = None
    if unit is not None:
        coefficients, outcome, squares, check = _unit_coefficients(
            unit, params, grads, norm_types[0]
        )
    if squares is not None and all(p == 2.0 for p in norm_types):
        measured = _measure.measure_from_squares(
            grads, names, squares, orders, track, check, scope.pp_group
        )
    elif given is not None and unit is None:
        measured = Measurement(given, [given] * len(grads), None)
    elif scope.process_group is None and (track or per_rule):
        measured = _measure.measure_per_tensor(
            grads, names, orders, config.foreach, lambda: params, per_rule, scope.pp_group
        )
    else:
        every = lambda: _measure.flatten(params)  # noqa: E731
        measured = _measure.measure(grads, orders, scope, config.foreach, every)
    if rule is None or unit is not None:
        return measured, coefficients, outcome
    if not per_rule:
        coefficient, threshold = rule.decide(measured.norm, norm_type=norm_types[0])
        return measured, [coefficient] * len(grads), (measured.norm, coefficient, threshold)
    if not any(grads):
        return measured, [None] * len(grads), None
    norms = measured.tensor_norms
    assert norms is not None  # measure_per_tensor's: the constructor rules out a process_group
    # under pipeline stages the norms are this stage's, the total the whole model's
    total = measured.norm if scope.pp_group is not None else None
    coefficients_1d, thresholds = rule.decide(norms, norm_type=norm_types[0], total_norm=total)
    per_grad = _by_group(coefficients_1d.unbind(), grads)
    return measured, per_grad, (norms, coefficients_1d, thresholds)


def _unit_coefficients(
    rule: UnitWiseRule, params: list[list[Tensor]], grads: list[list[Tensor]], norm_type: float
) -> tuple[list[Coefficient], Outcome | None, tuple[Tensor, ...] | None, Tensor | None]:
    every = [p for group in params for p in group]
    sharded = {id(q) for q in _mesh.dtensors(every)}
    slotted = [p for p in every if id(p) in sharded or p.grad is not None]
    flat = [g for group in grads for g in group]
    if slotted:
        rule.check_norm_type(norm_type)
    decision = rule.decide_slots(slotted, [p.grad for p in slotted], norm_type) if sharded else None
    what = "parameters"
    if not slotted or (decision is None and not flat):
        return [None] * len(grads), None, None, None
    if decision is None:
        slotted, what = [p for p in every if p.grad is not None], "grads"
        decision = rule.decide_units(slotted, flat, norm_type)
    for name, given in (("coefficients", decision.per_grad), ("squares", decision.squares)):
        if given is not None and len(given) != len(slotted):
            raise ValueError(f"{rule!r} gave {len(given)} {name} for {len(slotted)} {what}")
    here = [p.grad is not None for p in slotted]
    per_grad = [c for c, has in zip(decision.per_grad, here, strict=True) if has]
    squares = decision.squares
    if squares is not None:
        squares = tuple(s for s, has in zip(squares, here, strict=True) if has)
    coefficients: list[Coefficient] = [
        c if isinstance(c, tuple) and any(x is not None for x in c) else None
        for c in _by_group(per_grad, grads)
    ]
    outcome = (decision.norms, decision.coefficients, decision.thresholds) if flat else None
    return coefficients, outcome, squares, decision.check


def _by_group(per_grad: Sequence[Tensor | None], grads: list[list[Tensor]]) -> list[Coefficient]:
    split: list[Coefficient] = []
    start = 0
    for group in grads:  # a loop, as torch 2.6's dynamo traces it
        split.append(tuple(per_grad[start : start + len(group)]) if len(group) > 0 else None)
        start += len(group)
    return split


def _regrouped(items: list[list[Any]], layout: Layout) -> list[list[Any]]:
    joined: list[list[Any]] = [[] for _ in layout[1]]
    for own, at in zip(items, layout[0], strict=True):
        if at is not None:
            joined[at].extend(own)
    return joined


def _threshold_coefficients(
    group_norms: list[Tensor], thresholds: list[float | Tensor]
) -> list[Coefficient]:
    coefficients: list[Coefficient] = []
    made: list[tuple[Tensor, float | Tensor, Tensor]] = []  # by identity: dynamo 2.6 has no id()
    for norm, threshold in zip(group_norms, thresholds, strict=True):
        if isinstance(threshold, float) and math.isinf(threshold):
            coefficients.append(None)
            continue
        for seen_norm, seen_threshold, found in made:  # noqa: B007 (read after the loop)
            if seen_norm is norm and same_threshold(seen_threshold, threshold):
                break
        else:
            found = _scale.clip_coefficient(threshold, norm)
            made.append((norm, threshold, found))
        coefficients.append(found)
    return coefficients


def _shared(
    coefficients: list[Coefficient], grads: list[list[Tensor]] | None = None
) -> Coefficient | bool:
    """The coefficient every group (with grads) shares, None, or False (they differ)."""
    found: list[Coefficient] = []  # the first, and any other (by identity, as above)
    for index, c in enumerate(coefficients):
        if (grads is None or grads[index]) and (len(found) == 0 or c is not found[0]):
            found.append(c)
    if not found:
        return None
    return found[0] if len(found) == 1 and not isinstance(found[0], tuple) else False


def _local(tensors: list[Tensor]) -> list[Tensor]:
    if all(type(t) is Tensor for t in tensors):
        return tensors
    return _mesh.local_tensors(tensors)
