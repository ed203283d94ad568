"""Optimizer step hooks in torch's order, when one optimizer's step runs another's.

torch fires, around ``opt.step()``: the global pre-hooks, ``opt``'s own pre-hooks, the
step, ``opt``'s own post-hooks, then the global post-hooks
(``torch.optim.Optimizer.profile_hook_step``). A wrapper fires that sequence around its
whole step; the inner optimizer's step inside it then fires only the inner optimizer's
own hooks (:func:`inner_step`), so that global hooks fire once, in torch's places.

This is the one module that reads ``torch.optim``'s private hook state
(``optimizer._global_optimizer_pre_hooks`` / ``_post_hooks``, an optimizer's
``_optimizer_step_pre_hooks`` / ``_post_hooks`` and ``_optimizer_step_code``, and the
``hooked`` mark on a wrapped ``step``): no public API exposes them. All exist in torch
2.6 to 2.14 (the matrix runs the hook tests on each); where one is missing the globals
read as none and the inner step runs as ``opt.step()``, which fires its hooks itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer, optimizer

__all__ = ["global_post_hooks", "global_pre_hooks", "inner_step", "run_pre_hooks"]

Hook = Callable[..., Any]


def global_pre_hooks() -> list[Hook]:
    """The hooks of ``torch.optim.optimizer.register_optimizer_step_pre_hook``."""
    return list(getattr(optimizer, "_global_optimizer_pre_hooks", {}).values())


def global_post_hooks() -> list[Hook]:
    """The hooks of ``torch.optim.optimizer.register_optimizer_step_post_hook``."""
    return list(getattr(optimizer, "_global_optimizer_post_hooks", {}).values())


def run_pre_hooks(
    hooks: Iterable[Hook], opt: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
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


def inner_step(opt: Optimizer, closure: Callable[[], Any] | None) -> Any:
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
        args, kwargs = run_pre_hooks(list(opt._optimizer_step_pre_hooks.values()), opt, args, {})
        result = unwrapped(opt, *args, **kwargs)
        opt._optimizer_step_code()
        for hook in list(opt._optimizer_step_post_hooks.values()):
            hook(opt, args, kwargs)
    return result
