"""``OptimizerChain``: several optimizers stepped as one (Muon for the 2-D weights, AdamW
for the rest), so that one clip spans them all."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from torch.optim import Optimizer

from clipopt._wrapper import Closure, OptimizerShell, check_inner, check_state_shapes, inner_step

__all__ = ["OptimizerChain"]

_EXTRA_KEY = "chain"


class OptimizerChain(OptimizerShell):
    """Step several optimizers as one: ``ClippedOptimizer([muon, adamw], max_norm=1.0)``
    clips all their grads by one global norm, then steps each in order. ``param_groups``
    are theirs (the very dicts), ``state`` reads theirs; the state dict is one torch
    optimizer's holding all the groups.

    Args:
      optimizers: the optimizers, stepped in this order; no parameter in two of them.

    Raises:
      TypeError: not a list of optimizers, or one is a ``ClippedOptimizer``.
      ValueError: no optimizers, one given twice, or a parameter in two of them.

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
        self._lists: list[list[dict[str, Any]]] = []
        self._sizes: list[int] = []
        self._groups: list[dict[str, Any]] = []

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizers' param groups: one list, made again when one changed."""
        lists = [opt.param_groups for opt in self.optimizers]
        sizes = [len(groups) for groups in lists]
        if sizes != self._sizes or any(a is not b for a, b in zip(lists, self._lists, strict=True)):
            self._lists, self._sizes = lists, sizes
            self._groups = [group for groups in lists for group in groups]
        return self._groups

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
        """Evaluate ``closure`` once if given, then step each optimizer with its own
        hooks; return the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
        raise ValueError(
            "OptimizerChain.add_param_group cannot tell which optimizer should step the "
            f"group: add it to one of {_names(self.optimizers)}, e.g. "
            "chain.optimizers[i].add_param_group(group); the chain sees it"
        )

    def _state_dict(self) -> dict[str, Any]:
        """One torch optimizer's state dict with all the groups, parameters numbered
        across the optimizers; other top-level keys of an inner dict are kept under
        ``"chain"``, one dict per optimizer (absent where there are none)."""
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
        return {**merged, _EXTRA_KEY: extras} if any(extras) else merged

    def _load(self, loaded: dict[str, Any]) -> None:
        """Split a dict from :meth:`state_dict`, each part checked first, and load each
        optimizer's part (its parameters numbered from 0)."""
        state, groups = loaded.get("state"), loaded.get("param_groups")
        if not isinstance(state, Mapping) or not isinstance(groups, list):
            raise TypeError("state_dict must have a 'state' dict and a 'param_groups' list")
        if not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
            raise TypeError("state_dict['param_groups'] must be dicts with 'params' lists")
        sizes = [len(opt.param_groups) for opt in self.optimizers]
        if len(groups) != sum(sizes):
            raise ValueError(
                f"state_dict has {len(groups)} param groups; the chain has "
                f"{' + '.join(map(str, sizes))} ({_names(self.optimizers)})"
            )
        extras = loaded.get(_EXTRA_KEY, [{}] * len(sizes))
        if not isinstance(extras, list) or len(extras) != len(sizes):
            raise TypeError(f"state_dict[{_EXTRA_KEY!r}] must be a list of {len(sizes)} dicts")
        parts: list[dict[str, Any]] = []
        known: set[Any] = set()
        start = 0
        for i, (opt, extra) in enumerate(zip(self.optimizers, extras, strict=True)):
            mine = groups[start : start + sizes[i]]
            for g, (saved, group) in enumerate(zip(mine, opt.param_groups, strict=True), start):
                if len(saved["params"]) != len(group["params"]):
                    raise ValueError(
                        f"state_dict['param_groups'][{g}] has {len(saved['params'])} parameters; "
                        f"the group of optimizers[{i}] ({type(opt).__name__}) it loads into has "
                        f"{len(group['params'])}"
                    )
            if not isinstance(extra, Mapping):
                raise TypeError(f"state_dict[{_EXTRA_KEY!r}][{i}] must be a dict, got {extra!r}")
            start += sizes[i]
            index, renumbered = _renumbered(mine)
            known.update(index)
            own = {index[k]: v for k, v in state.items() if k in index}
            parts.append({**extra, "state": own, "param_groups": renumbered})
        unknown = [k for k in state if k not in known]
        if unknown:
            raise ValueError(f"state_dict['state'] has entries {unknown[:3]!r} of no parameter")
        for opt, part in zip(self.optimizers, parts, strict=True):
            opt.load_state_dict(part)
            check_state_shapes(opt)

    def __repr__(self) -> str:
        inner = "".join("\n  " + repr(opt).replace("\n", "\n  ") for opt in self.optimizers)
        return f"{type(self).__name__}({inner}\n)"


def _names(optimizers: Sequence[object]) -> str:
    return ", ".join(f"optimizers[{i}] ({type(o).__name__})" for i, o in enumerate(optimizers))


def _renumbered(groups: list[Any], start: int = 0) -> tuple[dict[Any, int], list[dict[str, Any]]]:
    """Saved groups with their parameters numbered from ``start``; the map from the old."""
    ids = itertools.chain.from_iterable(g["params"] for g in groups)
    index = {old: new for new, old in enumerate(ids, start)}
    return index, [{**g, "params": [index[k] for k in g["params"]]} for g in groups]
