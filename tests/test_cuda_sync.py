"""Every CUDA step path, run under ``torch.cuda.set_sync_debug_mode("error")``.

For each path ``ClippedOptimizer`` can take on CUDA (the explicit foreach scale,
``foreach=False``, the clip folded into fused AdamW, Adam and SGD through
``grad_scale``/``found_inf``, ``per_group``, a tensor ``max_norm``, bfloat16 grads, the
adaptive clip rules, SpikeSkip on a fused optimizer) and
each ``nonfinite`` policy that should not wait for the device (``"propagate"``; and
``"skip"`` where a fused kernel takes ``found_inf``), the second step runs with any
synchronizing CUDA call turned into an error. The first step is a warm-up: it moves the
counters onto the device and makes the optimizer state. The clipped grads are compared
with a float64 reference computed on the CPU, and the folded steps' parameters with the
explicit path's, to rounding.

The policies that read a flag on the host by design (``"raise"`` everywhere, ``"skip"``
on the explicit path) are checked to sync, so the detector is known to be live there.
The lagged skip count reads a pinned copy after ``Event.synchronize()``, which the sync
debug mode does not see: the test shows it raises at the documented step, not that the
event had completed.

Only the public API is used. Skipped where no GPU is present; ``make gpu-check`` runs it.
Without a GPU, ``tests/test_cuda_dryrun.py`` runs every setting's CUDA path on fake CUDA
tensors and catches each read of a CUDA value on the host; what it cannot see (a
blocking copy from pageable host memory, an event's real completion) and the values
are checked here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from helpers import sync_is_an_error
from torch import Tensor, nn

import clipopt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = [(7,), (300, 5), (20_000,), (64, 64), (1,)]
MAX_NORM = 1.0
EPS = 1e-6  # the clip's epsilon: min(1, max_norm / (norm + 1e-6))
SYNC_ERROR = "synchronizing CUDA operation"
MakeInner = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def make_params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [
        nn.Parameter((torch.randn(shape, generator=generator) * 0.1).to("cuda", dtype))
        for shape in SHAPES
    ]


def twin(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    return [nn.Parameter(p.detach().clone()) for p in params]


def set_grads(
    params: Sequence[nn.Parameter], seed: int, scale: float = 10.0, nan: bool = False
) -> list[Tensor]:
    """Fresh grads drawn on the device (nothing copied from the host); their float64 copy
    on the CPU (made here, before any checked block)."""
    generator = torch.Generator("cuda").manual_seed(seed)
    for p in params:
        grad = torch.randn(p.shape, generator=generator, device="cuda") * scale
        p.grad = grad.to(p.dtype)
    if nan:
        assert params[2].grad is not None
        params[2].grad[5] = math.nan
    return [p.grad.double().cpu() for p in params if p.grad is not None]


def copy_grads(source: Sequence[nn.Parameter], target: Sequence[nn.Parameter]) -> None:
    for s, t in zip(source, target, strict=True):
        t.grad = None if s.grad is None else s.grad.clone()


def step_beside(
    opt: torch.optim.Optimizer,
    params: Sequence[nn.Parameter],
    ref: torch.optim.Optimizer,
    others: Sequence[nn.Parameter],
) -> list[Tensor]:
    """Two steps of ``opt`` beside ``ref`` on the same grads, the second with any sync an
    error (the first makes the optimizers' state); the float64 copy of its grads."""
    set_grads(params, seed=1)
    copy_grads(params, others)
    opt.step()
    ref.step()
    grads = set_grads(params, seed=2)
    copy_grads(params, others)
    with sync_is_an_error():
        opt.step()
    ref.step()
    return grads


def reference_norm(grads: Sequence[Tensor]) -> float:
    return float(torch.cat([g.reshape(-1) for g in grads]).norm())


def reference_clip(grads: Sequence[Tensor], max_norm: float = MAX_NORM) -> list[Tensor]:
    """The clipped grads in float64, from the grads as stored (already rounded)."""
    coef = min(1.0, max_norm / (reference_norm(grads) + EPS))
    return [g * coef for g in grads]


def grad_tolerance(dtype: torch.dtype) -> dict[str, float]:
    """``g * c`` and ``g / (1 / c)`` in the grad's dtype, against the exact product: the
    float32 coefficient's rounding, its reciprocal's and the product's; ``atol`` covers
    products that fall among the subnormals (float16's start at 6.1e-5)."""
    info = torch.finfo(dtype)
    return {"rtol": 4 * info.eps, "atol": 4 * info.eps * info.smallest_normal}


def assert_clipped(params: Sequence[nn.Parameter], expected: Sequence[Tensor]) -> None:
    for i, (p, want) in enumerate(zip(params, expected, strict=True)):
        assert p.grad is not None
        tolerance = grad_tolerance(p.grad.dtype)
        torch.testing.assert_close(p.grad.double().cpu(), want, **tolerance, msg=str(i))


def tensor_state(opt: torch.optim.Optimizer) -> dict[tuple[int, str], Tensor]:
    """Copies of every tensor in the optimizer state, keyed by parameter index and name."""
    params = [p for group in opt.param_groups for p in group["params"]]
    return {
        (i, key): value.detach().clone()
        for i, p in enumerate(params)
        for key, value in opt.state.get(p, {}).items()
        if isinstance(value, Tensor)
    }


def assert_norm(opt: clipopt.ClippedOptimizer, grads: Sequence[Tensor]) -> None:
    assert opt.last_norm is not None and opt.last_norm.device.type == "cuda"
    assert math.isclose(float(opt.last_norm), reference_norm(grads), rel_tol=1e-5)


def warm_then_check(
    opt: clipopt.ClippedOptimizer, params: Sequence[nn.Parameter], nan: bool = False
) -> list[Tensor]:
    """A warm-up step, then a step under the sync error mode; the checked step's grads
    (float64, CPU, as they were before it)."""
    set_grads(params, seed=1)
    opt.step()
    grads = set_grads(params, seed=2, nan=nan)
    with sync_is_an_error():
        opt.step()
    return grads


# ---------------------------------------------------------------- inner optimizers


def foreach_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)


