"""A transparent ``torch.optim.Optimizer`` wrapper that knows nothing of clipping.

:class:`OptimizerWrapper` is an ``Optimizer`` for the ``isinstance`` checks of LR
schedulers, ``GradScaler`` and the training frameworks, but it does not call
``Optimizer.__init__`` (as torchao's ``CPUOffloadOptimizer`` does not): its
``param_groups``, ``state`` and ``defaults`` are the inner optimizer's very objects, so
schedulers and code that edits ``group["lr"]`` act on the inner optimizer directly.

It owns the hook registries and fires them; it saves and loads the inner optimizer's
state dict with one extra entry of its own (a load without it warns, unless the entry
travels apart: :meth:`_saved_apart`). A subclass supplies:

- :meth:`_wrapped_step`: the step itself (the inner step included);
- :meth:`_extra_state`, :meth:`_check_load`, :meth:`_finish_load`: its entry of the state
  dict, validated completely before the inner optimizer loads anything;
- :meth:`_warn_extra_missing`: what a load without that entry says.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeAlias, overload

import torch
from torch import Tensor
from torch.optim import Optimizer

from clipopt import _hooks

__all__ = ["Closure", "OptimizerWrapper", "check_state_shapes"]

Closure: TypeAlias = Callable[[], Any]


class OptimizerWrapper(Optimizer):
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

    def _init_hooks(self) -> None:
        """The hook registries that ``Optimizer.__init__`` would create, all empty."""
        self._optimizer_step_pre_hooks: dict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

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
        """The inner optimizer's defaults (the very dict, not a copy)."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the grads of every parameter, as the inner optimizer does."""
        self.optimizer.zero_grad(set_to_none)

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
        """Run :meth:`_wrapped_step` between the step hooks, in torch's order.

        Global pre-hooks, the wrapper's own pre-hooks, the wrapped step, the wrapper's own
        post-hooks, global post-hooks: as around a bare optimizer's step. The inner
        optimizer's own hooks fire around the inner step inside it, the global ones do not
        fire again there (:func:`clipopt._hooks.inner_step`).
        """
        args: tuple[Any, ...] = () if closure is None else (closure,)
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
            pre_hooks = [*_hooks.global_pre_hooks(), *self._optimizer_step_pre_hooks.values()]
            args, kwargs = _hooks.run_pre_hooks(pre_hooks, self, args, {})
            result = self._wrapped_step(kwargs.get("closure", args[0] if args else None))
            post_hooks = [*self._optimizer_step_post_hooks.values(), *_hooks.global_post_hooks()]
            for hook in post_hooks:
                hook(self, args, kwargs)
        return result

    def _wrapped_step(self, closure: Closure | None) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus this wrapper's state under ``EXTRA_KEY``.

        State-dict hooks registered on the wrapper run around the whole dict.
        """
        for pre_hook in list(self._optimizer_state_dict_pre_hooks.values()):
            pre_hook(self)
        state_dict = dict(self.optimizer.state_dict())
        state_dict[self.EXTRA_KEY] = self._extra_state()
        for post_hook in list(self._optimizer_state_dict_post_hooks.values()):
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a dict from :meth:`state_dict`, or a plain state dict of the inner optimizer.

        Everything the wrapper reads is validated before anything is changed, and if the
        inner optimizer's own load raises, it is put back as it was. A dict without
        ``EXTRA_KEY`` (a plain state dict, or one from torch's DCP functions, which keep
        only ``"state"`` and ``"param_groups"``) leaves the wrapper's own state as it is
        and warns, unless that state travels apart (:meth:`_saved_apart`).

        Raises:
          TypeError: ``state_dict`` is not a dict, or a value has the wrong type.
          ValueError: the dict does not match this optimizer or holds bad values.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        loaded = dict(state_dict)
        for pre_hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = pre_hook(self, loaded)
            if result is not None:
                loaded = dict(result)
        if self.EXTRA_KEY not in loaded and not self._extra_saved_apart:
            self._warn_extra_missing()
        extra = loaded.pop(self.EXTRA_KEY, None)
        inner_state, prepared = self._check_load(loaded, extra)
        self._load_atomically(lambda: self.optimizer.load_state_dict(inner_state), prepared)
        for post_hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            post_hook(self)

    def _saved_apart(self) -> None:
        """Note that this wrapper's entry is saved and loaded apart from its state dict
        (by :class:`clipopt.distributed.ClippedOptimizerState`): a load without it is
        then expected and does not warn."""
        self._extra_saved_apart = True

    def _load_extra(self, extra: Any) -> None:
        """Load this wrapper's entry alone, validated first, the inner optimizer untouched."""
        _, prepared = self._check_load({}, extra)
        self._load_atomically(lambda: None, prepared)

    def _warn_extra_missing(self) -> None:
        """Say that a load found no entry of this wrapper's, and how to keep it."""
        raise NotImplementedError

    def _load_atomically(self, load_inner: Callable[[], object], prepared: Any) -> None:
        """Run ``load_inner``, then :meth:`_finish_load`; if either raises, put the inner
        optimizer back as it was (its attributes, so its groups and state objects)."""
        snapshot = dict(self.optimizer.__dict__)
        try:
            load_inner()
            check_state_shapes(self.optimizer)
            self._finish_load(prepared)
        except BaseException:
            self.optimizer.__dict__.clear()
            self.optimizer.__dict__.update(snapshot)
            raise

    def _extra_state(self) -> dict[str, Any]:
        """This wrapper's entry of the state dict: tensors and plain values only."""
        raise NotImplementedError

    def _check_load(self, inner_state: Mapping[str, Any], extra: Any) -> tuple[dict[str, Any], Any]:
        """Validate a load (``extra`` is None without an entry) before anything changes.

        Returns:
          The dict to hand to the inner optimizer's ``load_state_dict``, and what
          :meth:`_finish_load` applies once it has loaded.
        """
        raise NotImplementedError

    def _finish_load(self, prepared: Any) -> None:
        """Check what the inner optimizer loaded where only then it can be read, and apply
        ``prepared``; raise before applying anything (the inner load is then undone)."""
        raise NotImplementedError


def check_state_shapes(optimizer: Optimizer) -> None:
    """Refuse a torch optimizer's state tensor whose shape is not its parameter's.

    Every state tensor of torch's own optimizers but LBFGS (whose state is flat vectors)
    has its parameter's shape or none; one that loaded with another would make the next
    step fail half-way, after some parameters were updated. Other optimizers keep
    state of their own shapes (factored moments, preconditioners), so they are not
    checked.

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


# A subclass that calls ``Optimizer.__init__`` would otherwise have ``step`` wrapped in
# torch's profiling hook, which fires the global hooks a second time.
setattr(OptimizerWrapper.step, "hooked", True)  # noqa: B010
