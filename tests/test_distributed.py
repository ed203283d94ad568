"""The global grad norm under real multi-process runs (gloo on 127.0.0.1, world size 2).

Every layout runs in ONE spawn (a spawn costs several seconds here): the workers run each
case in turn and record "ok" or the traceback per case, and one parametrized test per
case reads the records. Each case compares against a single-process run of the same
model and data, which every rank computes itself, to 1e-6 relative: the norms of every
step and the parameters after several clipped steps.

A case that fails on one rank only leaves the other waiting in a collective; the 60 s
process-group timeout ends that wait, the workers stop at their first failure, and the
parent kills anything still alive after ``JOIN_TIMEOUT_S``.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import (
    FSDP2_ON_CPU,
    FSDP2_UNAVAILABLE,
    assert_all_ok,
    assert_same,
    forbid_fsdp2_where_it_cannot_run,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import clipopt
from clipopt import distributed as cdist
from clipopt._dist import _reduce

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
)

WORLD_SIZE = 2
PG_TIMEOUT = datetime.timedelta(seconds=60)
JOIN_TIMEOUT_S = 240.0
RTOL = 1e-6
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "distributed_fsdp2.py"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_gloo(
    rank: int, world_size: int, port: int, timeout: datetime.timedelta = PG_TIMEOUT
) -> None:
    torch.set_num_threads(1)
    forbid_fsdp2_where_it_cannot_run()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


# --------------------------------------------------------------------------- helpers


def assert_rel(actual: Tensor, expected: Tensor, what: str) -> None:
    """``actual`` equals ``expected`` to RTOL relative (a tiny atol for values near 0)."""
    torch.testing.assert_close(
        actual.detach().double().cpu(),
        expected.detach().double().cpu(),
        rtol=RTOL,
        atol=1e-7,
        msg=lambda m: f"{what}: {m}",
    )


def assert_rel_tensor(actual: Tensor, expected: Tensor, what: str) -> None:
    """``||actual - expected|| <= RTOL * ||expected||``: relative to the tensor's size, so
    an element near zero may carry the float32 rounding of its neighbours."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == e.shape, f"{what}: shapes {a.shape} and {e.shape}"
    error = float(torch.linalg.vector_norm(a - e))
    scale = float(torch.linalg.vector_norm(e))
    assert error <= RTOL * scale, f"{what}: relative error {error / scale:.3g} > {RTOL}"


def full(t: Tensor) -> Tensor:
    """A parameter's full value: DTensors are gathered (a collective)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def assert_same_on_all_ranks(t: Tensor, what: str) -> None:
    assert type(t) is Tensor, f"{what} is a {type(t).__name__}, not a plain tensor"
    mine = t.detach().reshape(1).double()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    for other in gathered:
        assert torch.equal(other, mine) or (other.isnan().all() and mine.isnan().all()), (
            f"{what} differs across ranks: {gathered}"
        )


class CountAllReduce:
    """Counts ``torch.distributed.all_reduce`` calls made while it is active."""

    def __init__(self) -> None:
        self.calls = 0
        self._original = dist.all_reduce

    def __enter__(self) -> CountAllReduce:
        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self._original(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._original


def mlp(seed: int = 0) -> nn.Sequential:
    """First layer has 1 output row (an empty shard on rank 1), the others split unevenly."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 1), nn.Tanh(), nn.Linear(1, 5), nn.Tanh(), nn.Linear(5, 7))


def batches(steps: int, rows: int, width: int, seed: int = 7) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, width, generator=gen) * 3 for _ in range(steps)]


def loss_fn(output: Tensor) -> Tensor:
    """Mean over the batch, so averaging per-rank grads gives the full-batch grad."""
    return output.pow(2).sum(dim=1).mean() * 10


def local_rows(batch: Tensor) -> Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    size = batch.shape[0] // world
    return batch[rank * size : (rank + 1) * size]


def train(
    model: nn.Module,
    optimizer: clipopt.ClippedOptimizer,
    inputs: list[Tensor],
    count_step_all_reduces: bool = False,
) -> tuple[list[Tensor], list[int]]:
    """Clipped steps; returns each step's ``last_norm`` and all_reduce count in ``step``."""
    norms, calls = [], []
    for x in inputs:
        optimizer.zero_grad()
        loss_fn(model(x)).backward()
        with CountAllReduce() as counter:
            optimizer.step()
        calls.append(counter.calls)
        assert optimizer.last_norm is not None
        norms.append(optimizer.last_norm.clone())
    return norms, calls


def reference(
    model: nn.Module,
    make_inner: Callable[[Any], torch.optim.Optimizer],
    inputs: list[Tensor],
    **clip: Any,
) -> tuple[list[Tensor], list[Tensor]]:
    """The single-process run: same model and full batches. Returns (norms, params)."""
    optimizer = clipopt.ClippedOptimizer(make_inner(model.parameters()), **clip)
    norms, _ = train(model, optimizer, inputs)
    return norms, [p.detach().clone() for p in model.parameters()]


def compare_runs(
    norms: list[Tensor],
    ref_norms: list[Tensor],
    params: Iterator[Tensor],
    ref_params: list[Tensor],
    what: str,
) -> None:
    assert len(norms) == len(ref_norms)
    for step, (norm, ref) in enumerate(zip(norms, ref_norms, strict=True)):
        assert_same_on_all_ranks(norm, f"{what} norm at step {step}")
        assert_rel(norm, ref, f"{what} norm at step {step}")
    assert any(float(n) > 0.5 for n in ref_norms), "the test data should make clipping happen"
    for index, (param, ref) in enumerate(zip(params, ref_params, strict=True)):
        assert_rel_tensor(full(param.detach()), ref, f"{what} param {index}")


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


# --------------------------------------------------------------------------- cases


