"""Clip rules under DDP, FSDP2 and TP (gloo on 127.0.0.1, 2 ranks): one process's steps.

ONE spawn for the module, as in ``test_distributed``: the workers run every case in turn
and record "ok" or the traceback; one parametrized test per case reads the records.

- A rule case trains the same model on the same global batches, with spikes, under DDP,
  FSDP2 (an empty shard on rank 1, uneven ones elsewhere) or tensor parallelism, and in
  one process (every rank runs that itself), and compares each step's ``last_norm`` and
  ``last_threshold``, the parameters after the steps and the whole ``"clip"`` state entry
  (the rule's state and counters) to 1e-5 relative; the entry must also be bit-identical
  on both ranks. It counts each step's ``all_reduce`` calls: none under DDP; under FSDP2
  and TP one, which with a per-tensor rule (or tracked norms) carries every grad's norm
  and gives the global norm too, and with AGC (which runs under FSDP2 over TP too, and
  with its last layer excluded) every unit's grad and weight norms and the excluded
  grads' norms, from which the global norm is taken.
- A norm case checks :func:`global_per_tensor_norms` (the per-tensor step's powers) against the
  float64 norm of each whole (gathered) tensor, under FSDP2, HSDP, TP and FSDP2 over TP;
  a unit case checks :func:`clipopt._dist._units.whole_unit_norms` alike (the squares too, and
  grads measured whole beside the units), and each rank's rows against the gathered
  tensor.

A new rule is one entry in ``RULES``, with the layouts it runs under.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import assert_all_ok, assert_identical, sync_is_an_error
from hypothesis import given, settings
from hypothesis import strategies as st
from test_agc import timm_agc
from test_distributed import (
    WORLD_SIZE,
    CountAllReduce,
    batches,
    free_port,
    full,
    fully_shard_mlp,
    local_rows,
    loss_fn,
    mlp,
    rank_outcomes,
    run_cases,
)
from torch import Tensor, nn

import clipopt
from clipopt._dist import _mesh, _units
from clipopt._kernels import _norms

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
)

RTOL = 1e-5
STEPS = 10
SPIKES = {6: 40.0, 9: 25.0}
"""Steps whose loss (so every grad) is scaled: each rule must react to them."""


def global_per_tensor_norms(tensors: list[Tensor], p: float) -> Tensor:
    """Each whole tensor's p-norm across ranks, from the powers a per-tensor step reduces:
    local for plain tensors, one collective for DTensors; float32 (float64 if any is)."""
    if not _mesh.dtensors(tensors):
        return _norms.per_tensor_norms(tensors, p, None)
    powers = _units.global_tensor_powers([tensors], [p])[0]
    device = _mesh.local_tensors(tensors[:1])[0].device
    dtype = _norms.result_dtype([t.dtype for t in tensors])
    return _units.root(powers, p).to(device=device, dtype=dtype)


def spike_skip() -> dict[str, Any]:
    return {"max_norm": 50.0, "skip_spikes": clipopt.SpikeSkip(window=4, sigma=2.0, min_history=3)}


LAYOUTS = ("ddp", "fsdp2", "tp")
"""DDP and FSDP2 split the batch (each rank its rows); tensor parallelism splits the model."""

SPLIT_MODEL = ("tp", "fsdp2_tp")
"""The layouts that split the model, not the batch: FSDP2 over TP here has one dp rank."""

RULES: dict[str, tuple[Callable[[], dict[str, Any]], tuple[str, ...]]] = {
    "autoclip": (lambda: {"max_norm": clipopt.AutoClip(percentile=50.0, history=4)}, LAYOUTS),
    "autoclip_per_tensor": (
        lambda: {"max_norm": clipopt.AutoClip(50.0, 4, per_tensor=True)},
        LAYOUTS,
    ),
    "zclip": (
        lambda: {
            "max_norm": clipopt.ZClip(alpha=0.8, z_thresh=2.0, max_grad_norm=None, warmup_steps=3)
        },
        LAYOUTS,
    ),
    "adagc": (lambda: {"max_norm": clipopt.AdaGC(ratio=1.02, beta=0.9, warmup_steps=3)}, LAYOUTS),
    "spike_skip": (spike_skip, LAYOUTS),
    "agc": (lambda: {"max_norm": clipopt.AGC(clipping=0.05)}, (*LAYOUTS, "fsdp2_tp")),
    "agc_excluded": (
        lambda: {"max_norm": lambda model: clipopt.AGC(0.05, exclude=last_layer(model))},
        (*LAYOUTS, "fsdp2_tp"),
    ),
    "adagc_tracked": (
        lambda: {
            "max_norm": clipopt.AdaGC(ratio=1.02, beta=0.9, warmup_steps=3),
            "track_tensor_norms": True,
        },
        LAYOUTS,
    ),
    "fixed_tracked": (lambda: {"max_norm": 0.5, "track_tensor_norms": True}, LAYOUTS),
}
"""Each rule's ClippedOptimizer clip settings (made fresh for every run; a function of the
model where the rule needs its parameters), and the layouts it runs under."""


def last_layer(model: nn.Module) -> list[Tensor]:
    """The last layer's weight and bias, as the paper leaves the classifier unclipped."""
    return list(model.parameters())[-2:]


# --------------------------------------------------------------------------- rule runs


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def clip_entry(optimizer: clipopt.ClippedOptimizer) -> Any:
    """The wrapper's clip state: last norms, counters, the rule's and SpikeSkip's state."""
    return optimizer.state_dict()["clip"]


def run(
    model: nn.Module, clip: dict[str, Any], inputs: list[Tensor]
) -> tuple[clipopt.ClippedOptimizer, list[Tensor], list[Any], list[int]]:
    """Clipped steps; each step's last_norm, last_threshold (and tracked norms, if any)
    and all_reduce calls in step()."""
    made = {key: value(model) if callable(value) else value for key, value in clip.items()}
    optimizer = clipopt.ClippedOptimizer(sgd(model.parameters()), **made)
    rule = optimizer.rule
    norms, thresholds, calls = [], [], []
    for step, x in enumerate(inputs):
        optimizer.zero_grad()
        (loss_fn(model(x)) * SPIKES.get(step, 1.0)).backward()
        with CountAllReduce() as counter:
            optimizer.step()
        calls.append(counter.calls)
        assert optimizer.last_norm is not None
        norms.append(optimizer.last_norm.clone())
        seen = None if rule is None else rule.last_threshold
        thresholds.append((seen, optimizer.last_tensor_norms))
    return optimizer, norms, thresholds, calls


