"""Clip settings and the ``"clip"`` entry of a ClippedOptimizer's state dict.

One job: say what a valid setting and a valid saved clip state are, completely, before
anything is applied, so that a bad constructor argument or a malformed checkpoint raises
naming the value and leaves the live optimizer as it was.

Per-group settings live in the inner optimizer's param groups (and its defaults) under
names no optimizer uses, ``"clip_max_norm"`` and ``"clip_norm_type"``, so that they are
saved, loaded and edited like ``lr``. clipopt 0.1.0 called them ``"max_norm"`` and
``"norm_type"``, which optimizers may own (pytorch_optimizer's SCION has a
``"norm_type"``); :func:`migrate_legacy_keys` renames those where the inner optimizer
does not own the old name. Layout of ``"clip"``::

  {"settings": {"max_norm": float, "norm_type": float, "per_group": bool,
                "nonfinite": str, "max_consecutive_skips": int | None},
   "last_norm": 0-dim Tensor | None,
   "last_group_norms": 1-D Tensor | None,   # per_group=True only
   "step_count": 0-dim int64 Tensor, "skip_count": ..., "consecutive_skips": ...,
   # only when max_norm is a rule / skip_spikes is set (absent in 0.1.0's files):
   "rule": {"type": str, "config": dict, "state": dict, "last_threshold": Tensor | None,
            "clipped_count": 0-dim int64 Tensor},
   "skip_spikes": {"type": "SpikeSkip", "config": dict, "state": dict,
                   "spike_count": 0-dim int64 Tensor, "steps_seen": int}}

With a rule, ``settings["max_norm"]`` is inf (the rule sets every threshold). The two
optional entries are checked here only for being dicts: the rule objects check their own
entries (:meth:`clipopt.ClipRule.load_state_dict`) before anything loads.

Tensors and plain Python values only, so ``torch.load(..., weights_only=True)`` reads it.
"""

from __future__ import annotations

import warnings
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, cast

import torch
from torch import Tensor

from clipopt._errors import user_stacklevel
from clipopt._validation import check_norm_type, check_positive

__all__ = [
    "CLIP_KEY",
    "MAX_NORM_KEY",
    "NORM_TYPE_KEY",
    "ClipState",
    "NonFinite",
    "Settings",
    "Threshold",
    "check_group_settings",
    "check_groups",
    "check_one_norm_type",
    "group_max_norm",
    "migrate_legacy_keys",
    "migrated",
    "prepare_load",
    "rename_legacy_keys",
    "validated_settings",
]

NonFinite: TypeAlias = Literal["propagate", "skip", "raise"]
Threshold: TypeAlias = float | Tensor

NONFINITE_MODES: tuple[str, ...] = ("propagate", "skip", "raise")
CLIP_KEY = "clip"
"""The top-level key of :meth:`ClippedOptimizer.state_dict` that holds the clip state."""

MAX_NORM_KEY = "clip_max_norm"
"""The param-group (and defaults) key of a group's threshold."""

NORM_TYPE_KEY = "clip_norm_type"
"""The param-group (and defaults) key of a group's norm order."""

_LEGACY_KEYS = {"max_norm": MAX_NORM_KEY, "norm_type": NORM_TYPE_KEY}

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
_OPTIONAL_KEYS = ("rule", "skip_spikes")


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
    rule: Mapping[str, Any] | None = None
    skip_spikes: Mapping[str, Any] | None = None


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


def migrate_legacy_keys(group: dict[str, Any], owned: Container[str]) -> list[str]:
    """Rename a group's 0.1.0 clip keys to the namespaced ones, in place.

    A legacy name is renamed only where the inner optimizer does not own it (it is not
    among ``owned``, the inner optimizer's defaults); its value replaces the namespaced
    key's, since it was written later (by code that sets ``group["max_norm"]``).

    Returns:
      The legacy names renamed.
    """
    renamed = [old for old in _LEGACY_KEYS if old in group and old not in owned]
    for old in renamed:
        group[_LEGACY_KEYS[old]] = group.pop(old)
    return renamed


def migrated(group: Mapping[str, Any], owned: Container[str]) -> dict[str, Any]:
    """A copy of ``group`` with 0.1.0's clip keys renamed, to validate before renaming."""
    copy = dict(group)
    migrate_legacy_keys(copy, owned)
    return copy


def rename_legacy_keys(
    groups: Iterable[dict[str, Any]], owned: Container[str], warn: bool = True
) -> None:
    """Rename 0.1.0's clip keys in the live ``groups``; a user who wrote them is told."""
    renamed = sorted({key for group in groups for key in migrate_legacy_keys(group, owned)})
    if renamed and warn:
        warnings.warn(
            f"param group keys {renamed} are read as {[f'clip_{k}' for k in renamed]} and "
            "renamed so: an optimizer may own the old names. Write the clip_ names",
            FutureWarning,
            stacklevel=user_stacklevel(),
        )


