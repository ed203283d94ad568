"""Recognising torch's own DCP state-dict functions when they are handed a wrapper.

``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` and
``set_optimizer_state_dict`` (and ``get_state_dict`` / ``set_state_dict``, and the
``state_dict`` methods that ``_patch_optimizer_state_dict`` installs) call the optimizer's
own ``step``, ``state_dict`` and ``load_state_dict``, but keep only ``"state"`` and
``"param_groups"`` of the dict, and initialise a fresh optimizer's state by stepping it
on zero grads with ``lr`` 0. torch offers no hook to keep another top-level entry, so an
optimizer wrapper's own entry cannot survive them. What the wrapper can do is recognise
the call (torch's module is among its nearest callers) and then:

- step only the inner optimizer in that initialisation step, as the clipopt helpers do,
  so its own counters and norms are left alone;
- warn, once per call site, that its entry was not saved or not loaded, naming the
  helpers that keep it.

It warns rather than raises: training frameworks call torch's functions on whatever
optimizer they are given, the inner state and the per-group settings (in
``param_groups``) do survive, and what is lost is said.

Recognising costs a look at a few frames, no tensor is read; the step asks only while
the inner optimizer has no state, which is when torch would step it.
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType

from clipopt._errors import user_stacklevel

__all__ = ["called_by_torch_dcp", "warn_entry_dropped"]

TORCH_MODULE = "torch.distributed.checkpoint.state_dict"
_FRAMES = 4
"""How many callers to look at, past the wrapper's own method and a subclass's override:
room for an LR scheduler's patched ``step`` or a decorator in between."""

_HELPERS = (
    "clipopt.distributed.get_optimizer_state_dict / set_optimizer_state_dict "
    "(or clipopt.distributed.ClippedOptimizerState with dcp.save / dcp.load)"
)


def called_by_torch_dcp() -> bool:
    """True if one of the nearest callers of the caller is in torch's DCP state-dict module."""
    try:
        frame: FrameType | None = sys._getframe(
            2
        )  # past this function and the wrapper method asking
    except ValueError:
        return False
    for _ in range(_FRAMES):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == TORCH_MODULE:
            return True
        frame = frame.f_back
    return False


def warn_entry_dropped(wrapper: str, key: str, saving: bool) -> None:
    """Warn that torch's DCP function did not save (or load) the wrapper's ``key`` entry."""
    if saving:
        what = f"drops {wrapper}'s {key!r} entry from the optimizer state dict"
    else:
        what = f"loads no {key!r} entry, so {wrapper} keeps its current one"
    warnings.warn(
        f"{TORCH_MODULE} keeps only 'state' and 'param_groups': it {what} (its step "
        f"counters and last norms; the per-group settings in param_groups are kept). Use "
        f"{_HELPERS}, which keep it.",
        UserWarning,
        stacklevel=user_stacklevel(),
    )
