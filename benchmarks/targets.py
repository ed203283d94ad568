"""The benchmark's targets: each goal against the medians of one run, and the ones that
name CPU or CUDA costs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks import host
from benchmarks.common import (
    FOLDED_FLOOR,
    Row,
    Target,
    many_small_shapes,
)


def _median(rows: list[Row], section: str, case: str, contender: str) -> float:
    for row in rows:
        if (row.section, row.case, row.contender) == (section, case, contender):
            return row.median_ms
    raise KeyError((section, case, contender))


def check_targets(
    rows: list[Row], memory: dict[str, Any], layout: str = "transformer", quick: bool = False
) -> list[Target]:
    """The issue's targets, as ratios of medians from this run; ``layout``: the step's."""

    def clip(case: str, contender: str) -> float:
        return _median(rows, "clip", case, contender)

    step_case = f"{layout} float32"
    inf_case = f"{layout} float32 p=inf"
    clip_cases = [r.case for r in rows if r.section == "clip" and r.contender == "torch"]

    def e2e_case() -> str:
        return next(r.case for r in rows if r.section == "end_to_end")

    targets = _measured(
        *(_never_slower(clip, case) for case in dict.fromkeys(clip_cases)),
        lambda: Target(
            f"clip inf {layout} fp32: torch / clipopt",
            clip(inf_case, "torch") / clip(inf_case, "clipopt"),
            3.0,
            at_most=False,
        ),
        lambda: Target(
            f"step {layout} fp32: ClippedOptimizer(fused AdamW) / bare",
            _median(rows, "step", step_case, "fused AdamW: ClippedOptimizer")
            / _median(rows, "step", step_case, "fused AdamW: bare"),
            1.35,
            at_most=True,
        ),
        *(
            _folded_target(rows, layout, dtype, short)
            for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16"))
        ),
        lambda: Target(
            "end to end: ClippedOptimizer / unclipped",
            _median(rows, "end_to_end", e2e_case(), "ClippedOptimizer")
            / _median(rows, "end_to_end", e2e_case(), "unclipped"),
            1.02,
            at_most=True,
        ),
        *host_targets(rows, len(many_small_shapes(quick))),
        *small_model_targets(rows),
    )
    targets += _memory_target(memory, "peak_rss_growth_bytes", "memory: clipped peak RSS growth")
    return targets


def _memory_target(memory: dict[str, Any], key: str, name: str) -> list[Target]:
    """How far the clipped fused AdamW step's peak memory (``key``) rises above the bare
    step's, against one packing chunk plus 1 KiB per tensor; none where unmeasured."""
    bare = memory.get("bare fused AdamW", {}).get(key)
    clipped = memory.get("ClippedOptimizer(fused AdamW)", {}).get(key)
    if bare is None or clipped is None:
        return []
    allowance = 4 * 2**20 + 1024 * memory["tensors"]
    growth = (clipped - bare) / 2**20
    return [Target(f"{name} - bare (MiB)", growth, allowance / 2**20, at_most=True)]


def _measured(*makers: Callable[[], Target]) -> list[Target]:
    """The targets whose rows this run measured (``--only`` leaves sections out)."""
    targets = []
    for make in makers:
        try:
            targets.append(make())
        except (KeyError, StopIteration):
            continue
    return targets


def _never_slower(clip: Callable[[str, str], float], case: str) -> Callable[[], Target]:
    """torch's clip over clipopt's at least 1.0 on one clip case."""
    return lambda: Target(
        f"clip {case}: torch / clipopt", clip(case, "torch") / clip(case, "clipopt"), 1.0, False
    )


def _folded_target(rows: list[Row], layout: str, dtype: str, short: str) -> Callable[[], Target]:
    """The folded step against its floor: the fused step with grad_scale and a read."""
    case = f"{layout} {dtype}"
    return lambda: Target(
        f"step {layout} {short}: ClippedOptimizer(fused AdamW) / folded floor",
        _median(rows, "step", case, "fused AdamW: ClippedOptimizer")
        / _median(rows, "step", case, FOLDED_FLOOR),
        1.05,
        at_most=True,
    )