def case_ddp() -> None:
    """DDP averages grads already: no communication is added, the norm is the global one."""
    from torch.nn.parallel import DistributedDataParallel

    inputs = batches(4, 8, 3)
    ref_norms, ref_params = reference(mlp(), sgd, inputs, max_norm=0.5)
    model = DistributedDataParallel(mlp())
    optimizer = clipopt.ClippedOptimizer(sgd(model.parameters()), max_norm=0.5)
    norms, calls = train(model, optimizer, [local_rows(x) for x in inputs])
    assert calls == [0] * len(inputs), f"DDP steps made all_reduce calls: {calls}"
    compare_runs(norms, ref_norms, model.parameters(), ref_params, "ddp")


def fully_shard_mlp(model: nn.Sequential, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def case_fsdp2() -> None:
    """FSDP2 with an empty and uneven shards, for p in {1, 2, 3, inf}: one all_reduce."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    inputs = batches(3, 8, 3)
    for p in (1.0, 2.0, 3.0, math.inf):
        ref_norms, ref_params = reference(mlp(), adam, inputs, max_norm=0.5, norm_type=p)
        model = mlp()
        fully_shard_mlp(model, mesh)
        shards = [p_.to_local().shape[0] for p_ in model.parameters()]  # type: ignore[attr-defined]
        if dist.get_rank() == 1:
            assert 0 in shards, f"rank 1 should hold an empty shard, has {shards}"
        optimizer = clipopt.ClippedOptimizer(adam(model.parameters()), max_norm=0.5, norm_type=p)
        norms, calls = train(model, optimizer, [local_rows(x) for x in inputs])
        assert calls == [1] * len(inputs), f"p={p}: all_reduce calls per step {calls}"
        compare_runs(norms, ref_norms, model.parameters(), ref_params, f"fsdp2 p={p}")
        # The functional API gives the same global norm for the same grads.
        loss_fn(model(local_rows(inputs[0]))).backward()
        grads = [q.grad for q in model.parameters()]
        ours = clipopt.get_total_norm(grads, p)
        local = [g.to_local() for g in grads]  # type: ignore[union-attr]
        gathered = [torch.empty(0)] * WORLD_SIZE
        dist.all_gather_object(gathered, [t.double() for t in local])
        expected = _sharded_reference(gathered, [g.placements for g in grads], p)  # type: ignore[union-attr]
        assert_same_on_all_ranks(ours, f"get_total_norm p={p}")
        assert_rel(ours, expected, f"get_total_norm p={p}")


def _sharded_reference(gathered: list[Any], placements: list[Any], p: float) -> Tensor:
    """The float64 norm of the concatenated shards of every rank (Shard(0) grads only)."""
    pieces = [shard.flatten() for rank_shards in gathered for shard in rank_shards]
    assert all(len(pl) == 1 and pl[0].is_shard() for pl in placements)
    return torch.linalg.vector_norm(torch.cat(pieces), p)


def case_hsdp() -> None:
    """HSDP-like (replicate=2, shard=1) mesh: Replicate dims are weighted so replicas count once."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD_SIZE, 1), mesh_dim_names=("replicate", "shard"))
    inputs = batches(3, 8, 3)
    for p in (2.0, math.inf):
        ref_norms, ref_params = reference(mlp(), sgd, inputs, max_norm=0.5, norm_type=p)
        model = mlp()
        fully_shard_mlp(model, mesh)
        for q in model.parameters():
            replicate, shard = q.placements  # type: ignore[attr-defined]
            assert replicate.is_replicate() and shard.is_shard(), q.placements  # type: ignore[attr-defined]
        optimizer = clipopt.ClippedOptimizer(sgd(model.parameters()), max_norm=0.5, norm_type=p)
        norms, calls = train(model, optimizer, [local_rows(x) for x in inputs])
        assert calls == [1] * len(inputs), calls
        compare_runs(norms, ref_norms, model.parameters(), ref_params, f"hsdp p={p}")


def case_tensor_parallel() -> None:
    """TP on a (2,) mesh: Colwise (Shard(0)), Rowwise (Shard(1)) and a Replicate bias."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    def tp_model() -> nn.Sequential:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    inputs = batches(3, 6, 4, seed=11)  # the same full batch on every TP rank
    for p in (2.0, 3.0, math.inf):
        ref_norms, ref_params = reference(tp_model(), sgd, inputs, max_norm=0.5, norm_type=p)
        model = tp_model()
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        replicated = [q for q in model.parameters() if q.placements[0].is_replicate()]  # type: ignore[attr-defined]
        assert len(replicated) == 1, "the rowwise bias should be Replicate"
        optimizer = clipopt.ClippedOptimizer(sgd(model.parameters()), max_norm=0.5, norm_type=p)
        norms, calls = train(model, optimizer, inputs)
        assert calls == [1] * len(inputs), calls
        compare_runs(norms, ref_norms, model.parameters(), ref_params, f"tp p={p}")


def case_fsdp2_with_tensor_parallel() -> None:
    """FSDP2 over TP on one 2-D (dp=1, tp=2) mesh: _StridedShard dims count as sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    def tp_model() -> nn.Sequential:
        torch.manual_seed(4)
        layers = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3), nn.LayerNorm(3))
        return layers.double()

    # float64: TP reorders the matmul sums, and in float32 that drift alone reaches 1e-6
    # after a few steps; in float64 any difference left is the norm's.
    mesh = init_device_mesh("cpu", (1, WORLD_SIZE), mesh_dim_names=("dp", "tp"))
    inputs = [x.double() for x in batches(3, 6, 4, seed=17)]
    for p in (2.0, math.inf):
        ref_norms, ref_params = reference(tp_model(), sgd, inputs, max_norm=0.5, norm_type=p)
        model = tp_model()
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        kinds = {type(pl).__name__ for q in model.parameters() for pl in q.placements}  # type: ignore[attr-defined]
        assert "_StridedShard" in kinds, kinds
        optimizer = clipopt.ClippedOptimizer(sgd(model.parameters()), max_norm=0.5, norm_type=p)
        norms, calls = train(model, optimizer, inputs)
        assert calls == [1] * len(inputs), calls
        compare_runs(norms, ref_norms, model.parameters(), ref_params, f"fsdp2+tp p={p}")
    # The functional API scales grads that live on two meshes, shard by shard.
    loss_fn(model(inputs[0])).backward()
    before = [full(q.grad).clone() for q in model.parameters()]  # type: ignore[arg-type]
    norm = clipopt.clip_grad_norm_(model.parameters(), 1e-3, math.inf)
    expected = max(float(g.abs().max()) for g in before)
    assert_rel(norm, torch.tensor(expected), "clip_grad_norm_ over two meshes")
    for q, g in zip(model.parameters(), before, strict=True):
        assert_rel(full(q.grad), g * (1e-3 / (expected + 1e-6)), "scaled grad")  # type: ignore[arg-type]
    clipopt.clip_grad_value_(model.parameters(), 1e-4)
    for q, g in zip(model.parameters(), before, strict=True):
        clamped = (g * (1e-3 / (expected + 1e-6))).clamp(-1e-4, 1e-4)
        assert_rel(full(q.grad), clamped, "clamped grad")  # type: ignore[arg-type]


