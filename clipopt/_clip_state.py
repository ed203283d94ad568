"""Clip settings and the ``"clip"`` entry of a ClippedOptimizer's state dict.

One job: say what a valid setting and a valid saved clip state are, completely, before
anything is applied, so that a bad constructor argument or a malformed checkpoint raises
naming the value and leaves the live optimizer as it was. Layout of ``"clip"``::

  {"settings": {"max_norm": float, "norm_type": float, "per_group": bool,
                "nonfinite": str, "max_consecutive_skips": int | None},
   "last_norm": 0-dim Tensor | None,
   "last_group_norms": 1-D Tensor | None,   # per_group=True only
   "step_count": 0-dim int64 Tensor, "skip_count": ..., "consecutive_skips": ...}

Tensors and plain Python values only, so ``torch.load(..., weights_only=True)`` reads it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, cast

import torch
from torch import Tensor

from clipopt._validation import check_norm_type, check_positive

__all__ = [
    "CLIP_KEY",
    "ClipState",
    "NonFinite",
    "Settings",
    "Threshold",
    "check_group_settings",
    "check_one_norm_type",
    "group_max_norm",
    "prepare_load",
    "validated_settings",
]

NonFinite: TypeAlias = Literal["propagate", "skip", "raise"]
Threshold: TypeAlias = float | Tensor

NONFINITE_MODES: tuple[str, ...] = ("propagate", "skip", "raise")
CLIP_KEY = "clip"
"""The top-level key of :meth:`ClippedOptimizer.state_dict` that holds the clip state."""

_SETTINGS_KEYS = ("max_norm", "norm_type", "per_group", "nonfinite", "max_consecutive_skips")
_CLIP_STATE_KEYS = (
    "settings",
    "last_norm",
    "last_group_norms",
    "step_count",
    "skip_count",
    "consecutive_skips",
)
_COUNTER_KEYS = ("step_count", "skip_count", "consecutive_skips")


@dataclass(frozen=True)
class Settings:
    """Validated wrapper-wide settings; ``max_norm``/``norm_type`` are group defaults."""

    max_norm: float
    norm_type: float
    per_group: bool
    nonfinite: NonFinite
    max_consecutive_skips: int | None

    def as_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in _SETTINGS_KEYS}


@dataclass(frozen=True)
class ClipState:
    """A validated ``"clip"`` entry of a state dict, ready to be applied."""

    settings: Settings
    last_norm: Tensor | None
    last_group_norms: Tensor | None
    counters: dict[str, Tensor]


def validated_settings(
    max_norm: Any,
    norm_type: Any,
    per_group: Any,
    nonfinite: Any,
    max_consecutive_skips: Any,
) -> Settings:
    """Check every wrapper-wide setting; raise naming the first bad one."""
    check_positive("max_norm", max_norm, allow_tensor=False)
    p = check_norm_type(norm_type)
    if not isinstance(per_group, bool):
        raise TypeError(f"per_group must be a bool, got {per_group!r}")
    if not isinstance(nonfinite, str) or nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
    if max_consecutive_skips is not None:
        if isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, int):
            raise TypeError(
                "max_consecutive_skips must be a positive int or None, "
                f"got {max_consecutive_skips!r}"
            )
        if max_consecutive_skips < 1:
            raise ValueError(
                f"max_consecutive_skips must be >= 1 or None, got {max_consecutive_skips!r}"
            )
    return Settings(
        float(max_norm), p, per_group, cast(NonFinite, nonfinite), max_consecutive_skips
    )


def group_max_norm(index: int, value: Any) -> Threshold:
    """A param group's ``max_norm``: a number > 0 (inf allowed) or a 0-dim tensor."""
    check_positive(f"param_groups[{index}]['max_norm']", value)
    return value if isinstance(value, Tensor) else float(value)


def group_norm_type(index: int, value: Any) -> float:
    """A param group's ``norm_type`` as a float; errors name the group."""
    try:
        return check_norm_type(value)
    except (TypeError, ValueError) as error:
        raise type(error)(f"param_groups[{index}]['norm_type']: {error}") from None


def check_group_settings(index: int, group: Mapping[str, Any]) -> None:
    """Validate a param group's own ``max_norm`` / ``norm_type``, where it has them."""
    if "max_norm" in group:
        group_max_norm(index, group["max_norm"])
    if "norm_type" in group:
        group_norm_type(index, group["norm_type"])


def check_one_norm_type(
    groups: Sequence[Mapping[str, Any]], default_norm_type: float, per_group: bool
) -> list[float]:
    """Each group's norm order; without ``per_group`` they must all be the same.

    One global norm over all groups needs one order, so a mismatch is refused when
    the groups are set up rather than at the first step.

    Returns:
      The validated order of each group (``default_norm_type`` where it has none).

    Raises:
      ValueError: without ``per_group``, two groups use different orders.
    """
    norm_types = [
        group_norm_type(index, group.get("norm_type", default_norm_type))
        for index, group in enumerate(groups)
    ]
    if not per_group and len(set(norm_types)) > 1:
        raise ValueError(
            f"param groups use different norm_type values {norm_types}; one global norm "
            "needs one order (pass per_group=True to clip each group by its own norm)"
        )
    return norm_types


