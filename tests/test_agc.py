"""AGC (Brock et al., 2021) against timm's ``adaptive_clip_grad``, written out here.

- timm's arithmetic in float64, param by param, against ``ClippedOptimizer(SGD(lr=0),
  max_norm=AGC(...))`` on a model with conv, linear, bias and LayerNorm params, over many
  steps of random weights and grads above and below the thresholds: 1e-5 relative; the
  same arithmetic in float32: bit for bit.
- ``exclude``: excluded grads are bit-identical to before, the others clipped as timm.
- Properties (hypothesis): coefficients in (0, 1], clipped unit norms at most their
  threshold, thresholds proportional to the weights while above ``eps``.
- The step's norms come from AGC's one read of the grads: ``last_norm`` (excluded grads
  included), the tracked norms and per-group norms against float64 sums and the direct
  global norm, each grad read by one norm kernel once, its weight once (an excluded
  one's never); non-finite grads (an excluded one's too) and SpikeSkip act on that norm.
  A unit-wise rule of one's own without squares is measured as before; a wrong count
  of them is refused.
- Fused AdamW takes the explicit scale and agrees with the unfused step; no host read;
  bad settings, ``norm_type`` and checkpoints of other rules are refused.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import assert_same, sync_is_an_error
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import clipopt
from clipopt._step import _measure

STEPS = 200


# ---------------------------------------------------------------- timm's arithmetic


def timm_unitwise_norm(x: Tensor) -> Tensor:
    """timm.utils.agc.unitwise_norm with norm_type=2."""
    if x.ndim <= 1:
        return x.norm(2.0)
    return x.norm(2.0, dim=tuple(range(1, x.ndim)), keepdim=True)


def timm_agc(
    params: list[Tensor], grads: list[Tensor], clipping: float, eps: float, dtype: torch.dtype
) -> tuple[list[Tensor], list[Tensor], bool]:
    """timm.utils.agc.adaptive_clip_grad, param by param in ``dtype``: the clipped grads,
    each param's thresholds (``max_norm``), and whether some unit was scaled by < 1."""
    clipped, thresholds, scaled = [], [], False
    for p, g in zip(params, grads, strict=True):
        p_data, g_data = p.detach().to(dtype), g.to(dtype)
        max_norm = timm_unitwise_norm(p_data).clamp_(min=eps).mul_(clipping)
        grad_norm = timm_unitwise_norm(g_data)
        factor = max_norm / grad_norm.clamp(min=1e-6)
        clipped.append(torch.where(grad_norm < max_norm, g_data, g_data * factor))
        thresholds.append(max_norm.reshape(-1))
        scaled = scaled or bool(((grad_norm >= max_norm) & (factor < 1)).any())
    return clipped, thresholds, scaled


# ---------------------------------------------------------------- a model and a stream


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.ModuleDict(
        {
            "conv": nn.Conv2d(3, 4, 3),
            "norm": nn.LayerNorm(4),
            "fc": nn.Linear(4, 6),
            "head": nn.Linear(6, 3),
        }
    )


def draw(like: Tensor, gen: torch.Generator, unit_spread: bool) -> Tensor:
    """Random values shaped as ``like``; with ``unit_spread`` each unit (row) is scaled by
    its own factor between 1e-4 and 1e3, so that some fall under their threshold and
    some over it; some units are zero."""
    values = torch.randn(like.shape, generator=gen)
    if not unit_spread:
        return values
    rows = like.shape[0] if like.dim() >= 2 else 1
    factors = 10 ** torch.empty(rows).uniform_(-4, 3, generator=gen)
    factors = factors * (torch.rand(rows, generator=gen) > 0.1)
    return values * factors.reshape((rows,) + (1,) * (like.dim() - 1) if like.dim() >= 2 else ())


