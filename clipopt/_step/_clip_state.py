"""Clip settings: what a valid setting is, completely, before anything is applied.

A bad constructor argument, or a bad setting in a checkpoint's param groups, raises
naming the value and leaves the live optimizer as it was.

Per-group settings live in the inner optimizer's param groups (and its defaults) under
names no optimizer uses, ``"clip_max_norm"`` and ``"clip_norm_type"``, so that they are
saved, loaded and edited like ``lr``. The ``"clip"`` entry of the state dict, which holds the
wrapper-wide settings, is :mod:`clipopt._step._saved`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, cast

from torch import Tensor

from clipopt._validation import check_norm_type, check_positive

__all__ = [
    "CLIP_KEY",
    "MAX_NORM_KEY",
    "NORM_TYPE_KEY",
    "SETTINGS_KEYS",
    "ClipState",
    "NonFinite",
    "Settings",
    "Threshold",
    "check_group_settings",
    "check_groups",
    "check_one_norm_type",
    "group_max_norm",
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

SETTINGS_KEYS = ("max_norm", "norm_type", "per_group", "nonfinite", "max_consecutive_skips")


@dataclass(frozen=True)
class Settings:
    """Validated wrapper-wide settings; ``max_norm``/``norm_type`` are group defaults."""

    max_norm: float
    norm_type: float
    per_group: bool
    nonfinite: NonFinite
    max_consecutive_skips: int | None

    def as_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in SETTINGS_KEYS}


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


def check_groups(groups: Sequence[Mapping[str, Any]], settings: Settings) -> None:
    """Each group's clip settings, and one order for all groups unless ``per_group``."""
    for index, group in enumerate(groups):
        check_group_settings(index, group)
    check_one_norm_type(groups, settings.norm_type, settings.per_group)
