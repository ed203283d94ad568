"""Settings and argument checks, run when a setting is set, never on a step's tensors.

Each check raises a ``TypeError``/``ValueError`` naming the argument and the value, and
reads no tensor's value (that would wait on its device). A wrapper's settings live in the
inner optimizer's param groups and defaults under names no optimizer uses
(``"clip_max_norm"``, ``"clip_norm_type"``, ``"clip_group"``), so they are saved, loaded
and edited like ``lr``; the wrapper-wide ones are a :class:`Settings`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeAlias, cast

import torch
from torch import Tensor

__all__ = [
    "CLIP_GROUP_KEY",
    "CLIP_KEY",
    "DEFAULT_CLIP_GROUP",
    "MAX_NORM_KEY",
    "NORM_TYPE_KEY",
    "MaxNorm",
    "NonFinite",
    "NormType",
    "Settings",
    "check_foreach",
    "check_groups",
    "check_norm_type",
    "check_not_skip_step",
    "check_positive",
    "clip_layout",
    "same_threshold",
    "validated_settings",
]

NormType: TypeAlias = float | int | str
MaxNorm: TypeAlias = float | int | Tensor
NonFinite: TypeAlias = Literal["propagate", "skip", "raise", "assert"]
Threshold: TypeAlias = float | Tensor
Layout: TypeAlias = tuple[list[int | None], list[str | int]]
"""Each param group's clip group (an index into the names; None: not clipped), and the
clip groups' names in order of first appearance."""

NONFINITE_MODES: tuple[str, ...] = ("propagate", "skip", "raise", "assert")
CLIP_KEY = "clip"
"""The top-level key of ``ClippedOptimizer.state_dict()`` that holds the clip state."""
MAX_NORM_KEY = "clip_max_norm"
"""The param-group (and defaults) key of a group's threshold."""
NORM_TYPE_KEY = "clip_norm_type"
"""The param-group (and defaults) key of a group's norm order."""
CLIP_GROUP_KEY = "clip_group"
"""The param-group key naming a group's clip group (None: the group is not clipped)."""
DEFAULT_CLIP_GROUP = "default"
"""The clip group of a param group without a ``"clip_group"``."""


@dataclass(frozen=True)
class Settings:
    """Validated wrapper-wide settings; ``max_norm``/``norm_type`` are group defaults."""

    max_norm: float
    norm_type: float
    per_group: bool
    nonfinite: NonFinite
    max_consecutive_skips: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


SETTINGS_KEYS = tuple(Settings.__dataclass_fields__)


def check_norm_type(norm_type: NormType) -> float:
    """Validate a norm order and return it as a float (``math.inf`` for ``'inf'``)."""
    if isinstance(norm_type, str):
        if norm_type.lower() in ("inf", "+inf", "infinity"):
            return math.inf
        raise ValueError(f"norm_type must be a positive number or 'inf', got {norm_type!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real):
        raise TypeError(f"norm_type must be a number or 'inf', got {norm_type!r}")
    p = float(norm_type)
    if not p > 0:  # also catches NaN; math.isnan would break a torch.compile graph
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
    return p


def check_positive(name: str, value: MaxNorm, allow_tensor: bool = True) -> None:
    """Raise unless ``value`` is a number > 0 (``inf`` allowed) or a 0-dim real tensor.

    A tensor's value is not inspected: that would wait on its device. Any real number
    type is accepted (numpy scalars too), as torch does.
    """
    if isinstance(value, Tensor) and allow_tensor:
        if value.dim() != 0 or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} tensor must be a 0-dim real tensor, got {value!r}")
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive number, got {value!r}")
    if not value > 0:  # also catches NaN; math.isnan would break a torch.compile graph
        raise ValueError(f"{name} must be > 0 (inf allowed), got {value!r}")


def check_foreach(foreach: object) -> None:
    """Raise unless ``foreach`` is True, False or None (a truthy string is not a choice)."""
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"foreach must be a bool or None, got {foreach!r}")


