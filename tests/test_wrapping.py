"""Wrapping is transparent to the inner optimizer: its keys stay its own, and what it loads
bare it loads wrapped.

The round trips run over every ``torch.optim`` optimizer and every optimizer of
``pytorch_optimizer`` that builds with its default arguments: a wrapped and a bare twin
take the same steps (``max_norm=inf`` measures and scales nothing, so they see the same
grads), save, load into fresh twins, and must agree on whether the load works and on
every entry of the inner state afterwards.
"""

from __future__ import annotations

import collections
import copy
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import pytorch_optimizer
import torch
from helpers import assert_same
from pytorch_optimizer.optimizer.scion import LMONorm
from torch import nn
from torch.optim import Optimizer

import clipopt

CLIP_GROUP_KEYS = ("clip_max_norm", "clip_norm_type")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


# --- Keys that belong to the inner optimizer --------------------------------------------


def test_an_optimizers_own_norm_type_is_neither_read_nor_changed() -> None:
    w = nn.Parameter(torch.zeros(2, 2))
    inner = pytorch_optimizer.SCION([w])
    own = inner.param_groups[0]["norm_type"]
    opt = clipopt.ClippedOptimizer(inner, max_norm=1.0)
    w.grad = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    opt.step()
    assert opt.last_norm is not None
    torch.testing.assert_close(opt.last_norm, torch.tensor(5.0))  # the 2-norm, not SCION's
    assert inner.param_groups[0]["norm_type"] is own
    assert inner.defaults["norm_type"] is own


def test_scions_documented_two_group_set_up_is_wrapped() -> None:
    body, head = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(3, 4))
    groups = [
        {"params": [body], "norm_type": LMONorm.SPECTRAL, "scale": 50.0},
        {"params": [head], "norm_type": LMONorm.SIGN, "scale": 3000.0},
    ]
    opt = clipopt.ClippedOptimizer(pytorch_optimizer.SCION(groups), max_norm=0.5)
    body.grad, head.grad = torch.full((4, 4), 1.0), torch.full((3, 4), 2.0)
    grads = [body.grad.clone(), head.grad.clone()]
    opt.step()
    expected = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    assert opt.last_norm is not None and math.isclose(float(opt.last_norm), expected, rel_tol=1e-6)
    assert [g["norm_type"] for g in opt.param_groups] == [LMONorm.SPECTRAL, LMONorm.SIGN]
    clipped = math.sqrt(sum(float(p.grad.double().square().sum()) for p in (body, head)))
    assert math.isclose(clipped, 0.5, rel_tol=1e-5)


def test_a_max_norm_key_the_optimizer_owns_is_left_alone() -> None:
    class OwnsMaxNorm(torch.optim.SGD):
        def __init__(self, params: Any) -> None:
            super().__init__(params, lr=0.1)
            self.defaults["max_norm"] = "mine"
            for group in self.param_groups:
                group["max_norm"] = "mine"

    w = nn.Parameter(torch.zeros(2))
    opt = clipopt.ClippedOptimizer(OwnsMaxNorm([w]), max_norm=1.0)
    w.grad = torch.tensor([3.0, 4.0])
    opt.step()
    assert opt.param_groups[0]["max_norm"] == "mine" and opt.defaults["max_norm"] == "mine"
    torch.testing.assert_close(w.grad, torch.tensor([0.6, 0.8]))


# --- Round trips over every optimizer ----------------------------------------------------


def _torch_optimizers() -> dict[str, Callable[[list[nn.Parameter]], Optimizer]]:
    makers: dict[str, Callable[[list[nn.Parameter]], Optimizer]] = {}
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if isinstance(cls, type) and issubclass(cls, Optimizer) and cls is not Optimizer:
            makers[f"torch.{name}"] = cls
    return makers


def _pytorch_optimizer_optimizers() -> dict[str, Callable[[list[nn.Parameter]], Optimizer]]:
    makers: dict[str, Callable[[list[nn.Parameter]], Optimizer]] = {}
    for name in pytorch_optimizer.get_supported_optimizers():
        cls = pytorch_optimizer.load_optimizer(name)
        try:
            cls(_params(0))
        except Exception:  # some need arguments or other packages: not in scope
            continue
        makers[f"pytorch_optimizer.{name}"] = cls
    return makers


