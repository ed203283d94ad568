"""What a ``ClippedOptimizer`` accepts from a checkpoint or an older version.

A pickle written by clipopt 0.1.0 holds the wrapper's attributes in that version's
layout: :func:`upgrade_0_1_0_pickle` puts them in today's before they are restored. A
state dict's ``"clip"`` entry is validated by :func:`clipopt._clip_state.prepare_load`
(its layout, the settings); :func:`check_saved_rules` adds what only the wrapper knows:
that the saved rule and spike skip are the ones it was constructed with, and that their
own state loads (into copies), before anything is loaded.
"""

from __future__ import annotations

import math
from typing import Any

from clipopt._clip_state import ClipState, migrate_legacy_keys
from clipopt._nonfinite import COUNTER_NAMES, StepRecord
from clipopt._rule import ClipRule
from clipopt._spike_skip import SpikeSkip

__all__ = ["check_saved_rules", "upgrade_0_1_0_pickle"]


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
