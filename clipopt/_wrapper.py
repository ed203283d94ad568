"""torch.optim's step hooks in torch's order, the wrapper's base, and :class:`OptimizerChain`."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, TypeAlias

import torch
from torch import Tensor
from torch.optim import Optimizer, optimizer

Closure: TypeAlias = Callable[[], Any]


def pre_hooks(
    opt: Any, closure: Closure | None, own_only: bool = False
) -> tuple[tuple[Any, ...], dict[str, Any], Closure | None]:
    """Fire the global (unless ``own_only``) then ``opt``'s step pre-hooks, as torch."""
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
    globals_ = {} if own_only else getattr(optimizer, "_global_optimizer_post_hooks", {})
    for hook in [*opt._optimizer_step_post_hooks.values(), *globals_.values()]:
        hook(opt, args, kwargs)


def inner_step(opt: Optimizer, closure: Closure | None) -> Any:
    """``opt.step(closure)`` without the global hooks (the wrapper fires those)."""
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
    """An ``Optimizer`` without ``Optimizer.__init__``: hooks, pickling, hooked state dicts."""

    clips: ClassVar[bool] = False  # a ClippedOptimizer: wrapped again, it would clip twice
    _parts: tuple[Optimizer, ...] = ()  # the optimizers this one steps (a load changes them)
    _state_dict: Callable[[], dict[str, Any]]
    _load: Callable[[dict[str, Any]], None]

    def _init_hooks(self) -> None:
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
        """Load a dict from :meth:`state_dict`; a bad one raises and changes nothing. Loaded
        clip settings replace the constructor's; without a ``"clip"`` entry the state stays
        (a warning, unless a ``ClippedOptimizerState`` carries it).

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
        tree: list[Optimizer] = [self]
        for opt in tree:  # grows as it goes: every optimizer a load may change
            tree += opt._parts if isinstance(opt, OptimizerShell) else ()
        saved = [(opt, dict(opt.__dict__)) for opt in tree]
        try:
            self._load(loaded)
        except BaseException:
            for opt, attributes in saved:
                opt.__dict__.clear()
                opt.__dict__.update(attributes)
            raise
        for post_hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            post_hook(self)


def check_inner(opt: object, name: str) -> Optimizer:
    """``opt``, unless no optimizer, a ClippedOptimizer, or OLMo-core's SkipStepOptimizer."""
    if isinstance(opt, OptimizerShell) and opt.clips:
        raise TypeError(
            f"{name} is a {type(opt).__name__}, already a ClippedOptimizer: pass the one it wraps"
        )
    if not isinstance(opt, Optimizer):
        hint = "; a list is optimizers to chain, not parameters" if isinstance(opt, Tensor) else ""
        raise TypeError(f"{name} must be a torch.optim.Optimizer, got {type(opt).__name__}{hint}")
    for kind in type(opt).__mro__:
        if kind.__name__ == "SkipStepOptimizer" and kind.__module__.startswith("olmo_core."):
            raise TypeError(f"{name} is {type(opt).__name__}: pass skip_spikes=clipopt.SpikeSkip()")
    return opt


def load_checked(opt: Optimizer, state_dict: dict[str, Any]) -> None:
    """``opt.load_state_dict``; a torch optimizer's state shaped unlike its param raises."""
    opt.load_state_dict(state_dict)
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
                        f"shape {tuple(value.shape)}, the parameter {tuple(p.shape)}"
                    )


