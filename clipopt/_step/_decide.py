"""The decision of a ``ClippedOptimizer`` step: measure, then decide; nothing changes.

A step is measure -> decide -> apply (:mod:`clipopt._step._parts` holds the parts,
:mod:`clipopt._step._rule_step` what a clip rule decides in them).
:func:`decide` is the first two: it reads each group's settings, collects the grads and
measures them (:func:`_measure`: one reduction, one per-tensor pass, or a unit-wise
rule's squares), turns the norms into one coefficient per group (:func:`_coefficients`:
a threshold, or a rule's decision), judges a spike and a non-finite norm, and returns
one :class:`clipopt._step._parts.ClipDecision` with whether to fold it into a fused kernel. The
wrapper applies and records it; :func:`decide_and_scale` is :func:`decide` and the
explicit scale, which a compiled step must trace together. What it reads of the
wrapper is a :class:`ClipConfig`, made for each decision, since a load may change the
settings; the inner optimizer and the step record are passed as they are.

What a decision could not work with is refused before any step: the constructor's
arguments by :func:`check_config`, a group's own threshold beside a rule by
:func:`check_rule_groups` (also at each step, since a group may be given one later).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from clipopt._dist import _deepspeed
from clipopt._dist._reduce import NormScope
from clipopt._step import _fold, _monitor, _parts, _rule_step
from clipopt._step._clip_state import (
    MAX_NORM_KEY,
    NORM_TYPE_KEY,
    NonFinite,
    Settings,
)
from clipopt._step._nonfinite import (
    StepRecord,
    device_verdict,
    host_verdict,
    skip_flag,
    spike_verdict,
)
from clipopt.rules._base import ClipRule
from clipopt.rules._spike_skip import SpikeSkip
from clipopt.rules._unit import UnitWiseRule

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "ClipConfig",
    "check_config",
    "check_rule_groups",
    "commit",
    "decide",
    "decide_and_scale",
]


@dataclass(frozen=True)
class ClipConfig:
    """What a decision reads of the wrapper: its rules and its settings."""

    rule: ClipRule | None
    skip_spikes: SpikeSkip | None
    per_group: bool
    nonfinite: NonFinite
    max_consecutive_skips: int | None
    foreach: bool | None
    norm_scope: NormScope
    track_tensor_norms: bool
    deepspeed: _deepspeed.Watch | None = None


def check_config(
    rule: ClipRule | None,
    settings: Settings,
    process_group: ProcessGroup | None,
    track_tensor_norms: Any,
    skip_spikes: Any,
) -> None:
    """Refuse a wrapper's arguments that no decision could measure with, or of the wrong
    type: a rule per group, a per-tensor or unit-wise rule or tracked norms with a
    ``process_group`` (it splits tensors across ranks), a unit-wise rule's bad order."""
    if rule is not None and settings.per_group:
        raise ValueError(
            f"per_group=True cannot take a clip rule ({rule!r}): a rule keeps one "
            "history of one norm; use per_group=False, or per_tensor=True where the "
            "rule has it"
        )
    local = rule is not None and (rule.per_tensor or isinstance(rule, UnitWiseRule))
    if local and process_group is not None:
        raise ValueError(
            f"{rule!r} measures each grad on its own, and with a process_group each rank "
            "holds other tensors (pipeline stages, model-parallel slices), so its grads "
            "would differ by rank: per-tensor and unit-wise rules need unsplit parameters "
            "(DDP), or, per tensor, DTensor grads (FSDP2, tensor parallel) and no "
            "process_group"
        )
    if isinstance(rule, UnitWiseRule):
        rule.check_norm_type(settings.norm_type)
    if not isinstance(track_tensor_norms, bool):
        raise TypeError(f"track_tensor_norms must be a bool, got {track_tensor_norms!r}")
    if track_tensor_norms and process_group is not None:
        raise ValueError(
            "track_tensor_norms=True measures each grad on its own, which a process_group "
            "splits across ranks; it needs unsplit parameters"
        )
    if skip_spikes is not None and not isinstance(skip_spikes, SpikeSkip):
        raise TypeError(f"skip_spikes must be a clipopt.SpikeSkip or None, got {skip_spikes!r}")


def check_rule_groups(groups: Iterable[Mapping[str, Any]], rule: ClipRule | None) -> None:
    """With a rule, no group may carry a threshold of its own: the rule sets them all."""
    if rule is None:
        return
    for index, group in enumerate(groups):
        value = group.get(MAX_NORM_KEY, math.inf)
        if not (isinstance(value, (int, float)) and value == math.inf):
            raise ValueError(
                f"param_groups[{index}][{MAX_NORM_KEY!r}] is {value!r}, but max_norm is "
                f"{rule!r}, which sets the threshold of every group; remove the group's own"
            )


