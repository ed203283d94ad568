"""A ``ClippedOptimizer``'s side of its checkpoints: what it saves, and what it accepts.

:func:`clip_entry` writes the ``"clip"`` entry of the state dict, and
:func:`prepare_load` checks a loaded one completely, with the saved param groups' clip
settings, before anything is loaded. Its layout::

  {"format": 1,
   "settings": {"max_norm": float, "norm_type": float, "per_group": bool,
                "nonfinite": str, "max_consecutive_skips": int | None},
   "last_norm": 0-dim Tensor | None,
   "last_group_norms": 1-D Tensor | None,   # per_group=True only
   "step_count": 0-dim int64 Tensor, "skip_count": ..., "consecutive_skips": ...,
   # only when max_norm is a rule / skip_spikes is set:
   "rule": {"type": str, "config": dict, "state": dict, "last_threshold": Tensor | None,
            "clipped_count": 0-dim int64 Tensor},
   "skip_spikes": {"type": "SpikeSkip", "config": dict, "state": dict,
                   "spike_count": 0-dim int64 Tensor, "steps_seen": int}}

With a rule, ``settings["max_norm"]`` is inf (the rule sets every threshold). The two
optional entries are checked here only for being dicts: the rule objects check their own
entries (:meth:`clipopt.ClipRule.load_state_dict`) before anything loads.

Tensors and plain Python values only, so ``torch.load(..., weights_only=True)`` reads it.
``"format"`` is the layout's version, :data:`FORMAT`; an entry of another version, or
without one, is refused.

:func:`check_saved_rules` checks what only the wrapper knows: that the saved rule and
spike skip are the ones it was constructed with, and that their own state loads (into
copies), before anything is loaded; :func:`load_clip_state` then installs them and the
record.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from clipopt._step._clip_state import (
    SETTINGS_KEYS,
    ClipState,
    Settings,
    check_groups,
    validated_settings,
)
from clipopt._step._nonfinite import StepRecord
from clipopt.rules._base import ClipRule
from clipopt.rules._spike_skip import SpikeSkip

__all__ = [
    "FORMAT",
    "check_saved_rules",
    "clip_entry",
    "load_clip_state",
    "prepare_load",
]

FORMAT = 1
"""The version of the ``"clip"`` entry's layout, saved in it as ``"format"``."""

_CLIP_STATE_KEYS = (
    "format",
    "settings",
    "last_norm",
    "last_group_norms",
    "step_count",
    "skip_count",
    "consecutive_skips",
)
_COUNTER_KEYS = ("step_count", "skip_count", "consecutive_skips")
_OPTIONAL_KEYS = ("rule", "skip_spikes")


def clip_entry(
    settings: Settings, record: StepRecord, rule: ClipRule | None, skip_spikes: SpikeSkip | None
) -> dict[str, Any]:
    """The ``"clip"`` entry of a state dict: copies of the record, the rules' own dicts."""

    def copy(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.detach().clone()

    entry = {
        "format": FORMAT,
        "settings": settings.as_dict(),
        "last_norm": copy(record.last_norm),
        "last_group_norms": copy(record.last_group_norms),
        **record.state(),
    }
    if rule is not None:
        entry["rule"] = rule.state_dict()
    if skip_spikes is not None:
        entry["skip_spikes"] = skip_spikes.state_dict()
    return entry


def check_saved_rules(
    prepared: ClipState, rule: ClipRule | None, skip_spikes: SpikeSkip | None, max_norm: float
) -> None:
    """The saved rule and spike skip are this wrapper's (``rule``, ``skip_spikes``; a
    ``max_norm`` number otherwise), with their settings; trial loads into copies check
    their state. Nothing here changes."""
    pairs = (
        ("max_norm", rule, prepared.rule),
        ("skip_spikes", skip_spikes, prepared.skip_spikes),
    )
    for name, mine, saved in pairs:
        if (mine is None) != (saved is None):
            had = (
                "no rule (a number or None)"
                if saved is None
                else f"{saved.get('type')}({saved.get('config')})"
            )
            shown: object = max_norm if mine is None and name == "max_norm" else mine
            raise ValueError(
                f"the checkpoint was saved with {name}={had}, this optimizer has "
                f"{name}={shown!r}; construct it as it was saved"
            )
        if mine is not None and saved is not None:
            mine.trial_copy().load_state_dict(saved)
    if rule is not None and (prepared.settings.per_group or prepared.settings.max_norm != math.inf):
        raise ValueError(
            "state_dict['clip']['settings'] of a rule must have per_group=False and "
            f"max_norm=inf, got {prepared.settings.as_dict()}"
        )


def load_clip_state(
    clip_state: ClipState,
    device: torch.device,
    record: StepRecord,
    rule: ClipRule | None,
    skip_spikes: SpikeSkip | None,
) -> None:
    """Load a validated clip state's rule, spike skip and record, copied onto ``device``."""

    def here(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(device=device, copy=True)

    if rule is not None and clip_state.rule is not None:
        rule.load_state_dict(clip_state.rule)
        rule.to(device)
    if skip_spikes is not None and clip_state.skip_spikes is not None:
        skip_spikes.load_state_dict(clip_state.skip_spikes)
        skip_spikes.to(device)
    counters = {k: v.to(device=device, copy=True) for k, v in clip_state.counters.items()}
    record.load(counters, here(clip_state.last_norm), here(clip_state.last_group_norms))


def readable_groups(state_dict: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The saved param groups when they are a list of dicts, else None (a custom layout,
    left to the inner optimizer's own ``load_state_dict``)."""
    groups = state_dict.get("param_groups")
    if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        return groups
    return None


def prepare_load(
    raw_clip: Any,
    inner_state: Mapping[str, Any],
    num_groups: int,
    current: Settings,
) -> tuple[dict[str, Any], ClipState | None]:
    """Validate what the wrapper reads from a load, before anything is loaded.

    The one check of both loaders (``ClippedOptimizer.load_state_dict`` and the DCP
    one): the ``"clip"`` entry completely and, where the saved param groups are a list of
    dicts, their clip settings. Everything else is
    the inner optimizer's to judge: its own ``load_state_dict`` gets it as it is.

    Args:
      raw_clip: the saved ``"clip"`` entry, None when there is none.
      inner_state: the rest of the dict, for the inner optimizer.
      num_groups: how many param groups the optimizer has now.
      current: the settings that stay when the dict has no ``"clip"`` entry.

    Returns:
      The dict to hand to the inner optimizer, and the validated clip state (or None).

    Raises:
      TypeError, ValueError: naming the first bad value; nothing has been changed.
    """
    clip_state = parse_clip_state(raw_clip, num_groups)
    inner_state = dict(inner_state)
    groups = readable_groups(inner_state)
    if groups is not None:
        check_groups(groups, current if clip_state is None else clip_state.settings)
    return inner_state, clip_state


def parse_clip_state(raw: Any, num_groups: int) -> ClipState | None:
    """Validate a ``"clip"`` entry completely; None when there is none."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise TypeError(f"state_dict['clip'] must be a dict, got {type(raw).__name__}")
    version = raw.get("format")
    if type(version) is not int or version != FORMAT:
        raise ValueError(
            f"state_dict['clip']['format'] is {version!r}; this clipopt reads only "
            f"format {FORMAT}, which it writes"
        )
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
    if not isinstance(saved, Mapping) or set(saved) != set(SETTINGS_KEYS):
        raise ValueError(
            f"state_dict['clip']['settings'] must be a dict with the keys {list(SETTINGS_KEYS)}"
        )
    settings = validated_settings(*(saved[key] for key in SETTINGS_KEYS))
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
