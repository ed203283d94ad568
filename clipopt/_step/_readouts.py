"""What a ``ClippedOptimizer`` shows of itself: its settings, the last norms, the counters.

:class:`ClipReadouts` gives :class:`clipopt.ClippedOptimizer` its read-only properties:
the settings it steps with (each param group's ``clip_max_norm`` / ``clip_norm_type``,
the constructor's choices), the last step's norms and the step counters, read from the
step record (:mod:`clipopt._step._nonfinite`) and the tracked per-tensor norms
(:mod:`clipopt._step._monitor`). Nothing here writes anything or waits for the device;
assigning a property raises an error that says what to set instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from clipopt._step._clip_state import MAX_NORM_KEY, NORM_TYPE_KEY, NonFinite
from clipopt._step._monitor import TensorNorms
from clipopt._step._nonfinite import StepRecord
from clipopt.rules._base import ClipRule
from clipopt.rules._spike_skip import SpikeSkip

__all__ = ["ClipReadouts"]


class ClipReadouts:
    """The read-only public state of a wrapper holding a step record and its settings."""

    optimizer: Optimizer
    _record: StepRecord
    _tensor_norms: TensorNorms
    _rule: ClipRule | None
    _skip_spikes: SpikeSkip | None
    _per_group: bool
    _foreach: bool | None
    _nonfinite: NonFinite
    _max_consecutive_skips: int | None
    _track_tensor_norms: bool

    def _group_setting(self, key: str) -> float | list[float]:
        """Each param group's ``key``: one number where every group has the same."""
        values = [float(group[key]) for group in self.optimizer.param_groups]
        return values[0] if len(set(values)) == 1 else values

    @property
    def max_norm(self) -> float | list[float] | ClipRule:
        """The threshold the step uses: the rule, else the param groups'
        ``clip_max_norm`` (one number where every group has the same, else one per group).

        Read-only: set ``opt.param_groups[i]["clip_max_norm"]`` (and
        ``opt.defaults["clip_max_norm"]`` for groups added later) to change it, as an LR
        scheduler changes ``lr``.
        """
        return self._rule if self._rule is not None else self._group_setting(MAX_NORM_KEY)

    @max_norm.setter
    def max_norm(self, value: object) -> None:
        how = (
            f"(and opt.defaults[{MAX_NORM_KEY!r}] for groups added later), or make a new "
            "ClippedOptimizer for a rule"
        )
        raise AttributeError(_group_setting_refused("max_norm", MAX_NORM_KEY, value, how))

    @property
    def norm_type(self) -> float | list[float]:
        """The norm's order the step uses: the param groups' ``clip_norm_type`` (one
        number where every group has the same). Read-only, as :attr:`max_norm`."""
        return self._group_setting(NORM_TYPE_KEY)

    @norm_type.setter
    def norm_type(self, value: object) -> None:
        how = "in every group (one order for all unless per_group=True)"
        raise AttributeError(_group_setting_refused("norm_type", NORM_TYPE_KEY, value, how))

    @property
    def per_group(self) -> bool:
        """Whether each param group is clipped by its own norm."""
        return self._per_group

    @property
    def foreach(self) -> bool | None:
        """The ``foreach`` choice passed to the norm and scale kernels."""
        return self._foreach

    @property
    def nonfinite(self) -> NonFinite:
        """What a non-finite norm does: ``"propagate"``, ``"skip"`` or ``"raise"``."""
        return self._nonfinite

    @property
    def max_consecutive_skips(self) -> int | None:
        """Skipped steps in a row after which a non-finite norm raises."""
        return self._max_consecutive_skips

    @property
    def rule(self) -> ClipRule | None:
        """The clip rule passed as ``max_norm``, None for a number. Its
        :attr:`~clipopt.ClipRule.last_threshold` and
        :attr:`~clipopt.ClipRule.clipped_count` are the rule's monitoring."""
        return self._rule

    @property
    def skip_spikes(self) -> SpikeSkip | None:
        """The :class:`clipopt.SpikeSkip` that skips spikes, or None."""
        return self._skip_spikes

    @property
    def track_tensor_norms(self) -> bool:
        """Whether each step keeps its per-tensor norms in :attr:`last_tensor_norms`."""
        return self._track_tensor_norms

    @property
    def last_norm(self) -> Tensor | None:
        """The pre-clip total norm of the most recent step, None before the first.

        A 0-dim tensor on the grads' device (float32, float64 for double grads). With
        ``per_group=True`` it is the norm of the per-group norms taken with the default
        ``norm_type``: the total norm whenever every group uses that order.
        """
        return self._record.last_norm

    @property
    def last_group_norms(self) -> Tensor | None:
        """With ``per_group=True``, the pre-clip norm of each group (1-D); else None."""
        return self._record.last_group_norms

    @property
    def last_tensor_norms(self) -> dict[str, Tensor] | None:
        """With ``track_tensor_norms=True``, each grad's pre-clip norm in the last step.

        ``{name: 0-dim tensor}`` on the grads' device (float32, float64 for double
        grads), in the order of the param groups, parameters without a grad left out.
        A name is the one torch keeps in each group's ``param_names`` when the inner
        optimizer was given ``model.named_parameters()``, else the parameter's index
        over all groups as a string (its key in ``state_dict()["state"]``). None before
        the first step, after a load, and without ``track_tensor_norms``. Not saved in
        :meth:`state_dict`: nothing in a step reads it.
        """
        return self._tensor_norms.as_dict()

    @property
    def step_count(self) -> Tensor:
        """Inner steps taken (skipped ones not counted), a 0-dim int64 tensor."""
        return self._record.step_count

    @property
    def skip_count(self) -> Tensor:
        """Steps skipped for a non-finite norm, a 0-dim int64 tensor."""
        return self._record.skip_count

    @property
    def consecutive_skips(self) -> Tensor:
        """Steps skipped in a row since the last step taken, a 0-dim int64 tensor."""
        return self._record.consecutive_skips


def _group_setting_refused(name: str, key: str, value: object, how: str) -> str:
    return (
        f"ClippedOptimizer.{name} cannot be assigned ({name}={value!r}): the step reads each "
        f"param group's {key!r}; set opt.param_groups[i][{key!r}] {how}"
    )


def _refuse_assignment(name: str) -> Callable[[Any, object], None]:
    def refuse(self: Any, value: object) -> None:
        raise AttributeError(
            f"ClippedOptimizer.{name} cannot be assigned ({name}={value!r}): it is fixed when "
            "the wrapper is made (and by load_state_dict); make a new ClippedOptimizer"
        )

    return refuse


# Settings fixed at construction say so when assigned, rather than "has no setter".
for _name in (
    "per_group",
    "foreach",
    "nonfinite",
    "max_consecutive_skips",
    "rule",
    "skip_spikes",
    "track_tensor_norms",
):
    _read = getattr(ClipReadouts, _name)
    setattr(ClipReadouts, _name, _read.setter(_refuse_assignment(_name)))
