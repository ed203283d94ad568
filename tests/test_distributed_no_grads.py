"""Ranks whose local grads differ (none, only empty shards, some groups, some meshes).

Every rank must enter the same collectives whatever its local grads, or the others wait
in theirs. The workers (gloo on 127.0.0.1, world size 2, ONE spawn for every case) use a
short process-group timeout, so a rank left waiting fails its case in ``PG_TIMEOUT``
seconds instead of 60. Each case compares every rank's norms with a float64 reference
built from all ranks' local shards, gathered: the norm one process would compute of the
grads that exist.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import assert_all_ok, forbid_fsdp2_where_it_cannot_run
from test_distributed import (
    WORLD_SIZE,
    CountAllReduce,
    all_ranks_failed,
    assert_rel,
    assert_same_on_all_ranks,
    batches,
    fully_shard_mlp,
    local_rows,
    loss_fn,
    mlp,
    run_workers,
    sgd,
)
from torch import Tensor, nn

import clipopt

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
)

PG_TIMEOUT = datetime.timedelta(seconds=10)
JOIN_TIMEOUT_S = 150.0
P_VALUES = (1.0, 2.0, 3.0, math.inf)


def gathered_norm(counted: Sequence[Tensor], p: float) -> Tensor:
    """The float64 p-norm of every rank's ``counted`` tensors together (a collective).

    Each rank passes the local values it is the one to count: its own shards, and a
    replicated value on one rank only.
    """
    mine = [t.detach().double().flatten().cpu() for t in counted]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    pieces = [t for rank_pieces in gathered for t in rank_pieces]
    values = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float64)
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.float64)
    return torch.linalg.vector_norm(values, p)


def fsdp2_mlp_with_grads() -> tuple[nn.Module, list[nn.Parameter]]:
    """The FSDP2 mlp of test_distributed (rank 1 holds empty shards of layer 0), after one
    backward. Its parameters are layer 0's, layer 2's and layer 4's weight and bias."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    model = mlp()
    fully_shard_mlp(model, mesh)
    loss_fn(model(local_rows(batches(1, 8, 3)[0]))).backward()
    return model, list(model.parameters())


def local(t: Tensor | None) -> Tensor:
    assert t is not None
    return t.to_local() if hasattr(t, "to_local") else t


# --------------------------------------------------------------------------- cases


def case_only_empty_shards() -> None:
    """Rank 1's grads of layer 0 are 0-element DTensors: still DTensors, so rank 1 joins."""
    _, params = fsdp2_mlp_with_grads()
    layer0 = params[:2]
    shapes = [tuple(local(q.grad).shape) for q in layer0]
    if dist.get_rank() == 1:
        assert all(0 in s for s in shapes), f"rank 1 should hold empty shards, has {shapes}"
    grads = [q.grad for q in layer0]
    for p in P_VALUES:
        expected = gathered_norm([local(g) for g in grads], p)
        with CountAllReduce() as counter:
            norm = clipopt.get_total_norm(grads, p)
        assert counter.calls == 1, counter.calls
        assert_same_on_all_ranks(norm, f"get_total_norm p={p}")
        assert_rel(norm, expected, f"get_total_norm p={p}")
        assert float(expected) > 0


def case_no_grads_get_total_norm() -> None:
    """Rank 1 has no grads at all. ``get_total_norm`` cannot see a mesh in an empty list,
    so the documented ways are: pass ``process_group`` (a group spanning the mesh), or
    measure through the parameters with ``clip_grad_norm_(params, inf)``."""
    _, params = fsdp2_mlp_with_grads()
    if dist.get_rank() == 1:
        for q in params:
            q.grad = None
    before = [local(q.grad).clone() for q in params if q.grad is not None]
    for p in P_VALUES:
        expected = gathered_norm([local(q.grad) for q in params if q.grad is not None], p)
        grads = [q.grad for q in params]  # all None on rank 1
        norm = clipopt.get_total_norm(grads, p, process_group=dist.group.WORLD)
        assert_same_on_all_ranks(norm, f"get_total_norm(process_group) p={p}")
        assert_rel(norm, expected, f"get_total_norm(process_group) p={p}")
        measured = clipopt.clip_grad_norm_(params, math.inf, p)
        assert_same_on_all_ranks(measured, f"clip_grad_norm_(inf) p={p}")
        assert_rel(measured, expected, f"clip_grad_norm_(inf) p={p}")
    after = [local(q.grad) for q in params if q.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), "measure only"


def _per_group_wrapper(params: list[nn.Parameter], norm_types: Sequence[float]) -> Any:
    groups = [
        {"params": params[2 * i : 2 * i + 2], "clip_norm_type": p} for i, p in enumerate(norm_types)
    ]
    return clipopt.ClippedOptimizer(sgd(groups), max_norm=1e9, per_group=True)