def loop_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)


def fused_adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


def fused_adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2, fused=True)


def fused_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)


FUSED: dict[str, tuple[MakeInner, MakeInner]] = {
    # each fused optimizer, and its explicit (foreach) twin for the parameters
    "AdamW": (fused_adamw, lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True)),
    "Adam": (fused_adam, lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True)),
    "SGD": (fused_sgd, foreach_sgd),
}


# ---------------------------------------------------------------- explicit paths


@pytest.mark.parametrize(
    ("make", "foreach"),
    [(foreach_sgd, True), (foreach_sgd, None), (loop_sgd, False)],
    ids=["foreach=True", "foreach=None", "foreach=False"],
)
def test_explicit_step_never_syncs(make: MakeInner, foreach: bool | None) -> None:
    params = make_params()
    opt = clipopt.ClippedOptimizer(make(params), max_norm=MAX_NORM, foreach=foreach)
    grads = warm_then_check(opt, params)
    assert_clipped(params, reference_clip(grads))
    assert_norm(opt, grads)
    assert int(opt.step_count) == 2


@pytest.mark.parametrize("fused", [False, True], ids=["foreach SGD", "fused AdamW"])
def test_per_group_step_never_syncs(fused: bool) -> None:
    params = make_params()
    groups = [{"params": params[:2]}, {"params": params[2:], "clip_max_norm": 0.5}]
    inner = (
        torch.optim.AdamW(groups, lr=1e-2, fused=True)
        if fused
        else torch.optim.SGD(groups, lr=0.1, momentum=0.9, foreach=True)
    )
    opt = clipopt.ClippedOptimizer(inner, max_norm=MAX_NORM, per_group=True)
    grads = warm_then_check(opt, params)
    assert_clipped(params[:2], reference_clip(grads[:2], MAX_NORM))
    assert_clipped(params[2:], reference_clip(grads[2:], 0.5))
    assert opt.last_group_norms is not None
    expected = [reference_norm(grads[:2]), reference_norm(grads[2:])]
    for got, want in zip(opt.last_group_norms.tolist(), expected, strict=True):
        assert math.isclose(got, want, rel_tol=1e-5)


@pytest.mark.parametrize("where", ["cuda", "cpu"])
@pytest.mark.parametrize("make", [foreach_sgd, fused_adamw], ids=["foreach SGD", "fused AdamW"])
def test_tensor_max_norm_never_syncs(where: str, make: MakeInner) -> None:
    params = make_params()
    threshold = torch.tensor(0.75, device=where)
    inner = make(params)
    inner.param_groups[0]["clip_max_norm"] = threshold
    opt = clipopt.ClippedOptimizer(inner, max_norm=MAX_NORM)
    grads = warm_then_check(opt, params)
    assert_clipped(params, reference_clip(grads, 0.75))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("make", [foreach_sgd, fused_adamw], ids=["foreach SGD", "fused AdamW"])