def stream(params: list[Tensor], steps: int, seed: int = 0) -> Iterator[tuple[list[Tensor], ...]]:
    """Per step: new weights (zero rows included, to reach eps) and grads."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        weights = [draw(p, gen, unit_spread=True) for p in params]
        grads = [draw(p, gen, unit_spread=True) * 0.05 for p in params]
        yield weights, grads


def load(params: list[nn.Parameter], weights: list[Tensor], grads: list[Tensor]) -> None:
    with torch.no_grad():
        for p, w, g in zip(params, weights, grads, strict=True):
            p.copy_(w)
            p.grad = g.clone()


def agc_sgd(params: list[nn.Parameter], **kwargs: Any) -> clipopt.ClippedOptimizer:
    return clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.0), max_norm=clipopt.AGC(**kwargs))


# ---------------------------------------------------------------- against timm


@pytest.mark.parametrize(("clipping", "eps"), [(0.01, 1e-3), (0.16, 1e-3), (0.04, 0.0), (1.0, 0.5)])
def test_matches_timm_in_float64_to_1e_5(clipping: float, eps: float) -> None:
    params = list(model().parameters())
    opt = agc_sgd(params, clipping=clipping, eps=eps)
    clipped_steps = 0
    for step, (weights, grads) in enumerate(stream(params, STEPS)):
        load(params, weights, grads)
        opt.step()
        expected, thresholds, scaled = timm_agc(weights, grads, clipping, eps, torch.float64)
        for p, e in zip(params, expected, strict=True):
            torch.testing.assert_close(
                p.grad.double(), e, rtol=1e-5, atol=1e-12, msg=f"step {step}"
            )
        assert opt.rule is not None and opt.rule.last_threshold is not None
        torch.testing.assert_close(
            opt.rule.last_threshold.double(), torch.cat(thresholds), rtol=1e-5, atol=0.0
        )
        clipped_steps += scaled
        assert int(opt.clipped_count) == clipped_steps
    assert clipped_steps > 0
    assert opt.last_norm is not None
    torch.testing.assert_close(
        opt.last_norm.double(), torch.cat([g.double().reshape(-1) for g in grads]).norm()
    )


def test_matches_timm_in_float32_bit_for_bit() -> None:
    params = list(model().parameters())
    opt = agc_sgd(params)
    for weights, grads in stream(params, STEPS, seed=1):
        load(params, weights, grads)
        opt.step()
        expected, thresholds, _ = timm_agc(weights, grads, 0.01, 1e-3, torch.float32)
        for p, e in zip(params, expected, strict=True):
            assert torch.equal(p.grad, e)
        assert opt.rule is not None
        assert torch.equal(opt.rule.last_threshold, torch.cat(thresholds))


def test_half_grads_are_measured_in_float32() -> None:
    params = [p.to(torch.bfloat16) for p in model().parameters()]
    params = [nn.Parameter(p) for p in params]
    opt = agc_sgd(params, clipping=0.05)
    for weights, grads in stream(params, 20, seed=2):
        weights = [w.to(torch.bfloat16) for w in weights]
        grads = [g.to(torch.bfloat16) for g in grads]
        load(params, weights, grads)
        opt.step()
        expected, _, _ = timm_agc(weights, grads, 0.05, 1e-3, torch.float64)
        for p, e in zip(params, expected, strict=True):
            assert p.grad.dtype == torch.bfloat16
            torch.testing.assert_close(p.grad.double(), e, rtol=2e-2, atol=1e-30)


# ---------------------------------------------------------------- exclude


def test_excluded_params_are_left_bit_identical() -> None:
    net = model()
    params = list(net.parameters())
    head = list(net["head"].parameters())
    opt = agc_sgd(params, clipping=0.01, exclude=net["head"].parameters())
    kept = [i for i, p in enumerate(params) if all(p is not q for q in head)]
    for weights, grads in stream(params, 50, seed=3):
        load(params, weights, grads)
        opt.step()
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            if i not in kept:
                assert torch.equal(p.grad, g)
        others = [weights[i] for i in kept], [grads[i] for i in kept]
        expected, thresholds, _ = timm_agc(*others, 0.01, 1e-3, torch.float32)
        for i, e in zip(kept, expected, strict=True):
            assert torch.equal(params[i].grad, e)
        assert opt.rule is not None
        assert torch.equal(opt.rule.last_threshold, torch.cat(thresholds))


def test_every_param_excluded_scales_nothing() -> None:
    params = list(model().parameters())
    opt = agc_sgd(params, exclude=params)
    weights, grads = next(stream(params, 1))
    load(params, weights, grads)
    opt.step()
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
    assert opt.rule is not None and opt.rule.last_threshold.shape == (0,)
    assert int(opt.clipped_count) == 0


def test_copies_exclude_their_own_params_and_a_trial_load_copies_none() -> None:
    net = model()
    params = list(net.parameters())
    opt = agc_sgd(params, exclude=net["head"].parameters())
    load(params, *next(stream(params, 1)))
    opt.step()
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        ids = {id(p) for group in clone.param_groups for p in group["params"]}
        assert clone.rule is not None
        assert len(clone.rule.exclude) == 2 and all(id(p) in ids for p in clone.rule.exclude)
    assert clipopt.AGC(exclude=[params[0], params[0]]).config()["excluded"] == 1
    assert opt.rule is not None
    trial = opt.rule.trial_copy()
    assert all(a is b for a, b in zip(trial.exclude, opt.rule.exclude, strict=True))


# ---------------------------------------------------------------- the step's norms


def float64_norms(grads: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Each grad's L2 norm and the global one, from float64 squares summed."""
    squares = torch.stack([g.to_dense().double().square().sum() for g in grads])
    return squares.sqrt(), squares.sum().sqrt()


