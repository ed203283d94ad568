"""ClippedOptimizer under mixed precision with ``torch.amp.GradScaler``.

The reference is torch's documented recipe for clipping with a scaler, ``scale(loss)
.backward(); unscale_(opt); clip_grad_norm_(...); step(opt); update()``, with
``clipopt.clip_grad_norm_`` as its clip. Wrapped, the user writes ``scale(loss).backward();
step(opt); update()`` (``unscale_`` optional) and the wrapper must clip the *unscaled*
grads: parameters and norms must be bit-identical to that recipe, and ``last_norm`` must
be the true unscaled norm, checked against a float64 reference computed from the scaled
grads and the scale. A step that the scaler skips because a grad is inf must leave
parameters, optimizer state, ``last_norm`` and the step count exactly as they were.

Against torch's own ``torch.nn.utils.clip_grad_norm_`` the wrapper is not bit-identical:
both norms are measured against the float64 norm of the same grads, and the two runs'
losses compared.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from helpers import assert_identical
from torch import Tensor, nn
from torch.optim import Optimizer

import clipopt

MAX_NORM = 0.05
STEPS = 5
INF_STEP = 2
"""The step whose grads get an inf, so the scaler skips it."""

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
AUTOCAST_DTYPE = {"cpu": torch.bfloat16, "cuda": torch.float16}

INNER: dict[str, Callable[[list[nn.Parameter]], Optimizer]] = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "AdamW-fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
}


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)


def _loss(model: nn.Module, step: int, device: str) -> Tensor:
    data = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 8, generator=data), torch.randn(32, 4, generator=data)
    with torch.autocast(device, dtype=AUTOCAST_DTYPE[device]):
        out = model(x.to(device))
    return ((out.float() - y.to(device)) ** 2).mean() * 10


def _poison(model: nn.Module, step: int) -> None:
    if step == INF_STEP:
        first = next(model.parameters())
        assert first.grad is not None
        first.grad.view(-1)[0] = float("inf")


def _unscaled_norm64(model: nn.Module, scale: float) -> Tensor:
    """The float64 norm of the grads divided by the loss scale: the truth to compare with."""
    grads = [p.grad.double().flatten() / scale for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.cat(grads))


def _snapshot(opt: Optimizer) -> dict[str, object]:
    return copy.deepcopy(opt.state_dict())


@dataclass
class Run:
    params: list[Tensor]
    norms: list[Tensor | None] = field(default_factory=list)
    true_norms: list[Tensor] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)


def _train_by_hand(device: str, inner: str) -> Run:
    """torch's recipe: unscale_, clip_grad_norm_, step, update."""
    model = _model(device)
    opt = INNER[inner](list(model.parameters()))
    scaler = torch.amp.GradScaler(device, init_scale=2.0**12)
    run = Run([])
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(_loss(model, step, device)).backward()
        _poison(model, step)
        run.scales.append(scaler.get_scale())
        scaler.unscale_(opt)
        norm = clipopt.clip_grad_norm_(model.parameters(), MAX_NORM)
        run.norms.append(None if step == INF_STEP else norm)
        scaler.step(opt)
        scaler.update()
    run.params = [p.detach().clone() for p in model.parameters()]
    return run


def _train_wrapped(device: str, inner: str, explicit_unscale: bool) -> Run:
    """The wrapper under the scaler, checking the skipped step as it goes."""
    model = _model(device)
    opt = clipopt.ClippedOptimizer(INNER[inner](list(model.parameters())), max_norm=MAX_NORM)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**12)
    run = Run([])
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(_loss(model, step, device)).backward()
        _poison(model, step)
        run.scales.append(scaler.get_scale())
        run.true_norms.append(_unscaled_norm64(model, run.scales[-1]))
        if explicit_unscale:
            scaler.unscale_(opt)
        before = (_snapshot(opt), [p.detach().clone() for p in model.parameters()], opt.last_norm)
        scaler.step(opt)
        scaler.update()
        if step == INF_STEP:
            _assert_untouched(opt, model, *before)
        run.norms.append(None if step == INF_STEP else opt.last_norm)
    assert int(opt.step_count) == STEPS - 1, "the skipped step must not be counted"
    run.params = [p.detach().clone() for p in model.parameters()]
    return run


def _assert_untouched(
    opt: clipopt.ClippedOptimizer,
    model: nn.Module,
    state: dict[str, object],
    params: list[Tensor],
    last_norm: Tensor | None,
) -> None:
    """Nothing moved: state dict (inner state, step and skip counts), params, last_norm."""
    assert_identical(_snapshot(opt), state)
    assert_identical(list(model.parameters()), params)
    assert last_norm is not None and opt.last_norm is not None
    assert torch.equal(opt.last_norm, last_norm)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inner", sorted(INNER))
@pytest.mark.parametrize("explicit_unscale", [False, True], ids=["step-only", "unscale-first"])
def test_grad_scaler_clips_unscaled_grads(device: str, inner: str, explicit_unscale: bool) -> None:
    reference = _train_by_hand(device, inner)
    ours = _train_wrapped(device, inner, explicit_unscale)
    # A fused inner optimizer gets the clip folded into its kernel as grad_scale =
    # 1 / coefficient (clipopt._step._fold): g / (1 / c) may differ from g * c in the last bit.
    exact = not inner.endswith("-fused")
    tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-6, "atol": 1e-7}
    assert ours.scales == reference.scales
    assert reference.scales[INF_STEP + 1] < reference.scales[INF_STEP], "the scaler must back off"
    for step, (norm, truth, theirs) in enumerate(
        zip(ours.norms, ours.true_norms, reference.norms, strict=True)
    ):
        if step == INF_STEP:
            continue
        assert norm is not None and theirs is not None
        assert theirs > MAX_NORM, "every finite step must clip"
        torch.testing.assert_close(norm, theirs, **tolerance)
        torch.testing.assert_close(norm.double(), truth, rtol=2e-6, atol=0)
    torch.testing.assert_close(ours.params, reference.params, **tolerance)