def _split_rows(full_tensor: Tensor) -> Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    return full_tensor.chunk(world)[rank]


def case_model_parallel() -> None:
    """Plain tensors split across a process group, with a replicated bias that counts once."""
    group = dist.new_group(list(range(WORLD_SIZE)))
    gen = torch.Generator().manual_seed(5)
    weight0, bias0 = torch.randn(6, 4, generator=gen), torch.randn(4, generator=gen)
    grads = [
        (torch.randn(6, 4, generator=gen) * 4, torch.randn(4, generator=gen)) for _ in range(4)
    ]
    for p, per_group in ((2.0, False), (math.inf, False), (3.0, True)):
        full_w, full_b = nn.Parameter(weight0.clone()), nn.Parameter(bias0.clone())
        mine_w, mine_b = nn.Parameter(_split_rows(weight0).clone()), nn.Parameter(bias0.clone())
        settings = {"max_norm": 0.5, "norm_type": p, "per_group": per_group}
        ref = clipopt.ClippedOptimizer(
            sgd([{"params": [full_w]}, {"params": [full_b]}]), **settings
        )
        ours = clipopt.ClippedOptimizer(
            sgd([{"params": [mine_w]}, {"params": [mine_b]}]),
            **settings,
            process_group=group,
            replicated_params=[mine_b],
        )
        for step, (g_w, g_b) in enumerate(grads):
            full_w.grad, full_b.grad = g_w.clone(), g_b.clone()
            mine_w.grad, mine_b.grad = _split_rows(g_w).clone(), g_b.clone()
            ref.step()
            with CountAllReduce() as counter:
                ours.step()
            assert counter.calls == 1, f"p={p}: {counter.calls} all_reduce calls"
            assert ours.last_norm is not None and ref.last_norm is not None
            assert_same_on_all_ranks(ours.last_norm, f"mp p={p} step {step}")
            assert_rel(ours.last_norm, ref.last_norm, f"mp p={p} step {step}")
            if per_group:
                assert ours.last_group_norms is not None and ref.last_group_norms is not None
                assert_rel(ours.last_group_norms, ref.last_group_norms, f"mp groups p={p}")
        assert_rel_tensor(mine_w.detach(), _split_rows(full_w.detach()), f"mp weight p={p}")
        assert_rel_tensor(mine_b.detach(), full_b.detach(), f"mp bias p={p}")
    # The functional API: the same declaration, against a float64 reference.
    g_w, g_b = grads[0]
    mine_w.grad, mine_b.grad = _split_rows(g_w).clone(), g_b.clone()
    expected = torch.linalg.vector_norm(torch.cat([g_w.flatten(), g_b]).double(), 3.0)
    norm = clipopt.clip_grad_norm_(
        [mine_w, mine_b], 1.0, 3.0, process_group=group, replicated_params=[mine_b]
    )
    assert_rel(norm, expected, "clip_grad_norm_ with replicated_params")
    assert_rel(mine_b.grad, g_b * (1.0 / (expected + 1e-6)), "clipped replicated grad")
    # Undeclared, the replicated grad counts once per rank: that is what the mark fixes.
    counted_twice = clipopt.get_total_norm([_split_rows(g_w), g_b], 3.0, process_group=group)
    twice = (g_w.double().abs().pow(3).sum() + 2 * g_b.double().abs().pow(3).sum()).pow(1 / 3)
    assert_rel(counted_twice, twice, "undeclared replicated grad")


def case_model_parallel_edges() -> None:
    """Ranks with different dtypes, a rank with no grads, NaN on one rank only."""
    rank = dist.get_rank()
    group = dist.group.WORLD
    assert group is not None
    gen = torch.Generator().manual_seed(9)
    values = torch.randn(10, generator=gen, dtype=torch.float64)
    for p in (2.0, math.inf):
        # rank 0 holds float64 grads, rank 1 none at all: dtypes differ across ranks.
        mine = [values] if rank == 0 else []
        norm = clipopt.get_total_norm(mine, p, process_group=group)
        assert_same_on_all_ranks(norm.float(), f"dtype-mixed p={p}")
        assert_rel(norm, torch.linalg.vector_norm(values, p), f"dtype-mixed p={p}")
        # rank 0 half precision, rank 1 float32.
        half = values[:5].to(torch.bfloat16) if rank == 0 else values[5:].float()
        norm = clipopt.get_total_norm([half], p, process_group=group)
        expected = torch.linalg.vector_norm(
            torch.cat([values[:5].to(torch.bfloat16).double(), values[5:].float().double()]), p
        )
        assert_rel(norm, expected, f"bf16/fp32 p={p}")
        # NaN on rank 1 only: every rank sees NaN (MAX may drop NaN; it must not here).
        grads = [torch.tensor([1.0, math.nan if rank == 1 else 2.0])]
        norm = clipopt.get_total_norm(grads, p, process_group=group)
        assert norm.isnan(), f"p={p}: rank {rank} got {norm}"
        grads = [torch.tensor([1.0, math.inf if rank == 0 else 2.0])]
        norm = clipopt.get_total_norm(grads, p, process_group=group)
        assert norm.isinf(), f"p={p}: rank {rank} got {norm}"


