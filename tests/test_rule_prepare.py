"""``rule.prepare(norms)`` makes a rule's state ahead of the first step: a compiled step
then traces every graph at its first call and none after, a rule prepared for other
norms (a parameter that never gets a grad) starts over at its first step, and a
prepared rule that has not stepped saves no state."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

import clipopt

SHAPES = [(4, 3), (3,), (2, 2)]
RULES: dict[str, Callable[[], clipopt.ClipRule]] = {
    "AutoClip": lambda: clipopt.AutoClip(history=5),
    "AutoClip-per-tensor": lambda: clipopt.AutoClip(history=5, per_tensor=True),
    "ZClip": lambda: clipopt.ZClip(warmup_steps=2),
    "AdaGC": lambda: clipopt.AdaGC(warmup_steps=2),
}


def prepared(rule: clipopt.ClipRule, grads: int) -> clipopt.ClipRule:
    """The call the wrapper makes: norms of the step's shape, dtype and device."""
    rule.prepare(torch.zeros(grads if rule.per_tensor else ()))
    return rule


def frames_per_step(rule: clipopt.ClipRule, steps: int = 3) -> list[int]:
    torch._dynamo.reset()
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.1), max_norm=rule)
    counter = CompileCounter()
    step = torch.compile(opt.step, backend=counter)
    generator = torch.Generator().manual_seed(0)
    frames = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        step()
        frames.append(counter.frame_count)
    return frames


@pytest.mark.parametrize("name", sorted(RULES))
def test_a_rule_compiles_once_the_wrapper_prepared_it(name: str) -> None:
    """The constructor prepares the rule: no step after the first compiles again."""
    frames = frames_per_step(RULES[name]())
    assert len(set(frames)) == 1, frames


@pytest.mark.parametrize("name", sorted(RULES))
def test_a_rule_prepared_for_other_norms_starts_over_and_saves_nothing_until_it_steps(
    name: str,
) -> None:
    rule = prepared(RULES[name](), len(SHAPES) + 1)  # one parameter never gets a grad
    assert rule.state_dict()["state"] == {}
    same = RULES[name]()
    opts = []
    for r in (rule, same):
        params = [torch.nn.Parameter(torch.ones(s)) for s in SHAPES]
        opts.append(clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.1), max_norm=r))
        for scale in (1.0, 3.0, 0.5):
            for p in params:
                p.grad = torch.full(p.shape, scale)
            opts[-1].step()
    assert set(rule.state_dict()["state"]) == set(rule.state_keys)
    for key in rule.state_keys:
        assert torch.equal(rule.state[key], same.state[key])
    assert torch.equal(opts[0].clipped_count, opts[1].clipped_count)