@pytest.mark.parametrize("excluded", [False, True], ids=["all", "head-excluded"])
@pytest.mark.parametrize("track", [False, True], ids=["untracked", "tracked"])
def test_last_norm_and_tracked_norms_are_every_grads_to_float64(
    excluded: bool, track: bool
) -> None:
    """The global norm of all grads (an excluded one's too) before clipping: to 1e-6 of
    float64 sums and of the direct measurement; float32 on the grads' device; each
    tracked norm by name."""
    net = model()
    params = list(net.parameters())
    exclude = list(net["head"].parameters()) if excluded else []
    inner = torch.optim.SGD(net.named_parameters(), lr=0.0)
    opt = clipopt.ClippedOptimizer(
        inner, max_norm=clipopt.AGC(0.01, exclude=exclude), track_tensor_norms=track
    )
    for step, (weights, grads) in enumerate(stream(params, 30, seed=11)):
        load(params, weights, grads)
        opt.step()
        each, total = float64_norms(grads)
        norm = opt.last_norm
        assert norm is not None and norm.dtype == torch.float32 and opt.last_group_norms is None
        torch.testing.assert_close(norm.double(), total, rtol=1e-6, atol=0.0, msg=f"step {step}")
        direct = clipopt.get_total_norm(grads)
        torch.testing.assert_close(norm, direct, rtol=1e-6, atol=0.0, msg=f"step {step}")
        tracked = opt.last_tensor_norms
        if not track:
            assert tracked is None
            continue
        assert tracked is not None and list(tracked) == [n for n, _ in net.named_parameters()]
        got = torch.stack(list(tracked.values()))
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), each, rtol=1e-6, atol=0.0, msg=f"step {step}")


def test_an_excluded_double_grad_makes_last_norm_double() -> None:
    """As without AGC: the norm is float64 when any grad is."""
    net = model()
    net["head"].double()
    params = list(net.parameters())
    opt = agc_sgd(params, exclude=net["head"].parameters())
    weights, grads = next(stream(params, 1, seed=12))
    typed = [[t.to(p.dtype) for t, p in zip(ts, params, strict=True)] for ts in (weights, grads)]
    load(params, *typed)
    grads = typed[1]
    opt.step()
    assert opt.last_norm is not None and opt.last_norm.dtype == torch.float64
    torch.testing.assert_close(opt.last_norm, float64_norms(grads)[1], rtol=1e-6, atol=0.0)