def case_zero() -> None:
    """ZeroRedundancyOptimizer as the inner optimizer: every rank holds all (averaged) grads."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    inputs = batches(4, 8, 3)
    ref_norms, ref_params = reference(mlp(), adam, inputs, max_norm=0.5)
    model = DistributedDataParallel(mlp())
    inner = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    optimizer = clipopt.ClippedOptimizer(inner, max_norm=0.5)
    norms, calls = train(model, optimizer, [local_rows(x) for x in inputs])
    assert calls == [0] * len(inputs), calls
    compare_runs(norms, ref_norms, model.parameters(), ref_params, "zero")


def case_dcp_round_trip(checkpoint_dir: str) -> None:
    """Clip state survives dcp.save/dcp.load with FSDP2, as the distributed page's recipe
    saves it: torch's functions handed the inner optimizer, ClippedOptimizerState beside."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    inputs = [local_rows(x) for x in batches(5, 8, 3, seed=13)]

    def fresh() -> tuple[nn.Module, clipopt.ClippedOptimizer]:
        model = mlp(seed=21)
        fully_shard_mlp(model, mesh)
        inner = torch.optim.Adam(model.parameters(), lr=0.01)
        return model, clipopt.ClippedOptimizer(inner, max_norm=0.5, nonfinite="skip")

    def state(model: nn.Module, optimizer: clipopt.ClippedOptimizer) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer.optimizer),
            "clip": cdist.ClippedOptimizerState(optimizer),
        }

    model, optimizer = fresh()
    train(model, optimizer, inputs[:3])
    dcp.save(state(model, optimizer), checkpoint_id=checkpoint_dir)
    saved_clip = optimizer.state_dict()["clip"]

    restored_model, restored = fresh()
    target = state(restored_model, restored)
    # torch's functions made the inner optimizer's state with a step on zero grads; it
    # reached the inner optimizer only, so the clip state is still fresh.
    assert len(restored.state) > 0, "DCP should have initialised the inner state"
    assert restored.last_norm is None and int(restored.step_count) == 0
    dcp.load(target, checkpoint_id=checkpoint_dir)
    set_model_state_dict(restored_model, target["model"])
    set_optimizer_state_dict(restored_model, restored.optimizer, target["optim"])
    loaded_clip = restored.state_dict()["clip"]
    assert loaded_clip["settings"] == saved_clip["settings"]
    for key in ("last_norm", "step_count", "skip_count", "consecutive_skips"):
        assert torch.equal(loaded_clip[key], saved_clip[key]), key
    assert type(restored.last_norm) is Tensor
    # Resume is exact: both continue with the same data and stay bit-identical.
    norms, _ = train(model, optimizer, inputs[3:])
    restored_norms, _ = train(restored_model, restored, inputs[3:])
    for a, b in zip(norms, restored_norms, strict=True):
        assert torch.equal(a, b), (a, b)
    for a, b in zip(model.parameters(), restored_model.parameters(), strict=True):
        assert torch.equal(full(a.detach()), full(b.detach()))
    assert int(restored.step_count) == 5


def case_example() -> None:
    """examples/distributed_fsdp2.py: the same last_norm on every rank, as a single process."""
    spec = importlib.util.spec_from_file_location("distributed_fsdp2", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    norm = example.train()
    assert_same_on_all_ranks(norm, "example last_norm")
    # The single-process run: one model on both ranks' data, with the grads averaged.
    model = example.build_model()
    optimizer = clipopt.ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), max_norm=0.5
    )
    data = [torch.Generator().manual_seed(1000 + r) for r in range(WORLD_SIZE)]
    for _ in range(example.STEPS):
        pairs = [
            (
                torch.randn(example.BATCH, 16, generator=g),
                torch.randn(example.BATCH, 4, generator=g),
            )
            for g in data
        ]
        inputs = torch.cat([x for x, _ in pairs])
        targets = torch.cat([y for _, y in pairs])
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert optimizer.last_norm is not None
    assert_rel(norm, optimizer.last_norm, "example last_norm")


