"""Long runs do not grow memory: once a rule's history is full, 3,000 more steps leave
its state's tensor bytes where they were, and the last 1,500 the number of live Python
objects within a slack of 15 (the first 1,500 may make what is made once, as a first
skip's objects). The slack is for what the rest of the suite, run in the same process,
makes now and then (one object was seen once in CI); a leak of one object every 100
steps or more often still fails.

(``python -m benchmarks.rules`` measures the same at 100,000 steps, with RSS.)
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import clipopt

Make = Callable[[], tuple[clipopt.ClipRule | float, clipopt.SpikeSkip | None]]

# One line per rule: a new rule is covered by adding its own.
RULES: dict[str, Make] = {
    "autoclip": lambda: (clipopt.AutoClip(10.0, 100), None),
    "autoclip-per-tensor": lambda: (clipopt.AutoClip(10.0, 100, per_tensor=True), None),
    "zclip": lambda: (clipopt.ZClip(warmup_steps=20), None),
    "spike-skip": lambda: (1.0, clipopt.SpikeSkip(window=64)),
    "adagc": lambda: (clipopt.AdaGC(warmup_steps=20), None),
    "agc": lambda: (clipopt.AGC(clipping=0.05), None),
}
FILLED = 200  # past every history above
MORE = 1_500
SLACK = MORE // 100


def _state_tensors(state: Any) -> list[Tensor]:
    if isinstance(state, Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in _state_tensors(value)]
    return []


def _state(opt: clipopt.ClippedOptimizer) -> tuple[int, list[tuple[int, ...]]]:
    """Bytes and shapes of the tensors in the rule's and SpikeSkip's state."""
    entry = opt.state_dict()["clip"]
    tensors = _state_tensors({"rule": entry.get("rule"), "spikes": entry.get("skip_spikes")})
    return sum(t.numel() * t.element_size() for t in tensors), [tuple(t.shape) for t in tensors]


def _live_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


@pytest.mark.parametrize("name", sorted(RULES))
def test_state_and_objects_do_not_grow_after_the_history_fills(name: str) -> None:
    rule, spikes = RULES[name]()
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((4, 3), (3,))]
    pool = [[torch.randn(p.shape, generator=generator) for p in params] for _ in range(31)]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(params, lr=1e-3, momentum=0.9), max_norm=rule, skip_spikes=spikes
    )

    def run(steps: int) -> None:
        for step in range(steps):
            for p, g in zip(params, pool[step % len(pool)], strict=True):
                p.grad.copy_(g)  # type: ignore[union-attr]
            opt.step()

    run(FILLED)
    _state(opt)  # a first state_dict() makes objects of its own, once
    state_before = _state(opt)
    run(MORE)  # what is made once (a first skip's objects, lazy caches) is made here
    objects_before = _live_objects()  # an int: counting adds no object to the next count
    run(MORE)
    objects_after = _live_objects()
    held, shapes = _state(opt)
    assert held == state_before[0] > 0
    assert shapes == state_before[1]
    grown = objects_after - objects_before
    assert grown <= SLACK, f"{grown} objects more over {MORE} steps"
