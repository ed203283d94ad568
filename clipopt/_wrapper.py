"""torch.optim's step hooks in torch's order (the one module reading their private state,
as in torch 2.6 to 2.14), and :class:`OptimizerShell`, the wrapper's and chain's base."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeAlias

import torch
from torch import Tensor
from torch.optim import Optimizer, optimizer

Closure: TypeAlias = Callable[[], Any]


def pre_hooks(
    opt: Any, closure: Closure | None, own_only: bool = False
) -> tuple[tuple[Any, ...], dict[str, Any], Closure | None]:
    """Fire the global step pre-hooks (not with ``own_only``), then ``opt``'s own; one
    may replace ``(args, kwargs)``, as in torch. Return them and the closure they hold."""
    globals_ = {} if own_only else getattr(optimizer, "_global_optimizer_pre_hooks", {})
    args: tuple[Any, ...] = () if closure is None else (closure,)
    kwargs: dict[str, Any] = {}
    for hook in [*globals_.values(), *opt._optimizer_step_pre_hooks.values()]:
        result = hook(opt, args, kwargs)
        if result is not None and not (isinstance(result, tuple) and len(result) == 2):
            raise RuntimeError(f"step pre-hook must return None or (args, kwargs), got {result!r}")
        args, kwargs = result or (args, kwargs)
    return args, kwargs, kwargs.get("closure", args[0] if args else None)


def post_hooks(
    opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any], own_only: bool = False
) -> None:
    """Fire ``opt``'s own step post-hooks, then the global ones (not with ``own_only``)."""
    globals_ = {} if own_only else getattr(optimizer, "_global_optimizer_post_hooks", {})
    for hook in [*opt._optimizer_step_post_hooks.values(), *globals_.values()]:
        hook(opt, args, kwargs)


def inner_step(opt: Optimizer, closure: Closure | None) -> Any:
    """``opt.step(closure)`` with ``opt``'s own hooks but not the global ones (the wrapper
    fires those around its whole step). A step torch did not wrap is called as it is."""
    step = type(opt).step
    unwrapped = getattr(step, "__wrapped__", None)
    if unwrapped is None or not getattr(step, "hooked", False) or "step" in opt.__dict__:
        return opt.step() if closure is None else opt.step(closure)
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(opt).__name__}.step"):
        args, kwargs, _ = pre_hooks(opt, closure, own_only=True)
        result = unwrapped(opt, *args, **kwargs)
        opt._optimizer_step_code()
        post_hooks(opt, args, kwargs, own_only=True)
    return result


class OptimizerShell(Optimizer):
    """An ``Optimizer`` that does not call ``Optimizer.__init__`` (nor does torchao's
    ``CPUOffloadOptimizer``): hook registries, pickling, and a state dict with hooks."""

    clips: ClassVar[bool] = False  # a ClippedOptimizer: wrapped again, it would clip twice
    _parts: tuple[Optimizer, ...] = ()  # the optimizers this one steps (a load changes them)

    def _init_hooks(self) -> None:
        """The empty hook registries ``Optimizer.__init__`` would make."""
        for kind in ("step", "state_dict", "load_state_dict"):
            for when in ("pre", "post"):
                setattr(self, f"_optimizer_{kind}_{when}_hooks", OrderedDict())

    def __getstate__(self) -> dict[str, Any]:
        # Like torch.optim.Optimizer: hooks and a scheduler's patched ``step`` stay behind.
        return {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("step", "_opt_called") and not k.startswith("_optimizer_")
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_hooks()

    def state_dict(self) -> dict[str, Any]:
        """This optimizer's state dict, with its state-dict hooks around it as in torch."""
        for pre_hook in list(self._optimizer_state_dict_pre_hooks.values()):
            pre_hook(self)
        state_dict = self._state_dict()
        for post_hook in list(self._optimizer_state_dict_post_hooks.values()):
            result = post_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        return state_dict

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a dict from :meth:`state_dict`, checked first: a bad one raises and changes
        nothing (what an inner optimizer loaded is put back). A ClippedOptimizer also loads
        a dict without its ``"clip"`` entry (a plain one, or DCP's): it keeps the clip state
        and warns, unless a :class:`clipopt.distributed.ClippedOptimizerState` carries it.
        Loaded clip settings replace the constructor's, as for ``lr``.

        Raises:
          TypeError: ``state_dict`` is not a dict, or a value has the wrong type.
          ValueError: the dict does not match this optimizer or holds bad values.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        loaded = dict(state_dict)
        for pre_hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = pre_hook(self, loaded)
            loaded = loaded if result is None else dict(result)
        saved = [(opt, dict(opt.__dict__)) for opt in _tree(self)]
        try:
            self._load(loaded)
        except BaseException:
            for opt, attributes in saved:  # their groups and state objects as they were
                opt.__dict__.clear()
                opt.__dict__.update(attributes)
            raise
        for post_hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            post_hook(self)

    _state_dict: Callable[[], dict[str, Any]]  # what a subclass saves and loads
    _load: Callable[[dict[str, Any]], None]


def _tree(opt: Optimizer) -> list[Optimizer]:
    """``opt`` and the optimizers it steps, all of which a load may change."""
    parts = opt._parts if isinstance(opt, OptimizerShell) else ()
    return [opt, *(o for part in parts for o in _tree(part))]


def check_inner(opt: object, name: str) -> Optimizer:
    """``opt``, unless it is no optimizer, a ClippedOptimizer, or OLMo-core's
    ``SkipStepOptimizer`` (which skips only as OLMo-core's own optimizer, never wrapped)."""
    if isinstance(opt, OptimizerShell) and opt.clips:
        raise TypeError(
            f"{name} is a {type(opt).__name__}, already a ClippedOptimizer: it would clip "
            "twice; pass the optimizer it wraps, or change its groups' 'clip_max_norm'"
        )
    if not isinstance(opt, Optimizer):
        hint = "; a list is optimizers to chain, not parameters" if isinstance(opt, Tensor) else ""
        raise TypeError(f"{name} must be a torch.optim.Optimizer, got {type(opt).__name__}{hint}")
    for kind in type(opt).__mro__:
        if kind.__name__ == "SkipStepOptimizer" and kind.__module__.startswith("olmo_core."):
            raise TypeError(
                f"{name} is OLMo-core's {type(opt).__name__}: wrapped it would never skip; wrap "
                "the plain optimizer and pass skip_spikes=clipopt.SpikeSkip() instead"
            )
    return opt


def check_state_shapes(opt: Optimizer) -> None:
    """Refuse a loaded state tensor of a torch optimizer (not LBFGS: its own shapes) whose
    shape is not its parameter's: the next step would fail half-way."""
    kind = type(opt)
    if not kind.__module__.startswith("torch.optim.") or kind is torch.optim.LBFGS:
        return
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            entries = opt.state.get(p, {})
            for key, value in entries.items() if isinstance(entries, Mapping) else ():
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape != p.shape:
                    raise ValueError(
                        f"the loaded state {key!r} of param_groups[{g}]['params'][{i}] has "
                        f"shape {tuple(value.shape)}, the parameter {tuple(p.shape)}; "
                        "nothing was loaded"
                    )