def case_sub_meshes() -> None:
    """DTensors on a strict sub-mesh of the world: a 1-D one (its own group, one
    all_reduce) and an N-D one (one all_reduce per dimension, or one with a
    ``process_group`` over exactly its ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE, 1, 1), mesh_dim_names=("dp", "a", "b"))
    local = torch.arange(4.0) + 10 * dist.get_rank()  # a different tensor on each rank
    for names in (("a",), ("a", "b")):
        sub = mesh[names]
        assert sub.size() == 1
        grad = DTensor.from_local(local.clone(), sub, [Shard(0)] * len(names))
        with CountAllReduce() as counter:
            norm = clipopt.get_total_norm([grad], 3.0)
        assert counter.calls == len(names), (names, counter.calls)
        assert_rel(norm, torch.linalg.vector_norm(local.double(), 3.0), f"sub-mesh {names}")
        with pytest.raises(ValueError, match="ranks"):
            clipopt.get_total_norm([grad], 3.0, process_group=dist.group.WORLD)
    # A group over exactly the N-D sub-mesh's ranks: one all_reduce instead of one per dim.
    own = [dist.new_group([r]) for r in range(WORLD_SIZE)][dist.get_rank()]
    grad = DTensor.from_local(local.clone(), mesh["a", "b"], [Shard(0), Shard(0)])
    with CountAllReduce() as counter:
        norm = clipopt.get_total_norm([grad], 3.0, process_group=own)
    assert counter.calls == 1, counter.calls
    assert_rel(norm, torch.linalg.vector_norm(local.double(), 3.0), "sub-mesh with its group")


def case_rank_without_grads() -> None:
    """FSDP2, and no grad reached rank 1's parameters this step: rank 1 still joins the
    reduction (with a zero), so no rank waits out the timeout, and every rank gets the
    norm of the grads that exist, from the functional API and from ClippedOptimizer."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for p in (2.0, math.inf):
        model = mlp()
        fully_shard_mlp(model, mesh)
        optimizer = clipopt.ClippedOptimizer(sgd(model.parameters()), max_norm=1e9, norm_type=p)
        loss_fn(model(local_rows(batches(1, 8, 3)[0]))).backward()
        if dist.get_rank() == 1:
            for q in model.parameters():
                q.grad = None
        local = [q.grad.to_local().double() for q in model.parameters() if q.grad is not None]
        gathered: list[Any] = [None] * WORLD_SIZE
        dist.all_gather_object(gathered, local)
        expected = torch.linalg.vector_norm(
            torch.cat([t.flatten() for shards in gathered for t in shards]), p
        )
        functional = clipopt.clip_grad_norm_(model.parameters(), 1e9, p)
        assert_same_on_all_ranks(functional, f"clip_grad_norm_ p={p}")
        assert_rel(functional, expected, f"clip_grad_norm_ p={p}")
        optimizer.step()
        assert optimizer.last_norm is not None
        assert_same_on_all_ranks(optimizer.last_norm, f"ClippedOptimizer p={p}")
        assert_rel(optimizer.last_norm, expected, f"ClippedOptimizer p={p}")


CASES: dict[str, Callable[..., None]] = {
    "sub_meshes": case_sub_meshes,
    "ddp": case_ddp,
    "fsdp2": case_fsdp2,
    "hsdp": case_hsdp,
    "tensor_parallel": case_tensor_parallel,
    "fsdp2_with_tensor_parallel": case_fsdp2_with_tensor_parallel,
    "model_parallel": case_model_parallel,
    "model_parallel_edges": case_model_parallel_edges,
    "zero": case_zero,
    "dcp_round_trip": case_dcp_round_trip,
    "example": case_example,
    "rank_without_grads": case_rank_without_grads,
}


def all_ranks_failed(control: Any, failed: bool) -> tuple[bool, bool]:
    """(any rank failed, every rank failed), agreed over the control group."""
    flags = torch.tensor([float(failed), float(failed)])
    dist.all_reduce(flags[:1], op=dist.ReduceOp.MAX, group=control)
    dist.all_reduce(flags[1:], op=dist.ReduceOp.MIN, group=control)
    return bool(flags[0]), bool(flags[1])


def run_cases(
    rank: int,
    port: int,
    out_dir: str,
    cases: dict[str, Callable[..., None]],
    call: Callable[[str, Callable[..., None]], None] = lambda name, case: case(),
    timeout: datetime.timedelta = PG_TIMEOUT,
) -> None:
    """Run every case in order on this rank, recording each outcome in its JSON file
    (a ``pytest.raises`` that did not raise too); collectives time out after ``timeout``.

    After each case the ranks agree over a separate control group on who failed: when
    every rank failed the collectives are still in step and the next case runs; when
    only some did, the others were stuck in a collective until the timeout, so stop.
    """
    results: dict[str, str] = {}
    try:
        init_gloo(rank, WORLD_SIZE, port, timeout)
        control = dist.new_group(list(range(WORLD_SIZE)))
        for name, case in cases.items():
            try:
                call(name, case)
                results[name] = "ok"
            except (Exception, pytest.fail.Exception):
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


def worker(rank: int, port: int, out_dir: str) -> None:
    """Every case of this module in order (:func:`run_cases`); the DCP case gets a
    directory of its own."""

    def call(name: str, case: Callable[..., None]) -> None:
        if name == "dcp_round_trip":
            case(os.path.join(out_dir, "checkpoint"))
        else:
            case()

    run_cases(rank, port, out_dir, CASES, call)