def assert_reacts_to_spikes(optimizer: clipopt.ClippedOptimizer) -> None:
    """The data must make the rule act, or comparing runs proves little."""
    if optimizer.rule is not None:
        assert int(optimizer.clipped_count) >= 2, optimizer.clipped_count
    if optimizer.skip_spikes is not None:
        assert int(optimizer.skip_spikes.spike_count) >= 1, "no spike was skipped"


def assert_same_on_every_rank(value: Any, what: str) -> None:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    for other in gathered:
        assert_identical(other, value, what, nan_equal=True)


def single_model(layout: str) -> nn.Module:
    """The model the layout splits, in float64: over ten steps with momentum, float32's
    rounding of the differently ordered sums (DDP's average, FSDP2's reduce-scatter, TP's
    matmuls) alone reaches 1e-5; in float64 any difference left is the clipping's."""
    return (tp_model(3) if layout in SPLIT_MODEL else mlp()).double()


def layout_model(layout: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    model = single_model(layout)
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if layout == "fsdp2_tp":
        return fsdp2_over_tp(model)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    if layout == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard_mlp(model, mesh)
    shards = [q.to_local().shape[0] for q in model.parameters()]  # type: ignore[operator]
    assert dist.get_rank() == 0 or 0 in shards, f"rank 1 should hold an empty shard: {shards}"
    return model


def fsdp2_over_tp(model: nn.Module) -> nn.Module:
    """FSDP2 over TP on a (1, 2) mesh: the Colwise weight's rows are a _StridedShard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (1, WORLD_SIZE), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    first = model[0].weight.placements  # type: ignore[index, union-attr]
    assert "_StridedShard" in type(first[0]).__name__, first
    return model


def expected_calls(layout: str) -> int:
    """FSDP2, TP: one all_reduce, with any rule (per-tensor ones, tracked norms, and AGC,
    whose one carries all units' norms, grads' and weights', and gives the global norm)."""
    return 0 if layout == "ddp" else 1


def rule_case(rule: str, layout: str) -> None:
    width = 4 if layout in SPLIT_MODEL else 3
    inputs = [x.double() for x in batches(STEPS, 8, width)]
    make = RULES[rule][0]
    reference, ref_norms, ref_thresholds, _ = run(single_model(layout), make(), inputs)
    assert_reacts_to_spikes(reference)
    assert max(float(n) for n in ref_norms) > 1.0, "no step for a fixed max_norm to clip"
    model = layout_model(layout)
    mine = inputs if layout in SPLIT_MODEL else [local_rows(x) for x in inputs]
    ours, norms, thresholds, calls = run(model, make(), mine)
    assert calls == [expected_calls(layout)] * STEPS, f"all_reduce calls per step {calls}"
    for step in range(STEPS):
        assert_identical(norms[step], ref_norms[step], f"last_norm at step {step}", True, RTOL)
        where = f"threshold and tracked norms at step {step}"
        assert_identical(thresholds[step], ref_thresholds[step], where, True, RTOL)
    entry = clip_entry(ours)
    assert_same_on_every_rank(entry, "the clip state")
    assert_identical(entry, clip_entry(reference), "clip state", nan_equal=True, rtol=RTOL)
    params = [full(q.detach()) for q in model.parameters()]
    ref_params = [q.detach() for q in mlp_parameters(reference)]
    for index, (param, ref) in enumerate(zip(params, ref_params, strict=True)):
        error = float(torch.linalg.vector_norm((param - ref).double()))
        scale = float(torch.linalg.vector_norm(ref.double()))
        assert error <= RTOL * scale, f"param {index}: relative error {error / scale:.3g}"


def mlp_parameters(optimizer: clipopt.ClippedOptimizer) -> list[Tensor]:
    return [q for group in optimizer.param_groups for q in group["params"]]


# --------------------------------------------------------------------------- norm cases


def whole_norms(grads: list[Tensor], p: float) -> Tensor:
    """Each grad gathered whole (a collective), then its float64 norm."""
    return torch.stack([torch.linalg.vector_norm(full(g).double(), p) for g in grads])


def assert_whole_tensor_norms(grads: list[Tensor], what: str) -> None:
    """One all_reduce per p, every rank the same, each norm the whole tensor's."""
    for p in (1.0, 2.0, 3.0, math.inf):
        with CountAllReduce() as counter:
            norms = global_per_tensor_norms(grads, p)
        assert counter.calls == 1, f"{what} p={p}: {counter.calls} all_reduce calls"
        assert type(norms) is Tensor and norms.shape == (len(grads),)
        assert_same_on_every_rank(norms, f"{what} p={p}")
        torch.testing.assert_close(
            norms.double(), whole_norms(grads, p), rtol=1e-6, atol=0.0, msg=f"{what} p={p}"
        )


def grads_of(model: nn.Module, x: Tensor) -> list[Tensor]:
    loss_fn(model(x)).backward()
    return [q.grad for q in model.parameters() if q.grad is not None]


def fsdp2_norms_case() -> None:
    """Shard(0) of 1, 5 and 7 rows over 2 ranks: an empty shard on rank 1, uneven ones."""
    from torch.distributed.device_mesh import init_device_mesh

    model = mlp()
    fully_shard_mlp(model, init_device_mesh("cpu", (WORLD_SIZE,)))
    grads = grads_of(model, local_rows(batches(1, 8, 3)[0]))
    rows = [g.to_local().shape[0] for g in grads]  # type: ignore[attr-defined]
    assert rows == ([1, 1, 3, 3, 4, 4] if dist.get_rank() == 0 else [0, 0, 2, 2, 3, 3]), rows
    assert_whole_tensor_norms(grads, "fsdp2")


def hsdp_norms_case() -> None:
    """(Replicate, Shard(0)) on a (2, 1) mesh: each replica counts once."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD_SIZE, 1), mesh_dim_names=("replicate", "shard"))
    model = mlp()
    fully_shard_mlp(model, mesh)
    assert_whole_tensor_norms(grads_of(model, local_rows(batches(1, 8, 3)[0])), "hsdp")


def tp_model(seed: int, *more: nn.Module) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3), *more)


def tp_norms_case() -> None:
    """Colwise Shard(0), Rowwise Shard(1), and a Replicate bias and LayerNorm."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    model = tp_model(3)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    grads = grads_of(model, batches(1, 6, 4, seed=11)[0])
    assert grads[3].placements[0].is_replicate(), "the rowwise bias should be Replicate"  # type: ignore[attr-defined]
    # The replicated bias among the sharded grads: its share (weighted 1/2) is sent
    # after theirs and must come back in its place.
    assert_whole_tensor_norms([grads[0], grads[3], grads[1], grads[2]], "tp")


def fsdp2_with_tp_norms_case() -> None:
    """FSDP2 over TP on a (1, 2) mesh: grads on the 2-D mesh and on its dp sub-mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (1, WORLD_SIZE), mesh_dim_names=("dp", "tp"))
    model = tp_model(4, nn.LayerNorm(3))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    grads = grads_of(model, batches(1, 6, 4, seed=17)[0])
    meshes = {g.device_mesh.ndim for g in grads}  # type: ignore[attr-defined]
    assert meshes == {1, 2}, meshes
    # The LayerNorm's bias (on the dp sub-mesh, weighted 1/2) among the TP'd grads.
    assert_whole_tensor_norms([grads[0], grads[-1], *grads[1:-1]], "fsdp2+tp")


# --------------------------------------------------------------------------- unit cases


def whole_units(t: Tensor) -> Tensor:
    """Every unit's float64 norm of one tensor gathered whole: its rows, or all of it."""
    whole = full(t.detach()).double()
    if whole.dim() <= 1:
        return torch.linalg.vector_norm(whole).reshape(1)
    return torch.linalg.vector_norm(whole.flatten(1), dim=1)


def assert_rows_in_place(t: Tensor, rows: Any) -> None:
    """The shard's rows are the whole tensor's ``[start, start + count)``: some window of
    its columns (a Shard(1) shard holds a few) equals the shard."""
    shard = t.detach().to_local().flatten(1)  # type: ignore[attr-defined]
    block = full(t.detach())[rows.start : rows.start + rows.count].flatten(1)
    width = shard.shape[1]
    windows = [block[:, k : k + width] for k in range(block.shape[1] - width + 1)]
    assert any(torch.equal(shard, w) for w in windows), f"rows {rows} of {tuple(t.shape)}"


def assert_whole_unit_norms(model: nn.Module, x: Tensor, what: str) -> None:
    """One all_reduce for every unit of every grad and weight, and the first and last
    grads measured whole too (as AGC measures excluded ones), every rank the same, each
    norm the whole unit's, each square its square; this rank's rows are where the layout
    says."""
    weights = list(model.parameters())
    grads = grads_of(model, x)
    whole = [grads[0], grads[-1]]
    with CountAllReduce() as counter:
        found = _units.whole_unit_norms(grads, weights, torch.float64, whole)
    assert counter.calls == 1, f"{what}: {counter.calls} all_reduce calls"
    norms = (found.grads, found.weights, found.grad_squares, found.whole_squares)
    assert_same_on_every_rank(norms, what)
    expected = torch.cat([whole_units(g) for g in grads])
    torch.testing.assert_close(found.grads, expected, rtol=1e-6, atol=0.0, msg=what)
    torch.testing.assert_close(found.grad_squares, expected.square(), rtol=1e-6, atol=0.0)
    expected = torch.cat([whole_units(w) for w in weights])
    torch.testing.assert_close(found.weights, expected, rtol=1e-6, atol=0.0, msg=what)
    expected = torch.stack([full(g).double().square().sum() for g in whole])
    torch.testing.assert_close(found.whole_squares, expected, rtol=1e-6, atol=0.0, msg=what)
    for g, r in zip(grads, found.rows, strict=True):
        if g.dim() >= 2:
            assert_rows_in_place(g, r)


def fsdp2_units_case() -> None:
    """Shard(0) rows, uneven and an empty shard: each rank's rows at their offsets."""
    from torch.distributed.device_mesh import init_device_mesh

    model = mlp()
    fully_shard_mlp(model, init_device_mesh("cpu", (WORLD_SIZE,)))
    assert_whole_unit_norms(model, local_rows(batches(1, 8, 3)[0]), "fsdp2")


def hsdp_units_case() -> None:
    """(Replicate, Shard(0)) on a (2, 1) mesh: each replica's rows count once."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD_SIZE, 1), mesh_dim_names=("replicate", "shard"))
    model = mlp()
    fully_shard_mlp(model, mesh)
    assert_whole_unit_norms(model, local_rows(batches(1, 8, 3)[0]), "hsdp")


def tp_units_case() -> None:
    """Colwise Shard(0), Rowwise Shard(1) (every row split), a Replicate bias."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = tp_model(3)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    assert_whole_unit_norms(model, batches(1, 6, 4, seed=11)[0], "tp")


def fsdp2_with_tp_units_case() -> None:
    """FSDP2 over TP: _StridedShard rows, and a LayerNorm on the dp sub-mesh."""
    model = fsdp2_over_tp(tp_model(4, nn.LayerNorm(3)))
    assert_whole_unit_norms(model, batches(1, 6, 4, seed=17)[0], "fsdp2+tp")


def strided_rows_case() -> None:
    """Rows strided across the ranks ({0, 2} and {1, 3}) are refused, on every rank,
    before any grad changes; a 1-D tensor strided alike is one unit and is measured."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    placements = [_StridedShard(0, split_factor=2)]

    def strided(local: Tensor, shape: tuple[int, ...]) -> Tensor:
        stride = torch.empty(shape).stride()
        return DTensor.from_local(local, mesh, placements, shape=shape, stride=stride)

    w = nn.Parameter(strided(torch.ones(2, 3), (4, 3)))
    w.grad = strided(torch.full((2, 3), 5.0), (4, 3))
    optimizer = clipopt.ClippedOptimizer(sgd([w]), max_norm=clipopt.AGC())
    try:
        optimizer.step()
    except ValueError as error:
        assert "(4, 3)" in str(error) and "_StridedShard" in str(error), error
    else:
        raise AssertionError("rows strided across ranks were not refused")
    assert torch.equal(w.grad.to_local(), torch.full((2, 3), 5.0))  # type: ignore[union-attr]
    bias = strided(torch.full((2,), 3.0 + dist.get_rank()), (4,))
    found = _units.whole_unit_norms([bias], [bias], torch.float64, whole=[w.grad])
    torch.testing.assert_close(found.grads, torch.tensor([(2 * 9.0 + 2 * 16.0) ** 0.5]).double())
    # Rows strided across ranks are one unit when measured whole (an excluded weight).
    torch.testing.assert_close(found.whole_squares, torch.tensor([4 * 3 * 25.0]).double())


def whole_norm(grads: list[Tensor], p: float) -> Tensor:
    """All grads gathered whole (a collective), then the float64 norm of them together."""
    return torch.linalg.vector_norm(torch.cat([full(g).double().flatten() for g in grads]), p)


def sharded_models() -> list[tuple[str, nn.Module, Tensor]]:
    """FSDP2 (an empty and uneven shards) and TP models, each with its rank's batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    fsdp = mlp()
    fully_shard_mlp(fsdp, mesh)
    tp = parallelize_module(tp_model(3), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fsdp_x, tp_x = local_rows(batches(1, 8, 3)[0]), batches(1, 6, 4, seed=11)[0]
    return [("fsdp2", fsdp, fsdp_x), ("tp", tp, tp_x)]


def step_norms_case() -> None:
    """A step's norms with DTensor grads, from ONE all_reduce: a per-tensor rule's, tracked
    by name, the global norm, and per group (finite orders; inf beside finite needs a
    MAX too), each to 1e-6 of the float64 norm of the gathered whole grads."""
    for layout, model, x in sharded_models():
        params = list(model.parameters())
        for p in (1.0, 2.0, 3.0, math.inf):
            model.zero_grad()
            grads = grads_of(model, x)
            each, total = whole_norms(grads, p), whole_norm(grads, p)
            rule = clipopt.AutoClip(50.0, 4, per_tensor=True)
            optimizer = clipopt.ClippedOptimizer(
                torch.optim.SGD(params, lr=0.0), rule, p, track_tensor_norms=True
            )
            with CountAllReduce() as counter:
                optimizer.step()
            what = f"{layout} p={p}"
            assert counter.calls == 1, f"{what}: {counter.calls} all_reduce calls"
            tracked = optimizer.last_tensor_norms
            assert tracked is not None and list(tracked) == [str(i) for i in range(len(grads))]
            assert optimizer.last_norm is not None and rule.last_threshold is not None
            torch.testing.assert_close(
                torch.stack(list(tracked.values())).double(), each, rtol=1e-6, atol=0.0, msg=what
            )
            torch.testing.assert_close(
                optimizer.last_norm.double(), total, rtol=1e-6, atol=0.0, msg=what
            )
            assert_same_on_every_rank(optimizer.state_dict()["clip"], what)
        for orders, collectives in (((1.0, 3.0), 1), ((2.0, math.inf), 2)):
            model.zero_grad()
            grads = grads_of(model, x)
            half = len(params) // 2
            expected = [
                whole_norm(grads[:half], orders[0]),
                whole_norm(grads[half:], orders[1]),
            ]
            groups = [
                {"params": params[:half], "clip_norm_type": orders[0]},
                {"params": params[half:], "clip_norm_type": orders[1]},
            ]
            optimizer = clipopt.ClippedOptimizer(
                torch.optim.SGD(groups, lr=0.0), 1e9, per_group=True, track_tensor_norms=True
            )
            with CountAllReduce() as counter:
                optimizer.step()
            what = f"{layout} per group {orders}"
            assert counter.calls == collectives, f"{what}: {counter.calls} all_reduce calls"
            assert optimizer.last_group_norms is not None and optimizer.last_norm is not None
            torch.testing.assert_close(
                optimizer.last_group_norms.double(),
                torch.stack(expected),
                rtol=1e-6,
                atol=0.0,
                msg=what,
            )
            torch.testing.assert_close(
                optimizer.last_norm.double(),
                torch.linalg.vector_norm(torch.stack(expected)),
                rtol=1e-6,
                atol=0.0,
                msg=what,
            )


# --------------------------------------------------------------------------- workers


def _rule_cases() -> dict[str, Callable[[], None]]:
    def bind(rule: str, layout: str) -> Callable[[], None]:
        return lambda: rule_case(rule, layout)

    return {
        f"{rule}-{layout}": bind(rule, layout)
        for rule, (_, layouts) in RULES.items()
        for layout in layouts
    }


CASES: dict[str, Callable[[], None]] = {
    "fsdp2_norms": fsdp2_norms_case,
    "hsdp_norms": hsdp_norms_case,
    "tp_norms": tp_norms_case,
    "fsdp2_with_tp_norms": fsdp2_with_tp_norms_case,
    "fsdp2_units": fsdp2_units_case,
    "hsdp_units": hsdp_units_case,
    "tp_units": tp_units_case,
    "fsdp2_with_tp_units": fsdp2_with_tp_units_case,
    "strided_rows": strided_rows_case,
    "step_norms": step_norms_case,
    **_rule_cases(),
}


def worker(rank: int, port: int, out_dir: str) -> None:
    """Every case in order, as ``test_distributed.worker``: stop once ranks disagree."""
    run_cases(rank, port, out_dir, CASES)


@pytest.fixture(scope="module")
def case_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    return rank_outcomes(worker, tmp_path_factory.mktemp("distributed_rules"), CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_one_process(case: str, case_results: dict[str, list[str]]) -> None:
    assert_all_ok(case_results[case])


# --------------------------------------------------------------------------- one process
#
# A world-size-1 gloo group in this process: the same code paths, no spawn.


CUDA = torch.cuda.is_available() and dist.is_nccl_available()


@pytest.fixture(scope="module")
def mesh_of_one() -> Iterator[Any]:
    """A CPU mesh over a world of one; with CUDA the group takes CUDA tensors too (NCCL)."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if CUDA else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def dtensor(local: Tensor, mesh: Any, placement: str) -> Tensor:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    kind = {"shard": Shard(0), "replicate": Replicate(), "partial": Partial()}[placement]
    return DTensor.from_local(local, mesh, [kind], run_check=False)


@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), min_size=1, max_size=5),
    placements=st.lists(st.sampled_from(["shard", "replicate"]), min_size=5, max_size=5),
    p=st.sampled_from([1.0, 1.5, 2.0, 3.0, math.inf]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_per_tensor_norms_of_dtensors_match_float64(
    mesh_of_one: Any,
    float64_norm: Any,
    sizes: list[list[int]],
    placements: list[str],
    p: float,
    dtype: torch.dtype,
) -> None:
    """Any mix of placements (so of weights and orders to put back), in one all_reduce."""
    locals_ = [(torch.randn(tuple(s)) * 3).to(dtype) for s in sizes]
    grads = [dtensor(t, mesh_of_one, kind) for t, kind in zip(locals_, placements, strict=False)]
    with CountAllReduce() as counter:
        norms = global_per_tensor_norms(grads, p)
    assert counter.calls == 1
    assert norms.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    expected = torch.tensor([float64_norm([t], p) for t in locals_], dtype=torch.float64)
    torch.testing.assert_close(norms.double(), expected, rtol=1e-6, atol=0.0)


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=2), min_size=1, max_size=6),
    kinds=st.lists(st.sampled_from(["shard", "replicate", "none"]), min_size=6, max_size=6),
    orders=st.lists(st.sampled_from([1.0, 1.5, 2.0, 3.0, math.inf]), min_size=3, max_size=3),
    per_group=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_a_dtensor_step_measurement_matches_float64(
    mesh_of_one: Any,
    float64_norm: Any,
    sizes: list[list[int]],
    kinds: list[str],
    orders: list[float],
    per_group: bool,
    dtype: torch.dtype,
) -> None:
    """Each grad's norm, each group's and the total, in groups with grads missing ("none"),
    from the reduced sums of powers: one all_reduce (a MAX as well where inf and finite
    orders mix across groups), each norm to 1e-6 of float64."""
    from clipopt._step import _measure

    gen = torch.Generator().manual_seed(len(sizes) * 7 + len(sizes[0]))
    locals_ = [(torch.randn(tuple(s), generator=gen) * 3).to(dtype) for s in sizes]
    params, grads_of_param = [], []
    for t, kind in zip(locals_, kinds, strict=False):
        placement = "shard" if kind == "none" else kind
        q = nn.Parameter(dtensor(torch.zeros_like(t), mesh_of_one, placement))
        q.grad = None if kind == "none" else dtensor(t, mesh_of_one, placement)
        params.append(q)
        grads_of_param.append(None if kind == "none" else t)
    split = [params[0::3], params[1::3], params[2::3]]
    kept = [grads_of_param[0::3], grads_of_param[1::3], grads_of_param[2::3]]
    if not per_group:
        orders = [orders[0]] * 3
    groups = [{"params": group} for group in split]
    grads = [[p.grad for p in g["params"] if p.grad is not None] for g in groups]
    with CountAllReduce() as counter:
        measured = _measure.measure_per_tensor(
            grads, None, _measure.Orders(orders, 2.0, per_group), None, lambda: split, strict=True
        )
    finite = {p != math.inf for p in orders}
    assert counter.calls == len(finite)
    each = [
        float64_norm([t], p)
        for ts, p in zip(kept, orders, strict=True)
        for t in ts
        if t is not None
    ]
    assert measured.tensor_norms is not None and measured.tensor_norms.shape == (len(each),)
    torch.testing.assert_close(
        measured.tensor_norms.double(), torch.tensor(each, dtype=torch.float64), rtol=1e-6, atol=0
    )
    wanted = [float64_norm(ts, p) for ts, p in zip(kept, orders, strict=True)]
    if per_group:
        total = float(torch.linalg.vector_norm(torch.tensor(wanted, dtype=torch.float64)))
        assert measured.stacked is not None
        torch.testing.assert_close(
            measured.stacked.double(), torch.tensor(wanted, dtype=torch.float64), rtol=1e-6, atol=0
        )
    else:
        total = float64_norm([t for ts in kept for t in ts], orders[0])
    double = dtype == torch.float64 and any(grads)  # no grad: float32, as the global norm
    assert measured.norm.dtype == (torch.float64 if double else torch.float32)
    torch.testing.assert_close(
        measured.norm.double(), torch.tensor(total, dtype=torch.float64), rtol=1e-6, atol=0
    )


def test_mixed_plain_and_dtensor_grads_are_refused_per_tensor(mesh_of_one: Any) -> None:
    """A per-tensor rule or tracked norms: the ValueError of the global norm, before any
    grad or state changes."""
    sharded = nn.Parameter(dtensor(torch.zeros(2), mesh_of_one, "shard"))
    plain = nn.Parameter(torch.zeros(3))
    for clip in (
        {"max_norm": clipopt.AdaGC(warmup_steps=0)},
        {"max_norm": 1.0, "track_tensor_norms": True},
    ):
        optimizer = clipopt.ClippedOptimizer(sgd([sharded, plain]), **clip)
        sharded.grad = dtensor(torch.full((2,), 5.0), mesh_of_one, "shard")
        plain.grad = torch.full((3,), 5.0)
        with pytest.raises(ValueError, match="DTensor and plain"):
            optimizer.step()
        assert torch.equal(plain.grad, torch.full((3,), 5.0))
        assert optimizer.last_norm is None and int(optimizer.step_count) == 0
        assert optimizer.rule is None or optimizer.rule.last_threshold is None


def test_plain_grads_take_no_collective(mesh_of_one: Any) -> None:
    """DDP's case: whole grads on every rank, each norm local, as in one process."""
    params = [nn.Parameter(torch.zeros(s)) for s in ((3,), (2, 2))]
    rule = clipopt.AutoClip(50.0, 4, per_tensor=True)
    optimizer = clipopt.ClippedOptimizer(sgd(params), max_norm=rule)
    for q in params:
        q.grad = torch.ones_like(q) * 3
    with CountAllReduce() as counter:
        optimizer.step()
        norms = global_per_tensor_norms([q.grad for q in params], 2.0)  # type: ignore[misc]
    assert counter.calls == 0
    assert torch.equal(norms, torch.tensor([27.0**0.5, 6.0]))


def test_a_per_tensor_step_on_dtensors_reads_nothing_on_the_host(
    mesh_of_one: Any, no_host_sync: Any
) -> None:
    """One all_reduce (every grad's norm, and from them the global norm), no host read."""
    params = [nn.Parameter(dtensor(torch.zeros(s), mesh_of_one, "shard")) for s in (3, 4)]
    rule = clipopt.AutoClip(50.0, 4, per_tensor=True)
    optimizer = clipopt.ClippedOptimizer(sgd(params), max_norm=rule)
    for step in range(3):
        for q, value in zip(params, (3.0 + step, 1.0), strict=True):
            q.grad = dtensor(torch.full(q.shape, value), mesh_of_one, "shard")
        with CountAllReduce() as counter, no_host_sync():
            optimizer.step()
        assert counter.calls == 1
    assert rule.last_threshold is not None
    # The median of the last norms, 3 * sqrt(3) and 4 * sqrt(3), for the first grad.
    threshold = 3.5 * 3.0**0.5
    torch.testing.assert_close(rule.last_threshold, torch.tensor([threshold, 2.0]))
    scaled = params[0].grad.to_local()  # type: ignore[union-attr]
    torch.testing.assert_close(scaled, torch.full((3,), 5.0) * (threshold / (75.0**0.5 + 1e-6)))


def test_refused_per_tensor_input(mesh_of_one: Any) -> None:
    """Mixed plain and DTensor grads, a Partial grad, no grads; and, on ClippedOptimizer, a
    per-tensor rule with a process_group (each rank's rows are other tensors)."""
    shard = dtensor(torch.ones(2), mesh_of_one, "shard")
    with pytest.raises(ValueError, match="DTensor and plain"):
        global_per_tensor_norms([shard, torch.ones(2)], 2.0)
    with pytest.raises(ValueError, match="Partial"):
        global_per_tensor_norms([dtensor(torch.ones(2), mesh_of_one, "partial")], 2.0)
    with pytest.raises(ValueError, match="at least one"):
        global_per_tensor_norms([], 2.0)
    w = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="process_group"):
        clipopt.ClippedOptimizer(
            sgd([w]),
            max_norm=clipopt.AutoClip(per_tensor=True),
            process_group=dist.group.WORLD,  # type: ignore[arg-type]
        )


@pytest.mark.skipif(not CUDA, reason="needs CUDA and NCCL")
def test_cuda_dtensor_per_tensor_norms_stay_on_the_device(
    mesh_of_one: Any, float64_norm: Any, no_host_sync: Any
) -> None:
    """The reduction runs on the grads' device and never waits for it (after a first call,
    which sets up NCCL's communicator); a per-tensor step reads nothing on the host."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (1,))
    values = [torch.randn(s, device="cuda") * 3 for s in ((5, 2), (0,), (4,))]
    grads = [
        dtensor(t, mesh, kind)
        for t, kind in zip(values, ("shard", "shard", "replicate"), strict=True)
    ]
    for p in (2.0, math.inf):
        global_per_tensor_norms(grads, p)
        with sync_is_an_error():
            norms = global_per_tensor_norms(grads, p)
        assert norms.device.type == "cuda" and norms.dtype == torch.float32
        expected = torch.tensor([float64_norm([t], p) for t in values], dtype=torch.float64)
        torch.testing.assert_close(norms.double().cpu(), expected, rtol=1e-6, atol=0.0)
    params = [nn.Parameter(dtensor(torch.zeros_like(t), mesh, "shard")) for t in values]
    rule = clipopt.AutoClip(50.0, 4, per_tensor=True)
    optimizer = clipopt.ClippedOptimizer(sgd(params), max_norm=rule)
    for step in range(3):
        for q, t in zip(params, values, strict=True):
            q.grad = dtensor(t * (step + 1), mesh, "shard")
        with CountAllReduce() as counter, no_host_sync():
            optimizer.step()
        assert counter.calls == 1
    assert rule.last_threshold is not None and rule.last_threshold.device.type == "cuda"


# --------------------------------------------------------------------------- AGC, one process


def agc_dtensors(mesh: Any, shapes: list[tuple[int, ...]], kinds: list[str]) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(5)
    return [
        nn.Parameter(dtensor(torch.randn(s, generator=gen), mesh, kind))
        for s, kind in zip(shapes, kinds, strict=True)
    ]


def test_an_agc_step_on_dtensors_is_timms_and_reads_nothing_on_the_host(
    mesh_of_one: Any, no_host_sync: Any
) -> None:
    """Shard(0) and Replicate weights of 1, 2 and 4 dims: the grads and last_threshold of
    timm's AGC in float64, every unit of every tensor; an excluded one left as it is;
    last_norm and the tracked norms (the excluded grad's too) of the float64 grads; one
    all_reduce, no host read."""
    shapes = [(4, 3), (5,), (2, 3, 2, 2), (3, 2), (3, 2, 2)]
    kinds = ["shard", "shard", "shard", "replicate", "shard"]
    params = agc_dtensors(mesh_of_one, shapes, kinds)
    rule = clipopt.AGC(clipping=0.05, exclude=params[-1:])
    optimizer = clipopt.ClippedOptimizer(
        torch.optim.SGD(params, lr=0.0), max_norm=rule, track_tensor_norms=True
    )
    gen = torch.Generator().manual_seed(9)
    for step in range(3):
        values = [torch.randn(s, generator=gen) * 10.0**step for s in shapes]
        for q, v, kind in zip(params, values, kinds, strict=True):
            q.grad = dtensor(v.clone(), mesh_of_one, kind)
        with CountAllReduce() as counter, no_host_sync():
            optimizer.step()
        assert counter.calls == 1
        weights = [q.detach().to_local() for q in params]  # type: ignore[attr-defined]
        clipped, thresholds, scaled = timm_agc(weights[:-1], values[:-1], 0.05, 1e-3, torch.float64)
        for q, expected in zip(params, [*clipped, values[-1].double()], strict=True):
            got = q.grad.to_local().double()  # type: ignore[union-attr]
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=0.0)
        assert rule.last_threshold is not None
        torch.testing.assert_close(rule.last_threshold.double(), torch.cat(thresholds))
        squares = torch.stack([v.double().square().sum() for v in values])
        assert optimizer.last_norm is not None and optimizer.last_norm.dtype == torch.float32
        torch.testing.assert_close(
            optimizer.last_norm.double(), squares.sum().sqrt(), rtol=1e-6, atol=0.0
        )
        tracked = optimizer.last_tensor_norms
        assert tracked is not None
        torch.testing.assert_close(
            torch.stack(list(tracked.values())).double(), squares.sqrt(), rtol=1e-6, atol=0.0
        )
    assert int(optimizer.clipped_count) >= 2 and scaled


def test_an_agc_step_on_dtensors_with_grads_missing_reads_nothing_on_the_host(
    mesh_of_one: Any, no_host_sync: Any
) -> None:
    """A parameter without a grad, one excluded without a grad too: their units are in
    the one reduction (zeros), the others' grads and last_threshold are timm's in
    float64, last_norm and the tracked norms those of the grads present; no host read."""
    shapes = [(4, 3), (5,), (3, 2), (2, 2)]
    kinds = ["shard", "shard", "replicate", "shard"]
    params = agc_dtensors(mesh_of_one, shapes, kinds)
    rule = clipopt.AGC(clipping=0.05, exclude=params[-1:])
    optimizer = clipopt.ClippedOptimizer(
        torch.optim.SGD(params, lr=0.0), max_norm=rule, track_tensor_norms=True
    )
    gen = torch.Generator().manual_seed(11)
    held = [0, 2]
    values = [torch.randn(shapes[i], generator=gen) * 3.0 for i in held]
    for i, v in zip(held, values, strict=True):
        params[i].grad = dtensor(v.clone(), mesh_of_one, kinds[i])
    with CountAllReduce() as counter, no_host_sync():
        optimizer.step()
    assert counter.calls == 1
    assert params[1].grad is None and params[3].grad is None
    weights = [params[i].detach().to_local() for i in held]  # type: ignore[attr-defined]
    clipped, thresholds, scaled = timm_agc(weights, values, 0.05, 1e-3, torch.float64)
    for i, expected in zip(held, clipped, strict=True):
        got = params[i].grad.to_local().double()  # type: ignore[union-attr]
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0.0)
    assert rule.last_threshold is not None
    torch.testing.assert_close(rule.last_threshold.double(), torch.cat(thresholds))
    squares = torch.stack([v.double().square().sum() for v in values])
    assert optimizer.last_norm is not None
    torch.testing.assert_close(
        optimizer.last_norm.double(), squares.sum().sqrt(), rtol=1e-6, atol=0.0
    )
    tracked = optimizer.last_tensor_norms
    assert tracked is not None and list(tracked) == ["0", "2"]
    torch.testing.assert_close(
        torch.stack(list(tracked.values())).double(), squares.sqrt(), rtol=1e-6, atol=0.0
    )
    assert scaled


def test_agc_refuses_a_grad_laid_out_otherwise_than_its_parameter(mesh_of_one: Any) -> None:
    """Before any grad changes, naming the parameter's shape and both placements."""
    (w,) = agc_dtensors(mesh_of_one, [(4, 3)], ["shard"])
    w.grad = dtensor(torch.full((4, 3), 5.0), mesh_of_one, "replicate")
    optimizer = clipopt.ClippedOptimizer(sgd([w]), max_norm=clipopt.AGC())
    with pytest.raises(ValueError, match=r"shape \(4, 3\) with placements \(Shard\(dim=0\),\)"):
        optimizer.step()
    assert torch.equal(w.grad.to_local(), torch.full((4, 3), 5.0))  # type: ignore[union-attr]
    assert optimizer.last_norm is None and optimizer.rule is not None
    assert int(optimizer.clipped_count) == 0


def test_agc_refuses_a_shard_whose_rows_are_not_its_layouts(mesh_of_one: Any) -> None:
    """A shard of 3 rows said to be all 5 rows of its tensor on a mesh of one."""
    from torch.distributed.tensor import DTensor, Shard

    def wrong(value: float) -> Tensor:
        local = torch.full((3, 2), value)
        return DTensor.from_local(local, mesh_of_one, [Shard(0)], shape=(5, 2), stride=(2, 1))

    w = nn.Parameter(wrong(1.0))
    w.grad = wrong(5.0)
    optimizer = clipopt.ClippedOptimizer(sgd([w]), max_norm=clipopt.AGC())
    with pytest.raises(ValueError, match=r"shape \(5, 2\).*holds 3 rows, not 5"):
        optimizer.step()
    assert torch.equal(w.grad.to_local(), torch.full((3, 2), 5.0))  # type: ignore[union-attr]


def test_unit_norms_refuse_partial_and_mixed_tensors(mesh_of_one: Any) -> None:
    """A Partial grad has no norm until reduced (1-D and 2-D); a plain weight beside a
    DTensor grad carries no placement to match it with."""
    for shape in ((3,), (3, 2)):
        partial = dtensor(torch.ones(shape), mesh_of_one, "partial")
        with pytest.raises(ValueError, match=re.escape(f"shape {shape}") + ".*Partial"):
            _units.whole_unit_norms([partial], [partial], torch.float32)
    shard = dtensor(torch.ones(3, 2), mesh_of_one, "shard")
    with pytest.raises(ValueError, match="1 of 2 grads and weights are DTensors"):
        _units.whole_unit_norms([shard], [torch.ones(3, 2)], torch.float32)


def test_unit_norms_refuse_a_grad_shard_unlike_its_weights_and_unrelated_meshes(
    mesh_of_one: Any,
) -> None:
    """A 1-D grad whose shard is not its weight's shard is refused; tensors on two meshes
    built apart over the same ranks are measured together, each unit once (meshes are
    matched by their ranks: tests/test_distributed_pipeline.py refuses meshes none of
    which holds the others' ranks, on 4 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = mesh_of_one
    weight = DTensor.from_local(torch.ones(3), mesh, [Shard(0)], shape=(3,), stride=(1,))
    grad = DTensor.from_local(torch.ones(2), mesh, [Shard(0)], shape=(3,), stride=(1,))
    with pytest.raises(ValueError, match=r"shape \(3,\).*grad's shard is \(2,\), not \(3,\)"):
        _units.whole_unit_norms([grad], [weight], torch.float32)
    one = init_device_mesh("cpu", (1,), mesh_dim_names=("one",))
    other = init_device_mesh("cpu", (1,), mesh_dim_names=("other",))
    pair = [dtensor(torch.full((2,), 3.0), one, "shard"), dtensor(torch.ones(2), other, "shard")]
    found = _units.whole_unit_norms(pair, pair, torch.float32)
    expected = torch.stack([torch.linalg.vector_norm(t.to_local()) for t in pair])
    torch.testing.assert_close(found.grads, expected, rtol=0, atol=0)


def test_strided_rows_are_ranges_only_as_fsdp2_over_tp_makes_them() -> None:
    """On a (2, 2) mesh, _StridedShard on dp then Shard on tp (FSDP2 over TP) gives each
    rank a range of rows; the other order, or a _StridedShard alone, strides them."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    strided = _StridedShard(0, split_factor=2)
    for rows in (8, 7, 5, 4, 1, 0):
        shape = (rows, 3)
        assert _units.rows_at(shape, (2, 2), (0, 0), (strided, Shard(0))) is not None
        if rows >= 4:  # rows {0, 2} and {1, 3} of 4, {0, 1, 3} and {2, 4} of 5
            assert _units.rows_at(shape, (2,), (0,), (strided,)) is None
        if rows >= 7:  # each half cut as the 4 rows above
            assert _units.rows_at(shape, (2, 2), (0, 0), (Shard(0), strided)) is None


def pieces(ids: Tensor, count: int) -> list[Tensor]:
    """``ids`` cut by torch.chunk into ``count`` pieces, the missing last ones empty."""
    found = list(ids.chunk(count)) if ids.numel() else []
    return found + [ids[:0]] * (count - len(found))


def simulated_rows(
    rows: int, mesh_shape: tuple[int, ...], at: tuple[int, ...], kinds: Any
) -> Tensor:
    """The rows the rank at ``at`` holds, cut as DTensor documents its placements: Shard
    takes its chunk of the rows left; _StridedShard(sf) cuts them into sf chunks first
    and takes its piece of each (what TP then FSDP2 leave on a rank)."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    ids = torch.arange(rows)
    for size, index, kind in zip(mesh_shape, at, kinds, strict=True):
        if isinstance(kind, _StridedShard) and kind.dim == 0:
            parts = pieces(ids, kind.split_factor)
            ids = torch.cat([pieces(part, size)[index] for part in parts])
        elif isinstance(kind, Shard) and kind.dim == 0:
            ids = pieces(ids, size)[index]
    return ids


def placement_kinds() -> Any:
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    strided = [_StridedShard(0, split_factor=f) for f in (2, 3)]
    return st.sampled_from([Replicate(), Shard(0), Shard(1), *strided])


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(0, 12),
    mesh_shape=st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple),
    data=st.data(),
)
def test_each_ranks_rows_are_where_the_placements_put_them(
    rows: int, mesh_shape: tuple[int, ...], data: Any
) -> None:
    """Over every coordinate of a mesh of up to 3 dims: the rows each rank holds are the
    range found, and a layout is refused exactly when some rank's rows are not a range."""
    import itertools

    kinds = tuple(data.draw(placement_kinds()) for _ in mesh_shape)
    shape = (rows, 4)
    coordinates = list(itertools.product(*(range(n) for n in mesh_shape)))
    held = [simulated_rows(rows, mesh_shape, at, kinds) for at in coordinates]
    ranges = all(
        torch.equal(h, torch.arange(int(h[0]), int(h[0]) + len(h))) for h in held if len(h)
    )
    for at, ids in zip(coordinates, held, strict=True):
        found = _units.rows_at(shape, mesh_shape, at, kinds)
        if not ranges:
            assert found is None, (at, kinds, held)
            continue
        assert found is not None and found.units == rows and found.count == len(ids), (at, kinds)
        if len(ids):
            assert found.start == int(ids[0]), (at, kinds, held)


@pytest.mark.parametrize(
    ("mesh_shape", "kinds"),
    [
        ((2, 2), ("shard0", "shard1")),
        ((2, 2), ("replicate", "shard1")),
        ((3, 2), ("shard0", "shard0")),
    ],
)
def test_placed_shares_of_four_or_six_ranks_sum_to_each_rows_norm(
    mesh_shape: tuple[int, int], kinds: tuple[str, str]
) -> None:
    """What the one all_reduce sums, for layouts two ranks cannot make: rows and columns
    split on a 2-D mesh, replicas, rows split twice (uneven, some ranks empty)."""
    import itertools

    from torch.distributed.tensor.placement_types import Replicate, Shard

    placements = tuple(
        {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}[k] for k in kinds
    )
    whole = torch.randn(5, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    replicas = math.prod(n for n, k in zip(mesh_shape, kinds, strict=True) if k == "replicate")
    total = torch.zeros(5, dtype=torch.float64)
    for at in itertools.product(*(range(n) for n in mesh_shape)):
        ids = simulated_rows(5, mesh_shape, at, placements)
        columns = torch.arange(7)
        for n, index, k in zip(mesh_shape, at, kinds, strict=True):
            if k == "shard1":
                columns = pieces(columns, n)[index]
        local = whole[ids][:, columns]
        rows = _units.rows_at((5, 7), mesh_shape, at, placements)
        assert rows is not None
        share = torch.linalg.vector_norm(local, dim=1).square() if local.numel() else local.sum(1)
        total += _units._placed(share, rows, replicas)
    expected = torch.linalg.vector_norm(whole, dim=1).square()
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=0.0)


@pytest.mark.skipif(not CUDA, reason="needs CUDA and NCCL")
def test_cuda_agc_step_on_dtensors_stays_on_the_device(mesh_of_one: Any) -> None:
    """After a first step (NCCL's set-up), an AGC step waits for nothing on the GPU."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (1,))
    shapes, kinds = [(4, 3), (5,), (3, 2)], ["shard", "shard", "replicate"]
    gen = torch.Generator().manual_seed(5)
    params = [
        nn.Parameter(dtensor(torch.randn(s, generator=gen).cuda(), mesh, kind))
        for s, kind in zip(shapes, kinds, strict=True)
    ]
    rule = clipopt.AGC(clipping=0.05)
    optimizer = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.0), max_norm=rule)
    for step in range(3):
        values = [torch.randn(s, generator=gen).cuda() * 10.0**step for s in shapes]
        for q, v, kind in zip(params, values, kinds, strict=True):
            q.grad = dtensor(v.clone(), mesh, kind)
        if step == 0:
            optimizer.step()
            continue
        with sync_is_an_error():
            optimizer.step()
    weights = [q.detach().to_local().cpu() for q in params]  # type: ignore[attr-defined]
    clipped, thresholds, _ = timm_agc(weights, [v.cpu() for v in values], 0.05, 1e-3, torch.float64)
    for q, expected in zip(params, clipped, strict=True):
        got = q.grad.to_local().double().cpu()  # type: ignore[union-attr]
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0.0)
    assert rule.last_threshold is not None and rule.last_threshold.device.type == "cuda"
    torch.testing.assert_close(rule.last_threshold.double().cpu(), torch.cat(thresholds))
