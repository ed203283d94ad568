"""Every torch LR scheduler drives a ClippedOptimizer exactly as it drives the bare optimizer.

For each scheduler, two runs of 50 steps start from the same seed: the bare optimizer with
:func:`clipopt.clip_grad_norm_` before each ``step()``, and the same optimizer wrapped in
:class:`clipopt.ClippedOptimizer`. The learning rates (and the momentum or Adam beta1
that CyclicLR and OneCycleLR cycle) of every param group must be equal at every step, the
parameters must be bit-identical at the end, and neither run may emit any warning: in
particular not "Detected call of `lr_scheduler.step()` before `optimizer.step()`", which
torch raises when its patch of ``optimizer.step`` does not see the wrapper's step.

The case list is checked against ``torch.optim.lr_scheduler`` and ``swa_utils`` at run
time, so a scheduler added by a new torch release fails until it has a case here.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch
from torch import Tensor, nn
from torch.optim import Optimizer, lr_scheduler, swa_utils
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

import clipopt

STEPS = 50
MAX_NORM = 0.05
PLATEAU_METRICS = [1.0 / (1 + i) if i < 10 else 0.1 for i in range(STEPS)]
"""Improves for 10 steps, then stalls: ReduceLROnPlateau must cut the LR several times."""

Scheduler = LRScheduler | ReduceLROnPlateau


def _sgd(params: list[dict[str, object]]) -> Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adam(params: list[dict[str, object]]) -> Optimizer:
    return torch.optim.Adam(params, lr=0.01, betas=(0.9, 0.99))


@dataclass(frozen=True)
class Case:
    """A scheduler, the optimizer it needs, and how it is stepped."""

    optimizer: Callable[[list[dict[str, object]]], Optimizer]
    scheduler: Callable[[Optimizer], Scheduler]
    plateau: bool = False


def _sequential(opt: Optimizer) -> Scheduler:
    warmup = lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5)
    decay = lr_scheduler.ExponentialLR(opt, gamma=0.9)
    return lr_scheduler.SequentialLR(opt, [warmup, decay], milestones=[5])


def _chained(opt: Optimizer) -> Scheduler:
    constant = lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=7)
    decay = lr_scheduler.ExponentialLR(opt, gamma=0.95)
    return lr_scheduler.ChainedScheduler([constant, decay], optimizer=opt)


CASES: dict[str, Case] = {
    "LambdaLR": Case(_sgd, lambda o: lr_scheduler.LambdaLR(o, lambda e: 1 / (1 + e))),
    "MultiplicativeLR": Case(_sgd, lambda o: lr_scheduler.MultiplicativeLR(o, lambda e: 0.97)),
    "StepLR": Case(_sgd, lambda o: lr_scheduler.StepLR(o, step_size=7, gamma=0.5)),
    "MultiStepLR": Case(_sgd, lambda o: lr_scheduler.MultiStepLR(o, milestones=[5, 20, 33])),
    "ConstantLR": Case(_sgd, lambda o: lr_scheduler.ConstantLR(o, factor=0.3, total_iters=9)),
    "LinearLR": Case(_sgd, lambda o: lr_scheduler.LinearLR(o, start_factor=0.2, total_iters=30)),
    "ExponentialLR": Case(_sgd, lambda o: lr_scheduler.ExponentialLR(o, gamma=0.93)),
    "SequentialLR": Case(_sgd, _sequential),
    "PolynomialLR": Case(_sgd, lambda o: lr_scheduler.PolynomialLR(o, total_iters=40, power=2)),
    "CosineAnnealingLR": Case(_adam, lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=20)),
    "ChainedScheduler": Case(_sgd, _chained),
    "ReduceLROnPlateau": Case(
        _sgd, lambda o: lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=2), plateau=True
    ),
    "CyclicLR-momentum": Case(
        _sgd,
        lambda o: lr_scheduler.CyclicLR(
            o, base_lr=0.01, max_lr=0.1, step_size_up=6, base_momentum=0.8, max_momentum=0.95
        ),
    ),
    "CyclicLR-betas": Case(
        _adam,
        lambda o: lr_scheduler.CyclicLR(
            o, base_lr=0.001, max_lr=0.01, step_size_up=6, mode="triangular2"
        ),
    ),
    "OneCycleLR-betas": Case(
        _adam, lambda o: lr_scheduler.OneCycleLR(o, max_lr=[0.01, 0.03], total_steps=STEPS)
    ),
    "OneCycleLR-momentum": Case(
        _sgd, lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=STEPS, three_phase=True)
    ),
    "CosineAnnealingWarmRestarts": Case(
        _sgd, lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=5, T_mult=2)
    ),
    "SWALR": Case(
        _sgd, lambda o: swa_utils.SWALR(o, swa_lr=0.02, anneal_epochs=10, anneal_strategy="linear")
    ),
}


def _schedulers_in(module: ModuleType) -> set[str]:
    """Public scheduler classes defined in ``module`` (not the abstract bases)."""
    bases = {LRScheduler, lr_scheduler._LRScheduler}
    return {
        name
        for name, obj in vars(module).items()
        if inspect.isclass(obj)
        and obj.__module__ == module.__name__
        and issubclass(obj, (LRScheduler, ReduceLROnPlateau))
        and obj not in bases
        and not name.startswith("_")
    }


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _groups(model: nn.Module) -> list[dict[str, object]]:
    """Two param groups with different LRs, so per-group scheduling is visible."""
    first, second = model[0], model[2]
    return [{"params": list(first.parameters())}, {"params": list(second.parameters()), "lr": 0.05}]


def _loss(model: nn.Module, step: int) -> Tensor:
    data = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 4, generator=data), torch.randn(8, 3, generator=data)
    return ((model(x) - y) ** 2).mean() * 10


def _hyperparameters(opt: Optimizer) -> list[tuple[object, ...]]:
    """What a scheduler may write, per group: lr, momentum and betas."""
    return [(g["lr"], g.get("momentum"), g.get("betas")) for g in opt.param_groups]


@dataclass
class Trace:
    hyperparameters: list[list[tuple[object, ...]]]
    last_lrs: list[list[float]]
    params: list[Tensor]
    norms: list[Tensor]


def _train(case: Case, wrapped: bool) -> Trace:
    """50 steps; raises if the scheduler or the optimizer emits any warning."""
    model = _model()
    inner = case.optimizer(_groups(model))
    opt = clipopt.ClippedOptimizer(inner, max_norm=MAX_NORM) if wrapped else inner
    trace = Trace([], [], [], [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # torch 2.6 (at least): SequentialLR passes an epoch to its own schedulers, and warns
        # of it with or without a wrapper; the bare reference run meets the same filter.
        warnings.filterwarnings("ignore", "The epoch parameter in `scheduler.step", UserWarning)
        sched = case.scheduler(opt)
        for step in range(STEPS):
            opt.zero_grad()
            _loss(model, step).backward()
            if wrapped:
                opt.step()
                trace.norms.append(opt.last_norm)  # type: ignore[attr-defined]
            else:
                trace.norms.append(clipopt.clip_grad_norm_(model.parameters(), MAX_NORM))
                opt.step()
            if case.plateau:
                sched.step(PLATEAU_METRICS[step])  # type: ignore[call-arg]
            else:
                sched.step()
            trace.hyperparameters.append(_hyperparameters(inner))  # what the update used
            trace.last_lrs.append(list(sched.get_last_lr()))
    trace.params = [p.detach().clone() for p in model.parameters()]
    return trace


def test_every_scheduler_has_a_case() -> None:
    covered = {name.split("-", 1)[0] for name in CASES}
    assert covered == _schedulers_in(lr_scheduler) | _schedulers_in(swa_utils)


@pytest.mark.parametrize("name", sorted(CASES))
def test_schedule_is_identical_and_silent(name: str) -> None:
    reference = _train(CASES[name], wrapped=False)
    ours = _train(CASES[name], wrapped=True)
    distinct = {tuple(h) for h in reference.hyperparameters}
    assert len(distinct) > 1, "the schedule must change something over 50 steps"
    assert ours.hyperparameters == reference.hyperparameters
    assert ours.last_lrs == reference.last_lrs
    assert all(bool(n > MAX_NORM) for n in reference.norms), "every step must clip"
    torch.testing.assert_close(ours.norms, reference.norms, rtol=0, atol=0)
    torch.testing.assert_close(ours.params, reference.params, rtol=0, atol=0)


def test_stepping_the_scheduler_first_still_warns() -> None:
    """The check the tests above rely on is live: torch does see a missing optimizer step."""
    model = _model()
    opt = clipopt.ClippedOptimizer(_sgd(_groups(model)), max_norm=MAX_NORM)
    sched = lr_scheduler.StepLR(opt, step_size=3)
    with pytest.warns(UserWarning, match=r"lr_scheduler\.step\(\)` before `optimizer\.step\(\)"):
        sched.step()
