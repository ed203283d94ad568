"""A transparent ``torch.optim.Optimizer`` wrapper that knows nothing of clipping, and
the step hooks in torch's order when one optimizer's step runs another's.

:class:`OptimizerWrapper` is an ``Optimizer`` for the ``isinstance`` checks of LR
schedulers, ``GradScaler`` and the training frameworks, but it does not call
``Optimizer.__init__`` (as torchao's ``CPUOffloadOptimizer`` does not): its
``param_groups``, ``state`` and ``defaults`` are the inner optimizer's very objects. It
saves and loads the inner optimizer's state dict with one extra entry of its own,
validated whole before the inner optimizer loads anything; its base
:class:`OptimizerShell` is what it shares with :class:`clipopt._chain.OptimizerChain`.
A subclass supplies ``step`` (firing the hooks with :func:`pre_hooks` /
:func:`post_hooks`), :meth:`_extra_state`, :meth:`_check_load`, :meth:`_finish_load`
and :meth:`_warn_extra_missing`.

torch fires, around ``opt.step()``: the global pre-hooks, ``opt``'s own, the step,
``opt``'s own post-hooks, the global ones. A wrapper fires that around its whole step;
the inner step inside it fires only the inner optimizer's own hooks
(:func:`inner_step`). This is the one module that reads ``torch.optim``'s private hook
state (``_global_optimizer_pre_hooks``/``_post_hooks``, ``_optimizer_step_code`` and
the ``hooked`` mark on a wrapped ``step``), present in torch 2.6 to 2.14; where one is
missing the globals read as none and the inner step runs as ``opt.step()``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeAlias

import torch
from torch import Tensor
from torch.optim import Optimizer, optimizer

__all__ = [
    "Closure",
    "OptimizerShell",
    "OptimizerWrapper",
    "check_state_shapes",
    "hooked_step",
    "inner_step",
    "post_hooks",
    "pre_hooks",
    "restore_point",
]

Closure: TypeAlias = Callable[[], Any]
Hook = Callable[..., Any]


def _run_pre_hooks(
    hooks: list[Hook], opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Call each pre-hook in order; one may replace ``(args, kwargs)``, as in torch."""
    for hook in hooks:
        result = hook(opt, args, kwargs)
        if result is None:
            continue
        if not (isinstance(result, tuple) and len(result) == 2):
            raise RuntimeError(
                f"a step pre-hook must return None or (args, kwargs), got {result!r}"
            )
        args, kwargs = result
    return args, kwargs


def pre_hooks(
    opt: Any, closure: Closure | None
) -> tuple[tuple[Any, ...], dict[str, Any], Closure | None]:
    """Fire the global step pre-hooks, then ``opt``'s own; return the (possibly replaced)
    arguments and the closure they hold."""
    hooks = [
        *getattr(optimizer, "_global_optimizer_pre_hooks", {}).values(),
        *opt._optimizer_step_pre_hooks.values(),
    ]
    args: tuple[Any, ...] = () if closure is None else (closure,)
    args, kwargs = _run_pre_hooks(hooks, opt, args, {})
    return args, kwargs, kwargs.get("closure", args[0] if args else None)