def run_workers(
    fn: Callable[..., None], out_dir: str, timeout_s: float = JOIN_TIMEOUT_S
) -> str | None:
    """Spawn WORLD_SIZE processes; None when all exit cleanly, else why not. Never hangs."""
    context = mp.start_processes(
        fn, args=(free_port(), out_dir), nprocs=WORLD_SIZE, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                return f"workers still running after {timeout_s} s"
    except Exception as error:  # a worker died or raised outside the recorded cases
        return f"{type(error).__name__}: {error}"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
    return None


def rank_outcomes(
    worker: Callable[..., None],
    out_dir: Path,
    cases: Iterable[str],
    timeout_s: float = JOIN_TIMEOUT_S,
) -> dict[str, list[str]]:
    """Run ``worker`` on every rank; each case's outcome per rank ("ok" or what failed),
    from the ``rank{r}.json`` files the workers write (a failed setup or start fails all)."""
    failure = run_workers(worker, str(out_dir), timeout_s)
    results: dict[str, list[str]] = {name: [] for name in cases}
    for rank in range(WORLD_SIZE):
        path = out_dir / f"rank{rank}.json"
        recorded = json.loads(path.read_text()) if path.exists() else {}
        setup = recorded.get("<setup>")
        for name in results:
            default = setup or failure or "not run: an earlier case failed"
            results[name].append(recorded.get(name, default))
    return results


@pytest.fixture(scope="module")
def case_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    return rank_outcomes(worker, tmp_path_factory.mktemp("distributed"), CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_single_process(case: str, case_results: dict[str, list[str]]) -> None:
    assert_all_ok(case_results[case])


# gloo's teardown race: a rank whose peer closed its connections first can abort in a
# joinable thread's destructor after all its work is done (seen once under `make test`,
# every rank's norm already printed). torch's, not the example's: such a run is run again
# once, and any other failure, or the same abort twice, fails.
TEARDOWN_ABORT = "terminate called without an active exception"


def _torchrun(command: list[str]) -> tuple[int, str, str]:
    # Its own session, so that a timeout kills torchrun and its workers together.
    launch = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = launch.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)
        launch.communicate()
        pytest.fail("torchrun did not finish within 180 s")
    return launch.returncode, stdout, stderr


def _printed_norms(stdout: str) -> list[tuple[str, str]]:
    return re.findall(r"rank (\d+): last_norm=(\d+\.\d{6})", stdout)


def test_example_under_torchrun_prints_one_norm_on_every_rank() -> None:
    """The example as users run it: ``torchrun --nproc_per_node=2``, env-based init."""
    if not (FSDP2_ON_CPU or torch.cuda.is_available()):
        pytest.skip(FSDP2_UNAVAILABLE)  # the example shards its model with FSDP2
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this Python")
    command = [
        str(torchrun),
        f"--nproc_per_node={WORLD_SIZE}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(EXAMPLE),
    ]
    code, stdout, stderr = _torchrun(command)
    if code != 0 and TEARDOWN_ABORT in stderr and len(_printed_norms(stdout)) == WORLD_SIZE:
        command[3] = f"--master_port={free_port()}"
        code, stdout, stderr = _torchrun(command)
    assert code == 0, stdout + stderr
    lines = _printed_norms(stdout)
    assert sorted(rank for rank, _ in lines) == [str(r) for r in range(WORLD_SIZE)], stdout
    assert len({norm for _, norm in lines}) == 1, stdout


# --------------------------------------------------------------------------- one process
#
# A world-size-1 gloo group in this process: the same code paths (the all_reduce runs),
# no spawn, so properties and error cases can be many and cheap.


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[Any]:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    init_gloo(0, 1, free_port())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def mesh(world_of_one: Any) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def dtensor(local: Tensor, mesh: Any, placement: str = "shard") -> Tensor:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    kind = {"shard": Shard(0), "replicate": Replicate(), "partial": Partial()}[placement]
    return DTensor.from_local(local, mesh, [kind], run_check=False)


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3)