def test_per_group_norms_from_the_units_match_float64() -> None:
    """What the step derives from AGC's squares with per_group=True (which a rule refuses
    in ClippedOptimizer, so the function is called here): each group's norm, an empty
    group's zero, and the norm of the group norms."""
    params = list(model().parameters())
    weights, grads = next(stream(params, 1, seed=13))
    squares = clipopt.AGC(exclude=params[-2:]).decide_units(weights, grads, 2.0).squares
    assert squares is not None
    groups = [grads[:3], [], grads[3:]]
    got = _measure.measure_from_squares(
        groups, None, squares, _measure.Orders([2.0] * 3, 2.0, True), False
    )
    expected = torch.stack(
        [float64_norms(g)[1] if g else torch.zeros((), dtype=torch.float64) for g in groups]
    )
    assert got.stacked is not None
    torch.testing.assert_close(got.stacked.double(), expected, rtol=1e-6, atol=0.0)
    assert [n.dtype for n in got.group_norms] == [torch.float32] * 3
    torch.testing.assert_close(got.norm.double(), float64_norms(grads)[1], rtol=1e-6, atol=0.0)


NONFINITE = {"nan": math.nan, "inf": math.inf}


@pytest.mark.parametrize("value", sorted(NONFINITE))
@pytest.mark.parametrize("where", ["clipped", "excluded"])
@pytest.mark.parametrize("nonfinite", ["propagate", "skip", "raise"])
def test_a_nonfinite_grad_reaches_the_nonfinite_policy(
    value: str, where: str, nonfinite: str
) -> None:
    """An inf or NaN in a clipped grad or an excluded one makes last_norm non-finite:
    "skip" skips the step (params and grads as they were), "raise" raises and changes
    nothing, "propagate" steps."""
    net = model()
    params = list(net.parameters())
    rule = clipopt.AGC(0.01, exclude=net["head"].parameters())
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(params, lr=0.1),
        max_norm=rule,
        nonfinite=nonfinite,  # type: ignore[arg-type]
    )
    weights, grads = next(stream(params, 1, seed=15))
    poisoned = 2 if where == "clipped" else len(params) - 1
    grads[poisoned].reshape(-1)[0] = NONFINITE[value]
    load(params, weights, grads)
    before = [p.detach().clone() for p in params]
    if nonfinite == "raise":
        with pytest.raises(clipopt.NonFiniteNormError):
            opt.step()
        assert opt.last_norm is None
    else:
        opt.step()
        assert opt.last_norm is not None and not bool(opt.last_norm.isfinite())
        expected = math.nan if value == "nan" else math.inf
        torch.testing.assert_close(opt.last_norm, torch.tensor(expected), equal_nan=True)
    moved = [not torch.equal(p, b) for p, b in zip(params, before, strict=True)]
    if nonfinite == "propagate":
        assert any(moved)
        return
    assert not any(moved) and int(opt.skip_count) == (nonfinite == "skip")
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0.0, atol=0.0, equal_nan=True)


