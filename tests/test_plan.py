"""Kept plans (``clipopt/_kernels/_plan.py``): reused while the grads' metadata holds, remade on
any change, and every clip exact either way.

Each test clips, changes something between clips, and clips again; after every clip
the norm is checked against a float64 norm computed here and the grads against what
``torch.nn.utils.clip_grad_norm_`` leaves on copies of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor, nn

import clipopt
from clipopt import _torch_internals
from clipopt._kernels import _cpu, _plan

MAX_NORM = 0.5


@pytest.fixture
def plans() -> Iterator[list[_plan.Plan]]:
    """The plans kept during the test: only guarded ones are, so none without a guard."""
    if not _torch_internals.available()["TensorGuards"]:
        pytest.skip("plans are kept only with torch's TensorGuards; this run has none")
    with _plan.kept() as kept:
        yield kept


def make_params(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(len(shapes))
    params = []
    for shape in shapes:
        p = nn.Parameter(torch.randn(shape, generator=generator, dtype=dtype))
        p.grad = torch.randn(shape, generator=generator, dtype=dtype) * 3
        params.append(p)
    return params


def reference_norm(params: list[nn.Parameter], p: float = 2.0) -> float:
    """The p-norm of every grad element, in float64."""
    grads = [q.grad for q in params if q.grad is not None]
    if not grads:
        return 0.0
    values = torch.cat([g.double().to_dense().abs().reshape(-1) for g in grads])
    if p == math.inf:
        return values.max().item()
    return values.pow(p).sum().pow(1.0 / p).item()


def clip_and_check(params: list[nn.Parameter], p: float = 2.0) -> None:
    """clipopt's clip against torch's on copies, and its norm against float64."""
    copies = [nn.Parameter(torch.zeros(q.shape, dtype=q.dtype)) for q in params]
    for copy, q in zip(copies, params, strict=True):
        if q.grad is not None:
            copy.data = torch.zeros(q.grad.shape, dtype=q.grad.dtype)
            copy.grad = q.grad.clone()
    expected = reference_norm(params, p)
    if any(q.grad is not None and q.grad.is_sparse for q in params):  # torch refuses these
        for copy in copies:
            if copy.grad is not None:
                copy.grad = copy.grad * min(1.0, MAX_NORM / (expected + 1e-6))
    else:
        torch_norm = torch.nn.utils.clip_grad_norm_(copies, MAX_NORM, p)
        assert torch_norm.item() == pytest.approx(expected, rel=1e-5)
    got = clipopt.clip_grad_norm_(params, MAX_NORM, p)
    assert got.item() == pytest.approx(expected, rel=1e-6)
    for q, copy in zip(params, copies, strict=True):
        if q.grad is None:
            assert copy.grad is None
        else:
            torch.testing.assert_close(q.grad.to_dense(), copy.grad.to_dense(), rtol=1e-5, atol=0)


def rescale(params: list[nn.Parameter]) -> None:
    """Grads back above MAX_NORM, so that the next clip scales again."""
    with torch.no_grad():
        for q in params:
            if q.grad is not None:
                q.grad.mul_(100.0)


def planned_twice(params: list[nn.Parameter], plans: list[_plan.Plan]) -> _plan.Plan:
    """Clip twice (an unguarded plan, then a kept one) and return the kept plan."""
    for _ in range(2):
        clip_and_check(params)
        rescale(params)
    assert len(plans) == 1
    return plans[0]


def test_same_metadata_reuses_the_plan_even_with_new_grads(plans: list[_plan.Plan]) -> None:
    """zero_grad(set_to_none=True) makes new grads, at new addresses: the same plan."""
    params = make_params((30, 7), (5,), (4, 4, 2))
    first = planned_twice(params, plans)
    for _ in range(3):
        for q in params:
            assert q.grad is not None
            q.grad = torch.randn_like(q.grad) * 5
        clip_and_check(params)
        assert plans[0] is first


def test_new_storage_under_the_same_grad_is_read(plans: list[_plan.Plan]) -> None:
    """A plan keeps no address: a grad given other memory (``.data =``) is read there."""
    params = make_params((100,), (20, 5))
    first = planned_twice(params, plans)
    grad = params[1].grad
    assert grad is not None
    grad.data = torch.full((20, 5), 7.0)
    clip_and_check(params)
    assert plans[0] is first
    assert params[1].grad is grad


def test_a_plan_of_plain_grads_reads_their_addresses_in_c(plans: list[_plan.Plan]) -> None:
    """Plain strided grads get a plan whose runs read addresses by torch's C function."""
    params = make_params((30, 7), (5,))
    first = planned_twice(params, plans)
    assert first.plain
    groups = _plan.group([q.grad for q in params if q.grad is not None])
    run, _ = groups.split((torch.device("cpu"), torch.float32))
    assert run.plain