def _check_group_norms(
    optimizer: Any, params: list[nn.Parameter], norm_types: Sequence[float], what: str
) -> None:
    expected = [
        gathered_norm([local(q.grad) for q in params[2 * i : 2 * i + 2] if q.grad is not None], p)
        for i, p in enumerate(norm_types)
    ]
    with CountAllReduce() as counter:
        optimizer.step()
    assert counter.calls == 2, f"{what}: {counter.calls} all_reduce calls (one SUM, one MAX)"
    assert optimizer.last_group_norms is not None and optimizer.last_norm is not None
    assert_same_on_all_ranks(optimizer.last_norm, f"{what} norm")
    for i, e in enumerate(expected):
        assert_same_on_all_ranks(optimizer.last_group_norms[i], f"{what} group {i}")
        assert_rel(optimizer.last_group_norms[i], e, f"{what} group {i}")
    assert_rel(optimizer.last_norm, torch.linalg.vector_norm(torch.stack(expected)), what)


def case_per_group_some_groups_empty() -> None:
    """per_group, inf and finite orders, one group without grads on rank 1, then all."""
    norm_types = (2.0, math.inf, 3.0)
    for empty in ([1], [0], [0, 1, 2]):
        _, params = fsdp2_mlp_with_grads()
        if dist.get_rank() == 1:
            for i in empty:
                params[2 * i].grad = params[2 * i + 1].grad = None
        optimizer = _per_group_wrapper(params, norm_types)
        _check_group_norms(optimizer, params, norm_types, f"groups {empty} empty on rank 1")