@torch.no_grad()
def decide(
    optimizer: Optimizer, config: ClipConfig, record: StepRecord, may_fold: bool, may_skip: bool
) -> tuple[_parts.ClipDecision, bool]:
    """Measure, compute the coefficients and rule on a non-finite norm; change nothing.

    Args:
      optimizer: the inner optimizer: its param groups, defaults and fused kernel.
      config: the wrapper's rules and settings.
      record: the step record, whose skip streak the non-finite verdict reads.
      may_fold: the decision may be folded into a fused kernel (no closure).
      may_skip: a non-finite norm or a spike may skip the step (not in a re-evaluation
        of the closure, once the step has started).

    Returns:
      The decision, and whether it is to be folded into the fused inner kernel.

    Raises:
      NonFiniteNormError: as ``nonfinite`` and ``max_consecutive_skips`` say.
    """
    settings = _parts.read_group_settings(
        optimizer.param_groups, optimizer.defaults, config.per_group
    )
    zero, final, given = None, True, None
    if config.deepspeed is not None:
        zero, final = config.deepspeed.call(optimizer.param_groups)
    if zero is not None:  # DeepSpeed's ZeRO optimizer: its group, or its norm of them all
        rule, track = config.rule, config.track_tensor_norms
        each = track or isinstance(rule, UnitWiseRule) or (rule is not None and rule.per_tensor)
        scope, given = _deepspeed.zero_source(
            zero, config.norm_scope, settings.norm_types, config.per_group, each
        )
        config = dataclasses.replace(config, norm_scope=scope)
    grads = _parts.collect_grads(optimizer.param_groups)
    measured, coefficients, outcome = _coefficients(optimizer, config, grads, settings, given)
    spike = None
    spikes = config.skip_spikes
    # Compiled, the verdict is judged from the first step (it is false on the device until
    # min_history norms are in): a graph that judged only once may_trigger() turned true
    # would recompile at that step, long after warm-up. Eager, no read until it can fire.
    if may_skip and spikes is not None and (torch.compiler.is_compiling() or spikes.may_trigger()):
        spike = spikes.verdict(measured.norm)
    fold = may_fold and _fold.can_fold(
        optimizer, lambda: _parts.grad_dtypes(grads, measured), coefficients
    )
    if config.nonfinite == "propagate" and spike is None:
        return _parts.ClipDecision(
            grads, measured, coefficients, rule_outcome=outcome, final=final
        ), fold
    norms = measured.norm if measured.stacked is None else measured.stacked
    values = _parts.coefficient_values(coefficients, norms)
    limit = config.max_consecutive_skips
    if fold and config.nonfinite != "raise" and _fold.skips_cleanly(optimizer):
        found_inf = streak_limit = None
        if config.nonfinite == "skip":
            found_inf, streak_limit = device_verdict(norms, values), limit
        if spike is not None:
            found_inf = spike_verdict(found_inf, spike)
        return _parts.ClipDecision(
            grads,
            measured,
            coefficients,
            found_inf=found_inf,
            rule_outcome=outcome,
            spike=spike,
            streak_limit=streak_limit,
            final=final,
        ), fold
    flag = None
    if torch.compiler.is_compiling():
        flag = skip_flag(norms, values, config.nonfinite, spike)
    streak = host_verdict(norms, values, record, config.nonfinite, limit, may_skip, spike)
    skip = streak is not None
    return _parts.ClipDecision(
        grads,
        measured,
        coefficients,
        skip,
        streak or 0,
        rule_outcome=outcome,
        spike=spike,
        skip_flag=flag,
        final=final,
    ), fold


def decide_and_scale(
    optimizer: Optimizer, config: ClipConfig, record: StepRecord, may_fold: bool, may_skip: bool
) -> tuple[_parts.ClipDecision, bool]:
    """:func:`decide`, then scale the grads by its coefficients
    unless the step is skipped or the scale is to be folded into the fused kernel.

    A folded step gets its fused kernel's ``grad_scale`` here instead. One function, so
    that ``torch.compile(opt.step)`` traces the norm, the decision and the scale into
    one graph: the inner step's own graph break (torch's optimizers break
    the graph around ``step``) makes dynamo trace each call of the function that leads
    to it as a graph of its own.

    Args and Returns: as :func:`decide`.
    """
    decision, fold = decide(optimizer, config, record, may_fold, may_skip)
    if fold and not decision.skip:
        coefficient = decision.coefficients[0]
        assert not isinstance(coefficient, tuple)  # can_fold refuses per-grad coefficients
        if coefficient is not None:
            grad_scale = _fold.grad_scale_of(coefficient)
            decision = dataclasses.replace(decision, grad_scale=grad_scale)
    elif not decision.skip:
        measured = decision.measurement
        _parts.scale(decision.grads, decision.coefficients, config.foreach, measured.groups)
    return decision, fold