@settings(max_examples=20, deadline=None)
@given(
    sizes=st.lists(shapes, min_size=1, max_size=5),
    p=st.sampled_from([1.0, 1.5, 2.0, 3.0, math.inf]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_process_group_of_one_matches_float64(
    world_of_one: Any, float64_norm: Any, sizes: list[list[int]], p: float, seed: int, data: Any
) -> None:
    """With one rank, declaring some tensors replicated changes nothing: weights are 1."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(tuple(s), generator=gen) * 5 for s in sizes]
    shared = data.draw(st.lists(st.sampled_from(tensors), unique_by=id))
    norm = clipopt.get_total_norm(tensors, p, process_group=world_of_one, replicated=shared)
    assert norm.dtype == torch.float32 and type(norm) is Tensor
    assert_rel(norm, torch.tensor(float64_norm(tensors, p)), f"p={p}")


@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), min_size=1, max_size=4),
    placements=st.lists(st.sampled_from(["shard", "replicate"]), min_size=4, max_size=4),
    p=st.sampled_from([1.0, 2.0, 3.0, math.inf]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_dtensor_on_mesh_of_one_matches_float64(
    mesh: Any,
    float64_norm: Any,
    sizes: list[list[int]],
    placements: list[str],
    p: float,
    dtype: torch.dtype,
) -> None:
    locals_ = [(torch.randn(tuple(s)) * 3).to(dtype) for s in sizes]
    grads = [dtensor(t, mesh, kind) for t, kind in zip(locals_, placements, strict=False)]
    norm = clipopt.get_total_norm(grads, p)
    assert type(norm) is Tensor
    assert norm.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_rel(norm, torch.tensor(float64_norm(locals_, p)), f"p={p} {dtype}")


def test_one_all_reduce_per_step_whatever_the_dtype_groups(mesh: Any, no_host_sync: Any) -> None:
    """Three param groups in three dtypes, per-group norms: still a single all_reduce."""
    params = [
        nn.Parameter(dtensor(torch.ones(3, dtype=dtype), mesh))
        for dtype in (torch.float32, torch.float64, torch.bfloat16)
    ]
    optimizer = clipopt.ClippedOptimizer(
        torch.optim.SGD([{"params": [q]} for q in params], lr=0.1), 1.0, per_group=True
    )
    for q in params:
        q.grad = dtensor(torch.full((3,), 2.0, dtype=q.dtype), mesh)
    with CountAllReduce() as counter, no_host_sync():
        optimizer.step()
    assert counter.calls == 1
    assert optimizer.last_group_norms is not None
    expected = torch.full((3,), 12.0**0.5, dtype=torch.float64)
    assert_rel(optimizer.last_group_norms, expected, "per-group norms")
    # Mixing finite and inf orders across groups needs one SUM and one MAX.
    optimizer.param_groups[0]["clip_norm_type"] = math.inf
    with CountAllReduce() as counter:
        optimizer.step()
    assert counter.calls == 2


def test_process_group_path_reads_nothing_on_the_host(
    world_of_one: Any, no_host_sync: Any, float64_norm: Any
) -> None:
    w, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(2))
    w.grad, b.grad = torch.arange(4.0), torch.tensor([3.0, 1.0])
    optimizer = clipopt.ClippedOptimizer(
        torch.optim.SGD([w, b], lr=0.1), 1.0, process_group=world_of_one, replicated_params=[b]
    )
    with no_host_sync():
        optimizer.step()
        inf_norm = clipopt.get_total_norm([w.grad, b.grad], "inf", process_group=world_of_one)
    assert optimizer.last_norm is not None
    assert_rel(
        optimizer.last_norm,
        torch.tensor(float64_norm([torch.arange(4.0), torch.tensor([3.0, 1.0])], 2)),
        "norm",
    )
    assert inf_norm.isfinite()


@pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA"
)
def test_cuda_grads_reduce_on_the_device(
    world_of_one: Any, no_host_sync: Any, float64_norm: Any
) -> None:
    nccl = dist.new_group([0], backend="nccl")
    grads = [
        torch.randn(5, device="cuda") * 3,
        torch.randn(3, device="cuda").to(torch.bfloat16),
        torch.empty(0, device="cuda"),
    ]
    for p in (2.0, math.inf):
        with no_host_sync():
            norm = clipopt.get_total_norm(grads, p, process_group=nccl)
            nothing = clipopt.get_total_norm([], p, process_group=nccl)
        assert norm.device.type == "cuda" and norm.dtype == torch.float32
        assert_rel(norm, torch.tensor(float64_norm(grads, p)), f"cuda p={p}")
        assert nothing.device.type == "cuda" and float(nothing) == 0.0


def test_local_grads_add_no_collective(world_of_one: Any) -> None:
    w = nn.Parameter(torch.ones(3))
    w.grad = torch.ones(3)
    with CountAllReduce() as counter:
        clipopt.clip_grad_norm_([w], 1.0)
        clipopt.ClippedOptimizer(torch.optim.SGD([w], lr=0.1), 1.0).step()
    assert counter.calls == 0


def test_partial_grad_is_refused_before_anything_is_touched(mesh: Any) -> None:
    w = nn.Parameter(dtensor(torch.ones(3), mesh))
    w.grad = dtensor(torch.full((3,), 5.0), mesh, "partial")
    optimizer = clipopt.ClippedOptimizer(torch.optim.SGD([w], lr=0.1), 1.0)
    with pytest.raises(ValueError, match="Partial"):
        optimizer.step()
    with pytest.raises(ValueError, match="Partial"):
        clipopt.clip_grad_norm_([w], 1.0)
    assert torch.equal(w.grad.to_local(), torch.full((3,), 5.0))  # type: ignore[union-attr]
    assert torch.equal(w.detach().to_local(), torch.ones(3))  # type: ignore[attr-defined]
    assert optimizer.last_norm is None


def test_mixed_dtensor_and_plain_grads_are_refused(mesh: Any) -> None:
    grads = [dtensor(torch.ones(2), mesh), torch.ones(2)]
    with pytest.raises(ValueError, match="DTensor and plain"):
        clipopt.get_total_norm(grads, math.inf)


def test_dtensors_on_meshes_over_the_same_ranks_reduce_together(world_of_one: Any) -> None:
    """Meshes are matched by the ranks they hold, not by their names or roots: separately
    built, unnamed or flattened meshes over the same ranks reduce together, each grad
    counted once (on main before 0.3 they were refused, and torchtitan's meshes, all
    unflattened from a 1-D root, with them). Meshes none of which holds the others'
    ranks are refused: tests/test_distributed_pipeline.py, on 4 ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    one = init_device_mesh("cpu", (1,), mesh_dim_names=("one",))
    other = init_device_mesh("cpu", (1,), mesh_dim_names=("other",))
    unnamed = init_device_mesh("cpu", (1,))
    root = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    flat = root["a", "b"]._flatten("ab")
    pairs = ((one, other), (unnamed, one), (root["a"], flat), (flat, root), (root["a"], root))
    for first, second in pairs:
        grads = [dtensor(torch.full((2,), 3.0), first), dtensor(torch.full((2,), 4.0), second)]
        norm = clipopt.get_total_norm(grads)
        assert math.isclose(norm.item(), math.sqrt(50.0), rel_tol=1e-6), (first, second)


def test_bad_process_group_and_replicated_arguments(world_of_one: Any, mesh: Any) -> None:
    w, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    w.grad, b.grad = torch.ones(2), torch.ones(2)
    sgd_wb = torch.optim.SGD([w, b], lr=0.1)
    with pytest.raises(TypeError, match="process_group"):
        clipopt.get_total_norm([w.grad], process_group="world")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="process_group"):
        clipopt.ClippedOptimizer(sgd_wb, 1.0, process_group=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="process_group"):
        clipopt.clip_grad_norm_([w, b], 1.0, replicated_params=[b])
    with pytest.raises(ValueError, match="process_group"):
        clipopt.ClippedOptimizer(sgd_wb, 1.0, replicated_params=[b])
    stranger = nn.Parameter(torch.ones(5))
    with pytest.raises(ValueError, match=r"replicated_params holds .* not among parameters"):
        clipopt.clip_grad_norm_([w], 1.0, process_group=world_of_one, replicated_params=[b])
    with pytest.raises(ValueError, match="not among the optimizer's parameters"):
        clipopt.ClippedOptimizer(
            sgd_wb, 1.0, process_group=world_of_one, replicated_params=[stranger]
        )
    with pytest.raises(ValueError, match="not among"):
        clipopt.get_total_norm([w.grad], process_group=world_of_one, replicated=[b.grad])
    shard = dtensor(torch.ones(2), mesh)
    with pytest.raises(ValueError, match="Replicate placements"):
        clipopt.get_total_norm([shard], process_group=world_of_one, replicated=[shard])
    assert torch.equal(w.grad, torch.ones(2)) and torch.equal(b.grad, torch.ones(2))
    assert "clip_max_norm" not in sgd_wb.param_groups[0], "a refused wrapper must not touch it"


def test_wrapper_with_a_group_deep_copies_but_does_not_pickle(world_of_one: Any) -> None:
    w, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    optimizer = clipopt.ClippedOptimizer(
        torch.optim.SGD([w, b], lr=0.1), 1.0, process_group=world_of_one, replicated_params=[b]
    )
    twin = copy.deepcopy(optimizer)
    assert twin._clip.norm_scope.process_group is world_of_one
    twin_b = twin.param_groups[0]["params"][1]
    assert twin._clip.norm_scope.replicated_params == [twin_b] and twin_b is not b
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(optimizer)


def test_bad_pp_mesh_is_refused_before_anything_is_touched(world_of_one: Any) -> None:
    """pp_mesh must be a 1-D DeviceMesh or a ProcessGroup; a bad one raises, naming it,
    before any grad is read or written and before the inner optimizer is touched."""
    from torch.distributed.device_mesh import init_device_mesh

    w = nn.Parameter(torch.ones(2))
    w.grad = torch.full((2,), 3.0)
    inner = torch.optim.SGD([w], lr=0.1)
    two_d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "dp"))
    for bad, error in (("pp", TypeError), (0, TypeError), (two_d, ValueError)):
        with pytest.raises(error, match="pp_mesh must be"):
            clipopt.ClippedOptimizer(inner, 1.0, pp_mesh=bad)
        with pytest.raises(error, match="pp_mesh must be"):
            clipopt.clip_grad_norm_([w], 1.0, pp_mesh=bad)
        with pytest.raises(error, match="pp_mesh must be"):
            clipopt.clip_grad_norm([w], 1.0, pp_mesh=bad)
        with pytest.raises(error, match="pp_mesh must be"):
            clipopt.get_total_norm([w.grad], pp_mesh=bad)
    assert torch.equal(w.grad, torch.full((2,), 3.0))
    assert "clip_max_norm" not in inner.param_groups[0], "a refused wrapper must not touch it"


