"""Settings and their checks, run when set, each naming the argument and the value."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeAlias, cast, get_args

import torch
from torch import Tensor

NormType: TypeAlias = float | int | str
MaxNorm: TypeAlias = float | int | Tensor
NonFinite: TypeAlias = Literal["propagate", "skip", "raise", "assert"]
Threshold: TypeAlias = float | Tensor
Layout: TypeAlias = tuple[list[int | None], list[str | int]]  # each group's clip group; names

CLIP_KEY = "clip"  # ClippedOptimizer.state_dict()'s entry of the clip state
# Param group (and defaults) keys no optimizer uses: saved, loaded and edited like ``lr``.
MAX_NORM_KEY, NORM_TYPE_KEY, CLIP_GROUP_KEY = "clip_max_norm", "clip_norm_type", "clip_group"
DEFAULT_CLIP_GROUP = "default"


@dataclass(frozen=True)
class Settings:
    max_norm: float
    norm_type: float
    per_group: bool
    nonfinite: NonFinite
    max_consecutive_skips: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


SETTINGS_KEYS = tuple(Settings.__dataclass_fields__)


def check_norm_type(norm_type: NormType) -> float:
    if isinstance(norm_type, str):
        if norm_type.lower() in ("inf", "+inf", "infinity"):
            return math.inf
        raise ValueError(f"norm_type must be a positive number or 'inf', got {norm_type!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real):
        raise TypeError(f"norm_type must be a number or 'inf', got {norm_type!r}")
    if not norm_type > 0:  # also catches NaN; math.isnan would break a torch.compile graph
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
    return float(norm_type)


def check_positive(name: str, value: MaxNorm, allow_tensor: bool = True) -> None:
    if isinstance(value, Tensor) and allow_tensor:
        if value.dim() != 0 or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} tensor must be a 0-dim real tensor, got {value!r}")
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive number, got {value!r}")
    if not value > 0:  # also catches NaN
        raise ValueError(f"{name} must be > 0 (inf allowed), got {value!r}")


def check_foreach(foreach: object) -> None:
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"foreach must be a bool or None, got {foreach!r}")


def validated_settings(
    max_norm: Any, norm_type: Any, per_group: Any, nonfinite: Any, max_consecutive_skips: Any
) -> Settings:
    check_positive("max_norm", max_norm, allow_tensor=False)
    p = check_norm_type(norm_type)
    if not isinstance(per_group, bool):
        raise TypeError(f"per_group must be a bool, got {per_group!r}")
    if not isinstance(nonfinite, str) or nonfinite not in get_args(NonFinite):
        raise ValueError(f"nonfinite must be one of {get_args(NonFinite)}, got {nonfinite!r}")
    limit = max_consecutive_skips
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        raise TypeError(f"max_consecutive_skips must be a positive int or None, got {limit!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"max_consecutive_skips must be >= 1 or None, got {limit!r}")
    return Settings(float(max_norm), p, per_group, cast(NonFinite, nonfinite), limit)


def same_threshold(a: Threshold, b: Threshold) -> bool:
    return a is b or (isinstance(a, float) and isinstance(b, float) and a == b)


def clip_layout(groups: Sequence[Mapping[str, Any]]) -> Layout | None:
    """The param groups' :data:`Layout`; None where no group has a ``"clip_group"``."""
    if not any(CLIP_GROUP_KEY in group for group in groups):
        return None
    layout: list[int | None] = []
    names: list[str | int] = []
    for index, group in enumerate(groups):
        name = group.get(CLIP_GROUP_KEY, DEFAULT_CLIP_GROUP)
        if name is not None and (isinstance(name, bool) or not isinstance(name, (str, int))):
            where = f"param_groups[{index}][{CLIP_GROUP_KEY!r}]"
            raise TypeError(f"{where} must be a str, an int or None, got {name!r}")
        if name is not None and name not in names:
            names.append(name)
        layout.append(None if name is None else names.index(name))
    if not names:
        raise ValueError(f"every param group has {CLIP_GROUP_KEY!r}: None: nothing to clip")
    return layout, names


def check_groups(
    groups: Sequence[Mapping[str, Any]], max_norm: Any, norm_type: Any, per_group: bool
) -> tuple[list[Threshold], list[float], Layout | None]:
    """Each param (or clip) group's threshold and norm order, validated, and the layout."""
    thresholds: list[Threshold] = []
    norm_types = []
    for index, group in enumerate(groups):
        value = group.get(MAX_NORM_KEY, max_norm)
        check_positive(f"param_groups[{index}][{MAX_NORM_KEY!r}]", value)
        thresholds.append(value if isinstance(value, Tensor) else float(value))
        try:
            norm_types.append(check_norm_type(group.get(NORM_TYPE_KEY, norm_type)))
        except (TypeError, ValueError) as error:
            raise type(error)(f"param_groups[{index}][{NORM_TYPE_KEY!r}]: {error}") from None
    layout = clip_layout(groups)
    if layout is None:
        if not per_group and len(set(norm_types)) > 1:
            raise ValueError(f"one norm of norm_type values {norm_types}: pass per_group=True")
        return thresholds, norm_types, None
    at, names = layout
    if per_group:
        index = next(i for i, group in enumerate(groups) if CLIP_GROUP_KEY in group)
        name = f"param_groups[{index}][{CLIP_GROUP_KEY!r}]"
        raise ValueError(f"per_group=True but {name} is {groups[index][CLIP_GROUP_KEY]!r}")
    first = [at.index(k) for k in range(len(names))]
    for index, k in enumerate(at):
        for key, values in ((MAX_NORM_KEY, thresholds), (NORM_TYPE_KEY, norm_types)):
            if k is not None and not same_threshold(values[first[k]], values[index]):
                raise ValueError(
                    f"param_groups[{first[k]}] and param_groups[{index}] are in clip group "
                    f"{names[k]!r} but have {key!r} {values[first[k]]!r} and {values[index]!r}"
                )
    return [thresholds[i] for i in first], [norm_types[i] for i in first], layout
