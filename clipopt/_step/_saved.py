"""A ``ClippedOptimizer``'s side of its checkpoints: what it saves, and what it accepts
from a checkpoint or from clipopt 0.1.0.

:func:`clip_entry` writes the ``"clip"`` entry of the state dict, in the layout
:mod:`clipopt._step._clip_state` describes and checks
(:func:`clipopt._step._clip_state.prepare_load`).
:func:`check_saved_rules` checks what only the wrapper knows: that the saved rule and
spike skip are the ones it was constructed with, and that their own state loads (into
copies), before anything is loaded; :func:`load_clip_state` then installs them and the
record. A pickle written by 0.1.0 holds the wrapper's attributes in that version's
layout: :func:`upgrade_0_1_0_pickle` puts them in today's before they are restored.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from clipopt._step._clip_state import ClipState, Settings, migrate_legacy_keys
from clipopt._step._nonfinite import COUNTER_NAMES, StepRecord
from clipopt.rules._base import ClipRule
from clipopt.rules._spike_skip import SpikeSkip

__all__ = ["check_saved_rules", "clip_entry", "load_clip_state", "upgrade_0_1_0_pickle"]


def clip_entry(
    settings: Settings, record: StepRecord, rule: ClipRule | None, skip_spikes: SpikeSkip | None
) -> dict[str, Any]:
    """The ``"clip"`` entry of a state dict: copies of the record, the rules' own dicts."""

    def copy(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.detach().clone()

    entry = {
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


def upgrade_0_1_0_pickle(state: dict[str, Any]) -> None:
    """A 0.1.0 pickle's attributes in today's layout, in place: its norms, counters and
    lagged count become one record, and its group keys get today's names."""
    record = StepRecord()
    counters = {name: state.pop(f"_{name}") for name in COUNTER_NAMES}
    record.load(counters, state.pop("_last_norm"), state.pop("_last_group_norms"))
    lagged = state.pop("_lagged_consecutive_skips", None)
    if lagged is not None:
        record.lagged = lagged
    state["_record"] = record
    inner = state["optimizer"]
    migrate_legacy_keys(inner.defaults, owned=())  # 0.1.0 wrote them there: they are ours
    for group in inner.param_groups:
        migrate_legacy_keys(group, inner.defaults)