@pytest.mark.parametrize("device", DEVICES)
def test_skipped_first_step_leaves_no_norm(device: str) -> None:
    """If the scaler skips the very first step, there is still no last norm to report."""
    model = _model(device)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), MAX_NORM)
    scaler = torch.amp.GradScaler(device)
    scaler.scale(_loss(model, 0, device)).backward()
    _poison(model, INF_STEP)
    params = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert opt.last_norm is None
    assert int(opt.step_count) == 0
    torch.testing.assert_close(list(model.parameters()), params, rtol=0, atol=0)


@pytest.mark.parametrize("unscaled", ["wrapper", "inner"])
def test_unscale_the_object_you_step(unscaled: str) -> None:
    """The scaler keeps its bookkeeping per optimizer object: unscaling the inner optimizer
    and stepping the wrapper unscales twice (the pitfall docs/optimizer.md warns of);
    unscaling the wrapper does it once, and ``last_norm`` is the true norm."""
    model = _model("cpu")
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), math.inf)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    scaler.scale(_loss(model, 0, "cpu")).backward()
    truth = _unscaled_norm64(model, scaler.get_scale())
    scaler.unscale_(opt if unscaled == "wrapper" else opt.optimizer)
    scaler.step(opt)
    assert opt.last_norm is not None
    times = 1 if unscaled == "wrapper" else 2
    expected = truth / scaler.get_scale() ** (times - 1)
    torch.testing.assert_close(opt.last_norm.double(), expected, rtol=2e-6, atol=0)


def _mlp(width: int, batch_norm: bool) -> nn.Module:
    torch.manual_seed(0)
    norm: list[nn.Module] = [nn.BatchNorm1d(width)] if batch_norm else []
    return nn.Sequential(
        nn.Linear(32, width),
        *norm,
        nn.GELU(),
        nn.Linear(width, width),
        nn.GELU(),
        nn.Linear(width, 8),
    )


def _bf16_loss(model: nn.Module, data: torch.Generator) -> Tensor:
    x, y = torch.randn(64, 32, generator=data), torch.randn(64, 8, generator=data)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    return nn.functional.mse_loss(out.float(), y)


@pytest.mark.parametrize("width", [64, 1024])
def test_amp_norm_against_float64(width: int) -> None:
    """Under bf16 autocast and a scaler, with a BatchNorm, the grads the wrapper clips
    measured three ways: at every step the wrapper's ``last_norm`` is no farther from
    the float64 norm of the same unscaled grads than torch's ``clip_grad_norm_`` norm;
    where a grad has more than 64K elements (width 1024) the two differ, and the
    wrapper's is nearer over the run."""
    model = _mlp(width, batch_norm=True)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), MAX_NORM)
    scaler = torch.amp.GradScaler("cpu")
    data = torch.Generator().manual_seed(1)
    ours_error = theirs_error = 0.0
    differ = 0
    for _ in range(10):
        scaler.scale(_bf16_loss(model, data)).backward()
        scaler.unscale_(opt)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        truth = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads]))
        theirs = torch.nn.utils.get_total_norm(grads)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert opt.last_norm is not None
        ours = opt.last_norm
        ours_step = float((ours.double() - truth).abs())
        theirs_step = float((theirs.double() - truth).abs())
        assert ours_step <= theirs_step, (ours, theirs, truth)
        ours_error += ours_step
        theirs_error += theirs_step
        differ += not torch.equal(ours, theirs)
    if width * width > 65_536:  # a weight of more than 64K elements
        assert ours_error < theirs_error, (ours_error, theirs_error)
        assert differ > 0


@pytest.mark.parametrize("width", [64, 1024])
def test_amp_runs_against_torch_clip_separate(width: int) -> None:
    """torch's recipe (``unscale_``, ``torch.nn.utils.clip_grad_norm_``, ``step``) and the
    wrapper, from the same start under bf16 autocast with AdamW, clipping every step:
    64 wide the norms are torch's and the runs bit-identical; 1024 wide (a weight past
    64K elements) the norms differ in their last bits, so the two runs' losses part,
    though by less than 1e-3 in 30 steps."""
    steps = 30
    losses: dict[bool, list[Tensor]] = {}
    for wrapped in (False, True):
        model = _mlp(width, batch_norm=False)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt = clipopt.ClippedOptimizer(inner, MAX_NORM) if wrapped else inner
        scaler = torch.amp.GradScaler("cpu")
        data = torch.Generator().manual_seed(1)
        losses[wrapped] = []
        for _ in range(steps):
            loss = _bf16_loss(model, data)
            losses[wrapped].append(loss.detach())
            scaler.scale(loss).backward()
            if not wrapped:
                scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                assert norm > MAX_NORM, "every step must clip"
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    gap = (torch.stack(losses[True]) - torch.stack(losses[False])).abs().max()
    if width * width > 65_536:
        assert 0 < gap < 1e-3, gap
    else:
        assert gap == 0, gap