def test_spike_skip_sees_the_global_norm_an_excluded_spike_included() -> None:
    """SpikeSkip's history is each step's float64 global norm, and a spike in an excluded
    grad alone is skipped."""
    net = model()
    params = list(net.parameters())
    spikes = clipopt.SpikeSkip(window=8, sigma=3.0, min_history=4)
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(params, lr=0.01),
        max_norm=clipopt.AGC(0.05, exclude=net["head"].parameters()),
        skip_spikes=spikes,
    )
    gen = torch.Generator().manual_seed(16)
    base = [torch.randn(p.shape, generator=gen) * 0.01 for p in params]
    totals = []
    for step in range(8):
        grads = [g * (1.0 + 0.05 * (step % 2)) for g in base]  # z-scores near 1
        if step == 7:
            grads[-1] = grads[-1] * 1e4  # the head's bias, excluded
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        before = [p.detach().clone() for p in params]
        opt.step()
        totals.append(float64_norms(grads)[1])
    assert int(spikes.spike_count) == 1 and int(opt.skip_count) == 1
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    buffer = spikes.state_dict()["state"]["buffer"]
    torch.testing.assert_close(buffer.double(), torch.stack(totals), rtol=1e-6, atol=0.0)


class RowClip(clipopt.UnitWiseRule):
    """Each row of each grad to a norm of at most 1, with AGC's squares or without."""

    def __init__(self, squares: Callable[[list[Tensor]], Any]) -> None:
        super().__init__()
        self.squares = squares

    def config(self) -> dict[str, Any]:
        return {}

    def update(self, norms: Tensor) -> None:
        pass

    def rule_state(self) -> dict[str, Any]:
        return {}

    def load_rule_state(self, state: Any) -> None:
        pass

    def decide_units(self, params: Any, grads: Any, norm_type: float) -> clipopt.UnitDecision:
        rows = [g.flatten(1).norm(dim=1) if g.dim() >= 2 else g.norm().reshape(1) for g in grads]
        norms = torch.cat(rows)
        coefficients = 1.0 / norms.clamp(min=1.0)
        parts = coefficients.split([r.numel() for r in rows])
        shapes = [(-1,) + (1,) * (g.dim() - 1) if g.dim() >= 2 else () for g in grads]
        per_grad = [c.reshape(shape) for c, shape in zip(parts, shapes, strict=True)]
        squares = self.squares(rows)
        return clipopt.UnitDecision(per_grad, norms, coefficients, coefficients, squares)


def test_a_unit_rule_without_squares_is_measured_and_a_wrong_count_refused() -> None:
    """A rule of one's own that gives no squares: the step measures the grads itself;
    one that gives them for too few grads: ValueError, nothing changed."""
    net = model()
    params = list(net.parameters())
    weights, grads = next(stream(params, 1, seed=17))
    for squares in (lambda rows: None, lambda rows: tuple(r.double().square() for r in rows)):
        opt = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.0), RowClip(squares))
        load(params, weights, grads)
        opt.step()
        assert opt.last_norm is not None
        torch.testing.assert_close(
            opt.last_norm.double(), float64_norms(grads)[1], rtol=1e-6, atol=0.0
        )
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(params, lr=0.0), RowClip(lambda rows: (rows[0].square(),))
    )
    load(params, weights, grads)
    with pytest.raises(ValueError, match=f"gave 1 squares for {len(params)} grads"):
        opt.step()
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))


# ---------------------------------------------------------------- properties


units = st.lists(
    st.tuples(st.integers(1, 5), st.integers(0, 6)), min_size=1, max_size=4
)  # (rows, row length; 0: a 1-D tensor of `rows` elements)