@pytest.mark.skipif(not _cpu.available(), reason="the C reader is used only with the C kernel")
def test_tensors_without_storage_raise_planned_or_not(plans: list[_plan.Plan]) -> None:
    """MKL-DNN tensors are strided-looking torch.Tensors without storage: torch's C reader
    would abort the process on them, so their plan is not plain and every clip raises the
    data_ptr method's RuntimeError, the first (unplanned) and the later (planned) ones."""
    tensors = [torch.ones(4).to_mkldnn(), torch.ones(3).to_mkldnn()]
    for _ in range(3):
        with pytest.raises(RuntimeError, match="storage"):
            clipopt.get_total_norm(tensors)
    assert plans and not any(plan.plain for plan in plans)


def test_a_subclass_grad_makes_the_plan_not_plain(plans: list[_plan.Plan]) -> None:
    class Marked(Tensor):
        pass

    grads = [torch.randn(5), torch.randn(7).as_subclass(Marked)]
    expected = torch.cat([g.reshape(-1) for g in grads]).double().norm().item()
    for _ in range(3):
        assert clipopt.get_total_norm(grads).item() == pytest.approx(expected, rel=1e-6)
    assert plans and not plans[0].plain


Change = Callable[[list[nn.Parameter]], list[nn.Parameter]]


