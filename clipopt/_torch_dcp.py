"""Torch's own DCP state-dict functions handed a wrapper: recognised, and the entry carried.

``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` and
``set_optimizer_state_dict`` (and ``get_state_dict`` / ``set_state_dict``, which the
checkpoints of OLMo-core and torchtitan go through) call the optimizer's own ``step``,
``state_dict`` and ``load_state_dict``, but build their dict from ``"state"`` and
``"param_groups"`` only: ``_get_optim_state_dict`` merges those two of each optimizer,
``_split_optim_state_dict`` and ``_unflatten_optim_state_dict`` rebuild only those two
for the load, so a wrapper's own top-level entry is dropped. What they keep whole is
each parameter's state, keyed by the parameter's name: every entry of it (with
``flatten_optimizer_state_dict``, the entries named in the live optimizer's state of
that parameter, each an int, float, tensor or dict). So the wrapper:

- carries its entry in the state of one parameter (:func:`carrier`: the first that
  requires grad) under :data:`CARRIED_KEY`, as one opaque int: the entry ``torch.save``-d
  to bytes. An int is a leaf that flattening accepts and that DCP saves and loads whole,
  without a template of the entry's tensors (which a fresh wrapper has not made yet);
- shows that key among the carrier's state names to torch's functions
  (:class:`StateView`), so a flattened load asks for it (a checkpoint without it gives
  an empty dict there, read as no entry);
- takes it back out in ``load_state_dict`` (:func:`take_carried`) before the inner
  optimizer sees the dict;
- steps only the inner optimizer in torch's initialisation step on zero grads with
  ``lr`` 0, so its own counters and norms are left alone.

Recognising a call costs a look at a few frames (torch's module is among the nearest
callers); no tensor is read. ``dcp.load`` fills only the keys its template has, and the
template a fresh wrapper gives has the carried key: a checkpoint written without it (by
an unwrapped run, or through torch's functions by clipopt before it carried the entry)
needs a non-strict load (``DefaultLoadPlanner(allow_partial_load=True)``), and the
wrapper warns that it keeps its current entry.
"""

from __future__ import annotations

import io
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

import torch
from torch import Tensor

from clipopt._errors import user_stacklevel

__all__ = [
    "CARRIED_KEY",
    "StateView",
    "called_by_torch_dcp",
    "carried",
    "carrier",
    "entry_bytes",
    "entry_from_bytes",
    "take_carried",
    "warn_entry_missing",
]

TORCH_MODULE = "torch.distributed.checkpoint.state_dict"
_FRAMES = 4
"""How many callers to look at, past the wrapper's own method and a subclass's override:
room for an LR scheduler's patched ``step`` or a decorator in between."""

CARRIED_KEY = "clipopt_entry"
"""The key of the wrapper's entry in its carrier's saved state: no dot (flattened names
are split at dots), and no name a torch optimizer's state uses."""


def called_by_torch_dcp() -> bool:
    """True if one of the nearest callers of the caller is in torch's DCP state-dict module
    (never while ``torch.compile`` traces, which cannot read frames)."""
    if torch.compiler.is_compiling():
        return False
    try:
        frame: FrameType | None = sys._getframe(2)  # past this function and the asking method
    except ValueError:
        return False
    for _ in range(_FRAMES):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == TORCH_MODULE:
            return True
        frame = frame.f_back
    return False


def carrier(param_groups: Sequence[Mapping[str, Any]]) -> tuple[int, Tensor] | None:
    """The parameter whose saved state carries the entry: its index over all groups (its
    key in ``state_dict()["state"]``) and itself. The first that requires grad, since
    torch's functions rebuild no state for the others; None if none does."""
    index = 0
    for group in param_groups:
        for p in group["params"]:
            if p.requires_grad:
                return index, p
            index += 1
    return None


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()  # saving a checkpoint, as the user asked: not a step
    if isinstance(value, Mapping):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def entry_bytes(entry: Mapping[str, Any]) -> bytes:
    """The wrapper's entry ``torch.save``-d to bytes, its tensors copied to the CPU: one
    opaque leaf that DCP saves and loads whole, without a template of its tensors."""
    buffer = io.BytesIO()
    torch.save(_to_cpu(entry), buffer)
    return buffer.getvalue()