def _tensors(shapes: list[tuple[int, int]], seed: int) -> tuple[list[Tensor], list[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    made = [(r, c) if c else (r,) for r, c in shapes]
    params = [draw(torch.empty(s), gen, unit_spread=True) + 1e-3 for s in made]
    grads = [draw(torch.empty(s), gen, unit_spread=True) for s in made]
    return params, grads


@settings(max_examples=60, deadline=None)
@given(shapes=units, seed=st.integers(0, 2**16), clipping=st.floats(1e-3, 1.0))
def test_coefficients_are_in_0_1_and_clipped_units_within_their_threshold(
    shapes: list[tuple[int, int]], seed: int, clipping: float
) -> None:
    params, grads = _tensors(shapes, seed)
    decision = clipopt.AGC(clipping=clipping).decide_units(params, grads, 2.0)
    assert bool(((decision.coefficients > 0) & (decision.coefficients <= 1)).all())
    after = [g * c for g, c in zip(grads, decision.per_grad, strict=True) if c is not None]
    from clipopt._dist._units import unit_norms

    norms = unit_norms([a.double() for a in after], torch.device("cpu"), torch.float64)
    limit = decision.thresholds.double() * (1 + 1e-6)
    assert bool((norms <= limit).all()), (norms - limit).max()


@settings(max_examples=60, deadline=None)
@given(shapes=units, seed=st.integers(0, 2**16), c=st.floats(0.01, 100.0))
def test_thresholds_scale_with_the_params_above_eps(
    shapes: list[tuple[int, int]], seed: int, c: float
) -> None:
    params, grads = _tensors(shapes, seed)
    params = [p.sign() * p.abs().clamp(min=1.0) for p in params]  # unit norms >= 1
    rule = clipopt.AGC(clipping=0.02, eps=1e-3)
    base = rule.decide_units(params, grads, 2.0).thresholds
    scaled = rule.decide_units([p * c for p in params], grads, 2.0).thresholds
    torch.testing.assert_close(scaled, base * c, rtol=1e-5, atol=0.0)


# ---------------------------------------------------------------- fused, host reads


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 4), max_size=4), min_size=1, max_size=5),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
    transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_batched_unit_norms_match_float64_and_the_per_tensor_path(
    shapes: list[list[int]], dtype: torch.dtype, transposed: bool, seed: int
) -> None:
    """The batched unit norms (squares summed by one segment_reduce, forced on the CPU
    through ``_scale.batched``; a transposed tensor takes the per-tensor route) are each
    unit's float64 norm within float32 rounding, as the per-tensor path's; the last
    tensor is also passed as a whole one."""
    from clipopt._dist._units import unit_norms
    from clipopt._kernels import _scale

    gen = torch.Generator().manual_seed(seed)
    tensors = [(torch.randn(s, generator=gen) * 3).to(dtype) for s in shapes]
    tensors = [t.transpose(0, 1) if transposed and t.dim() >= 2 else t for t in tensors]
    wide = [t.double() for t in tensors]
    expected = torch.cat(
        [t.flatten(1).norm(dim=1) if t.dim() >= 2 else t.norm().reshape(1) for t in wide]
        + [wide[-1].norm().reshape(1)]
    )
    cpu = torch.device("cpu")
    each = unit_norms(tensors, cpu, torch.float64, tensors[-1:])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_scale, "batched", lambda device: True)
        got = unit_norms(tensors, cpu, torch.float64, tensors[-1:])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0.0)
    torch.testing.assert_close(got, each, rtol=1e-5, atol=0.0)


@settings(max_examples=30, deadline=None)
@given(shapes=units, seed=st.integers(0, 2**16), clipping=st.floats(1e-3, 1.0))
def test_batched_decision_matches_the_per_tensor_one(
    shapes: list[tuple[int, int]], seed: int, clipping: float
) -> None:
    from clipopt._kernels import _scale

    params, grads = _tensors(shapes, seed)
    rule = clipopt.AGC(clipping=clipping)
    each = rule.decide_units(params, grads, 2.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_scale, "batched", lambda device: True)
        got = rule.decide_units(params, grads, 2.0)
    for name in ("norms", "coefficients", "thresholds"):
        torch.testing.assert_close(getattr(got, name), getattr(each, name), rtol=1e-5, atol=0.0)
    for a, b in zip(got.per_grad, each.per_grad, strict=True):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0.0)