def _add_param(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return [*params, *make_params((9,))]


def _double_grad(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The first parameter replaced by a double one."""
    return [*make_params(params[0].shape, dtype=torch.float64), *params[1:]]


def _double_in_place(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The same grad object, its dtype changed under it."""
    assert params[0].grad is not None
    params[0].grad.data = params[0].grad.data.double()
    return params


def _grad_to_none(params: list[nn.Parameter]) -> list[nn.Parameter]:
    params[1].grad = None
    return params


def _all_grads_to_none(params: list[nn.Parameter]) -> list[nn.Parameter]:
    for q in params:
        q.grad = None
    return params


def _non_contiguous(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Same shape and dtype, strides with gaps (the C kernel must not read it flat)."""
    wide = torch.randn(10, 48) * 3
    params[2].grad = wide[:, ::4]
    return params


def _transposed(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Same shape, other strides: dense in memory, in another order."""
    params[2].grad = (torch.randn(12, 10) * 3).t()
    return params


def _transposed_in_place(params: list[nn.Parameter]) -> list[nn.Parameter]:
    grad = params[3].grad
    assert grad is not None
    grad.t_()  # a square grad: same shape, strides swapped
    return params


def _resized_in_place(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The same grad object and address, fewer elements."""
    grad = params[0].grad
    assert grad is not None
    params[0].data = params[0].data[:50]
    grad.resize_(50)
    return params


def _sparse(params: list[nn.Parameter]) -> list[nn.Parameter]:
    params[1].grad = (torch.randn(params[1].shape) * 3).to_sparse()
    return params


def _conjugate_bit(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """A grad that is a negative view: a dispatch key of its own."""
    grad = params[0].grad
    assert grad is not None
    params[0].grad = grad.clone()._neg_view()
    return params


def _requires_grad(params: list[nn.Parameter]) -> list[nn.Parameter]:
    grad = params[0].grad
    assert grad is not None
    params[0].grad = grad.clone().requires_grad_()
    return params


def _shape(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Another parameter list of the same length, other shapes."""
    return make_params((7,), (3, 3), (12, 10), (6, 6))


CHANGES: dict[str, Change] = {
    "a param added": _add_param,
    "a dtype changed": _double_grad,
    "a dtype changed under the same grad": _double_in_place,
    "a grad set to None": _grad_to_none,
    "every grad set to None": _all_grads_to_none,
    "a grad replaced by a non-contiguous one": _non_contiguous,
    "a grad replaced by a transposed one": _transposed,
    "a grad transposed in place": _transposed_in_place,
    "a grad resized in place": _resized_in_place,
    "a grad made sparse": _sparse,
    "a grad made a negative view": _conjugate_bit,
    "a grad that requires grad": _requires_grad,
    "other shapes": _shape,
}


@pytest.mark.parametrize("name", list(CHANGES))
@pytest.mark.parametrize("p", [2.0, math.inf])
def test_any_change_remakes_the_plan(name: str, p: float, plans: list[_plan.Plan]) -> None:
    if name == "a grad made a negative view" and not _cpu.available():
        pytest.skip("torch's _foreach_mul_ refuses negative views; the C scale reads memory")
    params = make_params((100,), (20, 5), (10, 12), (6, 6))
    first = planned_twice(params, plans)
    with torch.no_grad():
        params = CHANGES[name](params)
    grads = [q.grad for q in params if q.grad is not None]
    assert not first.fits(grads, torch.is_inference_mode_enabled())
    for _ in range(3):  # the new metadata planned, then its plan kept and reused
        clip_and_check(params, p)
        rescale(params)
    if grads and not any(g.is_sparse for g in grads):
        assert plans[0] is not first
        assert plans[0].fits(grads, torch.is_inference_mode_enabled())


def test_an_inference_grad_swapped_in_is_still_refused(plans: list[_plan.Plan]) -> None:
    params = make_params((100,), (20, 5))
    planned_twice(params, plans)
    with torch.inference_mode():
        params[1].grad = torch.full((20, 5), 5.0)
    with pytest.raises(RuntimeError, match="inference tensor"):
        clipopt.clip_grad_norm_(params, MAX_NORM)
    assert torch.equal(params[1].grad, torch.full((20, 5), 5.0))


def test_plans_kept_are_bounded(plans: list[_plan.Plan]) -> None:
    for width in range(1, _plan.CAPACITY + 4):
        params = make_params((width,), (width, 2))
        for _ in range(2):
            clip_and_check(params)
    assert len(plans) == _plan.CAPACITY


def _grads_changed_between_steps(step: int, params: list[nn.Parameter], gaps: bool) -> None:
    """What changes before each wrapper step: nothing, new grads, a dtype, a None, gaps
    (if ``gaps``: torch 2.13's fused CPU SGD misreads a grad with gaps, with or without
    clipopt)."""
    if step == 3:
        params[0].grad = torch.randn_like(params[0]) * 4  # new object, same metadata
    elif step == 4:
        params[1].data = params[1].data.double()
        params[1].grad = torch.randn_like(params[1]) * 4
    elif step == 5:
        params[2].grad = None
    elif step == 6 and gaps:
        params[2].grad = (torch.randn(10, 48) * 4)[:, ::4]


@pytest.mark.parametrize("fused", [False, True])
def test_the_wrapper_clips_exactly_through_every_change(
    fused: bool, plans: list[_plan.Plan]
) -> None:
    """ClippedOptimizer's steps, grads changed between them, against torch's clip + SGD."""
    params = make_params((100,), (20, 5), (10, 12))
    twins = [nn.Parameter(q.detach().clone()) for q in params]
    kwargs = {"fused": True} if fused else {}
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.1, **kwargs), max_norm=MAX_NORM)
    bare = torch.optim.SGD(twins, lr=0.1, **kwargs)
    for step in range(8):
        _grads_changed_between_steps(step, params, gaps=not fused)
        for twin, q in zip(twins, params, strict=True):
            twin.data = twin.data.to(q.dtype)
            twin.grad = None if q.grad is None else q.grad.clone()
        expected = reference_norm(params)
        torch.nn.utils.clip_grad_norm_(twins, MAX_NORM)
        bare.step()
        opt.step()
        assert opt.last_norm is not None
        assert opt.last_norm.item() == pytest.approx(expected, rel=1e-6)
        for q, twin in zip(params, twins, strict=True):
            torch.testing.assert_close(q.detach(), twin.detach(), rtol=1e-5, atol=1e-7)
        rescale(params)


def test_no_plan_is_kept_while_compiling() -> None:
    """torch.compile traces the planning: nothing is kept from inside a graph."""
    params = make_params((16,), (4, 4))
    grads = [q.grad for q in params if q.grad is not None]

    @torch.compile(backend="eager", fullgraph=True)
    def norm(tensors: list[Tensor]) -> Tensor:
        return clipopt.get_total_norm(tensors)

    with _plan.kept() as kept:
        for _ in range(3):
            got = norm(grads)
        assert kept == []
    assert got.item() == pytest.approx(reference_norm(params), rel=1e-6)