def commit(
    config: ClipConfig,
    record: StepRecord,
    tensor_norms: _monitor.TensorNorms,
    decision: _parts.ClipDecision,
    latest: _parts.Measurement,
) -> None:
    """Keep what a step that ran (or was skipped) without raising leaves behind.

    Args:
      config: the wrapper's rules and settings the decision was made with.
      record: the step record: the last norms and the counters move.
      tensor_norms: where tracked per-tensor norms are kept.
      decision: the step's decision.
      latest: the measurement of the grads the inner step used (a closure's last).

    A call that is not the step's last (``decision.final`` False: DeepSpeed's ZeRO
    optimizer steps the wrapper once per param group) keeps nothing: the step is
    recorded and its rules commit once, at its last call. Nor does DeepSpeed's start-up
    step on zero grads.
    """
    if not decision.final:
        return
    skipped = decision.skip if decision.found_inf is None else decision.found_inf
    if decision.skip_flag is not None:  # compiled: the same verdict, as a tensor
        skipped = decision.skip_flag
    record.record(latest.norm, latest.stacked, skipped, decision.streak)
    if config.track_tensor_norms:
        tensor_norms.record(latest)
    if config.rule is not None and decision.rule_outcome is not None:
        config.rule.commit(*decision.rule_outcome)
    if config.skip_spikes is not None:
        config.skip_spikes.commit(decision.measurement.norm, decision.spike)


def _coefficients(
    optimizer: Optimizer,
    config: ClipConfig,
    grads: list[list[Tensor]],
    settings: _parts.GroupSettings,
    given: Tensor | None = None,
) -> tuple[_parts.Measurement, list[_parts.Coefficient], tuple[Tensor, Tensor, Tensor] | None]:
    """The step's norms, each group's coefficient and what a rule decided. A unit-wise
    rule decides first: the norms come from what it measured, where it says. A ``given``
    norm (DeepSpeed's, of groups this call does not see) is the norm of every group."""
    norm_types = settings.norm_types
    config.norm_scope.check_stages(config.per_group, norm_types, settings.thresholds)
    if isinstance(config.rule, UnitWiseRule):
        check_rule_groups(optimizer.param_groups, config.rule)
        coefficients, outcome, squares, check = _rule_step.unit_rule_coefficients(
            config.rule, optimizer.param_groups, grads, norm_types[0]
        )
        return _measure(optimizer, config, grads, norm_types, squares, check), coefficients, outcome
    if given is not None:
        measured = _parts.Measurement(given, [given] * len(grads), None)
    else:
        measured = _measure(optimizer, config, grads, norm_types)
    if config.rule is None:
        return (
            measured,
            _parts.threshold_coefficients(measured.group_norms, settings.thresholds),
            None,
        )
    check_rule_groups(optimizer.param_groups, config.rule)
    stages = config.norm_scope.pp_group is not None
    coefficients, outcome = _rule_step.rule_coefficients(
        config.rule, grads, measured, norm_types[0], stages
    )
    return measured, coefficients, outcome


def _measure(
    optimizer: Optimizer,
    config: ClipConfig,
    grads: list[list[Tensor]],
    norm_types: list[float],
    squares: tuple[Tensor, ...] | None = None,
    check: Tensor | None = None,
) -> _parts.Measurement:
    """The step's norms: from a unit-wise rule's ``squares`` where it measured them
    (AGC: no grad read again, no collective more; its ``check`` NaN where the ranks'
    grads do not line up); with per-tensor norms wanted
    (tracked, or for a per-tensor rule), all of them from one per-tensor pass, and
    for DTensor grads one collective (the constructor refuses a process_group then).
    Under pipeline stages the totals are then combined over the stages (one collective
    more); per-tensor and unit norms stay each stage's own."""
    default = float(optimizer.defaults[NORM_TYPE_KEY])
    names = _monitor.grad_names(optimizer.param_groups) if config.track_tensor_norms else None
    pp_group = config.norm_scope.pp_group
    if squares is not None and all(p == 2.0 for p in norm_types):
        measured = _monitor.measure_from_squares(
            grads, names, squares, default, config.per_group, config.track_tensor_norms, check
        )
        return _monitor.across_stages(measured, norm_types, default, config.per_group, pp_group)
    per_rule = config.rule is not None and config.rule.per_tensor
    if config.norm_scope.process_group is None and (config.track_tensor_norms or per_rule):
        measured = _monitor.measure_per_tensor(
            grads,
            names,
            norm_types,
            default,
            config.per_group,
            config.foreach,
            lambda: [group["params"] for group in optimizer.param_groups],
            strict=per_rule,
        )
        return _monitor.across_stages(measured, norm_types, default, config.per_group, pp_group)
    return _parts.measure(
        grads,
        norm_types,
        default,
        config.per_group,
        config.norm_scope,
        config.foreach,
        lambda: [p for group in optimizer.param_groups for p in group["params"]],
    )
