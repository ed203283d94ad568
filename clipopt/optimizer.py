"""``ClippedOptimizer``: clip the gradient norm before every step of any torch optimizer.

Gradient-norm clipping as an optimizer wrapper. The wrapper's plumbing (pass-through
``param_groups`` / ``state`` / ``defaults``, hooks, pickling, the state-dict templates)
is :class:`clipopt._wrapper.OptimizerWrapper`, and its read-only properties are
:class:`clipopt._step._readouts.ClipReadouts`; this module is the clip: its settings, its
step (measure -> decide -> apply: :func:`clipopt._step._decide.decide_and_scale` makes
the decision and scales the grads by it, :func:`clipopt._step._apply.apply_decision` runs
the inner step (or folds the scale into it), and
:func:`clipopt._step._decide.commit` keeps what the step leaves) and the entry points of
its ``"clip"`` entry in the state dict (written, checked and installed by
:mod:`clipopt._step._saved`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, overload

import torch
from torch import Tensor
from torch.optim import Optimizer

from clipopt._dist._deepspeed import Watch, bind
from clipopt._dist._reduce import NormScope
from clipopt._errors import user_stacklevel
from clipopt._step import _monitor
from clipopt._step._apply import apply_decision
from clipopt._step._clip_state import (
    CLIP_KEY,
    MAX_NORM_KEY,
    NORM_TYPE_KEY,
    ClipState,
    NonFinite,
    Settings,
    check_groups,
    validated_settings,
)
from clipopt._step._decide import (
    ClipConfig,
    check_config,
    check_rule_groups,
    commit,
    decide_and_scale,
)
from clipopt._step._nonfinite import StepRecord
from clipopt._step._parts import ClipDecision
from clipopt._step._readouts import ClipReadouts
from clipopt._step._saved import (
    check_saved_rules,
    clip_entry,
    load_clip_state,
    prepare_load,
)
from clipopt._validation import check_foreach, check_not_skip_step
from clipopt._wrapper import Closure, OptimizerWrapper
from clipopt.rules._base import ClipRule
from clipopt.rules._spike_skip import SpikeSkip

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ClippedOptimizer"]


def _check_inner(optimizer: Any) -> None:
    """Refuse what cannot be wrapped: a wrapper, a non-optimizer, nothing to optimize."""
    if isinstance(optimizer, ClippedOptimizer):
        raise TypeError(
            "optimizer is already a ClippedOptimizer; wrapping it twice would clip twice. "
            "Change its param groups' 'clip_max_norm' instead"
        )
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    check_not_skip_step(optimizer)
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not any(g.get("params") for g in groups):
        raise ValueError(f"optimizer {type(optimizer).__name__} has no parameters to clip")


class ClippedOptimizer(ClipReadouts, OptimizerWrapper):
    """Wrap any :class:`torch.optim.Optimizer` and clip the grad norm before every step.

    Each :meth:`step` computes the total norm of all grads with grouped kernels (one
    per device and dtype, on the grads' devices, no host sync), scales the grads in
    place by ``min(1, max_norm / (norm + 1e-6))`` and then runs the inner optimizer's
    step; it returns what the inner step returns. This is
    :func:`clipopt.clip_grad_norm_` followed by ``optimizer.step()``, in one object that
    schedulers and checkpoints treat like the optimizer it wraps (Pascanu et al., 2013).

    Args:
      optimizer: the optimizer to wrap; it keeps its param groups and state.
      max_norm: the default largest allowed norm, > 0 (``inf``: measure only). Each
        param group may carry its own ``"clip_max_norm"`` (a number or a 0-dim tensor).
        Or a clip rule (:class:`clipopt.AutoClip`, :class:`clipopt.ZClip`,
        :class:`clipopt.AdaGC`, :class:`clipopt.AGC`, any :class:`clipopt.ClipRule`),
        which chooses the threshold each step from the norms it has seen (AGC: from the
        weights, unit by unit): it sets every group's threshold (a group's own
        ``clip_max_norm`` is refused), needs ``per_group=False``, and a global rule folds
        into a fused kernel like a number does. See ``docs/adaptive.md``.
      norm_type: the default order p of the norm: any number > 0, ``inf`` or ``'inf'``.
        Each param group may carry its own ``"clip_norm_type"`` when ``per_group=True``.
      per_group: clip each param group by its own norm instead of one global norm over
        all groups; the per-group norms are in :attr:`last_group_norms`.
      foreach: multi-tensor kernels (True), per-tensor ops (False) or the fastest for
        each device (None), as in :func:`clipopt.clip_grad_norm_`.
      nonfinite: what a NaN/inf norm does. ``"propagate"`` (torch's behaviour, no
        sync): the grads are scaled by the NaN coefficient and the step runs.
        ``"skip"``: the inner step is skipped, grads, parameters and optimizer state
        are left untouched and :attr:`skip_count` grows; this reads one flag on the
        host per step. ``"raise"``: :class:`clipopt.NonFiniteNormError` (a
        ``FloatingPointError``) before anything is touched; also one host read.
      max_consecutive_skips: with ``nonfinite="skip"``, the non-finite step that
        follows this many skipped steps in a row raises
        :class:`clipopt.NonFiniteNormError` instead of skipping again; None never raises.
      process_group: the group plain (non-DTensor) parameters are split across in
        model parallelism: the norm is reduced over it with one ``all_reduce``. DTensor
        grads (FSDP2, HSDP, tensor parallel) are reduced over their mesh without it, and
        DDP needs nothing. See :mod:`clipopt.distributed`.
      replicated_params: parameters identical on every rank of ``process_group`` (tied
        embeddings, layer norms under tensor parallel); they count once.
      skip_spikes: a :class:`clipopt.SpikeSkip`: skip the whole step when the pre-clip
        norm is an outlier of the recent ones. On a fused torch optimizer the skip rides
        on ``found_inf``; otherwise it costs one host read per step once the rule can
        fire (as ``nonfinite="skip"`` does, and in the same read).
      track_tensor_norms: keep each grad's pre-clip norm of the last step, by name, in
        :attr:`last_tensor_norms`. They are measured in the step's one read of the grads
        (the global norm is derived from them), not by a second pass; DTensor grads
        (FSDP2, TP) are measured whole across ranks in the step's one collective.
        Not with a ``process_group`` (a split tensor's rows differ by rank).
      pp_mesh: under pipeline parallelism, a 1-D ``DeviceMesh`` (torchtitan's
        ``world_mesh["pp"]``) or a ``ProcessGroup`` joining this rank to one rank of each
        other stage; the wrapper holds this stage's parameters. Each stage's norm is
        reduced as without it, then the stages' ``norm**p`` are summed over it (max for
        inf) in one more ``all_reduce``, so every stage clips, skips and updates its rule
        by the whole model's norm. Per-tensor and unit norms, and their rules' state, stay
        the stage's own. With ``per_group`` the stages' groups are matched by position;
        the first step refuses stages whose clip settings differ, on every rank.

    Raises:
      TypeError: ``optimizer`` is not an optimizer or is already a ClippedOptimizer, or
        a setting has the wrong type.
      ValueError: ``optimizer`` has no parameters, a setting is out of range, or
        param groups use different ``norm_type`` values without ``per_group``.

    Example:
      >>> import torch, clipopt
      >>> w = torch.nn.Parameter(torch.zeros(2))
      >>> opt = clipopt.ClippedOptimizer(torch.optim.SGD([w], lr=1.0), max_norm=1.0)
      >>> w.grad = torch.tensor([30.0, 40.0])
      >>> opt.step()
      >>> opt.last_norm, w.grad, w.data
      (tensor(50.), tensor([0.6000, 0.8000]), tensor([-0.6000, -0.8000]))
    """

    # GradScaler must unscale the grads before step() measures them, even when the inner
    # optimizer is fused and could take the scale itself: last_norm is the true norm.
    _step_supports_amp_scaling = False

    EXTRA_KEY = CLIP_KEY

    def __init__(
        self,
        optimizer: Optimizer,
        max_norm: float | ClipRule,
        norm_type: float | str = 2.0,
        *,
        per_group: bool = False,
        foreach: bool | None = None,
        nonfinite: NonFinite = "propagate",
        max_consecutive_skips: int | None = 10,
        process_group: ProcessGroup | None = None,
        replicated_params: Iterable[Tensor] | None = None,
        skip_spikes: SpikeSkip | None = None,
        track_tensor_norms: bool = False,
        pp_mesh: DeviceMesh | ProcessGroup | None = None,
    ) -> None:
        _check_inner(optimizer)
        rule = max_norm if isinstance(max_norm, ClipRule) else None
        settings = validated_settings(
            math.inf if rule is not None else max_norm,
            norm_type,
            per_group,
            nonfinite,
            max_consecutive_skips,
        )
        check_config(rule, settings, process_group, track_tensor_norms, skip_spikes)
        check_foreach(foreach)
        check_groups(optimizer.param_groups, settings)
        check_rule_groups(optimizer.param_groups, rule)
        scope = NormScope(
            process_group,
            replicated_params,
            params=[p for group in optimizer.param_groups for p in group["params"]],
            pp_mesh=pp_mesh,
        )
        # Nothing has been touched above this line.
        super().__init__(optimizer)
        self._foreach = foreach
        self._norm_scope = scope
        self._rule = rule
        self._skip_spikes = skip_spikes
        self._track_tensor_norms = track_tensor_norms
        self._tensor_norms = _monitor.TensorNorms()
        self._apply_settings(settings)
        self._fill_group_defaults()
        self._record = StepRecord()
        self._deepspeed = Watch(p for group in optimizer.param_groups for p in group["params"])

    def _apply_settings(self, settings: Settings) -> None:
        self.optimizer.defaults[MAX_NORM_KEY] = settings.max_norm
        self.optimizer.defaults[NORM_TYPE_KEY] = settings.norm_type
        self._per_group = settings.per_group
        self._nonfinite: NonFinite = settings.nonfinite
        self._max_consecutive_skips = settings.max_consecutive_skips

    def _fill_group_defaults(self) -> None:
        """Give each param group without its own clip settings the defaults."""
        for group in self.param_groups:
            group.setdefault(MAX_NORM_KEY, self.defaults[MAX_NORM_KEY])
            group.setdefault(NORM_TYPE_KEY, self.defaults[NORM_TYPE_KEY])

    def _settings(self) -> Settings:
        return Settings(
            float(self.defaults[MAX_NORM_KEY]),
            float(self.defaults[NORM_TYPE_KEY]),
            self._per_group,
            self._nonfinite,
            self._max_consecutive_skips,
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the inner optimizer.

        Missing ``clip_max_norm`` / ``clip_norm_type`` are filled from :attr:`defaults`,
        like every other hyperparameter; given ones are validated first, and without
        ``per_group`` the group's ``clip_norm_type`` must be the one the others use.

        Raises:
          TypeError, ValueError: a bad ``clip_max_norm``/``clip_norm_type``; nothing is
            added.
        """
        if isinstance(param_group, dict):
            check_groups([*self.param_groups, param_group], self._settings())
            check_rule_groups([param_group], self._rule)
        self.optimizer.add_param_group(param_group)
        self._deepspeed.add(self.param_groups[-1]["params"])

    def attach_deepspeed(self, engine: Any) -> None:
        """Say that DeepSpeed's ``engine`` steps this wrapper: call it once, right after
        ``deepspeed.initialize(optimizer=this wrapper, ...)``, at any ZeRO stage.

        Under ZeRO-1/2 each step then measures the global norm of DeepSpeed's flat
        partitions (see ``docs/integrations.md#deepspeed``). A wrapper whose param groups
        DeepSpeed has rewritten refuses to step until it is attached.

        Raises:
          ValueError: the engine does not step this wrapper, or uses a setting under which
            the norm cannot be right (its own ``gradient_clipping``, fp16 dynamic loss
            scaling, an optimizer clipopt has not tested); the message names the setting.
            Nothing is changed.
        """
        self._deepspeed.binding = bind(engine, self)

    def __repr__(self) -> str:
        shown = self._settings().as_dict()
        shown["max_norm"], shown["norm_type"] = self.max_norm, self.norm_type
        if self._skip_spikes is not None:
            shown["skip_spikes"] = self._skip_spikes
        settings = ", ".join(f"{k}={v!r}" for k, v in shown.items())
        return f"{type(self).__name__}({settings}) wrapping\n{self.optimizer!r}"

    # ------------------------------------------------------------------ the step

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Closure | None = None) -> Any:
        """Clip the grads, then run the inner optimizer's step; return what it returns.

        With a ``closure``, it is evaluated (with grad enabled) before the inner step
        and its grads are clipped; the inner optimizer gets a closure that returns that
        first loss once and afterwards re-evaluates and clips, so optimizers that call
        it many times (LBFGS) always see clipped grads. With ``nonfinite="skip"`` a
        non-finite norm in those later evaluations cannot skip a step that has already
        started, so it raises :class:`clipopt.NonFiniteNormError`, as ``"raise"`` does.

        Step hooks fire in torch's order around this whole clipped step (global ones
        once, with the wrapper as the optimizer); hooks on the inner optimizer fire
        around the inner step.
        """
        return super().step(closure)

    def _wrapped_step(self, closure: Closure | None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        config = self._config()
        record = self._record
        decision, fold = decide_and_scale(self.optimizer, config, record, closure is None, True)

        def redecide() -> ClipDecision:  # a closure's later evaluation: no skip, no fold
            return decide_and_scale(self.optimizer, config, record, False, False)[0]

        result, latest = apply_decision(
            self.optimizer, decision, fold, record, closure, loss, redecide
        )
        commit(config, self._record, self._tensor_norms, decision, latest)
        return result

    def _config(self) -> ClipConfig:
        """What a decision reads of this wrapper, made for each step (a load may change it)."""
        return ClipConfig(
            self._rule,
            self._skip_spikes,
            self._per_group,
            self._nonfinite,
            self._max_consecutive_skips,
            self._foreach,
            self._norm_scope,
            self._track_tensor_norms,
            self._deepspeed,
        )

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus the clip state under ``"clip"``.

        The layout of ``"clip"`` is in :mod:`clipopt._step._clip_state`: tensors and plain
        Python values only, so ``torch.load(..., weights_only=True)`` reads it.
        Per-group ``clip_max_norm`` / ``clip_norm_type`` are saved in ``param_groups``
        like ``lr``.
        State-dict hooks registered on the wrapper run around the whole dict.
        """
        return super().state_dict()

    def _extra_state(self) -> dict[str, Any]:
        return clip_entry(self._settings(), self._record, self._rule, self._skip_spikes)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a dict from :meth:`state_dict`, or a plain state dict of the inner optimizer.

        Everything is validated before anything is changed: a malformed or mismatched
        dict raises ``TypeError``/``ValueError`` and leaves this optimizer as it was. A
        dict without ``"clip"`` (a plain inner dict, or one that went through
        ``torch.distributed.checkpoint.state_dict``'s functions, which keep only
        ``"state"`` and ``"param_groups"``) keeps the current clip settings, counters and
        rule state, and warns with a ``UserWarning`` naming
        :class:`clipopt.distributed.ClippedOptimizerState`, unless one was made for this
        optimizer (its clip state then travels in that entry); param groups it loads
        without ``clip_max_norm``/``clip_norm_type`` get the defaults. As for ``lr``, the
        loaded settings replace the constructor's.

        Raises:
          TypeError: a value has the wrong type.
          ValueError: the dict does not match this optimizer's groups or holds bad values.
        """
        super().load_state_dict(state_dict)

    def _warn_extra_missing(self) -> None:
        warnings.warn(
            f"{type(self).__name__}.load_state_dict got a state dict without a "
            f"{CLIP_KEY!r} entry (torch.distributed.checkpoint.state_dict's functions "
            "keep only 'state' and 'param_groups'), so the clip state (step counters, "
            "last norms, the rule's state) stays as it was; to checkpoint it through DCP, "
            "save clipopt.distributed.ClippedOptimizerState(optimizer) beside the "
            "optimizer",
            UserWarning,
            stacklevel=user_stacklevel(),
        )

    def _check_load(
        self, inner_state: Mapping[str, Any], extra: Any
    ) -> tuple[dict[str, Any], ClipState | None]:
        inner, prepared = prepare_load(extra, inner_state, len(self.param_groups), self._settings())
        if prepared is not None:
            check_saved_rules(prepared, self._rule, self._skip_spikes, self.defaults[MAX_NORM_KEY])
        return inner, prepared

    def _finish_load(self, prepared: ClipState | None) -> None:
        # An inner optimizer with a layout of its own loads groups that only now can be read.
        settings = self._settings() if prepared is None else prepared.settings
        check_groups(self.param_groups, settings)
        if prepared is not None:
            self._apply_clip_state(prepared)
        self._fill_group_defaults()

    def _apply_clip_state(self, clip_state: ClipState) -> None:
        """Install a validated clip state; tensors are copied onto the params' device."""
        device = next(p.device for group in self.param_groups for p in group["params"])
        self._apply_settings(clip_state.settings)
        self._tensor_norms.clear()
        load_clip_state(clip_state, device, self._record, self._rule, self._skip_spikes)


setattr(ClippedOptimizer.step, "hooked", True)  # noqa: B010  see clipopt._wrapper