class OptimizerChain(OptimizerShell):
    """Step several optimizers as one: ``ClippedOptimizer([muon, adamw], max_norm=1.0)``
    clips all their grads by one norm, then steps each in order. ``param_groups`` and
    ``state`` are theirs; the state dict is one torch optimizer's with all the groups.

    Args:
      optimizers: the optimizers, stepped in this order; no parameter in two of them.

    Raises:
      TypeError, ValueError: not a list of optimizers, or one twice, a parameter in two.

    Example:
      >>> import torch, clipopt
      >>> w, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
      >>> chain = clipopt.OptimizerChain([torch.optim.SGD([w], lr=1.0), torch.optim.AdamW([b])])
      >>> opt = clipopt.ClippedOptimizer(chain, max_norm=1.0)
      >>> w.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([0.0])
      >>> opt.step()
      >>> opt.last_norm, w.data
      (tensor(5.), tensor([-0.6000, -0.8000]))
    """

    def __init__(self, optimizers: Sequence[Optimizer]) -> None:
        if not isinstance(optimizers, (list, tuple)) or not optimizers:
            kind = ValueError if isinstance(optimizers, (list, tuple)) else TypeError
            raise kind(f"optimizers must be a non-empty list of optimizers, got {optimizers!r}")
        owner: dict[int, int] = {}
        for i, opt in enumerate(optimizers):
            check_inner(opt, f"optimizers[{i}]")
            for j in (j for j in range(i) if optimizers[j] is opt):
                raise ValueError(f"optimizers[{i}] is optimizers[{j}]: it would step twice")
            for p in (p for group in opt.param_groups for p in group["params"]):
                j = owner.setdefault(id(p), i)
                if j != i:
                    raise ValueError(
                        f"a parameter of shape {tuple(p.shape)} is in optimizers[{j}] "
                        f"({type(optimizers[j]).__name__}) and optimizers[{i}] "
                        f"({type(opt).__name__}): it would be updated twice a step"
                    )
        self.optimizers = self._parts = tuple(optimizers)
        self._init_hooks()
        self.defaults: dict[str, Any] = {}
        self._groups: list[dict[str, Any]] = []

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizers' param groups in one list, made again when one changed."""
        groups = [group for opt in self.optimizers for group in opt.param_groups]
        mine = self._groups
        if len(groups) != len(mine) or any(a is not b for a, b in zip(groups, mine, strict=True)):
            self._groups = mine = groups
        return mine

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        raise AttributeError("OptimizerChain.param_groups are chain.optimizers[i]'s: set those")

    @property
    def state(self) -> Any:
        """The inner optimizers' per-parameter states, read-only (a look-up makes none)."""
        return MappingProxyType({p: s for opt in self.optimizers for p, s in opt.state.items()})

    @state.setter
    def state(self, state: Any) -> None:
        raise AttributeError("OptimizerChain.state is chain.optimizers[i]'s: set those")

    def _step(self, closure: Closure | None = None) -> Any:
        """Evaluate ``closure`` once if given, step each optimizer, return the loss."""
        with torch.enable_grad():
            loss = None if closure is None else closure()
        for opt in self.optimizers:
            inner_step(opt, None)
        return loss

    step = Optimizer.profile_hook_step(_step)  # type: ignore[arg-type,assignment]
    setattr(step, "hooked", True)  # noqa: B010  torch's mark of a step firing the hooks

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Each optimizer's ``zero_grad(set_to_none)``."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused (a ValueError): add the group to one of the optimizers; the chain sees it."""
        raise ValueError(f"add the group to one of {self._names()}: chain.optimizers[i]")

    def _names(self) -> str:
        return ", ".join(
            f"optimizers[{i}] ({type(o).__name__})" for i, o in enumerate(self.optimizers)
        )

    def _state_dict(self) -> dict[str, Any]:
        """One torch optimizer's state dict; inner dicts' other keys go under ``"chain"``."""
        state: dict[Any, Any] = {}
        groups: list[dict[str, Any]] = []
        extras: list[dict[str, Any]] = []
        for opt in self.optimizers:
            saved = opt.state_dict()
            start = sum(len(g["params"]) for g in groups)
            index, renumbered = _renumbered(saved["param_groups"], start)
            groups += renumbered
            state.update({index[k]: v for k, v in saved["state"].items()})
            extras.append({k: v for k, v in saved.items() if k not in ("state", "param_groups")})
        merged = {"state": state, "param_groups": groups}
        return {**merged, "chain": extras} if any(extras) else merged

    def _load(self, loaded: dict[str, Any]) -> None:
        state, groups = loaded.get("state"), loaded.get("param_groups")
        if not isinstance(state, Mapping) or not isinstance(groups, list):
            raise TypeError("state_dict must have a 'state' dict and a 'param_groups' list")
        if not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
            raise TypeError("state_dict['param_groups'] must be dicts with 'params' lists")
        sizes = [len(opt.param_groups) for opt in self.optimizers]
        if len(groups) != sum(sizes):
            raise ValueError(
                f"state_dict has {len(groups)} param groups; the chain has "
                f"{' + '.join(map(str, sizes))} ({self._names()})"
            )
        extras = loaded.get("chain", [{}] * len(sizes))
        if not isinstance(extras, list) or len(extras) != len(sizes):
            raise TypeError(f"state_dict['chain'] must be a list of {len(sizes)} dicts")
        parts: list[dict[str, Any]] = []
        known: set[Any] = set()
        for i, (opt, extra) in enumerate(zip(self.optimizers, extras, strict=True)):
            start = sum(sizes[:i])
            mine = groups[start : start + sizes[i]]
            for g, (saved, group) in enumerate(zip(mine, opt.param_groups, strict=True), start):
                if len(saved["params"]) != len(group["params"]):
                    raise ValueError(
                        f"state_dict['param_groups'][{g}] has {len(saved['params'])} parameters; "
                        f"the group of optimizers[{i}] ({type(opt).__name__}) it loads into has "
                        f"{len(group['params'])}"
                    )
            if not isinstance(extra, Mapping):
                raise TypeError(f"state_dict['chain'][{i}] must be a dict, got {extra!r}")
            index, renumbered = _renumbered(mine)
            known.update(index)
            own = {index[k]: v for k, v in state.items() if k in index}
            parts.append({**extra, "state": own, "param_groups": renumbered})
        if unknown := [k for k in state if k not in known]:
            raise ValueError(f"state_dict['state'] has entries {unknown[:3]!r} of no parameter")
        for opt, part in zip(self.optimizers, parts, strict=True):
            load_checked(opt, part)

    def __repr__(self) -> str:
        inner = "".join("\n  " + repr(opt).replace("\n", "\n  ") for opt in self.optimizers)
        return f"{type(self).__name__}({inner}\n)"


def _renumbered(groups: list[Any], start: int = 0) -> tuple[dict[Any, int], list[dict[str, Any]]]:
    ids = itertools.chain(*(g["params"] for g in groups))
    index = {old: new for new, old in enumerate(ids, start)}
    return index, [{**g, "params": [index[k] for k in g["params"]]} for g in groups]