def post_hooks(opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Fire ``opt``'s own step post-hooks, then the global ones."""
    hooks = [
        *opt._optimizer_step_post_hooks.values(),
        *getattr(optimizer, "_global_optimizer_post_hooks", {}).values(),
    ]
    for hook in hooks:
        hook(opt, args, kwargs)


def hooked_step(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` with the hooks fired around it and marked as torch does a torch
    optimizer's, so that :func:`inner_step` fires only the optimizer's own."""
    wrapped = Optimizer.profile_hook_step(step)
    setattr(wrapped, "hooked", True)  # noqa: B010
    return wrapped


def inner_step(opt: Optimizer, closure: Closure | None) -> Any:
    """``opt.step(closure)`` with ``opt``'s own hooks but not the global ones.

    Where ``opt``'s class step is torch's hook wrapper, its wrapped function is called
    between ``opt``'s own hooks; anything else (a step patched on the instance, a class
    torch never wrapped) is called as it is.
    """
    step = type(opt).step
    unwrapped = getattr(step, "__wrapped__", None)
    if unwrapped is None or not getattr(step, "hooked", False) or "step" in opt.__dict__:
        return opt.step() if closure is None else opt.step(closure)
    args: tuple[Any, ...] = () if closure is None else (closure,)
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(opt).__name__}.step"):
        hooks = list(opt._optimizer_step_pre_hooks.values())
        args, kwargs = _run_pre_hooks(hooks, opt, args, {})
        result = unwrapped(opt, *args, **kwargs)
        opt._optimizer_step_code()
        for hook in list(opt._optimizer_step_post_hooks.values()):
            hook(opt, args, kwargs)
    return result


class OptimizerShell(Optimizer):
    """An ``Optimizer`` that does not call ``Optimizer.__init__``: the hook registries it
    would make, pickling without them, and the state-dict hooks fired around a subclass's
    own saving and loading."""

    def _init_hooks(self) -> None:
        """The hook registries that ``Optimizer.__init__`` would create, all empty."""
        self._optimizer_step_pre_hooks: dict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    def _parts(self) -> tuple[Optimizer, ...]:
        """The optimizers this one steps, which a load may change too."""
        return ()

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

    def _hooked_state_dict(self, make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``make()`` with this optimizer's state-dict hooks around it, as torch runs them."""
        for pre_hook in list(self._optimizer_state_dict_pre_hooks.values()):
            pre_hook(self)
        state_dict = make()
        for post_hook in list(self._optimizer_state_dict_post_hooks.values()):
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _hooked_load(
        self, state_dict: Mapping[str, Any], load: Callable[[dict[str, Any]], None]
    ) -> None:
        """``load`` a copy of ``state_dict`` with the load hooks around it, as torch runs them.

        Raises:
          TypeError: ``state_dict`` is not a dict.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        loaded = dict(state_dict)
        for pre_hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = pre_hook(self, loaded)
            if result is not None:
                loaded = dict(result)
        load(loaded)
        for post_hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            post_hook(self)


def restore_point(opt: Optimizer) -> Callable[[], None]:
    """What puts ``opt`` back as it is now: its attributes (so its groups and state
    objects), and those of the optimizers it steps (:meth:`OptimizerShell._parts`)."""
    attributes = dict(opt.__dict__)
    parts = [restore_point(p) for p in opt._parts()] if isinstance(opt, OptimizerShell) else []

    def restore() -> None:
        opt.__dict__.clear()
        opt.__dict__.update(attributes)
        for part in parts:
            part()

    return restore


class OptimizerWrapper(OptimizerShell):
    """Pass-through plumbing around ``self.optimizer``; see the module docstring.

    Args:
      optimizer: the optimizer to wrap.
    """

    EXTRA_KEY: ClassVar[str]
    """The top-level state-dict key of the subclass's own state."""

    def __init__(self, optimizer: Optimizer) -> None:
        self._init_hooks()
        self.optimizer = optimizer
        self._extra_saved_apart = False

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
        """The inner optimizer's defaults (the very dict, not a copy)."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the grads of every parameter, as the inner optimizer does."""
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus this wrapper's state under ``EXTRA_KEY``.

        State-dict hooks registered on the wrapper run around the whole dict.
        """
        return self._hooked_state_dict(
            lambda: {**self.optimizer.state_dict(), self.EXTRA_KEY: self._extra_state()}
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a dict from :meth:`state_dict`, or a plain state dict of the inner optimizer.

        Everything is validated before anything is changed: a malformed or mismatched
        dict raises and leaves this optimizer as it was, and if the inner optimizer's own
        load raises, it is put back as it was. A dict without the wrapper's entry (a plain
        inner dict, or one from ``torch.distributed.checkpoint.state_dict``'s functions,
        which keep only ``"state"`` and ``"param_groups"``) keeps the wrapper's state
        (settings, counters, rule state) and warns with a ``UserWarning`` naming
        :class:`clipopt.distributed.ClippedOptimizerState`, unless one was made for this
        optimizer (the entry then travels in it). Loaded settings replace the
        constructor's, as for ``lr``; groups loaded without them get the defaults.

        Raises:
          TypeError: ``state_dict`` is not a dict, or a value has the wrong type.
          ValueError: the dict does not match this optimizer or holds bad values.
        """
        self._hooked_load(state_dict, self._load)

    def _load(self, loaded: dict[str, Any]) -> None:
        if self.EXTRA_KEY not in loaded and not self._extra_saved_apart:
            self._warn_extra_missing()
        extra = loaded.pop(self.EXTRA_KEY, None)
        prepared = self._check_load(loaded, extra)
        self._load_atomically(lambda: self.optimizer.load_state_dict(loaded), prepared)

    def _saved_apart(self) -> None:
        """Note that this wrapper's entry is saved and loaded apart from its state dict
        (by :class:`clipopt.distributed.ClippedOptimizerState`): a load without it is
        then expected and does not warn."""
        self._extra_saved_apart = True

    def _load_extra(self, extra: Any) -> None:
        """Load this wrapper's entry alone, validated first, the inner optimizer untouched."""
        self._load_atomically(lambda: None, self._check_load({}, extra))

    def _load_atomically(self, load_inner: Callable[[], object], prepared: Any) -> None:
        """Run ``load_inner``, then :meth:`_finish_load`; if either raises, put the inner
        optimizer back as it was (:func:`restore_point`)."""
        restore = restore_point(self.optimizer)
        try:
            load_inner()
            check_state_shapes(self.optimizer)
            self._finish_load(prepared)
        except BaseException:
            restore()
            raise

    # What a subclass supplies: its entry (plain data), the check of a load before
    # anything changes (returning what _finish_load installs once the inner optimizer
    # has loaded, raising before it installs anything), and what a load without it says.
    def _extra_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _check_load(self, inner_state: Mapping[str, Any], extra: Any) -> Any:
        raise NotImplementedError

    def _finish_load(self, prepared: Any) -> None:
        raise NotImplementedError

    def _warn_extra_missing(self) -> None:
        raise NotImplementedError


def check_state_shapes(optimizer: Optimizer) -> None:
    """Refuse a torch optimizer's state tensor whose shape is not its parameter's (the
    next step would fail half-way). Every state tensor of torch's own optimizers but
    LBFGS has its parameter's shape or none; others keep their own shapes, unchecked.

    Raises:
      ValueError: naming the parameter and the state entry.
    """
    kind = type(optimizer)
    if not kind.__module__.startswith("torch.optim.") or kind is torch.optim.LBFGS:
        return
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            entries = optimizer.state.get(p, {})
            for key, value in entries.items() if isinstance(entries, Mapping) else ():
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape != p.shape:
                    raise ValueError(
                        f"the loaded state {key!r} of param_groups[{g}]['params'][{i}] has "
                        f"shape {tuple(value.shape)}, the parameter {tuple(p.shape)}; "
                        "nothing was loaded"
                    )