def case_only_some_meshes() -> None:
    """FSDP2 over TP (dp=1, tp=2): rank 1 holds grads only for the LayerNorm, which lives
    on the dp sub-mesh. The reduction mesh must come from the parameters, not from the
    grads present, or rank 1 reduces over the 1-rank dp group while rank 0 waits in the
    world's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (1, WORLD_SIZE), mesh_dim_names=("dp", "tp"))
    for p in (2.0, math.inf):
        for use in ("clip_grad_norm_", "wrapper"):
            torch.manual_seed(4)
            # No rowwise bias: it would be Replicate over tp, and a replicated grad present
            # on one rank but not the other has no single right norm.
            layers = [nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3, bias=False), nn.LayerNorm(3)]
            model = nn.Sequential(*layers)
            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fully_shard(model, mesh=mesh["dp"])
            loss_fn(model(batches(1, 6, 4, seed=17)[0])).backward()
            params = list(model.parameters())
            norm_layer = params[-2:]
            assert all(q.device_mesh.ndim == 1 for q in norm_layer)  # type: ignore[attr-defined]
            assert all(q.device_mesh.ndim == 2 for q in params[:-2])  # type: ignore[attr-defined]
            if dist.get_rank() == 1:
                for q in params[:-2]:
                    q.grad = None
            # The LayerNorm's grads are replicated over tp: counted on rank 0 only.
            counted = [local(q.grad) for q in params] if dist.get_rank() == 0 else []
            expected = gathered_norm(counted, p)
            if use == "clip_grad_norm_":
                norm = clipopt.clip_grad_norm_(params, math.inf, p)
            else:
                optimizer = clipopt.ClippedOptimizer(sgd(params), max_norm=1e9, norm_type=p)
                optimizer.step()
                assert optimizer.last_norm is not None
                norm = optimizer.last_norm
            assert_same_on_all_ranks(norm, f"{use} p={p}")
            assert_rel(norm, expected, f"{use} p={p}")


def case_process_group_rank_without_grads() -> None:
    """Plain tensors split across a process group; rank 1 holds no grad in one group, then
    in none, with inf and finite orders: one SUM and one MAX on every rank."""
    group = dist.new_group(list(range(WORLD_SIZE)))
    gen = torch.Generator().manual_seed(5)
    values = [torch.randn(4, 3, generator=gen) * 3 for _ in range(3)]
    norm_types = (2.0, math.inf, 1.0)
    for empty in ([1], [0, 1, 2]):
        # Each rank holds its own rows of every weight, rank 1 none of the empty groups'.
        params = []
        for i, v in enumerate(values):
            rows = v.chunk(WORLD_SIZE)[dist.get_rank()]
            q = nn.Parameter(torch.zeros_like(rows))
            q.grad = None if dist.get_rank() == 1 and i in empty else rows.clone()
            params.append(q)
        groups = [
            {"params": [q], "clip_norm_type": p} for q, p in zip(params, norm_types, strict=True)
        ]
        optimizer = clipopt.ClippedOptimizer(
            sgd(groups), max_norm=1e9, per_group=True, process_group=group
        )
        expected = [
            gathered_norm([q.grad] if q.grad is not None else [], p)
            for q, p in zip(params, norm_types, strict=True)
        ]
        with CountAllReduce() as counter:
            optimizer.step()
        assert counter.calls == 2, counter.calls
        assert optimizer.last_group_norms is not None
        for i, e in enumerate(expected):
            assert_rel(optimizer.last_group_norms[i], e, f"empty {empty} group {i}")
        # The functional API: rank 1's list is empty, the group says where to reduce.
        for p in P_VALUES:
            mine = [q.grad for q in params if q.grad is not None]
            norm = clipopt.get_total_norm(mine, p, process_group=group)
            assert_same_on_all_ranks(norm, f"get_total_norm empty {empty} p={p}")
            assert_rel(norm, gathered_norm(mine, p), f"get_total_norm empty {empty} p={p}")


def case_per_tensor_rank_without_grads() -> None:
    """FSDP2, rank 1 without any grad: the per-tensor reduction has one slot per parameter,
    so rank 1 joins it. Tracked norms are those of the grads that exist (rank 0's
    shards); a per-tensor rule's norms cannot line up, so the step's norms are NaN on
    every rank and ``nonfinite`` rules on it; with no grad anywhere they are 0."""
    for p in (2.0, math.inf):
        _, params = fsdp2_mlp_with_grads()
        if dist.get_rank() == 1:
            for q in params:
                q.grad = None
        mine = [local(q.grad) for q in params if q.grad is not None]
        expected = gathered_norm(mine, p)
        tracked = clipopt.ClippedOptimizer(sgd(params), 1e9, p, track_tensor_norms=True)
        with CountAllReduce() as counter:
            tracked.step()
        assert counter.calls == 1, counter.calls
        assert tracked.last_norm is not None and tracked.last_tensor_norms is not None
        assert_same_on_all_ranks(tracked.last_norm, f"tracked p={p}")
        assert_rel(tracked.last_norm, expected, f"tracked p={p}")
        each = [torch.linalg.vector_norm(t.double(), p) for t in mine]
        norms = list(tracked.last_tensor_norms.values())
        assert len(norms) == len(each), (len(norms), len(each))
        for index, (norm, e) in enumerate(zip(norms, each, strict=True)):
            assert_rel(norm, e, f"tracked p={p} tensor {index}")
        before = [t.clone() for t in mine]
        rule = clipopt.AutoClip(50.0, 4, per_tensor=True)
        strict = clipopt.ClippedOptimizer(sgd(params), rule, p, nonfinite="raise")
        with pytest.raises(clipopt.NonFiniteNormError):
            strict.step()
        assert all(torch.equal(a, b) for a, b in zip(mine, before, strict=True))
        skipping = clipopt.ClippedOptimizer(sgd(params), rule, p, nonfinite="skip")
        skipping.step()
        assert int(skipping.skip_count) == 1 and int(skipping.step_count) == 0
        assert all(torch.equal(a, b) for a, b in zip(mine, before, strict=True))
        flowing = clipopt.ClippedOptimizer(sgd(params), clipopt.AdaGC(), p)
        flowing.step()
        assert flowing.last_norm is not None and bool(flowing.last_norm.isnan()), "not NaN"
        for q in params:
            q.grad = None
        flowing.step()
        assert flowing.last_norm is not None and float(flowing.last_norm) == 0.0


def _agc_rows(w: Tensor, clipping: float, eps: float) -> Tensor:
    """timm's AGC thresholds of a whole weight in float64: ``clipping * max(||unit||, eps)``."""
    whole = w.detach().double()
    units = whole.flatten(1) if whole.dim() >= 2 else whole.reshape(1, -1)
    return torch.linalg.vector_norm(units, 2.0, dim=1).clamp(min=eps) * clipping