def _params(seed: int, matrices_only: bool = False) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(4, 3), (3, 2)] if matrices_only else [(4, 3), (3,)]
    return [nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def _set_grads(params: list[nn.Parameter], step: int, sparse: bool) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for p in params:
        grad = torch.randn(p.shape, generator=generator)
        p.grad = grad.to_sparse() if sparse else grad


def _train(opt: Optimizer, params: list[nn.Parameter], sparse: bool, steps: int) -> bool:
    """Take ``steps`` steps, with a closure where the optimizer needs one; False if it
    cannot step on this problem at all (it is then compared on a fresh state). The global
    seeds are fixed first: some optimizers draw random numbers in their steps (Kron
    decides its preconditioner balancing by numpy's global generator)."""
    torch.manual_seed(0)
    np.random.seed(0)
    for step in range(steps):
        _set_grads(params, step, sparse)

        def closure(step: int = step) -> torch.Tensor:
            _set_grads(params, step, sparse)
            return torch.stack([p.detach().square().sum() for p in params]).sum()

        try:
            opt.step(closure)
        except Exception:  # the bare optimizer's own limits, wrapped or not
            return False
    return True


def _plain(value: Any) -> Any:
    """``value`` made comparable: deques (a queue of past grads) as lists, helper objects
    (preconditioners, projectors) as their attributes, and the wrapper's group keys gone,
    at any depth (some optimizers nest a base optimizer's dict)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k not in CLIP_GROUP_KEYS}
    if isinstance(value, (list, tuple, collections.deque)):
        return [_plain(v) for v in value]
    if hasattr(value, "__dict__") and not isinstance(value, (torch.Tensor, type)):
        return (type(value).__name__, _plain(vars(value)))
    return value


def _inner_part(state_dict: dict[str, Any]) -> Any:
    """A state dict without the wrapper's entry and group keys, to compare with the bare one."""
    return _plain({k: v for k, v in state_dict.items() if k != "clip"})


MAKERS = {**_torch_optimizers(), **_pytorch_optimizer_optimizers()}


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_what_loads_bare_loads_wrapped_and_the_same(name: str) -> None:
    make = MAKERS[name]
    sparse = name == "torch.SparseAdam"
    matrices = name == "torch.Muon"  # it refuses parameters of other dims
    wrapped_params, bare_params = _params(0, matrices), _params(0, matrices)
    wrapped = clipopt.ClippedOptimizer(make(wrapped_params), max_norm=math.inf)
    bare = make(bare_params)
    stepped = _train(bare, bare_params, sparse, steps=2)
    assert _train(wrapped, wrapped_params, sparse, steps=2) == stepped
    assert_same(_inner_part(wrapped.state_dict()), _inner_part(bare.state_dict()))

    saved_wrapped, saved_bare = (
        copy.deepcopy(wrapped.state_dict()),
        copy.deepcopy(bare.state_dict()),
    )
    fresh_wrapped_params, fresh_bare_params = _params(1, matrices), _params(1, matrices)
    fresh_wrapped = clipopt.ClippedOptimizer(make(fresh_wrapped_params), max_norm=math.inf)
    fresh_bare = make(fresh_bare_params)
    try:
        fresh_bare.load_state_dict(saved_bare)
    except Exception as error:  # then the wrapper must refuse it just the same
        with pytest.raises(type(error)):
            fresh_wrapped.load_state_dict(saved_wrapped)
        return
    fresh_wrapped.load_state_dict(saved_wrapped)
    assert_same(_inner_part(fresh_wrapped.state_dict()), _inner_part(fresh_bare.state_dict()))
    if stepped:
        for p, q in zip(fresh_wrapped_params, fresh_bare_params, strict=True):
            with torch.no_grad():
                p.copy_(q)
        _train(fresh_bare, fresh_bare_params, sparse, steps=1)
        _train(fresh_wrapped, fresh_wrapped_params, sparse, steps=1)
        for p, q in zip(fresh_wrapped_params, fresh_bare_params, strict=True):
            assert torch.equal(p, q), name


def test_the_round_trips_cover_the_optimizers_named_in_the_reliability_issue() -> None:
    for name in ("madgrad", "spam", "magma", "scion", "scionlight"):
        assert f"pytorch_optimizer.{name}" in MAKERS


# --- Inner state that would break the next step -------------------------------------------


def test_a_state_tensor_of_the_wrong_shape_is_refused_and_changes_nothing() -> None:
    params = _params(0)
    opt = clipopt.ClippedOptimizer(torch.optim.Adam(params, lr=0.1), max_norm=1.0)
    _train(opt, params, sparse=False, steps=1)
    bad = copy.deepcopy(opt.state_dict())
    bad["state"][1]["exp_avg"] = torch.zeros(4)  # the bias has 3 elements
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"'exp_avg'.*\['params'\]\[1\].*\(4,\).*\(3,\)"):
        opt.load_state_dict(bad)
    assert_same(opt.state_dict(), before)
    _train(opt, params, sparse=False, steps=1)  # and it still steps