def group_max_norm(index: int, value: Any) -> Threshold:
    """A param group's ``clip_max_norm``: a number > 0 (inf allowed) or a 0-dim tensor."""
    check_positive(f"param_groups[{index}][{MAX_NORM_KEY!r}]", value)
    return value if isinstance(value, Tensor) else float(value)


def group_norm_type(index: int, value: Any) -> float:
    """A param group's ``clip_norm_type`` as a float; errors name the group."""
    try:
        return check_norm_type(value)
    except (TypeError, ValueError) as error:
        raise type(error)(f"param_groups[{index}][{NORM_TYPE_KEY!r}]: {error}") from None


def check_group_settings(index: int, group: Mapping[str, Any]) -> None:
    """Validate a param group's own clip settings, where it has them."""
    if MAX_NORM_KEY in group:
        group_max_norm(index, group[MAX_NORM_KEY])
    if NORM_TYPE_KEY in group:
        group_norm_type(index, group[NORM_TYPE_KEY])


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
        group_norm_type(index, group.get(NORM_TYPE_KEY, default_norm_type))
        for index, group in enumerate(groups)
    ]
    if not per_group and len(set(norm_types)) > 1:
        raise ValueError(
            f"param groups use different norm_type values {norm_types}; one global norm "
            "needs one order (pass per_group=True to clip each group by its own norm)"
        )
    return norm_types


def readable_groups(state_dict: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The saved param groups when they are a list of dicts, else None (a custom layout,
    left to the inner optimizer's own ``load_state_dict``)."""
    groups = state_dict.get("param_groups")
    if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        return groups
    return None


def check_groups(groups: Sequence[Mapping[str, Any]], settings: Settings) -> None:
    """Each group's clip settings, and one order for all groups unless ``per_group``."""
    for index, group in enumerate(groups):
        check_group_settings(index, group)
    check_one_norm_type(groups, settings.norm_type, settings.per_group)


def prepare_load(
    raw_clip: Any,
    inner_state: Mapping[str, Any],
    num_groups: int,
    current: Settings,
    owned: Container[str],
) -> tuple[dict[str, Any], ClipState | None]:
    """Validate what the wrapper reads from a load, before anything is loaded.

    The one check of both loaders (``ClippedOptimizer.load_state_dict`` and the DCP
    one): the ``"clip"`` entry completely and, where the saved param groups are a list of
    dicts, their clip settings (0.1.0's names migrated on a copy). Everything else is
    the inner optimizer's to judge: its own ``load_state_dict`` gets it as it is.

    Args:
      raw_clip: the saved ``"clip"`` entry, None when there is none.
      inner_state: the rest of the dict, for the inner optimizer.
      num_groups: how many param groups the optimizer has now.
      current: the settings that stay when the dict has no ``"clip"`` entry.
      owned: the inner optimizer's own keys, which are never renamed.

    Returns:
      The dict to hand to the inner optimizer, and the validated clip state (or None).

    Raises:
      TypeError, ValueError: naming the first bad value; nothing has been changed.
    """
    clip_state = parse_clip_state(raw_clip, num_groups)
    inner_state = dict(inner_state)
    groups = readable_groups(inner_state)
    if groups is not None:
        groups = [dict(g) for g in groups]
        for group in groups:
            migrate_legacy_keys(group, owned)
        inner_state["param_groups"] = groups
        check_groups(groups, current if clip_state is None else clip_state.settings)
    return inner_state, clip_state


def parse_clip_state(raw: Any, num_groups: int) -> ClipState | None:
    """Validate a ``"clip"`` entry completely; None when there is none."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise TypeError(f"state_dict['clip'] must be a dict, got {type(raw).__name__}")
    if not set(_CLIP_STATE_KEYS) <= set(raw) <= {*_CLIP_STATE_KEYS, *_OPTIONAL_KEYS}:
        raise ValueError(
            f"state_dict['clip'] must have the keys {sorted(_CLIP_STATE_KEYS)} (and "
            f"optionally {list(_OPTIONAL_KEYS)}), got {sorted(map(str, raw))}"
        )
    optional: dict[str, Mapping[str, Any] | None] = {}
    for key in _OPTIONAL_KEYS:
        entry = raw.get(key)
        if entry is not None and not isinstance(entry, Mapping):
            raise TypeError(f"state_dict['clip'][{key!r}] must be a dict, got {entry!r}")
        optional[key] = entry
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
    return ClipState(
        settings, last_norm, group_norms, counters, optional["rule"], optional["skip_spikes"]
    )


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
