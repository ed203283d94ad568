"""With ``max_norm=inf`` a ClippedOptimizer is observably the optimizer it wraps.

Two runs from the same seed, one bare and one wrapped with ``max_norm=inf``, each with an
LR scheduler in the loop, must agree bit for bit after every step on: parameters, the
grads left for the user, the value ``step`` returns, the learning rates and other
scheduled hyperparameters, and the state dict (the wrapper's minus its ``"clip"`` entry).
The wrapper keeps its per-group clip settings in each param group, as torch keeps ``lr``
there; those two keys, ``max_norm`` and ``norm_type``, are the only difference allowed, and
they must hold exactly the wrapper's settings. The wrapper still measures: ``last_norm``
is the total grad norm of the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch_optimizer
from helpers import assert_identical
from torch import Tensor, nn
from torch.optim import Optimizer, lr_scheduler

import clipopt

STEPS = 6
CLIP_GROUP_KEYS = {"clip_max_norm": math.inf, "clip_norm_type": 2.0}
"""The per-group clip settings the wrapper keeps in param groups, and their values here."""


@dataclass(frozen=True)
class Case:
    optimizer: Callable[[list[dict[str, object]]], Optimizer]
    scheduler: Callable[[Optimizer], lr_scheduler.LRScheduler]
    closure: bool = False


def _step_lr(opt: Optimizer) -> lr_scheduler.LRScheduler:
    return lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _one_group(groups: list[dict[str, object]]) -> list[Tensor]:
    """LBFGS takes a single param group."""
    return [p for g in groups for p in g["params"]]  # type: ignore[attr-defined]


CASES: dict[str, Case] = {
    "SGD+CyclicLR": Case(
        lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9),
        lambda o: lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2),
    ),
    "Adam+OneCycleLR": Case(
        lambda g: torch.optim.Adam(g, lr=0.01),
        lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS),
    ),
    "AdamW-fused+CosineAnnealingLR": Case(
        lambda g: torch.optim.AdamW(g, lr=0.01, fused=True),
        lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=STEPS),
    ),
    "Adagrad+StepLR": Case(lambda g: torch.optim.Adagrad(g, lr=0.1), _step_lr),
    "LBFGS+StepLR": Case(lambda g: torch.optim.LBFGS(_one_group(g), max_iter=3), _step_lr, True),
    "Lamb+StepLR": Case(lambda g: torch_optimizer.Lamb(g, lr=0.01), _step_lr),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _groups(model: nn.Module) -> list[dict[str, object]]:
    return [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}]


def _loss(model: nn.Module, step: int) -> Tensor:
    data = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 4, generator=data), torch.randn(8, 3, generator=data)
    return ((model(x) - y) ** 2).mean() * 10


@dataclass
class Observed:
    """Everything a user can see after one step."""

    params: list[Tensor]
    grads: list[Tensor]
    returned: object
    hyperparameters: list[dict[str, object]]
    state_dict: dict[str, object]


def _without_clip_settings(group: dict[str, object], wrapped: bool) -> dict[str, object]:
    """A param group minus the wrapper's own keys, checked to hold its settings."""
    if wrapped:
        assert {k: group[k] for k in CLIP_GROUP_KEYS} == CLIP_GROUP_KEYS
    return {k: v for k, v in group.items() if k not in CLIP_GROUP_KEYS}


def _observe(model: nn.Module, opt: Optimizer, returned: object) -> Observed:
    wrapped = isinstance(opt, clipopt.ClippedOptimizer)
    state = opt.state_dict()
    assert wrapped == ("clip" in state)
    state.pop("clip", None)
    state["param_groups"] = [_without_clip_settings(g, wrapped) for g in state["param_groups"]]
    groups = [
        {k: v for k, v in _without_clip_settings(g, wrapped).items() if k != "params"}
        for g in opt.param_groups
    ]
    return Observed(
        params=[p.detach().clone() for p in model.parameters()],
        grads=[p.grad.clone() for p in model.parameters() if p.grad is not None],
        returned=returned,
        hyperparameters=groups,
        state_dict=state,
    )


def _run(case: Case, per_group: bool | None) -> tuple[list[Observed], list[Tensor]]:
    """Train; ``per_group=None`` means the bare optimizer, else the wrapper with that mode."""
    model = _model()
    opt = case.optimizer(_groups(model))
    if per_group is not None:
        opt = clipopt.ClippedOptimizer(opt, max_norm=math.inf, per_group=per_group)
    sched = case.scheduler(opt)
    observed: list[Observed] = []
    norms: list[Tensor] = []

    def closure() -> Tensor:
        opt.zero_grad()
        loss = _loss(model, len(observed))
        loss.backward()
        norms.append(clipopt.get_total_norm(p.grad for p in model.parameters()))
        return loss

    for _ in range(STEPS):
        if case.closure:
            returned = opt.step(closure)
        else:
            closure()
            returned = opt.step()
        sched.step()
        observed.append(_observe(model, opt, returned))
        if isinstance(opt, clipopt.ClippedOptimizer) and not per_group:
            assert opt.last_norm is not None
            torch.testing.assert_close(opt.last_norm, norms[-1], rtol=0, atol=0)
    return observed, norms


@pytest.mark.parametrize("per_group", [False, True], ids=["global", "per-group"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_infinite_max_norm_is_the_bare_optimizer(name: str, per_group: bool) -> None:
    bare, bare_norms = _run(CASES[name], per_group=None)
    wrapped, _ = _run(CASES[name], per_group=per_group)
    assert len({str(o.hyperparameters) for o in bare}) > 1, "the scheduler must change something"
    assert all(bool(n > 0) for n in bare_norms)
    for step, (ours, theirs) in enumerate(zip(wrapped, bare, strict=True)):
        for field in ("params", "grads", "returned", "hyperparameters", "state_dict"):
            assert_identical(getattr(ours, field), getattr(theirs, field), f"step {step} {field}")


def test_state_dict_loads_into_the_bare_optimizer() -> None:
    """Minus ``"clip"``, the wrapper's state dict resumes the bare optimizer exactly."""
    model = _model()
    opt = clipopt.ClippedOptimizer(torch.optim.Adam(_groups(model), lr=0.01), max_norm=math.inf)
    for step in range(3):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
    saved = opt.state_dict()
    del saved["clip"]
    bare = torch.optim.Adam(_groups(model), lr=0.5)
    bare.load_state_dict(saved)
    assert_identical(bare.state_dict(), saved)