def test_agc_on_fused_adamw_trains_as_on_the_plain_one() -> None:
    fused_params, plain_params = list(model().parameters()), list(model().parameters())
    fused = clipopt.ClippedOptimizer(
        torch.optim.AdamW(fused_params, lr=1e-2, fused=True), max_norm=clipopt.AGC(0.05)
    )
    plain = clipopt.ClippedOptimizer(
        torch.optim.AdamW(plain_params, lr=1e-2, foreach=False), max_norm=clipopt.AGC(0.05)
    )
    gen = torch.Generator().manual_seed(5)
    for _ in range(40):
        grads = [draw(p, gen, unit_spread=True) for p in fused_params]
        for ps in (fused_params, plain_params):
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.clone()
        fused.step()
        plain.step()
    for a, b in zip(fused_params, plain_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fused.rule is not None and plain.rule is not None
    assert torch.equal(fused.clipped_count, plain.clipped_count)
    assert int(fused.clipped_count) > 0


@pytest.mark.parametrize("fused", [False, True])
def test_no_host_read_in_an_agc_step(fused: bool, no_host_sync: Callable[[], Any]) -> None:
    net = model()
    params = list(net.parameters())
    inner = (
        torch.optim.AdamW(params, lr=0.01, fused=True)
        if fused
        else torch.optim.SGD(params, lr=0.01, momentum=0.9)
    )
    opt = clipopt.ClippedOptimizer(inner, max_norm=clipopt.AGC(exclude=net["head"].parameters()))
    gen = torch.Generator().manual_seed(6)
    grads = [[draw(p, gen, unit_spread=True) for p in params] for _ in range(10)]
    with no_host_sync():
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g
            opt.step()
    assert opt.rule is not None and int(opt.clipped_count) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_agc_step_does_not_sync_and_matches_timm(fused: bool) -> None:
    net = model().cuda()
    params = list(net.parameters())
    head = {id(p) for p in net["head"].parameters()}
    inner = torch.optim.AdamW(params, lr=0.0, fused=fused)
    opt = clipopt.ClippedOptimizer(inner, max_norm=clipopt.AGC(exclude=net["head"].parameters()))
    gen = torch.Generator().manual_seed(7)
    for _ in range(5):
        grads = [draw(p, gen, unit_spread=True) for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.cuda()
        with sync_is_an_error():
            opt.step()
        kept = [i for i, p in enumerate(params) if id(p) not in head]
        weights = [params[i].detach().cpu() for i in kept]
        expected, _, _ = timm_agc(weights, [grads[i] for i in kept], 0.01, 1e-3, torch.float64)
        for i, e in zip(kept, expected, strict=True):
            torch.testing.assert_close(params[i].grad.cpu().double(), e, rtol=1e-5, atol=1e-12)
        for i in set(range(len(params))) - set(kept):
            assert torch.equal(params[i].grad.cpu(), grads[i])


# ---------------------------------------------------------------- settings, checkpoints


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"clipping": 0.0}, ValueError, r"clipping.*0\.0"),
        ({"clipping": -0.01}, ValueError, r"clipping.*-0\.01"),
        ({"clipping": float("inf")}, ValueError, r"clipping.*inf"),
        ({"clipping": "0.01"}, TypeError, r"clipping.*'0\.01'"),
        ({"eps": -1e-3}, ValueError, r"eps.*-0\.001"),
        ({"exclude": torch.zeros(2)}, TypeError, r"exclude.*tensor\(\[0\., 0\.\]\).*exclude=\[p\]"),
        ({"exclude": ["head.weight"]}, TypeError, r"exclude.*'head\.weight'.*names"),
        ({"exclude": 3}, TypeError, r"exclude.*3"),
    ],
)
def test_bad_settings_are_refused_naming_the_value(
    kwargs: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        clipopt.AGC(**kwargs)


def test_another_norm_type_is_refused_at_construction_and_at_the_step() -> None:
    params = list(model().parameters())
    with pytest.raises(ValueError, match=r"norm_type must be 2, got 1\.0"):
        clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.1), clipopt.AGC(), norm_type=1.0)
    opt = agc_sgd(params)
    weights, grads = next(stream(params, 1))
    load(params, weights, grads)
    opt.param_groups[0]["clip_norm_type"] = float("inf")
    with pytest.raises(ValueError, match=r"norm_type must be 2, got inf"):
        opt.step()
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))