def test_half_grads_step_never_syncs(dtype: torch.dtype, make: MakeInner) -> None:
    params = make_params(dtype)
    opt = clipopt.ClippedOptimizer(make(params), max_norm=MAX_NORM)
    grads = warm_then_check(opt, params)
    assert_clipped(params, reference_clip(grads))
    assert_norm(opt, grads)  # accumulated in float32, not in the grads' dtype


# ---------------------------------------------------------------- folded into fused kernels


@pytest.mark.parametrize("nonfinite", ["propagate", "skip"])
@pytest.mark.parametrize("name", list(FUSED))
def test_folded_step_never_syncs_and_matches_the_explicit_path(name: str, nonfinite: Any) -> None:
    fused, explicit = FUSED[name]
    params = make_params()
    others = twin(params)
    opt = clipopt.ClippedOptimizer(fused(params), max_norm=MAX_NORM, nonfinite=nonfinite)
    ref = clipopt.ClippedOptimizer(explicit(others), max_norm=MAX_NORM, nonfinite="propagate")
    grads = step_beside(opt, params, ref, others)
    assert_clipped(params, reference_clip(grads))  # the kernel wrote the clipped grads back
    assert_norm(opt, grads)
    for p, q in zip(params, others, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert int(opt.step_count) == 2 and int(opt.skip_count) == 0


@pytest.mark.parametrize("name", list(FUSED))
def test_folded_skip_of_a_nonfinite_norm_never_syncs(name: str) -> None:
    params = make_params()
    opt = clipopt.ClippedOptimizer(FUSED[name][0](params), max_norm=MAX_NORM, nonfinite="skip")
    set_grads(params, seed=1)
    opt.step()
    torch.cuda.synchronize()
    before = [p.detach().clone() for p in params]
    state = tensor_state(opt)
    assert state
    set_grads(params, seed=2, nan=True)
    grads = [p.grad.clone() for p in params if p.grad is not None]
    with sync_is_an_error():
        opt.step()
    assert int(opt.skip_count) == 1 and int(opt.step_count) == 1
    assert int(opt.consecutive_skips) == 1
    for p, was, grad in zip(params, before, grads, strict=True):
        assert torch.equal(p.detach(), was)
        assert p.grad is not None
        torch.testing.assert_close(p.grad, grad, rtol=0, atol=0, equal_nan=True)
    after = tensor_state(opt)
    assert after.keys() == state.keys()
    for key, value in state.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0, equal_nan=True)


def test_folded_bf16_step_never_syncs() -> None:
    params = make_params(torch.bfloat16)
    others = twin(params)
    opt = clipopt.ClippedOptimizer(fused_sgd(params), max_norm=MAX_NORM, nonfinite="skip")
    ref = clipopt.ClippedOptimizer(foreach_sgd(others), max_norm=MAX_NORM)
    grads = step_beside(opt, params, ref, others)
    assert_clipped(params, reference_clip(grads))
    assert_norm(opt, grads)
    # The explicit path rounds the clipped grad to bfloat16 before the update (and
    # before it enters the momentum); the kernel does not: a bfloat16 unit or two in the
    # last place of parameters under 1 (2**-8 between 0.5 and 1). The same comparison on
    # the CPU's fused SGD differs by up to 0.0054 after two steps.
    for p, q in zip(params, others, strict=True):
        torch.testing.assert_close(p, q, rtol=2**-6, atol=2**-7)


def test_lagged_skip_limit_raises_one_step_late_without_syncing() -> None:
    """With ``max_consecutive_skips=2`` on the folded path the limit is read from the
    previous step's copy of the count (a pinned buffer and a stream event): three steps
    skip, the fourth raises, and none of them makes a synchronizing call."""
    params = make_params()
    opt = clipopt.ClippedOptimizer(
        fused_adamw(params), max_norm=MAX_NORM, nonfinite="skip", max_consecutive_skips=2
    )
    set_grads(params, seed=1)
    opt.step()
    for step in range(3):
        set_grads(params, seed=10 + step, nan=True)
        with sync_is_an_error():
            opt.step()
    assert int(opt.skip_count) == 3 and int(opt.consecutive_skips) == 3
    set_grads(params, seed=20, nan=True)
    with sync_is_an_error(), pytest.raises(clipopt.NonFiniteNormError):
        opt.step()
    grads = set_grads(params, seed=21)
    opt.step()  # decided afresh: finite grads step and clear the streak
    assert int(opt.consecutive_skips) == 0 and int(opt.step_count) == 2
    assert_norm(opt, grads)


