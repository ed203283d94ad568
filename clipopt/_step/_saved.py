"""The ``"clip"`` entry of a state dict (format :data:`FORMAT`; format 1 still loads)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from clipopt._validation import SETTINGS_KEYS, Settings, check_groups, validated_settings
from clipopt.rules._base import ClipRule
from clipopt.rules._spike_skip import SpikeSkip

FORMAT = 2

COUNTERS = ("step_count", "skip_count", "consecutive_skips")
_READOUTS = ("last_clipped_norm", "last_clipped", "clipped_count")  # new in format 2
_KEYS = ("format", "settings", "last_norm", "last_group_norms", *COUNTERS, *_READOUTS)
_OPTIONAL = ("rule", "skip_spikes")


@dataclass(frozen=True)
class ClipState:
    """A validated ``"clip"`` entry, ready to be installed."""

    settings: Settings
    last: dict[str, Tensor | None]  # last_norm, last_group_norms, last_clipped(_norm)
    counters: dict[str, Tensor]
    rule: Mapping[str, Any] | None = None
    skip_spikes: Mapping[str, Any] | None = None


def clip_entry(
    settings: Settings,
    record: Mapping[str, Tensor | None],
    rule: ClipRule | None,
    skip_spikes: SpikeSkip | None,
) -> dict[str, Any]:
    """The ``"clip"`` entry: copies of the record's tensors, the rules' own dicts."""
    entry: dict[str, Any] = {"format": FORMAT, "settings": settings.as_dict()}
    for key in _KEYS[2:]:
        value = record[key]
        entry[key] = None if value is None else value.detach().clone()
    for key, owner in (("rule", rule), ("skip_spikes", skip_spikes)):
        if owner is not None:
            entry[key] = owner.state_dict()
    return entry


def check_load(
    raw: Any,
    inner_state: Mapping[str, Any],
    num_groups: int,
    current: Settings,
    rule: ClipRule | None,
    skip_spikes: SpikeSkip | None,
) -> ClipState | None:
    """``raw`` (None: none) and the saved groups validated whole; changes nothing."""
    state = None if raw is None else _parsed(raw, num_groups)
    settings = current if state is None else state.settings
    groups = inner_state.get("param_groups")
    if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        check_groups(groups, settings.max_norm, settings.norm_type, settings.per_group)
    if state is None:
        return None
    for name, mine, saved in (
        ("max_norm", rule, state.rule),
        ("skip_spikes", skip_spikes, state.skip_spikes),
    ):
        if (mine is None) != (saved is None):
            had = "no rule (a number or None)"
            if saved is not None:
                had = f"{saved.get('type')}({saved.get('config')})"
            shown: object = current.max_norm if mine is None and name == "max_norm" else mine
            raise ValueError(
                f"the checkpoint was saved with {name}={had}, this optimizer has "
                f"{name}={shown!r}; construct it as it was saved"
            )
        if mine is not None and saved is not None:
            mine.trial_copy().load_state_dict(saved)
    if rule is not None and (settings.per_group or settings.max_norm != math.inf):
        raise ValueError(
            "state_dict['clip']['settings'] of a rule must have per_group=False and "
            f"max_norm=inf, got {settings.as_dict()}"
        )
    return state


def _parsed(raw: Any, num_groups: int) -> ClipState:
    if not isinstance(raw, Mapping):
        raise TypeError(f"state_dict['clip'] must be a dict, got {type(raw).__name__}")
    version = raw.get("format")
    if type(version) is not int or version not in (1, FORMAT):
        raise ValueError(
            f"state_dict['clip']['format'] is {version!r}; this clipopt reads formats 1 "
            f"and {FORMAT}, and writes {FORMAT}"
        )
    keys = _KEYS if version == FORMAT else _KEYS[: -len(_READOUTS)]
    if not set(keys) <= set(raw) <= {*keys, *_OPTIONAL}:
        raise ValueError(
            f"state_dict['clip'] of format {version} must have the keys {sorted(keys)} (and "
            f"optionally {list(_OPTIONAL)}), got {sorted(map(str, raw))}"
        )
    for key in _OPTIONAL:
        if raw.get(key) is not None and not isinstance(raw[key], Mapping):
            raise TypeError(f"state_dict['clip'][{key!r}] must be a dict, got {raw[key]!r}")
    saved = raw["settings"]
    if not isinstance(saved, Mapping) or set(saved) != set(SETTINGS_KEYS):
        raise ValueError(
            f"state_dict['clip']['settings'] must be a dict with the keys {list(SETTINGS_KEYS)}"
        )
    settings = validated_settings(*(saved[key] for key in SETTINGS_KEYS))
    last = {"last_norm": _tensor("last_norm", raw["last_norm"], dims=0, kind="float")}
    group_norms = _tensor("last_group_norms", raw["last_group_norms"], dims=1, kind="float")
    if group_norms is not None and group_norms.numel() != num_groups:
        raise ValueError(
            f"state_dict['clip']['last_group_norms'] has {group_norms.numel()} entries "
            f"for {num_groups} param (or clip) groups"
        )
    last["last_group_norms"] = group_norms
    # shaped as the norms they derive from; the count per group from the start with per_group
    shape = () if group_norms is None else tuple(group_norms.shape)
    for key, kind in zip(_READOUTS[:2], ("float", "bool"), strict=True):
        last[key] = _tensor(key, raw.get(key), dims=len(shape), kind=kind)
    counted = (num_groups,) if settings.per_group and group_norms is None else shape
    count = raw.get("clipped_count")
    if group_norms is None and isinstance(count, Tensor) and count.dim() < 2:
        counted = tuple(count.shape) if count.numel() == num_groups else ()
    counters = {"clipped_count": torch.zeros(counted, dtype=torch.int64)}  # format 1
    for key in COUNTERS if version == 1 else (*COUNTERS, "clipped_count"):
        dims = len(counted) if key == "clipped_count" else 0
        counter = _tensor(key, raw[key], dims=dims, kind="int64")
        if counter is None or bool((counter < 0).any()):
            raise ValueError(f"state_dict['clip'][{key!r}] must be an int64 tensor >= 0")
        counters[key] = counter
    for key, value in (*last.items(), ("clipped_count", counters["clipped_count"])):
        want = counted if key == "clipped_count" else shape
        if key != "last_norm" and value is not None and value.shape != want:
            raise ValueError(f"state_dict['clip'][{key!r}] must have the shape {want}")
    return ClipState(settings, last, counters, raw.get("rule"), raw.get("skip_spikes"))


def _tensor(name: str, value: Any, dims: int, kind: str) -> Tensor | None:
    """None, or a tensor of ``dims`` dimensions and a ``kind`` (float, int64, bool) dtype."""
    if value is None:
        return None
    if not (
        isinstance(value, Tensor)
        and value.dim() == dims
        and (value.is_floating_point() if kind == "float" else str(value.dtype) == f"torch.{kind}")
    ):
        wanted = "a floating-point" if kind == "float" else f"a {kind}"
        raise TypeError(
            f"state_dict['clip'][{name!r}] must be None or {wanted} tensor with {dims} "
            f"dimension(s), got {value!r}"
        )
    return value