def test_sparse_grads_are_refused_before_anything_is_touched() -> None:
    embedding = nn.Embedding(5, 3, sparse=True)
    embedding(torch.tensor([1, 3])).sum().backward()
    grad = embedding.weight.grad
    assert grad is not None
    before = grad.to_dense().clone()
    opt = agc_sgd(list(embedding.parameters()))
    with pytest.raises(ValueError, match=r"AGC needs dense grads.*sparse: True"):
        opt.step()
    assert torch.equal(embedding.weight.grad.to_dense(), before)
    excluded = agc_sgd(list(embedding.parameters()), exclude=[embedding.weight])
    excluded.step()  # an excluded sparse grad is measured, by its values, not clipped
    assert torch.equal(embedding.weight.grad.to_dense(), before)
    assert excluded.last_norm is not None
    torch.testing.assert_close(excluded.last_norm.double(), before.double().norm())


def test_a_process_group_is_refused() -> None:
    params = list(model().parameters())
    with pytest.raises(ValueError, match="unit-wise rules need unsplit parameters"):
        clipopt.ClippedOptimizer(
            torch.optim.SGD(params, lr=0.1),
            clipopt.AGC(),
            process_group=object(),  # type: ignore[arg-type]
        )


def _trained(rule: clipopt.ClipRule | float, seed: int = 0) -> clipopt.ClippedOptimizer:
    params = list(model().parameters())
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.1), max_norm=rule)
    for weights, grads in stream(params, 3, seed):
        load(params, weights, grads)
        opt.step()
    return opt


def test_checkpoint_round_trip_is_bit_exact() -> None:
    saved = _trained(clipopt.AGC(0.02))
    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    fresh = _trained(clipopt.AGC(0.02), seed=9)
    fresh.load_state_dict(loaded)
    assert_same(fresh.state_dict(), saved.state_dict())
    assert fresh.rule is not None and saved.rule is not None
    assert torch.equal(fresh.rule.last_threshold, saved.rule.last_threshold)
    assert int(fresh.clipped_count) == int(saved.clipped_count) > 0


@pytest.mark.parametrize(
    ("saved", "loader", "match"),
    [
        (lambda: clipopt.AGC(0.01), lambda: clipopt.AGC(0.02), "clipping"),
        (lambda: clipopt.AGC(), lambda: clipopt.AutoClip(), "AGC"),
        (lambda: clipopt.AutoClip(), lambda: clipopt.AGC(), "AutoClip"),
        (lambda: clipopt.ZClip(), lambda: clipopt.AGC(), "ZClip"),
        (lambda: 1.0, lambda: clipopt.AGC(), "no rule"),
        (lambda: clipopt.AGC(), lambda: 1.0, "AGC"),
    ],
)
def test_another_rules_checkpoint_is_refused_and_changes_nothing(
    saved: Callable[[], Any], loader: Callable[[], Any], match: str
) -> None:
    checkpoint = _trained(saved()).state_dict()
    target = _trained(loader(), seed=1)
    before = target.state_dict()
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(checkpoint)
    assert_same(target.state_dict(), before)


def test_a_checkpoint_with_other_excluded_params_is_refused() -> None:
    checkpoint = _trained(clipopt.AGC()).state_dict()
    params = list(model().parameters())
    target = clipopt.ClippedOptimizer(
        torch.optim.SGD(params, lr=0.1), max_norm=clipopt.AGC(exclude=params[-2:])
    )
    with pytest.raises(ValueError, match="'excluded': 0"):
        target.load_state_dict(checkpoint)
    checkpoint["clip"]["rule"]["state"] = {"buffer": torch.zeros(1)}
    with pytest.raises(ValueError, match="AGC has no state"):
        _trained(clipopt.AGC()).load_state_dict(checkpoint)