# ---------------------------------------------------------------- documented host reads


@pytest.mark.parametrize(
    ("make", "nonfinite"),
    [(foreach_sgd, "skip"), (foreach_sgd, "raise"), (fused_adamw, "raise")],
    ids=["explicit skip", "explicit raise", "fused raise"],
)
def test_policies_that_read_a_flag_on_the_host_do_sync(make: MakeInner, nonfinite: Any) -> None:
    params = make_params()
    opt = clipopt.ClippedOptimizer(make(params), max_norm=MAX_NORM, nonfinite=nonfinite)
    set_grads(params, seed=1)
    opt.step()
    before = [p.detach().clone() for p in params]
    set_grads(params, seed=2)
    with sync_is_an_error(), pytest.raises(RuntimeError, match=SYNC_ERROR):
        opt.step()
    for p, was in zip(params, before, strict=True):  # it stopped before touching them
        assert torch.equal(p.detach(), was)


# ---------------------------------------------------------------- functional API


@pytest.mark.parametrize("foreach", [True, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_functional_clip_and_norm_never_sync(dtype: torch.dtype, foreach: bool | None) -> None:
    params = make_params(dtype)
    grads = set_grads(params, seed=3)
    with sync_is_an_error():
        measured = clipopt.get_total_norm([p.grad for p in params], foreach=foreach)
        norm = clipopt.clip_grad_norm_(params, MAX_NORM, foreach=foreach)
    assert norm.device.type == "cuda" and measured.device.type == "cuda"
    for value in (norm, measured):
        assert math.isclose(float(value), reference_norm(grads), rel_tol=1e-5)
    assert_clipped(params, reference_clip(grads))


def test_the_sync_detector_is_live() -> None:
    norm = clipopt.get_total_norm([torch.ones(3, device="cuda")])
    with sync_is_an_error(), pytest.raises(RuntimeError, match=SYNC_ERROR):
        norm.item()


# ---------------------------------------------------------------- adaptive clip rules

RULES: dict[str, Callable[[], clipopt.ClipRule]] = {
    "AutoClip": lambda: clipopt.AutoClip(percentile=50.0, history=16),
    "AutoClip per tensor": lambda: clipopt.AutoClip(50.0, 16, per_tensor=True),
    "ZClip": lambda: clipopt.ZClip(warmup_steps=3),
    "AdaGC": lambda: clipopt.AdaGC(warmup_steps=3),
}


@pytest.mark.parametrize("make", [foreach_sgd, fused_adamw], ids=["foreach SGD", "fused AdamW"])
@pytest.mark.parametrize("rule", list(RULES))
def test_rule_steps_never_sync(rule: str, make: MakeInner) -> None:
    """Every step after the first (which makes the rule's state) runs in the error mode,
    past AutoClip's ring wrapping and ZClip's and AdaGC's warm-up."""
    params = make_params()
    opt = clipopt.ClippedOptimizer(make(params), max_norm=RULES[rule]())
    set_grads(params, seed=1)
    opt.step()
    for seed in range(2, 30):
        set_grads(params, seed=seed, scale=10.0 * (1 + seed % 5))
        with sync_is_an_error():
            opt.step()
    assert opt.rule is not None and opt.rule.last_threshold is not None
    assert opt.rule.last_threshold.device.type == "cuda"
    assert int(opt.clipped_count) > 0


def test_spike_skip_on_a_fused_optimizer_never_syncs() -> None:
    params = make_params()
    spikes = clipopt.SpikeSkip(window=8, sigma=3.0, min_history=4)
    opt = clipopt.ClippedOptimizer(fused_adamw(params), max_norm=MAX_NORM, skip_spikes=spikes)
    set_grads(params, seed=1)
    opt.step()
    for seed in range(2, 20):
        set_grads(params, seed=seed, scale=1000.0 if seed == 15 else 10.0)
        with sync_is_an_error():
            opt.step()
    assert int(opt.skip_count) >= 1 and int(spikes.spike_count) == int(opt.skip_count)