def host_targets(rows: list[Row], tensors: int) -> list[Callable[[], Target]]:
    """Many small tensors (``tensors`` of them): the clip and the wrapper's clip within
    3x the floor; and what limits that here (the floor plus the per-tensor calls no exact
    clip can skip, against the same 3x)."""

    def host_ratio(contender: str) -> float:
        return _median(rows, "host cost", host.HOST_CASE, contender) / _median(
            rows, "host cost", host.HOST_CASE, "floor"
        )

    return [
        lambda: Target("many_small fp32: clipopt clip / floor", host_ratio("clipopt"), 3.0, True),
        lambda: Target(
            "many_small fp32: ClippedOptimizer's clip / floor",
            host_ratio(host.WRAPPER_CLIP),
            3.0,
            True,
        ),
        lambda: Target(
            "many_small fp32, what limits it: floor + .grad + increment_version / floor",
            host_ratio(host.PER_TENSOR_FLOOR),
            3.0,
            True,
        ),
    ]


def cuda_targets(
    rows: list[Row], memory: dict[str, Any], syncs: dict[str, int], layout: str
) -> list[Target]:
    """The GPU check's targets (CUDA only), measured as on the CPU: medians of one run.

    The folded step against its floor (``FOLDED_FLOOR``: a read of the grads and the
    fused step with ``grad_scale``), and against torch's foreach clip + the fused step;
    clipopt's clip against torch's foreach clip on many small tensors; no host sync in
    any clipped call, with the control call counting at least one.
    """
    step_case = f"{layout} float32"

    def step(contender: str) -> float:
        return _median(rows, "step", step_case, contender)

    def clip(contender: str) -> float:
        return _median(rows, "clip", "many_small float32 p=2", contender)

    clipped = step("fused AdamW: ClippedOptimizer")
    targets = [
        Target(
            f"cuda step {layout} fp32: ClippedOptimizer(fused AdamW) / floor",
            clipped / step(FOLDED_FLOOR),
            1.05,
            at_most=True,
        ),
        Target(
            f"cuda step {layout} fp32: torch foreach clip + fused AdamW / ClippedOptimizer",
            step("fused AdamW: torch clip + step") / clipped,
            1.2,
            at_most=False,
        ),
        Target(
            "cuda clip L2 many_small fp32: torch foreach / clipopt",
            clip("torch") / clip("clipopt"),
            1.3,
            at_most=False,
        ),
    ]
    control = [n for n in syncs if n.startswith("control")]
    for name, count in syncs.items():
        if name in control:
            targets.append(Target(f"cuda host syncs counted, {name}", count, 1, at_most=False))
        else:
            targets.append(Target(f"cuda host syncs in one call: {name}", count, 0, at_most=True))
    targets += _memory_target(
        memory, "peak_cuda_growth_bytes", "cuda memory: clipped peak allocation growth"
    )
    return targets


def small_model_targets(rows: list[Row]) -> list[Callable[[], Target]]:
    """The small GPT: the wrapped step no slower than torch's clip + step, and the
    wrapper's first step at most twice a later one."""

    def ratio(case: str, contender: str, baseline: str) -> float:
        return _median(rows, "small model", case, contender) / _median(
            rows, "small model", case, baseline
        )

    return [
        lambda: Target(
            "GPT 2x64: ClippedOptimizer(AdamW) / torch clip + step",
            ratio(host.SMALL_CASE, host.SMALL_WRAPPED, host.SMALL_TORCH),
            1.0,
            True,
        ),
        lambda: Target(
            "GPT 2x64: ClippedOptimizer's first step / a later one",
            ratio(host.FIRST_CASE, "first", "later"),
            2.0,
            True,
        ),
    ]
