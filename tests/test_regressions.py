"""Regression cases from the hand-written clipping code clipopt replaced.

That code (kept below, comments translated, as ``note_total_norm`` and
``note_clip_grad_norm``) iterates ``parameters`` twice, so a generator is exhausted
before anything is scaled; reads ``p.grad`` of parameters without grads in its inf-norm
branch; returns a Python float when there are no grads; and branches in Python on a
tensor (``if clip_coef < 1``), which waits for the device. Each test checks clipopt and
also shows that the same check catches the old code, so the check can fail.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

import clipopt

Float64Norm = Callable[[Sequence[Tensor | None], float | str], float]
NoHostSync = Callable[[], contextlib.AbstractContextManager[None]]
NORM_TYPES = [1, 2.0, 3.5, math.inf, "inf"]


def note_total_norm(parameters: Iterable[Tensor], norm_type: float = 2) -> Any:
    """The old hand-written total norm, as it was."""
    if isinstance(norm_type, float) and norm_type == float("inf"):
        total_norm = max(p.grad.detach().abs().max() for p in parameters)
    else:
        total_norm = 0.0
        for p in filter(lambda p: p.grad is not None, parameters):  # only params with grads
            param_norm = p.grad.detach().data.norm(norm_type)
            total_norm += param_norm**norm_type  # accumulate the p-th powers
        total_norm = total_norm ** (1.0 / norm_type)  # take the root
    return total_norm


def note_clip_grad_norm(parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2) -> Any:
    """The old hand-written clip, as it was."""
    total_norm = note_total_norm(parameters, norm_type)  # the total norm first
    clip_coef = max_norm / (total_norm + 1e-6)  # a small constant against division by zero
    if clip_coef < 1:  # scale only when the grads are too large
        for p in parameters:
            if p.grad is not None:
                p.grad.data.mul_(clip_coef)
    return total_norm


def model_with_grads(seed: int = 0, scale: float = 100.0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(10, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    model[2].bias.requires_grad_(False)  # a parameter that never gets a grad
    (model(torch.randn(4, 10)).sum() * scale).backward()
    return model


def grads_of(model: torch.nn.Module) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


# --- A generator is consumed once -------------------------------------------------------


Clip = Callable[[Iterator[torch.nn.Parameter], float, Any], object]


def clips_a_generator(clip: Clip, norm_type: float | str) -> None:
    """Clipping ``model.parameters()`` (a generator) scales the grads, as a list does."""
    from_generator, from_list = model_with_grads(), model_with_grads()
    clip(from_generator.parameters(), 1.0, norm_type)
    clipopt.clip_grad_norm_(list(from_list.parameters()), 1.0, norm_type)
    for a, b in zip(grads_of(from_generator), grads_of(from_list), strict=True):
        assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_a_generator_of_parameters_is_consumed_once(norm_type: float | str) -> None:
    clips_a_generator(clipopt.clip_grad_norm_, norm_type)
    generator_norm = clipopt.get_total_norm(p.grad for p in model_with_grads().parameters())
    list_norm = clipopt.get_total_norm([p.grad for p in model_with_grads().parameters()])
    assert torch.equal(generator_norm, list_norm)
    model = model_with_grads()
    before = grads_of(model)
    clipped, _ = clipopt.clip_grad_norm(model.parameters(), 1.0, norm_type)
    assert len(clipped) == len(before) and clipped[-1] is None and clipped[0] is not None
    assert not torch.equal(clipped[0], before[0])


def test_the_generator_check_catches_a_second_pass() -> None:
    with pytest.raises(AssertionError):
        clips_a_generator(note_clip_grad_norm, 2.0)


def test_other_entry_points_consume_a_generator_once() -> None:
    model, reference = model_with_grads(), model_with_grads()
    total = clipopt.get_total_norm([p.grad for p in model.parameters()])
    clipopt.clip_grads_with_norm_(model.parameters(), 1.0, total)
    clipopt.clip_grads_with_norm_(list(reference.parameters()), 1.0, total)
    assert all(
        a is None or torch.equal(a, b)
        for a, b in zip(grads_of(model), grads_of(reference), strict=True)
    )
    clipopt.clip_grad_value_(model.parameters(), 1e-3)
    assert all(g is None or bool(g.abs().max() <= 1e-3) for g in grads_of(model))


# --- None grads, for every norm type ----------------------------------------------------


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_parameters_without_grads_are_skipped(
    norm_type: float | str, float64_norm: Float64Norm
) -> None:
    model = model_with_grads()
    grads = grads_of(model)
    assert grads[-1] is None
    norm = clipopt.clip_grad_norm_(model.parameters(), 1.0, norm_type)
    assert math.isclose(float(norm), float64_norm(grads, norm_type), rel_tol=1e-6)
    assert next(reversed(list(model.parameters()))).grad is None


def test_the_old_inf_norm_reads_missing_grads() -> None:
    with pytest.raises(AttributeError):
        note_total_norm(list(model_with_grads().parameters()), math.inf)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_no_grads_at_all_gives_a_zero_tensor(norm_type: float | str) -> None:
    params = list(torch.nn.Linear(3, 2).parameters())
    norm = clipopt.clip_grad_norm_(params, 1.0, norm_type)
    assert isinstance(norm, Tensor) and torch.equal(norm, torch.tensor(0.0))
    assert all(p.grad is None for p in params)
    assert not isinstance(note_total_norm(params, 2.0), Tensor)  # the old code: 0.0


# --- No host sync in the step path ------------------------------------------------------


def sync_free_grads() -> list[torch.nn.Parameter]:
    """Every layout the kernels handle: dtypes, large, strided, sparse, complex, None."""
    generator = torch.Generator().manual_seed(0)
    dense = [
        torch.randn(7, 3, generator=generator),
        torch.randn(20_000, generator=generator),
        torch.randn(300, generator=generator).half(),
        torch.randn(9000, generator=generator).bfloat16(),
        torch.randn(5, 4, generator=generator, dtype=torch.float64).t(),
        torch.randn(6, generator=generator, dtype=torch.complex64),
        torch.zeros(0),
    ]
    indices = torch.tensor([[0, 3, 0]])
    sparse = torch.sparse_coo_tensor(indices, torch.ones(3, 2), (5, 2), check_invariants=True)
    params = []
    for grad in [*dense, sparse, None]:
        like = torch.zeros(2) if grad is None else torch.zeros_like(grad.to_dense())
        param = torch.nn.Parameter(like)
        param.grad = grad
        params.append(param)
    return params


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("max_norm", [1e-3, 1e6, torch.tensor(0.5)], ids=repr)
def test_the_step_path_never_reads_a_tensor_on_the_host(
    norm_type: float | str,
    foreach: bool | None,
    max_norm: float | Tensor,
    no_host_sync: NoHostSync,
) -> None:
    params, reference = sync_free_grads(), sync_free_grads()
    with no_host_sync():
        norm = clipopt.clip_grad_norm_(
            params, max_norm, norm_type, error_if_nonfinite=False, foreach=foreach
        )
        total = clipopt.get_total_norm([p.grad for p in reference], norm_type, foreach=foreach)
        clipopt.clip_grads_with_norm_(reference, max_norm, total, foreach=foreach)
        clipped, _ = clipopt.clip_grad_norm(reference, max_norm, norm_type, foreach=foreach)
    assert torch.equal(norm, total)  # and the guarded calls did their work
    for p, q, copy in zip(params, reference, clipped, strict=True):
        if p.grad is not None and q.grad is not None and copy is not None:
            assert torch.equal(p.grad.to_dense(), q.grad.to_dense())


def test_error_if_nonfinite_is_the_one_documented_sync(no_host_sync: NoHostSync) -> None:
    params = list(model_with_grads().parameters())
    with no_host_sync(), pytest.raises(AssertionError, match="host sync"):
        clipopt.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


# --- The three examples of the original reference page ----------------------------------

PAGE_EXAMPLES = [(0, 1.0, 1.0, 2.0), (42, 100.0, 1.0, 2.0), (7, 50.0, 2.0, math.inf)]
"""(seed, loss scale, max_norm, norm_type). The page printed 0.8408, 8.6087 and 1.0480,
which no version of these computations gives; docs/functional.md prints the real values."""


@pytest.mark.parametrize(("seed", "scale", "max_norm", "norm_type"), PAGE_EXAMPLES)
def test_reference_page_examples_measure_like_torch_and_leave_grads(
    seed: int, scale: float, max_norm: float, norm_type: float, float64_norm: Float64Norm
) -> None:
    torch.manual_seed(seed)
    model = torch.nn.Linear(10, 5)
    (model(torch.randn(1, 10)).sum() * scale).backward()
    before = grads_of(model)
    clipped, norm = clipopt.clip_grad_norm(model.parameters(), max_norm, norm_type)
    assert torch.equal(norm, torch.nn.utils.get_total_norm(before, norm_type))
    assert math.isclose(float(norm), float64_norm(before, norm_type), rel_tol=1e-6)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before, strict=True))
    assert float(norm) > max_norm  # each example clips
    assert math.isclose(float64_norm(clipped, norm_type), max_norm, rel_tol=1e-5)