def entry_from_bytes(blob: bytes) -> Any:
    """What :func:`entry_bytes` wrote, read with ``weights_only=True``."""
    return torch.load(io.BytesIO(blob), weights_only=True)


def _encode(entry: Mapping[str, Any]) -> int:
    # A leading 1 keeps the bytes' leading zeros in the int.
    return int.from_bytes(b"\x01" + entry_bytes(entry), "big")


def _decode(value: object) -> Any:
    if isinstance(value, Mapping) and not value:
        return None  # a flattened load of a checkpoint written without the entry
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TypeError(
            f"the saved state's {CARRIED_KEY!r} must be the int clipopt writes, got "
            f"{type(value).__name__}; nothing was loaded"
        )
    blob = value.to_bytes((value.bit_length() + 7) // 8, "big")
    return entry_from_bytes(blob[1:])


def carried(
    state_dict: Mapping[str, Any], param_groups: Sequence[Mapping[str, Any]], entry: Any
) -> dict[str, Any]:
    """``state_dict`` (the inner optimizer's) with ``entry`` in its carrier's state.

    Nothing of the inner optimizer's is changed: the carrier's state is a new dict.
    """
    found = carrier(param_groups)
    if found is None:
        return dict(state_dict)
    index = found[0]
    state = dict(state_dict["state"])
    if not state:  # a stateless optimizer: torch checks every parameter has state, or none
        state = {i: {} for i, p in enumerate(_params(param_groups)) if p.requires_grad}
    state[index] = {**state.get(index, {}), CARRIED_KEY: _encode(entry)}
    return {**state_dict, "state": state}


def _params(param_groups: Sequence[Mapping[str, Any]]) -> list[Tensor]:
    return [p for group in param_groups for p in group["params"]]


def take_carried(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """``state_dict`` without a carried entry, and the entry (None where it has none).

    Raises:
      TypeError: the carried value is not what :func:`carried` writes.
      ValueError: more than one parameter carries one.
    """
    state = state_dict.get("state")
    if not isinstance(state, Mapping):
        return dict(state_dict), None
    keys = [k for k, v in state.items() if isinstance(v, Mapping) and CARRIED_KEY in v]
    if not keys:
        return dict(state_dict), None
    if len(keys) > 1:
        raise ValueError(
            f"the saved state carries {CARRIED_KEY!r} in {len(keys)} parameters, not one; "
            "nothing was loaded"
        )
    rest = dict(state)
    entry = _decode(rest[keys[0]][CARRIED_KEY])
    rest[keys[0]] = {k: v for k, v in rest[keys[0]].items() if k != CARRIED_KEY}
    if not any(rest.values()):
        rest = {}  # the empty states :func:`carried` gave a stateless optimizer
    return {**state_dict, "state": rest}, entry


class StateView(Mapping[Any, Any]):
    """The inner optimizer's ``state`` as torch's functions see it through the wrapper:
    the carrier's state names include :data:`CARRIED_KEY`. Read-only, and a lookup makes
    no entry (the inner ``defaultdict`` would); as truthy as the inner state, which
    torch's initialisation step reads.

    Args:
      state: the inner optimizer's state.
      carrier: the carrier parameter, or None.
    """

    def __init__(self, state: Mapping[Any, Any], carrier: Tensor | None) -> None:
        self._state = state
        self._carrier = carrier

    def __getitem__(self, param: Any) -> Any:
        own = self._state.get(param, {})
        if param is self._carrier:
            return {**own, CARRIED_KEY: None}
        return own

    def __iter__(self) -> Iterator[Any]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)

    def __bool__(self) -> bool:
        return bool(self._state)


def warn_entry_missing(wrapper: str, key: str) -> None:
    """Warn that torch's DCP function loaded a dict that carries no ``key`` entry."""
    warnings.warn(
        f"{TORCH_MODULE} loaded an optimizer state that carries no {key!r} entry (written "
        "by an unwrapped run, or through torch's functions before clipopt carried it), so "
        f"{wrapper} keeps its current one (its step counters, last norms and rules' state; "
        "the per-group settings in param_groups are loaded)",
        UserWarning,
        stacklevel=user_stacklevel(),
    )
