"""The clip-rule protocol and the state rules and SpikeSkip share (docs/adaptive.md)."""

from __future__ import annotations

import copy
import numbers
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeAlias, TypeVar

import torch
from torch import Tensor

from clipopt._kernels._scale import coefficient

_Self = TypeVar("_Self", bound="Stateful")
State: TypeAlias = dict[str, Tensor]


def number(name: str, value: Any, interval: str) -> float:
    """``value`` as a float in ``interval`` (e.g. ``"[0, 1)"``), else TypeError/ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    low, high = (float(end) for end in interval[1:-1].split(","))
    v = float(value)
    above = low < v if interval[0] == "(" else low <= v
    if not (above and (v < high if interval[-1] == ")" else v <= high)):  # NaN too
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return v


def integer(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if int(value) < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    return int(value)


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def checked(name: str, value: Tensor, shape: tuple[int, ...] | None, floating: bool) -> None:
    """Refuse a saved tensor of the wrong kind (or shape, where given) with ValueError."""
    ok = value.is_floating_point() if floating else value.dtype == torch.int64
    if not ok or (shape is not None and tuple(value.shape) != shape):
        kind = "floating-point" if floating else "int64"
        raise ValueError(f"state {name!r} must be a {kind} tensor of shape {shape}, got {value!r}")


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value


class Evaluation(NamedTuple):
    """:meth:`ClipRule.evaluate`'s thresholds, state after, and coefficients if not the usual."""

    thresholds: Tensor
    state: State
    coefficients: Tensor | None = None


class Stateful:
    """A rule's or SpikeSkip's state: tensors under ``state_keys``, saved and loaded."""

    settings: tuple[str, ...] = ()
    state_keys: tuple[str, ...] = ()
    extra_keys: tuple[str, ...] = ()  # attributes saved too: ints, tensors, None

    def __init__(self) -> None:
        self.state: State = {}
        self._made_for: tuple[Any, ...] | None = None  # prepare()'s norms: shape, dtype, device
        self._stepped = False

    def config(self) -> dict[str, Any]:
        """The settings as plain values; a checkpoint loads only into equal ones."""
        return {name: getattr(self, name) for name in self.settings}

    def init_state(self, norms: Tensor) -> State:
        """The state before the first step, on ``norms``' device."""
        return {}

    def check_state(self, state: Mapping[str, Tensor]) -> None:
        """Raise ValueError where a loaded state could not be this rule's."""

    def prepare(self, norms: Tensor) -> None:
        """Make the state for ``norms`` before the first step (compile once); no-op after."""
        if not self._stepped:
            self.state = self.init_state(norms)
            self._made_for = (tuple(norms.shape), norms.dtype, norms.device)

    def current(self, norms: Tensor) -> State:
        """The state for ``norms``: a new one if none, or if prepared for others, unstepped."""
        here = (tuple(norms.shape), norms.dtype, norms.device)
        # `_stepped` is read last: a compiled step guards on `_made_for`, which stays put.
        if not self.state or (self._made_for not in (None, here) and not self._stepped):
            return self.init_state(norms)
        return self.state

    def state_dict(self) -> dict[str, Any]:
        """``{"type", "config", "state"}`` and the ``extra_keys``: tensors and plain values."""
        state = {k: self.state[k].clone() for k in self.state_keys} if self._stepped else {}
        extras = {k: _clone(getattr(self, k)) for k in self.extra_keys}
        return {"type": type(self).__name__, "config": self.config(), "state": state, **extras}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict`'s output, all checked (ValueError) before anything changes."""
        name = type(self).__name__
        keys = {"type", "config", "state", *self.extra_keys}
        if not isinstance(state_dict, Mapping) or set(state_dict) != keys:
            raise ValueError(f"a {name} state dict must have the keys {sorted(keys)}")
        if state_dict["type"] != name or state_dict["config"] != self.config():
            raise ValueError(
                f"the checkpoint was saved with {state_dict['type']}({state_dict['config']}), "
                f"this optimizer uses {self!r}; construct it with the one it was saved with"
            )
        for key in self.extra_keys:
            value, now = state_dict[key], getattr(self, key)
            counter = isinstance(now, Tensor) and now.dtype == torch.int64
            if isinstance(now, int):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{key} must be an int >= 0, got {value!r}")
            elif counter or value is not None:
                if not isinstance(value, Tensor):
                    raise ValueError(f"{key} must be a tensor, got {value!r}")
                checked(key, value, () if counter else None, floating=not counter)
        state = state_dict["state"]
        ok = isinstance(state, Mapping) and set(state) in (set(), set(self.state_keys))
        if not (ok and all(isinstance(v, Tensor) for v in state.values())):
            names = ", ".join(self.state_keys)
            has = f"state must have the keys {names}, tensors" if names else "has no state"
            raise ValueError(f"{name} {has}, got {state!r}")
        if state:
            self.check_state(state)
        state = {k: v.clone() for k, v in state.items()}
        if state or self._stepped:
            self.state, self._stepped = state, bool(state)
        for key in self.extra_keys:
            setattr(self, key, _clone(state_dict[key]))

    def to(self, device: torch.device) -> None:
        """Move the state and tensor attributes to ``device``, after a load."""
        self.state = {k: v.to(device) for k, v in self.state.items()}
        for key, value in list(vars(self).items()):
            if isinstance(value, Tensor):
                setattr(self, key, value.to(device))

    def borrowed(self) -> tuple[object, ...]:
        """Objects referred to but not owned, which :meth:`trial_copy` shares."""
        return ()

    def trial_copy(self: _Self) -> _Self:
        return copy.deepcopy(self, {id(x): x for x in self.borrowed()})

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({settings})"


class ClipRule(Stateful):
    """An adaptive clip rule, passed as ``max_norm`` (docs/adaptive.md); one per optimizer."""

    per_tensor: bool = False
    extra_keys = ("last_threshold",)

    def __init__(self) -> None:
        super().__init__()
        self.last_threshold: Tensor | None = None
        """The threshold of the last step (per-tensor rules: one per grad), None before."""
        self._next: State | None = None

    def evaluate(
        self, norms: Tensor, state: State, *, norm_type: float, total_norm: Tensor | None
    ) -> Evaluation:
        """Thresholds and state after the step from the global norm (``per_tensor``: one
        per grad) and the state before; pure. ``total_norm``: the model's, under stages."""
        raise NotImplementedError

    def _same_grads(self, held: int, given: int) -> None:
        if held != given:
            raise ValueError(
                f"{type(self).__name__} has a state for {held} grads but this step has "
                f"{given}: a per-tensor rule needs the same grads every step"
            )

    def decide(
        self, norms: Tensor, *, norm_type: float = 2.0, total_norm: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """This step's coefficients and thresholds; the state waits for :meth:`commit`."""
        state = self.current(norms)
        found = self.evaluate(norms, state, norm_type=norm_type, total_norm=total_norm)
        thresholds, self._next, *given = found  # a plain (thresholds, state) tuple too
        own = given[0] if given else None
        coefficients = coefficient(thresholds, norms) if own is None else own
        return coefficients.to(norms.dtype), thresholds.to(norms.dtype)

    def commit(self, norms: Tensor, coefficients: Tensor, thresholds: Tensor) -> None:
        """After the step: install the state :meth:`decide` evaluated."""
        if self._next is not None:
            self.state, self._stepped = self._next, True
            self._next = None
        self.last_threshold = thresholds

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if isinstance(state_dict, Mapping):  # a rule's own old count: the wrapper's counts
            state_dict = {k: v for k, v in state_dict.items() if k != "clipped_count"}
        super().load_state_dict(state_dict)
        self._next = None
