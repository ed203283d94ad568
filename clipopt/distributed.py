"""Clipping under ``torch.distributed`` (docs/distributed.md): the DCP clip state."""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from clipopt.optimizer import ClippedOptimizer

__all__ = ["ClippedOptimizerState"]


class ClippedOptimizerState:
    """The clip state of a :class:`clipopt.ClippedOptimizer` as a DCP ``Stateful``.

    Save it beside the model and the optimizer (DCP drops the wrapper's ``"clip"`` entry).
    Its state dict is ``{"stage<i>": bytes}`` (``i``: this rank's ``pp_mesh`` stage, else
    0), loaded with ``weights_only=True``; a partial ``dcp.load`` without it warns.

    Raises:
      TypeError: ``optimizer`` is not a ``ClippedOptimizer``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, ClippedOptimizer):
            raise TypeError(f"optimizer must be a ClippedOptimizer, got {type(optimizer).__name__}")
        optimizer._extra_saved_apart = True  # a load without the entry is expected
        self.optimizer = optimizer
        self._template: bytes | None = None

    def _key(self) -> str:
        group = self.optimizer._clip.norm_scope.pp_group
        return f"stage{0 if group is None else dist.get_rank(group)}"

    def state_dict(self) -> dict[str, Any]:
        # One leaf DCP loads whole; kept to recognise it handed back by a partial dcp.load.
        buffer = io.BytesIO()
        torch.save(self.optimizer._extra_state(), buffer)
        self._template = buffer.getvalue()
        return {self._key(): self._template}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        key = self._key()
        if not isinstance(state_dict, Mapping) or key not in state_dict:
            shown = sorted(state_dict) if isinstance(state_dict, Mapping) else state_dict
            raise ValueError(f"ClippedOptimizerState's state dict has no {key!r}, got {shown!r}")
        blob = state_dict[key]
        if blob is self._template:
            warnings.warn(
                f"the checkpoint has no {key!r} ClippedOptimizerState entry: the clip state is "
                "kept as it is; save ClippedOptimizerState(optimizer) beside the model",
                stacklevel=2,
            )
            return
        entry = blob
        if isinstance(blob, bytes):
            entry = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        if not isinstance(blob, bytes) or not isinstance(entry, dict):
            raise TypeError(f"{key!r} must be the bytes of a dict, got {type(entry).__name__}")
        self.optimizer._load({"clip": entry}, inner=False)