def validated_settings(
    max_norm: Any, norm_type: Any, per_group: Any, nonfinite: Any, max_consecutive_skips: Any
) -> Settings:
    """Check every wrapper-wide setting; raise naming the first bad one."""
    check_positive("max_norm", max_norm, allow_tensor=False)
    p = check_norm_type(norm_type)
    if not isinstance(per_group, bool):
        raise TypeError(f"per_group must be a bool, got {per_group!r}")
    if not isinstance(nonfinite, str) or nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
    limit = max_consecutive_skips
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        raise TypeError(f"max_consecutive_skips must be a positive int or None, got {limit!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"max_consecutive_skips must be >= 1 or None, got {limit!r}")
    return Settings(float(max_norm), p, per_group, cast(NonFinite, nonfinite), limit)


def _group_norm_type(index: int, value: Any) -> float:
    """A param group's ``clip_norm_type`` as a float; errors name the group."""
    try:
        return check_norm_type(value)
    except (TypeError, ValueError) as error:
        raise type(error)(f"param_groups[{index}][{NORM_TYPE_KEY!r}]: {error}") from None


def same_threshold(a: Threshold, b: Threshold) -> bool:
    """Equal numbers, or one tensor (whose value is not read)."""
    return a is b or (isinstance(a, float) and isinstance(b, float) and a == b)


def clip_layout(groups: Sequence[Mapping[str, Any]]) -> Layout | None:
    """Each param group's clip group and the names (:data:`Layout`); None where no group
    has a ``"clip_group"``: one clip group, or one per group with ``per_group``.

    Raises:
      TypeError: a name that is not a str, an int or None.
      ValueError: every group is left out (None): nothing would be clipped.
    """
    if not any(CLIP_GROUP_KEY in group for group in groups):
        return None
    layout: list[int | None] = []
    names: list[str | int] = []
    for index, group in enumerate(groups):
        name = group.get(CLIP_GROUP_KEY, DEFAULT_CLIP_GROUP)
        if name is not None and (isinstance(name, bool) or not isinstance(name, (str, int))):
            raise TypeError(
                f"param_groups[{index}][{CLIP_GROUP_KEY!r}] must be a str, an int or None, "
                f"got {name!r}"
            )
        if name is not None and name not in names:
            names.append(name)
        layout.append(None if name is None else names.index(name))
    if not names:
        raise ValueError(
            f"every param group has {CLIP_GROUP_KEY!r}: None, so nothing would be clipped; "
            "name a clip group, or step the inner optimizer itself"
        )
    return layout, names


def check_groups(
    groups: Sequence[Mapping[str, Any]], max_norm: Any, norm_type: Any, per_group: bool
) -> tuple[list[Threshold], list[float], Layout | None]:
    """Each group's threshold and norm order (``max_norm``, ``norm_type`` where it has
    none), validated, and its clip group.

    Returns:
      The thresholds (a number > 0, inf allowed, or a 0-dim tensor) and the orders, one
      per param group, or one per clip group where a group names one; the
      :func:`clip_layout`.

    Raises:
      TypeError, ValueError: a bad setting or clip group name; without ``per_group`` two
        orders (one global norm needs one); two groups of one clip group with different
        settings; ``per_group`` with clip group names.
    """
    thresholds: list[Threshold] = []
    norm_types = []
    for index, group in enumerate(groups):
        value = group.get(MAX_NORM_KEY, max_norm)
        check_positive(f"param_groups[{index}][{MAX_NORM_KEY!r}]", value)
        thresholds.append(value if isinstance(value, Tensor) else float(value))
        norm_types.append(_group_norm_type(index, group.get(NORM_TYPE_KEY, norm_type)))
    layout = clip_layout(groups)
    if layout is None:
        if not per_group and len(set(norm_types)) > 1:
            raise ValueError(
                f"param groups use different norm_type values {norm_types}; one global "
                "norm needs one order (pass per_group=True to clip each group by its own "
                f"norm, or name clip groups with {CLIP_GROUP_KEY!r})"
            )
        return thresholds, norm_types, None
    at, names = layout
    if per_group:
        index = next(i for i, group in enumerate(groups) if CLIP_GROUP_KEY in group)
        raise ValueError(
            f"per_group=True gives each param group its own clip group, but "
            f"param_groups[{index}][{CLIP_GROUP_KEY!r}] is {groups[index][CLIP_GROUP_KEY]!r}: "
            f"use per_group=False with {CLIP_GROUP_KEY!r} names, or per_group alone"
        )
    first = [at.index(k) for k in range(len(names))]
    for index, k in enumerate(at):
        if k is None:
            continue
        lead = first[k]
        for key, values in ((MAX_NORM_KEY, thresholds), (NORM_TYPE_KEY, norm_types)):
            a, b = values[lead], values[index]
            if not same_threshold(a, b):
                raise ValueError(
                    f"param_groups[{lead}] and param_groups[{index}] are in clip group "
                    f"{names[k]!r} but have {key!r} {a!r} and {b!r}: a clip group has one "
                    "threshold and one order"
                )
    return [thresholds[i] for i in first], [norm_types[i] for i in first], layout


def check_not_skip_step(optimizer: object) -> None:
    """Refuse an OLMo-core ``SkipStepOptimizer`` (``SkipStepAdamW``, ``SkipStepLion``):
    it skips a spike only when it is OLMo-core's train module's optimizer itself, which
    a wrapper is not, so wrapped it would silently never skip. Recognised by name, so
    without importing olmo_core.

    Raises:
      TypeError: naming the optimizer and what to use instead.
    """
    for kind in type(optimizer).__mro__:
        if kind.__name__ == "SkipStepOptimizer" and kind.__module__.startswith("olmo_core."):
            raise TypeError(
                f"optimizer is OLMo-core's {type(optimizer).__name__}, a SkipStepOptimizer: "
                "OLMo-core feeds it the loss and grad norm only when it is the train "
                "module's optimizer itself, so wrapped it would never skip a step. Wrap the "
                "plain optimizer (torch.optim.AdamW for SkipStepAdamW) and pass "
                "skip_spikes=clipopt.SpikeSkip() to skip spikes of the grad norm instead"
            )