def test_a_pipeline_of_one_stage_adds_no_collective(world_of_one: Any) -> None:
    """A pp_mesh over this rank alone (one stage is the whole model) is no reduction: the
    norm is the local one, with no all_reduce; a wrapper holding a pipeline group
    deep-copies (sharing the group) but does not pickle."""
    from torch.distributed.device_mesh import init_device_mesh

    pp = init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "dp"))["pp"]
    grads = [torch.tensor([3.0, 4.0])]
    for pp_mesh in (pp, world_of_one):
        with CountAllReduce() as counter:
            norm = clipopt.get_total_norm(grads, pp_mesh=pp_mesh)
        assert counter.calls == 0 and torch.equal(norm, torch.tensor(5.0))
    scope = _reduce.NormScope()
    scope.pp_group = world_of_one  # as a pipeline of several stages holds it
    w = nn.Parameter(torch.ones(2))
    optimizer = clipopt.ClippedOptimizer(torch.optim.SGD([w], lr=0.1), 1.0)
    optimizer._clip = dataclasses.replace(optimizer._clip, norm_scope=scope)
    assert copy.deepcopy(optimizer)._clip.norm_scope.pp_group is world_of_one
    with pytest.raises(TypeError, match="holding a pp_group cannot be pickled"):
        pickle.dumps(optimizer)


def test_dcp_load_of_an_unwrapped_run_keeps_the_clip_state_and_validates_groups(
    world_of_one: Any,
) -> None:
    """A checkpoint of a run that started unwrapped has no "clip": loaded through torch's
    functions into the wrapper, the inner state loads, the clip state stays (with the
    warning naming ClippedOptimizerState), the groups get the defaults, and bad group
    settings are refused before anything is loaded."""
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    model = nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    unwrapped = torch.optim.Adam(model.parameters(), lr=0.1)
    unwrapped.step()
    saved = dcp_state_dict.get_optimizer_state_dict(model, unwrapped)
    assert "clip" not in saved and "clip_max_norm" not in saved["param_groups"][0]

    optimizer = clipopt.ClippedOptimizer(torch.optim.Adam(model.parameters(), lr=0.5), 0.25)
    optimizer.step()
    clip_before = optimizer.state_dict()["clip"]
    for bad, match in (
        ({"clip_max_norm": -1.0}, "max_norm"),
        ({"clip_norm_type": -2.0}, "norm_type"),
    ):
        groups = [{**g, **bad} for g in saved["param_groups"]]
        before = copy.deepcopy(optimizer.state_dict())
        with pytest.raises(ValueError, match=match), pytest.warns(UserWarning):
            dcp_state_dict.set_optimizer_state_dict(
                model, optimizer, {**saved, "param_groups": groups}
            )
        assert_same(optimizer.state_dict(), before)

    with pytest.warns(UserWarning, match="ClippedOptimizerState"):
        dcp_state_dict.set_optimizer_state_dict(model, optimizer, saved)
    group = optimizer.param_groups[0]
    assert group["lr"] == 0.1 and group["clip_max_norm"] == 0.25 and group["clip_norm_type"] == 2.0
    assert_same(optimizer.state_dict()["clip"], clip_before)
    assert_same(optimizer.optimizer.state_dict()["state"], unwrapped.state_dict()["state"])


@pytest.mark.parametrize("p", [2.0, math.inf])
def test_a_rank_without_grads_contributes_a_zero_made_on_the_reduction_device(p: float) -> None:
    # The meta device stands for an accelerator: a CPU zero would be copied there, a
    # blocking host-to-device copy every step on the rank that holds no grads.
    zero = _reduce._local_contribution([(1.0, [])], p, None, torch.device("meta"))
    assert zero.device.type == "meta" and zero.dtype == torch.float64 and zero.shape == (1,)
    one_rank = _reduce._local_contribution(
        [(1.0, [torch.tensor([3.0, 4.0])])], p, None, torch.device("meta")
    )
    assert one_rank.device.type == "cpu"  # a rank's own norm stays where its grads are