def case_agc_rank_without_grads() -> None:
    """FSDP2 with AGC, rank 1 without any grad: AGC's one reduction is laid out over every
    parameter's units, so rank 1 joins it; the units cannot line up, so the norms are
    NaN on every rank and ``nonfinite`` acts on every rank alike. Where the ranks agree
    (a layer without grads on both), the norm and thresholds are those of the grads that
    exist; with no grad anywhere the norm is 0."""
    for excluded in (False, True):
        _, params = fsdp2_mlp_with_grads()
        if dist.get_rank() == 1:
            for q in params:
                q.grad = None
        left_out = params[-1:] if excluded else []
        mine = [local(q.grad) for q in params if q.grad is not None]
        before = [local(q).detach().clone() for q in params]
        strict = clipopt.ClippedOptimizer(
            sgd(params), clipopt.AGC(0.05, exclude=left_out), nonfinite="raise"
        )
        with CountAllReduce() as counter, pytest.raises(clipopt.NonFiniteNormError):
            strict.step()
        assert counter.calls == 1, f"excluded={excluded}: {counter.calls} all_reduce calls"
        grads_now = [local(q.grad) for q in params if q.grad is not None]
        assert all(torch.equal(a, b) for a, b in zip(grads_now, mine, strict=True))
        skipping = clipopt.ClippedOptimizer(
            sgd(params), clipopt.AGC(0.05, exclude=left_out), nonfinite="skip"
        )
        skipping.step()
        assert int(skipping.skip_count) == 1 and int(skipping.step_count) == 0
        after = [local(q).detach() for q in params]
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), "moved"
        flowing = clipopt.ClippedOptimizer(sgd(params), clipopt.AGC(0.05, exclude=left_out))
        flowing.step()
        assert flowing.last_norm is not None and bool(flowing.last_norm.isnan()), "not NaN"
    # The ranks agree: layer 4 has no grad on either rank, the others on both.
    _, params = fsdp2_mlp_with_grads()
    for q in params[4:]:
        q.grad = None
    with_grads = params[:4]
    expected = gathered_norm([local(q.grad) for q in with_grads], 2.0)
    wholes = [q.full_tensor() for q in with_grads]  # type: ignore[attr-defined]
    thresholds = torch.cat([_agc_rows(w, 0.05, 1e-3) for w in wholes])
    rule = clipopt.AGC(0.05)
    agreeing = clipopt.ClippedOptimizer(sgd(params), rule, nonfinite="raise")
    with CountAllReduce() as counter:
        agreeing.step()
    assert counter.calls == 1, counter.calls
    assert agreeing.last_norm is not None
    assert_same_on_all_ranks(agreeing.last_norm, "agc agreeing norm")
    assert_rel(agreeing.last_norm, expected, "agc agreeing norm")
    got = rule.last_threshold
    assert got is not None and got.shape == thresholds.shape, (got, thresholds.shape)
    for index, (g, e) in enumerate(zip(got.unbind(), thresholds.unbind(), strict=True)):
        assert_same_on_all_ranks(g, f"agc threshold {index}")
        assert_rel(g, e, f"agc threshold {index}")
    for q in params:
        q.grad = None
    agreeing.step()
    assert agreeing.last_norm is not None and float(agreeing.last_norm) == 0.0


CASES: dict[str, Callable[[], None]] = {
    "only_empty_shards": case_only_empty_shards,
    "no_grads_get_total_norm": case_no_grads_get_total_norm,
    "per_group_some_groups_empty": case_per_group_some_groups_empty,
    "only_some_meshes": case_only_some_meshes,
    "process_group_rank_without_grads": case_process_group_rank_without_grads,
    "per_tensor_rank_without_grads": case_per_tensor_rank_without_grads,
    "agc_rank_without_grads": case_agc_rank_without_grads,
}


def worker(rank: int, port: int, out_dir: str) -> None:
    """Run every case in order, recording each outcome and its time; stop after a case
    that failed on some ranks only (the others were left waiting in a collective)."""
    import time

    results: dict[str, Any] = {}
    try:
        torch.set_num_threads(1)
        forbid_fsdp2_where_it_cannot_run()
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD_SIZE,
            timeout=PG_TIMEOUT,
        )
        control = dist.new_group(list(range(WORLD_SIZE)))
        for name, case in CASES.items():
            start = time.monotonic()
            try:
                case()
                outcome = "ok"
            except Exception:
                outcome = traceback.format_exc()
            results[name] = {"outcome": outcome, "seconds": time.monotonic() - start}
            some, every = all_ranks_failed(control, outcome != "ok")
            if some and not every:
                break
    except Exception:
        results["<setup>"] = {"outcome": traceback.format_exc(), "seconds": 0.0}
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def case_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out_dir = tmp_path_factory.mktemp("no_grads")
    failure = run_workers(worker, str(out_dir), timeout_s=JOIN_TIMEOUT_S)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in CASES}
    for rank in range(WORLD_SIZE):
        path = out_dir / f"rank{rank}.json"
        recorded = json.loads(path.read_text()) if path.exists() else {}
        setup = recorded.get("<setup>", {}).get("outcome")
        for name in CASES:
            default = {"outcome": setup or failure or "not run: an earlier case failed"}
            results[name].append(recorded.get(name, default))
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_joins_the_same_collectives(
    case: str, case_results: dict[str, list[dict[str, Any]]]
) -> None:
    outcomes = case_results[case]
    assert_all_ok([o["outcome"] for o in outcomes])
    # A rank left waiting would have taken the whole timeout: every case takes seconds.
    slowest = max(o["seconds"] for o in outcomes)
    assert slowest < PG_TIMEOUT.total_seconds(), f"{case} took {slowest:.1f} s"
