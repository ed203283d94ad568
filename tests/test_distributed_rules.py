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
  and gives the global norm too.
- A norm case checks :func:`clipopt._per_tensor.global_per_tensor_norms` against the
  float64 norm of each whole (gathered) tensor, under FSDP2, HSDP, TP and FSDP2 over TP.

A new rule is one entry in ``RULES``, with the layouts it runs under.
"""

from __future__ import annotations

import json
import math
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import assert_identical, sync_is_an_error
from hypothesis import given, settings
from hypothesis import strategies as st
from test_distributed import (
    WORLD_SIZE,
    CountAllReduce,
    all_ranks_failed,
    batches,
    free_port,
    full,
    fully_shard_mlp,
    init_gloo,
    local_rows,
    loss_fn,
    mlp,
    rank_outcomes,
)
from torch import Tensor, nn

import clipopt
from clipopt import _per_tensor

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
)

RTOL = 1e-5
STEPS = 10
SPIKES = {6: 40.0, 9: 25.0}
"""Steps whose loss (so every grad) is scaled: each rule must react to them."""


def spike_skip() -> dict[str, Any]:
    return {"max_norm": 50.0, "skip_spikes": clipopt.SpikeSkip(window=4, sigma=2.0, min_history=3)}


LAYOUTS = ("ddp", "fsdp2", "tp")
"""DDP and FSDP2 split the batch (each rank its rows); tensor parallelism splits the model."""

PLAIN = ("ddp",)
"""The layouts of a rule that refuses DTensor grads."""

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
    "agc": (lambda: {"max_norm": clipopt.AGC(clipping=0.05)}, PLAIN),  # units on one rank
    "adagc_tracked": (
        lambda: {
            "max_norm": clipopt.AdaGC(ratio=1.02, beta=0.9, warmup_steps=3),
            "track_tensor_norms": True,
        },
        LAYOUTS,
    ),
    "fixed_tracked": (lambda: {"max_norm": 0.5, "track_tensor_norms": True}, LAYOUTS),
}
"""Each rule's ClippedOptimizer clip settings (made fresh for every run), and the layouts
it runs under."""


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
    optimizer = clipopt.ClippedOptimizer(sgd(model.parameters()), **clip)
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
        assert int(optimizer.rule.clipped_count) >= 2, optimizer.rule.clipped_count
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
    return (tp_model(3) if layout == "tp" else mlp()).double()


def layout_model(layout: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    model = single_model(layout)
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
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


def expected_calls(layout: str) -> int:
    """FSDP2, TP: one all_reduce, per-tensor rules and tracked norms included."""
    return 0 if layout == "ddp" else 1


def rule_case(rule: str, layout: str) -> None:
    width = 4 if layout == "tp" else 3
    inputs = [x.double() for x in batches(STEPS, 8, width)]
    make = RULES[rule][0]
    reference, ref_norms, ref_thresholds, _ = run(single_model(layout), make(), inputs)
    assert_reacts_to_spikes(reference)
    assert max(float(n) for n in ref_norms) > 1.0, "no step for a fixed max_norm to clip"
    model = layout_model(layout)
    clip = make()
    mine = inputs if layout == "tp" else [local_rows(x) for x in inputs]
    ours, norms, thresholds, calls = run(model, clip, mine)
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
            norms = _per_tensor.global_per_tensor_norms(grads, p)
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
    "step_norms": step_norms_case,
    **_rule_cases(),
}


def worker(rank: int, port: int, out_dir: str) -> None:
    """Every case in order, as ``test_distributed.worker``: stop once ranks disagree."""
    results: dict[str, str] = {}
    try:
        init_gloo(rank, WORLD_SIZE, port)
        control = dist.new_group(list(range(WORLD_SIZE)))
        for name, case in CASES.items():
            try:
                case()
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc()
            some, every = all_ranks_failed(control, results[name] != "ok")
            if some and not every:
                break
    except Exception:
        results["<setup>"] = traceback.format_exc()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def case_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    return rank_outcomes(worker, tmp_path_factory.mktemp("distributed_rules"), CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_one_process(case: str, case_results: dict[str, list[str]]) -> None:
    failures = [f"rank {r}:\n{o}" for r, o in enumerate(case_results[case]) if o != "ok"]
    assert not failures, "\n".join(failures)


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
        norms = _per_tensor.global_per_tensor_norms(grads, p)
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
    from clipopt import _monitor, _step

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
    grads = _step.collect_grads(groups)
    with CountAllReduce() as counter:
        measured = _monitor.measure_per_tensor(
            grads, None, orders, 2.0, per_group, None, lambda: split, strict=True
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
        norms = _per_tensor.global_per_tensor_norms([q.grad for q in params], 2.0)  # type: ignore[misc]
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
        _per_tensor.global_per_tensor_norms([shard, torch.ones(2)], 2.0)
    with pytest.raises(ValueError, match="Partial"):
        _per_tensor.global_per_tensor_norms([dtensor(torch.ones(2), mesh_of_one, "partial")], 2.0)
    with pytest.raises(ValueError, match="at least one"):
        _per_tensor.global_per_tensor_norms([], 2.0)
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
        _per_tensor.global_per_tensor_norms(grads, p)
        with sync_is_an_error():
            norms = _per_tensor.global_per_tensor_norms(grads, p)
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
