"""The compiled recipe: ``torch.compile(opt.step)`` with inductor, clipped against bare.

For foreach AdamW and foreach SGD (momentum) on the step layout (the transformer), each
compiled with the default backend and warmed up before anything is timed:

- ``compiled: bare``: the inner optimizer's step alone;
- ``compiled: torch clip + step``: ``torch.nn.utils.clip_grad_norm_`` then the step, in
  one compiled function (torch's own recipe for a clipped compiled step);
- ``compiled: ClippedOptimizer``, ``... (ZClip)``, ``... (nonfinite='skip')``: the
  wrapper's step, with a fixed threshold, one rule, and the skip policy (one host read
  a step, a graph break there);
- ``compiled: bare + clip floor``: the bare compiled step, then the least any clip adds
  to it: a ``sum`` and an in-place ``mul_`` over one buffer holding the grads' bytes (the
  clip section's floor). It shows what limits the 1.10 target on a machine whose step
  is bound by memory: the clip must read every grad once and read and write it once more.

Each clipped row's ratio is to the bare compiled step (target at most 1.10 on the CPU),
and :func:`recipe_targets` also divides it by torch's compiled clip + step (target at
most 1.0). A quick run (``--quick``) traces with ``aot_eager`` to check the script
without minutes of C++ compilation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import clipopt
from benchmarks.common import (
    Row,
    Target,
    _grads_and_flat_copy,
    make_params,
    release,
    summarize,
    time_interleaved,
)

__all__ = [
    "BARE",
    "CLIPPED",
    "FLOORED",
    "KINDS",
    "SECTION",
    "TORCH_RECIPE",
    "bench_recipes",
    "recipe_targets",
]

SECTION = "compiled recipe"
BARE = "compiled: bare"
TORCH_RECIPE = "compiled: torch clip + step"
FLOORED = "compiled: bare + clip floor"
CLIPPED = {
    "fixed": "compiled: ClippedOptimizer",
    "zclip": "compiled: ClippedOptimizer(ZClip)",
    "skip": "compiled: ClippedOptimizer(nonfinite='skip')",
}
MAX_NORM = 1.0
WARM_UP_CALLS = 3  # compile, and the recompiles of the first steps (state, step count)

KINDS: dict[str, Callable[[list[Tensor]], torch.optim.Optimizer]] = {
    "foreach AdamW": lambda p: torch.optim.AdamW(p, lr=1e-6, foreach=True),
    "foreach SGD": lambda p: torch.optim.SGD(p, lr=1e-6, momentum=0.9, foreach=True),
}


def _wrapped(
    make: Callable[[list[Tensor]], torch.optim.Optimizer], params: list[Tensor], setting: str
) -> clipopt.ClippedOptimizer:
    inner = make(params)
    if setting == "zclip":
        return clipopt.ClippedOptimizer(inner, clipopt.ZClip())
    if setting == "skip":
        return clipopt.ClippedOptimizer(inner, MAX_NORM, nonfinite="skip")
    return clipopt.ClippedOptimizer(inner, MAX_NORM)


def recipe_contenders(
    params: list[Tensor],
    make: Callable[[list[Tensor]], torch.optim.Optimizer],
    backend: str = "inductor",
) -> dict[str, Callable[[], object]]:
    """Each compiled step of one inner kind, compiled and warmed up here. They share the
    parameters and their grads (a step changes the parameters, never the grads' norm by
    much: the lr is 1e-6)."""
    bare = make(params)
    floored = make(params)
    torch_inner = make(params)
    _, flat = _grads_and_flat_copy(params)
    shrink = torch.tensor(1 - 1e-7, device=flat.device)

    def torch_clip_then_step() -> None:
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        torch_inner.step()

    steps: dict[str, Callable[[], object]] = {
        BARE: bare.step,
        TORCH_RECIPE: torch_clip_then_step,
    }
    for setting, name in CLIPPED.items():
        steps[name] = _wrapped(make, params, setting).step
    contenders = {}
    for name, step in steps.items():
        compiled = torch.compile(step, backend=backend)
        for _ in range(WARM_UP_CALLS):
            compiled()
        contenders[name] = compiled
    floored_step = torch.compile(floored.step, backend=backend)
    for _ in range(WARM_UP_CALLS):
        floored_step()

    def bare_then_floor() -> object:
        floored_step()
        total = flat.sum()
        return flat.mul_(shrink), total

    contenders[FLOORED] = bare_then_floor
    return contenders


def recipe_case(layout: str, kind: str) -> str:
    return f"{layout} float32, {kind}"


def bench_recipes(config: Any) -> list[Row]:
    """The compiled-recipe rows for every inner kind, on the step layout."""
    rows = []
    layout = config.step_layout
    for kind, make in KINDS.items():
        params = make_params(config.layouts[layout](config.quick), torch.float32, config.device)
        backend = "aot_eager" if config.quick else "inductor"
        samples = time_interleaved(recipe_contenders(params, make, backend), config)
        rows += summarize(SECTION, recipe_case(layout, kind), samples, BARE)
        del params, samples
        torch._dynamo.reset()
        release(config.device)
    return rows


def recipe_targets(rows: list[Row], layout: str) -> list[Target]:
    """Per inner kind and clipped contender: over the bare compiled step (at most 1.10),
    over torch's compiled clip + step (at most 1.0), and over the bare step plus the clip
    floor (at most 1.10: what limits the first); none for rows not measured."""
    targets = []
    for kind in KINDS:
        case = recipe_case(layout, kind)
        medians = {r.contender: r.median_ms for r in rows if (r.section, r.case) == (SECTION, case)}
        if not medians:
            continue
        for name in CLIPPED.values():
            for baseline, goal in ((BARE, 1.10), (TORCH_RECIPE, 1.0), (FLOORED, 1.10)):
                ratio = medians[name] / medians[baseline]
                short = baseline.removeprefix("compiled: ")
                targets.append(
                    Target(
                        f"compiled {layout} fp32, {kind}: {name.removeprefix('compiled: ')} / "
                        f"{short}",
                        ratio if math.isfinite(ratio) else math.nan,
                        goal,
                        at_most=True,
                    )
                )
    return targets
