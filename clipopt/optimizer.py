"""``ClippedOptimizer``: clip the gradient norm before every step of any torch optimizer.

Gradient-norm clipping (Pascanu et al., 2013, "On the difficulty of training recurrent
neural networks") as an optimizer wrapper: ``opt.step()`` measures the total grad norm
on the device, scales the grads by ``min(1, max_norm / (norm + 1e-6))`` and runs the
inner optimizer's step. The wrapper is transparent: its ``param_groups``, ``state`` and
``defaults`` are the inner optimizer's own objects, so LR schedulers, checkpoints and
code that edits ``group["lr"]`` behave as if the wrapper were not there.

The step is split so that each part can be replaced on its own:

- :meth:`ClippedOptimizer._total_norms` is the only place grads are reduced to norms
  (across ranks too, see :mod:`clipopt.distributed`);
- :meth:`ClippedOptimizer._measure` turns grads into the norm(s) to clip against;
- :meth:`ClippedOptimizer._clip_coefficients` turns norms and thresholds into on-device
  coefficients (a threshold may be a 0-dim tensor);
- :meth:`ClippedOptimizer._scale_grads` applies them;
- :meth:`ClippedOptimizer._inner_step` runs the wrapped optimizer.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias, cast, overload

import torch
from torch import Tensor
from torch.optim import Optimizer

from clipopt import _fused, _kernels, distributed
from clipopt._clip_state import (
    CLIP_KEY,
    ClipState,
    NonFinite,
    Settings,
    Threshold,
    check_group_settings,
    check_inner_state_dict,
    check_one_norm_type,
    group_max_norm,
    parse_clip_state,
    validated_settings,
)
from clipopt.functional import NonFiniteNormError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ClippedOptimizer"]

Closure: TypeAlias = Callable[[], Any]


def _check_inner(optimizer: Any) -> None:
    """Refuse what cannot be wrapped: a wrapper, a non-optimizer, nothing to optimize."""
    if isinstance(optimizer, ClippedOptimizer):
        raise TypeError(
            "optimizer is already a ClippedOptimizer; wrapping it twice would clip twice. "
            "Change its param groups' 'max_norm' instead"
        )
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not any(g.get("params") for g in groups):
        raise ValueError(f"optimizer {type(optimizer).__name__} has no parameters to clip")


def _is_inf(threshold: Threshold) -> bool:
    return isinstance(threshold, float) and math.isinf(threshold)


def _new_counter() -> Tensor:
    return torch.zeros((), dtype=torch.int64)


class ClippedOptimizer(Optimizer):
    """Wrap any :class:`torch.optim.Optimizer` and clip the grad norm before every step.

    Each :meth:`step` computes the total norm of all grads with the grouped kernels of
    :mod:`clipopt._kernels` (one per device and dtype, on the grads' devices, no host
    sync), scales the grads in place by ``min(1, max_norm / (norm + 1e-6))`` and then
    runs the inner optimizer's step; it returns what the inner step returns. This is
    :func:`clipopt.clip_grad_norm_` followed by ``optimizer.step()``, in one object that
    schedulers and checkpoints treat like the optimizer it wraps (Pascanu et al., 2013).

    Args:
      optimizer: the optimizer to wrap; it keeps its param groups and state.
      max_norm: the default largest allowed norm, > 0 (``inf``: measure only). Each
        param group may carry its own ``"max_norm"`` (a number or a 0-dim tensor).
      norm_type: the default order p of the norm: any number > 0, ``inf`` or ``'inf'``.
        Each param group may carry its own ``"norm_type"`` when ``per_group=True``.
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

    def __init__(
        self,
        optimizer: Optimizer,
        max_norm: float,
        norm_type: float | str = 2.0,
        *,
        per_group: bool = False,
        foreach: bool | None = None,
        nonfinite: NonFinite = "propagate",
        max_consecutive_skips: int | None = 10,
        process_group: ProcessGroup | None = None,
        replicated_params: Iterable[Tensor] | None = None,
    ) -> None:
        _check_inner(optimizer)
        settings = validated_settings(
            max_norm, norm_type, per_group, nonfinite, max_consecutive_skips
        )
        if foreach is not None and not isinstance(foreach, bool):
            raise TypeError(f"foreach must be a bool or None, got {foreach!r}")
        for index, group in enumerate(optimizer.param_groups):
            check_group_settings(index, group)
        check_one_norm_type(optimizer.param_groups, settings.norm_type, settings.per_group)
        scope = distributed.NormScope(
            process_group,
            replicated_params,
            params=[p for group in optimizer.param_groups for p in group["params"]],
        )
        # Nothing has been touched above this line.
        self._init_hooks()
        self.optimizer = optimizer
        self._foreach = foreach
        self._norm_scope = scope
        self._apply_settings(settings)
        self._fill_group_defaults()
        self._last_norm: Tensor | None = None
        self._last_group_norms: Tensor | None = None
        self._step_count = _new_counter()
        self._skip_count = _new_counter()
        self._consecutive_skips = _new_counter()

    def _init_hooks(self) -> None:
        """The hook registries that ``Optimizer.__init__`` would create, all empty."""
        self._optimizer_step_pre_hooks: dict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    def _apply_settings(self, settings: Settings) -> None:
        self.optimizer.defaults["max_norm"] = settings.max_norm
        self.optimizer.defaults["norm_type"] = settings.norm_type
        self._per_group = settings.per_group
        self._nonfinite: NonFinite = settings.nonfinite
        self._max_consecutive_skips = settings.max_consecutive_skips

    def _fill_group_defaults(self) -> None:
        """Give each param group without its own ``max_norm``/``norm_type`` the defaults."""
        for group in self.param_groups:
            group.setdefault("max_norm", self.defaults["max_norm"])
            group.setdefault("norm_type", self.defaults["norm_type"])

    def _settings(self) -> Settings:
        return Settings(
            float(self.defaults["max_norm"]),
            float(self.defaults["norm_type"]),
            self._per_group,
            self._nonfinite,
            self._max_consecutive_skips,
        )

    # ------------------------------------------------------------------ delegation

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (the very list, not a copy)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        """The inner optimizer's per-parameter state (the very dict, not a copy)."""
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        """The inner optimizer's defaults, which also hold ``max_norm`` and ``norm_type``."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

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
    def last_norm(self) -> Tensor | None:
        """The pre-clip total norm of the most recent step, None before the first.

        A 0-dim tensor on the grads' device (float32, float64 for double grads). With
        ``per_group=True`` it is the norm of the per-group norms taken with the default
        ``norm_type``: the total norm whenever every group uses that order.
        """
        return self._last_norm

    @property
    def last_group_norms(self) -> Tensor | None:
        """With ``per_group=True``, the pre-clip norm of each group (1-D); else None."""
        return self._last_group_norms

    @property
    def step_count(self) -> Tensor:
        """Inner steps taken (skipped ones not counted), a 0-dim int64 tensor."""
        return self._step_count

    @property
    def skip_count(self) -> Tensor:
        """Steps skipped for a non-finite norm, a 0-dim int64 tensor."""
        return self._skip_count

    @property
    def consecutive_skips(self) -> Tensor:
        """Steps skipped in a row since the last step taken, a 0-dim int64 tensor."""
        return self._consecutive_skips

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the grads of every parameter, as the inner optimizer does."""
        self.optimizer.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the inner optimizer.

        Missing ``max_norm`` / ``norm_type`` are filled from :attr:`defaults`, like
        every other hyperparameter; given ones are validated first, and without
        ``per_group`` the group's ``norm_type`` must be the one the others use.

        Raises:
          TypeError, ValueError: a bad ``max_norm``/``norm_type``; nothing is added.
        """
        if isinstance(param_group, dict):
            check_group_settings(len(self.param_groups), param_group)
            groups = [*self.param_groups, param_group]
            check_one_norm_type(groups, float(self.defaults["norm_type"]), self._per_group)
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self._settings().as_dict().items())
        return f"{type(self).__name__}({settings}) wrapping\n{self.optimizer!r}"

    def __getstate__(self) -> dict[str, Any]:
        # Like torch.optim.Optimizer: hooks and a scheduler's patched ``step`` stay behind.
        dropped = {"step", "_opt_called"}
        return {
            k: v
            for k, v in self.__dict__.items()
            if k not in dropped and not k.startswith("_optimizer_")
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_hooks()

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

        Hooks registered on the wrapper fire around this whole clipped step; hooks on
        the inner optimizer (and global optimizer hooks) fire around the inner step.
        """
        args: tuple[Any, ...] = () if closure is None else (closure,)
        args, kwargs = self._run_step_pre_hooks(args, {})
        closure = kwargs.get("closure", args[0] if args else None)
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
            result = self._clipped_step(closure)
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, args, kwargs)
        return result

    def _run_step_pre_hooks(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        for hook in list(self._optimizer_step_pre_hooks.values()):
            result = hook(self, args, kwargs)
            if result is None:
                continue
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(
                    f"a step pre-hook must return None or (args, kwargs), got {result!r}"
                )
            args, kwargs = result
        return args, kwargs

    def _clipped_step(self, closure: Closure | None) -> Any:
        plan = _fused.fold_plan(self, closure)
        if plan is not None:
            return _fused.folded_step(self, plan)  # the scale rides on the fused kernel
        # This path checks the live skip count itself; a folded step's copy would be stale.
        _fused.forget_lagged_skips(self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._clip(may_skip=True):
            return loss
        inner_closure = None if closure is None else self._replaying_closure(loss, closure)
        result = self._inner_step(inner_closure)
        self._step_count.add_(1)
        self._consecutive_skips.zero_()
        return result

    def _replaying_closure(self, first_loss: Any, closure: Closure) -> Closure:
        """A closure that returns ``first_loss`` once, then evaluates and clips."""
        pending = [first_loss]

        def clipped_closure() -> Any:
            if pending:
                return pending.pop()
            with torch.enable_grad():
                loss = closure()
            self._clip(may_skip=False)
            return loss

        return clipped_closure

    def _inner_step(self, closure: Closure | None) -> Any:
        """Run the wrapped optimizer's step on the (already clipped) grads."""
        if closure is None:
            return self.optimizer.step()
        return self.optimizer.step(closure)

    @torch.no_grad()
    def _clip(self, may_skip: bool) -> bool:
        """Measure, decide on a non-finite norm, scale. False: the step is skipped."""
        thresholds, norm_types = self._group_settings()
        grads = self._grads_per_group()
        norm, group_norms, stacked = self._measure(grads, norm_types)
        self._move_counters(norm.device)
        if self._nonfinite != "propagate" and not self._finite_or_raise(
            stacked if stacked is not None else norm, may_skip
        ):
            self._last_norm, self._last_group_norms = norm, stacked
            return False
        self._scale_grads(grads, self._clip_coefficients(group_norms, thresholds))
        self._last_norm, self._last_group_norms = norm, stacked
        return True

    def _group_settings(self) -> tuple[list[Threshold], list[float]]:
        """Each group's validated threshold and norm order (read fresh every step)."""
        defaults = self.defaults
        thresholds = [
            group_max_norm(index, group.get("max_norm", defaults["max_norm"]))
            for index, group in enumerate(self.param_groups)
        ]
        norm_types = check_one_norm_type(
            self.param_groups, float(defaults["norm_type"]), self._per_group
        )
        return thresholds, norm_types

    def _grads_per_group(self) -> list[list[Tensor]]:
        return [
            [p.grad for p in group["params"] if p.grad is not None] for group in self.param_groups
        ]

    def _total_norm(self, grads: list[Tensor], norm_type: float) -> Tensor:
        """The p-norm of ``grads`` taken together: the one place grads are reduced to a norm."""
        return self._total_norms([grads], [norm_type])[0]

    def _total_norms(self, buckets: list[list[Tensor]], norm_types: list[float]) -> list[Tensor]:
        """The p-norm of each bucket of grads, across ranks in one ``all_reduce`` if needed.

        A rank without any grad hands over the parameters, so that it still joins a
        reduction over their DTensor mesh that the other ranks are in.
        """
        params = [] if any(buckets) else [p for g in self.param_groups for p in g["params"]]
        return self._norm_scope.total_norms(buckets, norm_types, self._foreach, params)

    def _measure(
        self, grads: list[list[Tensor]], norm_types: list[float]
    ) -> tuple[Tensor, list[Tensor], Tensor | None]:
        """The total norm to record and, per group, the norm that group is clipped by.

        Returns:
          ``(norm, group_norms, stacked)``: without ``per_group`` every entry of
          ``group_norms`` is ``norm`` itself and ``stacked`` is None; with it they are
          the groups' own norms, moved to one device and dtype, ``stacked`` is them in
          one 1-D tensor (stacked once per step) and ``norm`` is its norm with the
          default order.
        """
        if not self._per_group:
            norm = self._total_norm([g for group in grads for g in group], norm_types[0])
            return norm, [norm] * len(grads), None
        own = self._total_norms(grads, norm_types)
        device = next((g[0].device for g in grads if g), own[0].device)
        dtype = _kernels.result_dtype([n.dtype for n in own])
        # A group without grads gets its zero made here: moving the CPU zero the kernel
        # returns for it would be a blocking host-to-device copy every step.
        group_norms = [
            n.to(device=device, dtype=dtype)
            if bucket
            else torch.zeros((), device=device, dtype=dtype)
            for n, bucket in zip(own, grads, strict=True)
        ]
        stacked = torch.stack(group_norms)
        wide = _kernels.combine_dtype(stacked.device)
        norm_type = float(self.defaults["norm_type"])
        norm = torch.linalg.vector_norm(stacked, norm_type, dtype=wide).to(dtype)
        return norm, group_norms, stacked

    def _clip_coefficients(
        self, group_norms: list[Tensor], thresholds: list[Threshold]
    ) -> list[Tensor | None]:
        """Per group, ``min(1, max_norm / (norm + eps))`` on device; None: scale nothing.

        Groups that share a norm object and an equal threshold share one coefficient.
        """
        coefficients: list[Tensor | None] = []
        shared: dict[tuple[int, Any], Tensor] = {}
        for norm, threshold in zip(group_norms, thresholds, strict=True):
            if _is_inf(threshold):
                coefficients.append(None)
                continue
            key = (id(norm), threshold if isinstance(threshold, float) else id(threshold))
            if key not in shared:
                shared[key] = _kernels.clip_coefficient(threshold, norm)
            coefficients.append(shared[key])
        return coefficients

    def _scale_grads(self, grads: list[list[Tensor]], coefficients: list[Tensor | None]) -> None:
        """Multiply each group's grads by its coefficient, one kernel call per coefficient."""
        by_coefficient: dict[int, tuple[Tensor, list[Tensor]]] = {}
        for group_grads, coefficient in zip(grads, coefficients, strict=True):
            if coefficient is not None and group_grads:
                by_coefficient.setdefault(id(coefficient), (coefficient, []))[1].extend(group_grads)
        for coefficient, tensors in by_coefficient.values():
            _kernels.scale_(distributed.local_tensors(tensors), coefficient, self._foreach)

    def _finite_or_raise(self, norms: Tensor, may_skip: bool) -> bool:
        """One host read: True if ``norms`` are finite, False if the step is skipped.

        Raises :class:`NonFiniteNormError` for ``nonfinite="raise"``, for a non-finite
        norm that cannot skip, or once ``max_consecutive_skips`` steps were skipped.
        """
        nonfinite = (~torch.isfinite(norms).all()).to(torch.int64)
        is_bad, streak = (
            int(v) for v in torch.stack([nonfinite, self._consecutive_skips]).tolist()
        )
        if not is_bad:
            return True
        limit = self._max_consecutive_skips
        if self._nonfinite == "raise" or not may_skip:
            raise NonFiniteNormError(
                f"the gradient norm is non-finite ({norms.tolist()}); "
                f"nonfinite={self._nonfinite!r}, so nothing was changed"
            )
        if limit is not None and streak >= limit:
            raise NonFiniteNormError(
                f"the gradient norm is non-finite ({norms.tolist()}) after {streak} skipped "
                f"steps in a row (max_consecutive_skips={limit}); training is not recovering"
            )
        self._skip_count.add_(1)
        self._consecutive_skips.add_(1)
        return False

    def _move_counters(self, device: torch.device) -> None:
        """Keep the counters on the grads' device, so updating them never syncs."""
        if self._step_count.device != device:
            self._step_count = self._step_count.to(device)
            self._skip_count = self._skip_count.to(device)
            self._consecutive_skips = self._consecutive_skips.to(device)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus the clip state under ``"clip"``.

        Layout of ``"clip"`` (tensors and plain Python values only, so
        ``torch.load(..., weights_only=True)`` reads it)::

          {"settings": {"max_norm": float, "norm_type": float, "per_group": bool,
                        "nonfinite": str, "max_consecutive_skips": int | None},
           "last_norm": 0-dim Tensor | None,
           "last_group_norms": 1-D Tensor | None,   # per_group=True only
           "step_count": 0-dim int64 Tensor, "skip_count": ..., "consecutive_skips": ...}

        Per-group ``max_norm`` / ``norm_type`` are saved in ``param_groups`` like ``lr``.
        State-dict hooks registered on the wrapper run around the whole dict.
        """
        for pre_hook in list(self._optimizer_state_dict_pre_hooks.values()):
            pre_hook(self)
        state_dict = dict(self.optimizer.state_dict())
        state_dict[CLIP_KEY] = self._clip_state_dict()
        for post_hook in list(self._optimizer_state_dict_post_hooks.values()):
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _clip_state_dict(self) -> dict[str, Any]:
        def copy(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.detach().clone()

        return {
            "settings": self._settings().as_dict(),
            "last_norm": copy(self._last_norm),
            "last_group_norms": copy(self._last_group_norms),
            "step_count": self._step_count.clone(),
            "skip_count": self._skip_count.clone(),
            "consecutive_skips": self._consecutive_skips.clone(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a dict from :meth:`state_dict`, or a plain state dict of the inner optimizer.

        Everything is validated before anything is changed: a malformed or mismatched
        dict raises ``TypeError``/``ValueError`` and leaves this optimizer as it was. A
        plain inner dict keeps the current clip settings and counters; param groups it
        loads without ``max_norm``/``norm_type`` get the defaults. As for ``lr``, the
        loaded settings replace the constructor's.

        Raises:
          TypeError: a value has the wrong type.
          ValueError: the dict does not match this optimizer's groups or holds bad values.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        loaded = dict(state_dict)
        for pre_hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = pre_hook(self, loaded)
            if result is not None:
                loaded = dict(result)
        clip_state = parse_clip_state(loaded.pop(CLIP_KEY, None), len(self.param_groups))
        check_inner_state_dict(loaded, self.param_groups)
        settings = self._settings() if clip_state is None else clip_state.settings
        check_one_norm_type(loaded["param_groups"], settings.norm_type, settings.per_group)
        snapshot = dict(self.optimizer.__dict__)
        try:
            self.optimizer.load_state_dict(loaded)
        except BaseException:
            self.optimizer.__dict__.clear()
            self.optimizer.__dict__.update(snapshot)
            raise
        if clip_state is not None:
            self._apply_clip_state(clip_state)
        self._fill_group_defaults()
        for post_hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            post_hook(self)

    def _apply_clip_state(self, clip_state: ClipState) -> None:
        """Install a validated clip state; tensors are copied onto the params' device."""
        device = next(p.device for group in self.param_groups for p in group["params"])

        def here(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device=device, copy=True)

        self._apply_settings(clip_state.settings)
        self._last_norm = here(clip_state.last_norm)
        self._last_group_norms = here(clip_state.last_group_norms)
        counters = {k: cast(Tensor, here(v)) for k, v in clip_state.counters.items()}
        self._step_count = counters["step_count"]
        self._skip_count = counters["skip_count"]
        self._consecutive_skips = counters["consecutive_skips"]
        _fused.forget_lagged_skips(self)  # its copy of the replaced count is stale


setattr(ClippedOptimizer.step, "hooked", True)  # noqa: B010  Optimizer must not re-wrap step
