"""The clip-rule protocol (:class:`ClipRule`) and what the rules share.

A rule turns the step's pre-clip norms into clip coefficients and thresholds, from state
it keeps in tensors on the grads' device, and updates that state from the norms after
the step; nothing in either reads a tensor on the host. :class:`ClipRule` is the
protocol (a base class); :class:`AdaGC`, :class:`AutoClip` and :class:`ZClip` are rules,
:class:`AGC` a unit-wise one (:class:`~clipopt.UnitWiseRule`), and
:class:`SpikeSkip` is not a rule but the ``skip_spikes=`` setting of
:class:`~clipopt.ClippedOptimizer`, which skips whole steps. See ``docs/adaptive.md``.

The wrapper calls, once per ``step()``:

1. ``coefficients, thresholds = rule.decide(norms)``: ``norms`` is the global norm (a
   0-dim tensor), or with ``per_tensor = True`` a 1-D tensor with one norm per grad (in
   the order of the param groups and their params, params without a grad left out).
   The two results have the shape of ``norms``. Nothing changes.
2. the step is applied (or skipped);
3. ``rule.commit(norms, coefficients, thresholds)``: the rule's :meth:`ClipRule.update`
   and the monitoring counters (:attr:`ClipRule.last_threshold`,
   :attr:`ClipRule.clipped_count`).

A unit-wise rule (:class:`~clipopt.UnitWiseRule`, AGC) takes step 1
differently: it gets each grad beside its parameter,
``decision = rule.decide_units(params, grads, norm_type)``, and clips parts ("units")
of each grad by their own coefficients; ``norms``,
``coefficients`` and ``thresholds`` are then 1-D with one entry per unit.

Non-finite norms never enter a rule's history (the reference packages would keep a NaN
in theirs for good); what such a step does is the wrapper's ``nonfinite`` policy.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor

from clipopt._kernels._scale import EPS

__all__ = [
    "ClipRule",
    "OnDevice",
    "checked",
    "count_or_zero",
    "integer",
    "number",
    "state_dtype",
]

_Self = TypeVar("_Self", bound="OnDevice")


def state_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it (scalars: the cost is nothing), else float32."""
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def number(
    name: str,
    value: Any,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a float in the interval; ValueError/TypeError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    v = float(value)
    below = v <= low if low_open else v < low
    above = v >= high if high_open else v > high
    if math.isnan(v) or below or above:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be in {left}{low}, {high}{right}, got {value!r}")
    return v


def integer(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if int(value) < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    return int(value)


def checked(name: str, value: Any, shape: tuple[int, ...] | None, floating: bool) -> Tensor:
    """A saved tensor of the right kind (and shape, where given), else a ValueError."""
    ok = isinstance(value, Tensor) and (
        value.is_floating_point() if floating else value.dtype == torch.int64
    )
    if not ok or (shape is not None and tuple(value.shape) != shape):
        kind = "floating-point" if floating else "int64"
        raise ValueError(
            f"rule state {name!r} must be a {kind} tensor of shape {shape}, got {value!r}"
        )
    tensor: Tensor = value
    return tensor


def saved(rule: str, state: Any, keys: tuple[str, ...]) -> bool:
    """Whether a rule's saved ``state`` holds its tensors: True for exactly ``keys``,
    False for an empty mapping (the rule had not stepped), else a ValueError."""
    if not isinstance(state, Mapping) or set(state) not in (set(), set(keys)):
        names = " and ".join(keys) if len(keys) <= 2 else ", ".join(keys)
        raise ValueError(f"{rule} state must have the keys {names}, got {state!r}")
    return bool(state)


def count_or_zero(counter: Tensor | None) -> Tensor:
    """A counter made on the grads' device at its first step; a zero before it."""
    return torch.zeros((), dtype=torch.int64) if counter is None else counter


class OnDevice:
    """What a rule and SpikeSkip share: tensor state moved after a load, and a repr of
    the config."""

    def config(self) -> dict[str, Any]:
        raise NotImplementedError

    def to(self, device: torch.device) -> None:
        """Move the state (and counters) to ``device``, after a load."""
        for name, value in list(vars(self).items()):
            if isinstance(value, Tensor):
                setattr(self, name, value.to(device))

    def borrowed(self) -> tuple[object, ...]:
        """Objects this one refers to but does not own (AGC's excluded parameters)."""
        return ()

    def trial_copy(self: _Self) -> _Self:
        """A deep copy to try a load on: the state is copied, :meth:`borrowed` shared (a
        model's weights are not copied to check a checkpoint)."""
        return copy.deepcopy(self, {id(x): x for x in self.borrowed()})

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({settings})"


class ClipRule(OnDevice):
    """The protocol of an adaptive clip rule; subclass it and pass an instance as
    ``max_norm``.

    A subclass implements :meth:`config`, :meth:`threshold`, :meth:`update`,
    :meth:`rule_state` and :meth:`load_rule_state`; it may override :meth:`coefficient`
    (the default is torch's ``min(1, threshold / (norm + 1e-6))``) and sets
    ``per_tensor = True`` to get one norm per grad instead of the global norm. A rule
    that clips parts of each grad against its parameter (AGC) subclasses
    :class:`~clipopt.UnitWiseRule` instead.

    - Settings are validated in ``__init__``: a bad one raises ``ValueError`` (or
      ``TypeError``) naming the argument and the value.
    - State is made lazily, on the device and from the dtype of the first norms seen,
      and changes only in :meth:`update`, which must not read a tensor on the host.
    - :meth:`state_dict` / :meth:`load_state_dict` hold the config, the state and the
      monitoring counters as tensors and plain values; ``ClippedOptimizer`` saves them in
      ``state_dict()["clip"]["rule"]`` and refuses a checkpoint of another rule or other
      settings.

    One rule object belongs to one optimizer: its state is that optimizer's history.
    """

    per_tensor: bool = False
    norm_type: float = 2.0
    """The order p of the norms :meth:`decide` gets; ``ClippedOptimizer`` sets it to its
    ``norm_type`` before each call (AdaGC combines per-tensor norms into the total)."""
    total_norm: Tensor | None = None
    """For a per-tensor rule: the total norm of the whole model where the norms
    :meth:`decide` gets are only some of it (one pipeline stage's grads), which
    ``ClippedOptimizer`` sets before each call under ``pp_mesh``; None: the total is that
    of the norms given."""

    def __init__(self) -> None:
        self._last_threshold: Tensor | None = None
        self._clipped_count: Tensor | None = None

    # ------------------------------------------------------------ what a rule implements

    def config(self) -> dict[str, Any]:
        """The settings, plain Python values; a checkpoint loads only into equal ones."""
        raise NotImplementedError

    def threshold(self, norms: Tensor) -> Tensor:
        """This step's threshold(s), shaped as ``norms``, from the state before it."""
        raise NotImplementedError

    def update(self, norms: Tensor) -> None:
        """Fold this step's pre-clip ``norms`` into the state, on their device."""
        raise NotImplementedError

    def rule_state(self) -> dict[str, Any]:
        """The state: tensors (copies) and plain values; empty before the first step."""
        raise NotImplementedError

    def load_rule_state(self, state: Mapping[str, Any]) -> None:
        """Install ``state`` from :meth:`rule_state`; validate all of it before changing
        anything, raising ``ValueError``."""
        raise NotImplementedError

    def coefficient(self, norms: Tensor, threshold: Tensor) -> Tensor:
        """The factor each grad (or all of them) is multiplied by; at most 1."""
        return torch.clamp(threshold / (norms + EPS), max=1.0)

    # ------------------------------------------------------------ what the wrapper calls

    def decide(self, norms: Tensor) -> tuple[Tensor, Tensor]:
        """This step's coefficients and thresholds, in ``norms``' dtype; changes nothing."""
        threshold = self.threshold(norms)
        return self.coefficient(norms, threshold).to(norms.dtype), threshold.to(norms.dtype)

    def commit(self, norms: Tensor, coefficients: Tensor, thresholds: Tensor) -> None:
        """After the step: update the state, the last threshold and the clipped count."""
        self.update(norms)
        self._last_threshold = thresholds
        clipped = (coefficients < 1).any().to(torch.int64)
        if self._clipped_count is None or self._clipped_count.device != norms.device:
            self._clipped_count = torch.zeros((), dtype=torch.int64, device=norms.device)
        self._clipped_count = self._clipped_count + clipped

    # ------------------------------------------------------------ monitoring

    @property
    def last_threshold(self) -> Tensor | None:
        """The threshold of the last step (per-tensor rules: one per grad), None before."""
        return self._last_threshold

    @property
    def clipped_count(self) -> Tensor:
        """Steps in which the rule scaled some grad, a 0-dim int64 tensor."""
        return count_or_zero(self._clipped_count)

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """``{"type", "config", "state", "last_threshold", "clipped_count"}``: tensors and
        plain values, so ``torch.load(weights_only=True)`` reads it."""
        last = None if self._last_threshold is None else self._last_threshold.detach().clone()
        return {
            "type": type(self).__name__,
            "config": self.config(),
            "state": self.rule_state(),
            "last_threshold": last,
            "clipped_count": self.clipped_count.clone(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict`'s output; everything is checked before anything changes.

        Raises:
          ValueError: another rule's checkpoint, other settings, or a malformed state.
        """
        if not isinstance(state_dict, Mapping) or set(state_dict) != {
            "type",
            "config",
            "state",
            "last_threshold",
            "clipped_count",
        }:
            raise ValueError(
                f"a {type(self).__name__} state dict must be a dict from "
                f"state_dict(), got {state_dict!r}"
            )
        if state_dict["type"] != type(self).__name__ or state_dict["config"] != self.config():
            raise ValueError(
                f"the checkpoint was saved with {state_dict['type']}({state_dict['config']}), "
                f"this optimizer uses {type(self).__name__}({self.config()}); "
                "construct it with the rule it was saved with"
            )
        last = state_dict["last_threshold"]
        if last is not None:
            checked("last_threshold", last, None, floating=True)
        count = checked("clipped_count", state_dict["clipped_count"], (), floating=False)
        trial = self.trial_copy()
        trial.load_rule_state(state_dict["state"])  # raises before self changes
        self.load_rule_state(state_dict["state"])
        self._last_threshold = None if last is None else last.clone()
        self._clipped_count = count.clone()