def check_inner_state_dict(
    state_dict: Mapping[str, Any], live_groups: Sequence[Mapping[str, Any]]
) -> None:
    """Raise unless the inner part matches the live groups in number and size."""
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, list) or not all(isinstance(g, dict) for g in saved_groups):
        raise TypeError("state_dict['param_groups'] must be a list of dicts")
    if len(saved_groups) != len(live_groups):
        raise ValueError(
            f"state_dict has {len(saved_groups)} param groups, "
            f"this optimizer has {len(live_groups)}"
        )
    for index, (saved, live) in enumerate(zip(saved_groups, live_groups, strict=True)):
        params = saved.get("params")
        if not isinstance(params, list):
            raise TypeError(f"state_dict['param_groups'][{index}]['params'] must be a list")
        if len(params) != len(live["params"]):
            raise ValueError(
                f"state_dict['param_groups'][{index}] has {len(params)} params, "
                f"this optimizer's group {index} has {len(live['params'])}"
            )
    state = state_dict.get("state", {})
    if not isinstance(state, Mapping) or not all(isinstance(v, Mapping) for v in state.values()):
        raise TypeError("state_dict['state'] must be a dict of dicts")


def prepare_load(
    raw_clip: Any,
    inner_state: Mapping[str, Any],
    live_groups: Sequence[Mapping[str, Any]],
    current: Settings,
) -> ClipState | None:
    """Validate everything a load would apply, before anything is loaded.

    The one check of both loaders (``ClippedOptimizer.load_state_dict`` and the DCP
    one): the ``"clip"`` entry completely, the inner dict's layout against the live
    groups, each saved group's ``max_norm`` / ``norm_type``, and one order for all groups
    unless the settings that will apply say ``per_group``.

    Args:
      raw_clip: the saved ``"clip"`` entry, None when there is none.
      inner_state: the rest of the dict, for the inner optimizer.
      live_groups: the optimizer's param groups now.
      current: the settings that stay when the dict has no ``"clip"`` entry.

    Returns:
      The validated clip state to apply, or None.

    Raises:
      TypeError, ValueError: naming the first bad value; nothing has been changed.
    """
    clip_state = parse_clip_state(raw_clip, len(live_groups))
    check_inner_state_dict(inner_state, live_groups)
    saved_groups = inner_state["param_groups"]
    for index, group in enumerate(saved_groups):
        check_group_settings(index, group)
    settings = current if clip_state is None else clip_state.settings
    check_one_norm_type(saved_groups, settings.norm_type, settings.per_group)
    return clip_state


def parse_clip_state(raw: Any, num_groups: int) -> ClipState | None:
    """Validate a ``"clip"`` entry completely; None when there is none."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise TypeError(f"state_dict['clip'] must be a dict, got {type(raw).__name__}")
    if set(raw) != set(_CLIP_STATE_KEYS):
        raise ValueError(
            f"state_dict['clip'] must have the keys {sorted(_CLIP_STATE_KEYS)}, "
            f"got {sorted(map(str, raw))}"
        )
    saved = raw["settings"]
    if not isinstance(saved, Mapping) or set(saved) != set(_SETTINGS_KEYS):
        raise ValueError(
            f"state_dict['clip']['settings'] must be a dict with the keys {list(_SETTINGS_KEYS)}"
        )
    settings = validated_settings(*(saved[key] for key in _SETTINGS_KEYS))
    last_norm = _checked_tensor("last_norm", raw["last_norm"], dims=0, floating=True)
    group_norms = _checked_tensor(
        "last_group_norms", raw["last_group_norms"], dims=1, floating=True
    )
    if group_norms is not None and group_norms.numel() != num_groups:
        raise ValueError(
            f"state_dict['clip']['last_group_norms'] has {group_norms.numel()} entries "
            f"for {num_groups} param groups"
        )
    counters = {}
    for key in _COUNTER_KEYS:
        counter = _checked_tensor(key, raw[key], dims=0, floating=False)
        if counter is None or int(counter) < 0:
            raise ValueError(f"state_dict['clip'][{key!r}] must be a 0-dim int64 tensor >= 0")
        counters[key] = counter
    return ClipState(settings, last_norm, group_norms, counters)


def _checked_tensor(name: str, value: Any, dims: int, floating: bool) -> Tensor | None:
    """None, or a tensor with ``dims`` dimensions and a float (or int64) dtype."""
    if value is None:
        return None
    wanted = "a floating-point" if floating else "an int64"
    ok_dtype = value.is_floating_point() if isinstance(value, Tensor) else False
    if isinstance(value, Tensor) and not floating:
        ok_dtype = value.dtype == torch.int64
    if not isinstance(value, Tensor) or value.dim() != dims or not ok_dtype:
        raise TypeError(
            f"state_dict['clip'][{name!r}] must be None or {wanted} tensor with {dims} "
            f"dimension(s), got {value!r}"
        )
    return value
