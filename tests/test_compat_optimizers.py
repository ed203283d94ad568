"""ClippedOptimizer drives every optimizer exactly like ``clip_grad_norm_`` + ``step()`` by hand.

Each case trains a small model for a few steps twice from the same seed: once with the
optimizer wrapped in :class:`clipopt.ClippedOptimizer`, once with the bare optimizer and
:func:`clipopt.clip_grad_norm_` called before every ``step()`` (inside the closure for
LBFGS). The wrapper runs the same norm and scale kernels, so parameters, grads seen by the
optimizer and recorded norms must be bit-identical. ``MAX_NORM`` is far below every
gradient norm of these problems, and each test asserts that every step really clipped.

The lists of optimizers are checked against ``torch.optim`` and ``torch_optimizer`` at
run time, so an optimizer added by a new release fails until it has a case here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch_optimizer
from torch import Tensor, nn
from torch.optim import Optimizer

import clipopt

MAX_NORM = 0.05
STEPS = 5

pytestmark = [
    # Both come from the bare optimizers' own requirements, with or without clipopt:
    # Adahessian needs backward(create_graph=True), and Ranger calls a deprecated addcmul_.
    pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning"),
    pytest.mark.filterwarnings("ignore:This overload of addcmul_ is deprecated:UserWarning"),
]


@dataclass(frozen=True)
class Case:
    """One optimizer configuration and the problem it is trained on."""

    make: Callable[[list[nn.Parameter]], Optimizer]
    model: str = "mlp"
    closure: bool = False
    create_graph: bool = False


def _mlp(bias: bool = True) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6, bias=bias), nn.Tanh(), nn.Linear(6, 3, bias=bias))


def _build_model(kind: str) -> nn.Module:
    """A fresh model with weights fixed by the global seed (set by the caller)."""
    if kind == "mlp":
        return _mlp()
    if kind == "matrices":  # Muon updates only 2-D parameters
        return _mlp(bias=False)
    if kind == "embedding":  # SparseAdam needs sparse grads
        return nn.Embedding(10, 4, sparse=True)
    raise AssertionError(kind)


def _loss(model: nn.Module, kind: str) -> Tensor:
    data = torch.Generator().manual_seed(1)
    if kind == "embedding":
        idx = torch.tensor([1, 3, 3, 7])
        target = torch.randn(4, 4, generator=data)
        return ((model(idx) - target) ** 2).sum() * 10
    x = torch.randn(16, 4, generator=data)
    y = torch.randn(16, 3, generator=data)
    return ((model(x) - y) ** 2).mean() * 10


def _params(model: nn.Module) -> list[nn.Parameter]:
    return list(model.parameters())


def _torch_cases() -> dict[str, Case]:
    o = torch.optim
    return {
        "SGD": Case(lambda p: o.SGD(p, lr=0.1, momentum=0.9, nesterov=True)),
        "SGD-two-groups": Case(
            lambda p: o.SGD([{"params": p[:2]}, {"params": p[2:], "lr": 0.3}], lr=0.1, momentum=0.9)
        ),
        "Adam": Case(lambda p: o.Adam(p, lr=0.05, amsgrad=True)),
        "Adam-fused": Case(lambda p: o.Adam(p, lr=0.05, fused=True)),
        "AdamW": Case(lambda p: o.AdamW(p, lr=0.05, weight_decay=0.1)),
        "AdamW-fused": Case(lambda p: o.AdamW(p, lr=0.05, fused=True)),
        "Adamax": Case(lambda p: o.Adamax(p, lr=0.05)),
        "Adagrad": Case(lambda p: o.Adagrad(p, lr=0.1)),
        "Adadelta": Case(lambda p: o.Adadelta(p, lr=1.0)),
        "RMSprop": Case(lambda p: o.RMSprop(p, lr=0.01, momentum=0.5, centered=True)),
        "Rprop": Case(lambda p: o.Rprop(p, lr=0.01)),
        "NAdam": Case(lambda p: o.NAdam(p, lr=0.05)),
        "RAdam": Case(lambda p: o.RAdam(p, lr=0.05, decoupled_weight_decay=True)),
        "ASGD": Case(lambda p: o.ASGD(p, lr=0.05, t0=2)),
        "Adafactor": Case(lambda p: o.Adafactor(p, lr=0.05)),
        "Muon": Case(lambda p: o.Muon(p, lr=0.05), model="matrices"),
        "LBFGS": Case(lambda p: o.LBFGS(p, lr=0.5, max_iter=4), closure=True),
        "SparseAdam": Case(lambda p: o.SparseAdam(p, lr=0.05), model="embedding"),
    }


def _torch_optimizer_cases() -> dict[str, Case]:
    t = torch_optimizer
    defaults: dict[str, Case] = {
        name: Case(_with_lr(getattr(t, name), 0.05)) for name in _torch_optimizer_names()
    }
    overrides = {
        # The A2Grad family sets its own step size; lr=None is its documented default.
        "A2GradExp": Case(lambda p: t.A2GradExp(p)),
        "A2GradInc": Case(lambda p: t.A2GradInc(p)),
        "A2GradUni": Case(lambda p: t.A2GradUni(p)),
        "Adahessian": Case(lambda p: t.Adahessian(p, lr=0.05), create_graph=True),
        "LARS": Case(lambda p: t.LARS(p, lr=0.05, momentum=0.9)),
        "Lookahead": Case(lambda p: t.Lookahead(t.Yogi(p, lr=0.05), k=2, alpha=0.5)),
        "PID": Case(lambda p: t.PID(p, lr=0.05, momentum=0.9)),
        "QHM": Case(lambda p: t.QHM(p, lr=0.05, momentum=0.9)),
        "SGDW": Case(lambda p: t.SGDW(p, lr=0.05, momentum=0.9, weight_decay=0.01)),
        "Shampoo": Case(lambda p: t.Shampoo(p, lr=0.05, momentum=0.9)),
    }
    return defaults | overrides


def _with_lr(cls: type[Optimizer], lr: float) -> Callable[[list[nn.Parameter]], Optimizer]:
    return lambda params: cls(params, lr=lr)  # type: ignore[call-arg]


def _torch_optimizer_names() -> set[str]:
    """The names under which torch_optimizer exports an optimizer class."""
    return {
        name
        for name in torch_optimizer.__all__
        if isinstance(obj := getattr(torch_optimizer, name), type) and issubclass(obj, Optimizer)
    }


def _torch_optim_names() -> set[str]:
    """The optimizer classes torch.optim exposes, the abstract base excluded."""
    return {
        name
        for name, obj in vars(torch.optim).items()
        if isinstance(obj, type) and issubclass(obj, Optimizer) and obj is not Optimizer
    }


def _base_name(case_id: str) -> str:
    return case_id.split("-", 1)[0]


# Only the optimizers this torch has: Muon came in 2.9, Adafactor in 2.5.
TORCH_CASES = {
    name: case for name, case in _torch_cases().items() if hasattr(torch.optim, _base_name(name))
}
TORCH_OPTIMIZER_CASES = _torch_optimizer_cases()


@dataclass
class Run:
    """What one training run leaves behind."""

    params: list[Tensor]
    norms: list[Tensor]  # the pre-clip norm each step acted on


def _backward(model: nn.Module, case: Case) -> Tensor:
    loss = _loss(model, case.model)
    loss.backward(create_graph=case.create_graph)
    return loss


def _step(opt: Optimizer, closure: Callable[[], Tensor], with_closure: bool) -> None:
    """One step: the closure handed to ``step``, or evaluated first and ``step()`` bare."""
    if with_closure:
        opt.step(closure)
    else:
        closure()
        opt.step()


def _train_by_hand(case: Case) -> Run:
    """The reference: the bare optimizer, clipped with clip_grad_norm_ before each step."""
    torch.manual_seed(0)
    model = _build_model(case.model)
    opt = case.make(_params(model))
    evaluations: list[Tensor] = []  # one norm per closure evaluation

    def closure() -> Tensor:
        opt.zero_grad()
        loss = _backward(model, case)
        evaluations.append(clipopt.clip_grad_norm_(model.parameters(), MAX_NORM))
        return loss.detach()

    norms: list[Tensor] = []
    for _ in range(STEPS):
        _step(opt, closure, case.closure)
        norms.append(evaluations[-1])
    return Run([p.detach().clone() for p in model.parameters()], norms)


def _train_wrapped(case: Case) -> Run:
    torch.manual_seed(0)
    model = _build_model(case.model)
    opt = clipopt.ClippedOptimizer(case.make(_params(model)), max_norm=MAX_NORM)

    def closure() -> Tensor:
        opt.zero_grad()
        return _backward(model, case).detach()

    norms: list[Tensor] = []
    for _ in range(STEPS):
        _step(opt, closure, case.closure)
        assert opt.last_norm is not None
        norms.append(opt.last_norm.clone())
    return Run([p.detach().clone() for p in model.parameters()], norms)


def _assert_same_run(case: Case, reference: Run) -> None:
    assert all(bool(n > MAX_NORM) for n in reference.norms), "the problem must clip every step"
    wrapped = _train_wrapped(case)
    # Same kernels on the same grads in the same order: equality is bit for bit, except
    # that a fused inner optimizer gets the clip folded into its kernel as grad_scale =
    # 1 / coefficient (clipopt._step._fold), and g / (1 / c) may differ from g * c in the last bit.
    folded = bool(case.make([nn.Parameter(torch.zeros(2, 2))]).defaults.get("fused"))
    tolerance = {"rtol": 1e-6, "atol": 1e-7} if folded else {"rtol": 0.0, "atol": 0.0}
    for ours, theirs in zip(wrapped.norms, reference.norms, strict=True):
        torch.testing.assert_close(ours, theirs, **tolerance)
    for ours, theirs in zip(wrapped.params, reference.params, strict=True):
        torch.testing.assert_close(ours, theirs, **tolerance)


def _reference_or_skip(name: str, case: Case) -> Run:
    """The hand-clipped run; skip, quoting its error, only if the bare optimizer fails here."""
    try:
        return _train_by_hand(case)
    except Exception as exc:  # the optimizer itself is broken on this torch, not clipopt
        pytest.skip(f"{name} fails without clipopt on torch {torch.__version__}: {exc!r}")


def test_every_torch_optimizer_has_a_case() -> None:
    assert {_base_name(c) for c in TORCH_CASES} == _torch_optim_names()


def test_every_torch_optimizer_optimizer_has_a_case() -> None:
    assert set(TORCH_OPTIMIZER_CASES) == _torch_optimizer_names()


@pytest.mark.parametrize("name", sorted(TORCH_CASES))
def test_torch_optimizer_matches_clip_by_hand(name: str) -> None:
    case = TORCH_CASES[name]
    _assert_same_run(case, _train_by_hand(case))


@pytest.mark.parametrize("name", sorted(TORCH_OPTIMIZER_CASES))
def test_torch_optimizer_package_matches_clip_by_hand(name: str) -> None:
    case = TORCH_OPTIMIZER_CASES[name]
    _assert_same_run(case, _reference_or_skip(name, case))


def test_lbfgs_clips_every_closure_evaluation() -> None:
    """LBFGS evaluates the closure several times per step; it must see clipped grads each time."""
    torch.manual_seed(0)
    model = _build_model("mlp")
    inner = torch.optim.LBFGS(_params(model), lr=0.5, max_iter=4)
    gather = inner._gather_flat_grad
    seen_norms: list[Tensor] = []

    def recording_gather() -> Tensor:  # LBFGS reads the grads through this after each closure
        flat = gather()
        seen_norms.append(torch.linalg.vector_norm(flat.double()))
        return flat

    inner._gather_flat_grad = recording_gather  # type: ignore[method-assign]
    opt = clipopt.ClippedOptimizer(inner, max_norm=MAX_NORM)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = _loss(model, "mlp")
        loss.backward()
        return loss.detach()

    opt.step(closure)
    assert len(seen_norms) > 1, "LBFGS should have evaluated the closure more than once"
    for norm in seen_norms:
        assert norm <= MAX_NORM * (1 + 1e-5)
