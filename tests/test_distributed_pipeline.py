"""Pipeline stages, meshes as torchtitan builds them, and MoE's two meshes, on 4 ranks.

ONE spawn of 4 gloo ranks on 127.0.0.1 runs every case (a spawn of 4 costs seconds on
2 cores); each case records "ok" or its traceback per rank, as tests/test_distributed.py
does. The layout is (pp=2, dp=2): ranks 0 and 1 are stage 0, ranks 2 and 3 stage 1;
``pp_mesh`` joins ranks {0, 2} and {1, 3}. Every case compares against one process
holding the whole model, which every rank computes itself, or against the float64 norm
of every rank's full grads, gathered.
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import assert_all_ok, assert_identical, forbid_fsdp2_where_it_cannot_run
from test_distributed import CountAllReduce, all_ranks_failed, free_port
from torch import Tensor, nn

import clipopt
from clipopt._dist import _reduce, _stages

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
)

WORLD = 4
PP = 2
DP = 2
PG_TIMEOUT = datetime.timedelta(seconds=60)
JOIN_TIMEOUT_S = 300.0
RTOL = 1e-5  # float32 stages against float32 one-process runs: sums in other orders
STEPS = 3
SKIPPED = "skipped: "


def assert_close(actual: Tensor, expected: Tensor, what: str, rtol: float = RTOL) -> None:
    torch.testing.assert_close(
        actual.detach().double().cpu(),
        expected.detach().double().cpu(),
        rtol=rtol,
        atol=1e-7,
        equal_nan=True,
        msg=lambda m: f"{what}: {m}",
    )


def assert_same_everywhere(value: Tensor, what: str) -> None:
    """``value`` has the same bits on all 4 ranks (NaN matching NaN)."""
    mine = value.detach().reshape(-1).double().cpu()
    gathered = [torch.empty_like(mine) for _ in range(WORLD)]
    dist.all_gather(gathered, mine)
    for other in gathered:
        same = torch.equal(other, mine) or bool((other.isnan() & mine.isnan()).all())
        assert same, f"{what} differs across ranks: {gathered}"


def assert_state_close(ours: Any, theirs: Any, what: str) -> None:
    """A rule's state dict: its floating tensors the same on every rank and close to the
    one-process run's, everything else equal."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), what
        for key in theirs:
            assert_state_close(ours[key], theirs[key], f"{what}/{key}")
    elif isinstance(theirs, Tensor) and theirs.is_floating_point():
        assert_same_everywhere(ours, what)
        assert_close(ours, theirs, what)
    elif isinstance(theirs, Tensor):
        assert torch.equal(ours, theirs), what
    else:
        assert ours == theirs, what


def meshes() -> tuple[Any, Any, Any]:
    """(world 1-D, pp, dp) unflattened from a 1-D root as torchtitan's ParallelDims does."""
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (PP, DP), ("pp", "dp"))
    return world, dense["pp"], dense["dp"]


def stage_of() -> int:
    return dist.get_rank() // DP


def gathered_full(grads: list[Tensor], counted: bool) -> list[Tensor]:
    """Every rank's ``grads`` gathered as full float64 tensors where ``counted``."""
    mine = [
        (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().double().flatten()
        for g in grads
    ]
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, mine if counted else [])
    return [t for part in everyone for t in part]


def float64_norm(tensors: list[Tensor], p: float) -> Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    return torch.linalg.vector_norm(torch.cat(tensors), p)


# --------------------------------------------------------------------------- models


class Block(nn.Module):
    """A pre-norm transformer block: attention and an MLP, no dropout."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


VOCAB, WIDTH, SEQ, BATCH = 13, 8, 5, 8


def transformer(seed: int = 0) -> nn.ModuleDict:
    """A small transformer: its first stage is the embedding and block 0, its second
    block 1 and the head."""
    torch.manual_seed(seed)
    return nn.ModuleDict(
        {
            "embed": nn.Embedding(VOCAB, WIDTH),
            "block0": Block(WIDTH),
            "block1": Block(WIDTH),
            "head": nn.Linear(WIDTH, VOCAB),
        }
    )


class Stage0(nn.Module):
    def __init__(self, model: nn.ModuleDict) -> None:
        super().__init__()
        self.embed, self.block0 = model["embed"], model["block0"]

    def forward(self, tokens: Tensor) -> Tensor:
        return self.block0(self.embed(tokens))


class Stage1(nn.Module):
    def __init__(self, model: nn.ModuleDict) -> None:
        super().__init__()
        self.block1, self.head = model["block1"], model["head"]

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block1(x))


def whole(model: nn.ModuleDict, tokens: Tensor) -> Tensor:
    return Stage1(model)(Stage0(model)(tokens))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def token_batches(steps: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [
        (
            torch.randint(VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(VOCAB, (BATCH, SEQ), generator=g),
        )
        for _ in range(steps)
    ]


def sgd(params: Any) -> torch.optim.Optimizer:
    """SGD with momentum: its update is linear in the grads, so the stages' and the one
    process's float32 sums, in other orders, stay as close as the grads (Adam divides by
    the root of a second moment, and turns a grad that is 0 up to rounding, the
    attention's key bias, into a full step of either sign)."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def wrap(optimizer: torch.optim.Optimizer, max_norm: Any, pp: Any, **kwargs: Any) -> Any:
    return clipopt.ClippedOptimizer(optimizer, max_norm, pp_mesh=pp, **kwargs)


# --------------------------------------------------------------------------- cases


def _pipeline_run(
    steps: int, pp: Any, dp: Any, resume_at: int | None, checkpoint: str
) -> tuple[nn.Module, Any, list[Tensor]]:
    """Train this rank's stage of the transformer (FSDP2 over ``dp``) through GPipe."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    def build() -> tuple[nn.Module, Any, Any]:
        full = transformer()
        stage = Stage0(full) if stage_of() == 0 else Stage1(full)
        for module in stage.children():
            fully_shard(module, mesh=dp)
        fully_shard(stage, mesh=dp)
        rule = clipopt.ZClip(warmup_steps=2, z_thresh=1.0, max_grad_norm=0.3)
        optimizer = wrap(sgd(stage.named_parameters()), rule, pp, track_tensor_norms=True)
        pipe = PipelineStage(stage, stage_of(), PP, torch.device("cpu"), group=pp.get_group())
        return stage, optimizer, ScheduleGPipe(pipe, 2, loss_fn=lm_loss)

    stage, optimizer, schedule = build()
    norms: list[Tensor] = []
    rows = slice(dp.get_local_rank() * BATCH // DP, (dp.get_local_rank() + 1) * BATCH // DP)
    for step, (tokens, targets) in enumerate(token_batches(steps)):
        if step == resume_at:
            save_and_resume = _dcp_round_trip(stage, optimizer, checkpoint)
            stage, optimizer, schedule = build()
            save_and_resume(stage, optimizer)
        if stage_of() == 0:
            schedule.step(tokens[rows])
        else:
            schedule.step(target=targets[rows])
        optimizer.step()
        optimizer.zero_grad()
        norms.append(optimizer.last_norm.clone())
    return stage, optimizer, norms


def _dcp_round_trip(stage: nn.Module, optimizer: Any, checkpoint: str) -> Callable[..., None]:
    """Save ``stage`` and ``optimizer`` into one DCP checkpoint of every stage under the
    same keys, as torchtitan does (the model's and the flattened optimizer's keys are the
    stage's parameter names; ``ClippedOptimizerState`` keys its entry by stage); return
    what loads them into a fresh stage and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from clipopt.distributed import ClippedOptimizerState

    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    def state(module: nn.Module, wrapper: Any) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(module),
            "optim": get_optimizer_state_dict(module, wrapper.optimizer, options=flat),
            "clip": ClippedOptimizerState(wrapper),
        }

    dcp.save(state(stage, optimizer), checkpoint_id=checkpoint)

    def load(fresh: nn.Module, fresh_optimizer: Any) -> None:
        target = state(fresh, fresh_optimizer)
        dcp.load(target, checkpoint_id=checkpoint)
        set_model_state_dict(fresh, target["model"])
        set_optimizer_state_dict(fresh, fresh_optimizer.optimizer, target["optim"], options=flat)

    return load


def case_pipeline_schedule(out_dir: str) -> None:
    """(pp=2, dp=2), FSDP2 inside each stage, GPipe over two stages of a transformer,
    ZClip: every rank's norm, the update and ZClip's state equal one process training
    the whole model; a DCP checkpoint after step 1 resumes bit for bit, per stage."""
    _, pp, dp = meshes()
    stage, optimizer, norms = _pipeline_run(STEPS, pp, dp, None, "")
    reference = transformer()
    rule = clipopt.ZClip(warmup_steps=2, z_thresh=1.0, max_grad_norm=0.3)
    ref_optimizer = clipopt.ClippedOptimizer(sgd(reference.parameters()), rule)
    for step, (tokens, targets) in enumerate(token_batches(STEPS)):
        lm_loss(whole(reference, tokens), targets).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        assert_same_everywhere(norms[step], f"last_norm at step {step}")
        assert_close(norms[step], ref_optimizer.last_norm, f"last_norm at step {step}")
    unclipped = transformer()
    plain = sgd(unclipped.parameters())
    for tokens, targets in token_batches(STEPS):
        lm_loss(whole(unclipped, tokens), targets).backward()
        plain.step()
        plain.zero_grad()
    assert not torch.equal(unclipped["head"].weight, reference["head"].weight), "ZClip clipped"
    assert_state_close(optimizer.rule.state_dict(), rule.state_dict(), "ZClip")
    names = {name for name, _ in stage.named_parameters()}
    reference_params = dict(reference.named_parameters())
    for name, param in stage.named_parameters():
        full = param.full_tensor()
        expected = reference_params[name]
        error = float(torch.linalg.vector_norm((full - expected).double()))
        assert error <= RTOL * float(torch.linalg.vector_norm(expected.double())), name
    tracked = optimizer.last_tensor_norms
    assert tracked is not None and set(tracked) == names, (sorted(tracked or {}), sorted(names))
    # Resume: a checkpoint after step 1, loaded into a fresh stage, continues bit for bit.
    checkpoint = os.path.join(out_dir, "pipeline_checkpoint")
    resumed, resumed_optimizer, resumed_norms = _pipeline_run(STEPS, pp, dp, 1, checkpoint)
    assert_identical(resumed_norms, norms, "resumed last_norm")
    for (name, a), (_, b) in zip(resumed.named_parameters(), stage.named_parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local()), name
    assert_identical(resumed_optimizer.rule.state_dict(), optimizer.rule.state_dict())
    assert resumed_optimizer.step_count == optimizer.step_count == STEPS


def _separable(seed: int) -> nn.ModuleDict:
    """Two blocks trained on the sum of their own losses: block ``s`` is stage ``s``."""
    torch.manual_seed(seed)
    return nn.ModuleDict(
        {f"stage{s}": nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)) for s in range(PP)}
    )


def _separable_data(steps: int) -> list[list[Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [[torch.randn(8, 4, generator=g) for _ in range(PP)] for _ in range(steps)]


RULES: dict[str, Callable[[], dict[str, Any]]] = {
    "float": lambda: {"max_norm": 0.5},
    "autoclip": lambda: {"max_norm": clipopt.AutoClip(percentile=50)},
    "autoclip_per_tensor": lambda: {"max_norm": clipopt.AutoClip(percentile=50, per_tensor=True)},
    "zclip": lambda: {"max_norm": clipopt.ZClip(warmup_steps=1, z_thresh=0.5, max_grad_norm=None)},
    "adagc": lambda: {"max_norm": clipopt.AdaGC(warmup_steps=1, warmup_max_norm=0.3)},
    "agc": lambda: {"max_norm": clipopt.AGC(clipping=0.05)},
    "spike_skip": lambda: {
        "max_norm": 10.0,
        "skip_spikes": clipopt.SpikeSkip(window=4, sigma=0.1, min_history=2),
    },
}


def case_rules_under_stages() -> None:
    """Every clip rule and SpikeSkip, with stages that hold FSDP2 grads (stage 0) and
    plain DDP-style grads (stage 1): each rank's norms, skips, parameters and the rule's
    global state equal one process's over the whole model; the tracked norms name the
    stage's own parameters; a NaN on stage 0 skips the step on every rank."""
    from torch.distributed.fsdp import fully_shard

    _, pp, dp = meshes()
    stage = stage_of()
    steps = 4
    data = _separable_data(steps)
    for name, make in RULES.items():
        model = _separable(1)
        part = model[f"stage{stage}"]
        if stage == 0:
            fully_shard(part, mesh=dp)
        ours = wrap(
            torch.optim.SGD(part.named_parameters(), lr=0.1),
            pp=pp,
            nonfinite="skip",
            track_tensor_norms=not name.startswith("agc"),
            **make(),
        )
        reference_model = _separable(1)
        reference = clipopt.ClippedOptimizer(
            torch.optim.SGD(reference_model.parameters(), lr=0.1), nonfinite="skip", **make()
        )
        rows = slice(dp.get_local_rank() * 4, dp.get_local_rank() * 4 + 4)
        for step in range(steps):
            x = data[step][stage]
            part(x[rows] if stage == 0 else x).pow(2).mean().backward()
            poison = step == 2
            if poison and stage == 0:
                next(iter(part.parameters())).grad.to_local().view(-1)[0] = math.nan
            with CountAllReduce() as counter:
                ours.step()
            # The stage's own reduction (FSDP2: one; plain grads: none), then the stages';
            # at the first step, the check that the stages' clip settings agree before it.
            expected_calls = (1 if stage == 0 else 0) + 1 + (step == 0)
            assert counter.calls == expected_calls, (name, step, counter.calls)
            ours.zero_grad()
            for s in range(PP):
                reference_model[f"stage{s}"](data[step][s]).pow(2).mean().backward()
            if poison:
                next(iter(reference_model["stage0"].parameters())).grad.view(-1)[0] = math.nan
            reference.step()
            reference.zero_grad()
            what = f"{name} step {step}"
            assert_same_everywhere(ours.last_norm, f"{what} last_norm")
            assert_close(ours.last_norm, reference.last_norm, f"{what} last_norm")
            assert int(ours.skip_count) == int(reference.skip_count), what
        assert int(ours.skip_count) >= 1, name
        expected = dict(reference_model.named_parameters())
        for pname, param in part.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            assert_close(full, expected[f"stage{stage}.{pname}"], f"{name} {pname}")
        rule = ours.rule
        # A global rule's state is the same on every stage; a per-tensor or unit-wise
        # rule's is the stage's own tensors' (compared above through the updates).
        local = rule is not None and (rule.per_tensor or isinstance(rule, clipopt.UnitWiseRule))
        if rule is not None and not local:
            for key, value in reference.rule.state_dict().items():
                if isinstance(value, Tensor) and value.is_floating_point():
                    assert_same_everywhere(rule.state_dict()[key], f"{name} {key}")
        if ours.last_tensor_norms is not None:
            own = {pn for pn, _ in part.named_parameters()}
            assert set(ours.last_tensor_norms) == own, (name, sorted(ours.last_tensor_norms))
    # per_group: the stages' groups matched by position (weights, then biases).
    model = _separable(2)
    part = model[f"stage{stage}"]
    if stage == 0:
        fully_shard(part, mesh=dp)

    def split(module: nn.Module) -> list[dict[str, Any]]:
        named = list(module.named_parameters())
        return [
            {"params": [q for n, q in named if n.endswith("weight")]},
            {"params": [q for n, q in named if n.endswith("bias")], "clip_norm_type": 1.0},
        ]

    ours = wrap(torch.optim.SGD(split(part), lr=0.1), 0.3, pp, per_group=True)
    reference_model = _separable(2)
    groups = [split(reference_model[f"stage{s}"]) for s in range(PP)]
    merged = [
        {**groups[0][i], "params": groups[0][i]["params"] + groups[1][i]["params"]}
        for i in range(2)
    ]
    reference = clipopt.ClippedOptimizer(torch.optim.SGD(merged, lr=0.1), 0.3, per_group=True)
    rows = slice(dp.get_local_rank() * 4, dp.get_local_rank() * 4 + 4)
    x = data[0][stage]
    part(x[rows] if stage == 0 else x).pow(2).mean().backward()
    ours.step()
    for s in range(PP):
        reference_model[f"stage{s}"](data[0][s]).pow(2).mean().backward()
    reference.step()
    assert_same_everywhere(ours.last_group_norms, "per_group norms")
    assert_close(ours.last_group_norms, reference.last_group_norms, "per_group norms")
    assert_close(ours.last_norm, reference.last_norm, "per_group last_norm")
    # A stage without grads in a step (plain grads, tracked per tensor) joins with a zero.
    for tracked in (True, False):
        part = _separable(3)[f"stage{stage}"]
        ours = wrap(
            torch.optim.SGD(part.named_parameters(), lr=0.1), 1e9, pp, track_tensor_norms=tracked
        )
        if stage == 0:
            part(data[0][0]).pow(2).mean().backward()
        grads = [q.grad for q in part.parameters() if q.grad is not None]
        expected = float64_norm(gathered_full(grads, dp.get_local_rank() == 0), 2.0)
        ours.step()
        assert_same_everywhere(ours.last_norm, f"a stage without grads, tracked={tracked}")
        assert_close(ours.last_norm, expected, f"a stage without grads, tracked={tracked}")


def case_functional_stages() -> None:
    """The stages' norm from each stage's own reduction, in one collective more: FSDP2
    grads, plain grads whole on every rank of the stage, plain grads split across the
    stage's ranks (a process_group), a stage without grads; NaN and inf from one stage
    reach every rank; wrong pp_mesh and process_group refused."""
    from torch.distributed.tensor import DTensor, Shard

    _, pp, dp = meshes()
    stage = stage_of()
    group = _stages.stage_group(pp)
    g = torch.Generator().manual_seed(3)
    values = [torch.randn(6, generator=g) for _ in range(2 * WORLD)]
    mine = values[2 * dist.get_rank() : 2 * dist.get_rank() + 2]
    layouts: dict[str, tuple[list[Tensor], dict[str, Any], bool]] = {
        "fsdp2": ([DTensor.from_local(t, dp, [Shard(0)]) for t in mine], {}, True),
        # plain grads that every rank of the stage holds whole: each stage's rank 0 counts
        "whole": (values[2 * stage : 2 * stage + 2], {}, dp.get_local_rank() == 0),
        "split": (mine, {"process_group": dp.get_group()}, True),
        "stage1_only": (mine if stage == 1 else [], {"process_group": dp.get_group()}, True),
    }
    for name, (grads, kwargs, counted) in layouts.items():
        counted_grads = [t.to_local() if isinstance(t, DTensor) else t for t in grads]
        reference_parts = gathered_full(counted_grads if counted else [], True)
        for p in (1.0, 2.0, 3.0, math.inf):
            with CountAllReduce() as counter:
                norm = _reduce.global_norm(grads, p, pp_group=group, **kwargs)
            assert counter.calls == 2 if name != "whole" else counter.calls == 1, (
                name,
                counter.calls,
            )
            assert_same_everywhere(norm, f"{name} p={p}")
            assert_close(norm, float64_norm(reference_parts, p), f"{name} p={p}", rtol=1e-6)
    for bad, expect_nan in ((math.nan, True), (math.inf, False)):
        grads = [t.clone() for t in values[2 * stage : 2 * stage + 2]]
        if stage == 0:
            grads[0][0] = bad
        for p in (2.0, math.inf):
            norm = _reduce.global_norm(grads, p, pp_group=group)
            assert_same_everywhere(norm, f"{bad} p={p}")
            assert bool(norm.isnan()) == expect_nan and not bool(norm.isfinite()), (bad, p, norm)
    fsdp_grads = layouts["fsdp2"][0]
    with pytest.raises(ValueError, match=r"process_group spans ranks .* pp_mesh"):
        _reduce.global_norm(fsdp_grads, 2.0, process_group=pp.get_group())
    with pytest.raises(ValueError, match="pp_mesh spans ranks"):
        _reduce.global_norm(fsdp_grads, 2.0, pp_group=_stages.stage_group(dp))
    world, _, _ = meshes()
    with pytest.raises(ValueError, match="pp_mesh must be a 1-D DeviceMesh"):
        _stages.stage_group(world._unflatten(0, (PP, DP), ("pp", "dp")))
    with pytest.raises(TypeError, match="pp_mesh must be"):
        _stages.stage_group("pp")


def case_unflattened_meshes() -> None:
    """Meshes unflattened from a 1-D root, as torchtitan builds them: FSDP2 + TP with a
    LayerNorm left out of TP (grads on the 2-D mesh and on its dp part); MoE's dense
    grads on one mesh and experts on another (2-D, and on the ep part only, replicated
    over the rest); grads on meshes none of which holds the others' ranks refused."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    world, _, _ = meshes()
    dense = world._unflatten(0, (2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.LayerNorm(4))
    reference = copy.deepcopy(model)
    parallelize_module(model, dense["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=dense["dp"])
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    rows = slice(dense["dp"].get_local_rank() * 4, dense["dp"].get_local_rank() * 4 + 4)
    model(x[rows]).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    dims = sorted(q.grad.device_mesh.ndim for q in model.parameters())
    assert dims[0] == 1 and dims[-1] == 2, "the LayerNorm's grads live on the dp part only"
    for p in (2.0, math.inf):
        expected = torch.nn.utils.get_total_norm(
            [q.grad.double() for q in reference.parameters()], p
        )
        norm = clipopt.get_total_norm([q.grad for q in model.parameters()], p)
        assert_same_everywhere(norm, f"FSDP2 + TP p={p}")
        assert_close(norm, expected, f"FSDP2 + TP p={p}")
    # MoE: dense on a 4-rank mesh, experts on (efsdp, ep) and on ep alone.
    fsdp = world._unflatten(0, (1, 4), ("pp", "fsdp"))["fsdp"]
    sparse = world._unflatten(0, (1, 2, 2), ("pp", "efsdp", "ep"))
    g = torch.Generator().manual_seed(2)
    dense_full, experts_full, router_full = (torch.randn(8, 3, generator=g) for _ in range(3))
    grads = [
        distribute_tensor(dense_full, fsdp, [Shard(0)]),
        distribute_tensor(experts_full, sparse["efsdp", "ep"], [Shard(1), Shard(0)]),
        distribute_tensor(router_full, sparse["ep"], [Shard(0)]),
        distribute_tensor(router_full, sparse["efsdp"], [Replicate()]),
    ]
    fulls = [dense_full, experts_full, router_full, router_full]
    for p in (1.0, 2.0, math.inf):
        expected = float64_norm([t.double().flatten() for t in fulls], p)
        norm = clipopt.get_total_norm(grads, p)
        assert_same_everywhere(norm, f"MoE p={p}")
        assert_close(norm, expected, f"MoE p={p}")
    crossed = [
        distribute_tensor(dense_full, dense["dp"], [Shard(0)]),
        distribute_tensor(experts_full, dense["tp"], [Shard(0)]),
    ]
    with pytest.raises(ValueError, match="holds the ranks of all the others"):
        clipopt.get_total_norm(crossed)


def case_torchtitan() -> None:
    """torchtitan's own ParallelDims.build_mesh() meshes: (pp=2, dp_shard=2) with FSDP2
    stages (clipopt with pp_mesh against torchtitan's clip_grad_norm_ with pp_mesh and the
    float64 norm), and the pipeline group passed as process_group refused."""
    try:
        import torchtitan.distributed.parallel_dims as titan_dims
        from torchtitan.distributed.utils import clip_grad_norm_ as titan_clip
    except ImportError as error:
        raise _Skip(f"torchtitan is not installed: {error}") from error
    from torch.distributed.fsdp import fully_shard

    titan_dims.device_type = "cpu"  # torchtitan picks cuda wherever torch is built with it
    dims = titan_dims.ParallelDims(
        dp_replicate=1, dp_shard=DP, cp=1, tp=1, pp=PP, ep=1, world_size=WORLD
    )
    dims.build_mesh()
    pp, dp = dims.get_mesh("pp"), dims.get_mesh("dp_shard")
    torch.manual_seed(stage_of())
    part = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    fully_shard(part, mesh=dp)
    torch.manual_seed(100 + dist.get_rank())
    part(torch.randn(4, 5)).pow(2).sum().backward()
    grads = [q.grad for q in part.parameters()]
    expected = float64_norm(gathered_full(grads, dp.get_local_rank() == 0), 2.0)
    ours = clipopt.clip_grad_norm_(part.parameters(), 1e9, pp_mesh=pp)
    theirs = titan_clip(part.parameters(), 1e9, pp_mesh=pp)
    assert_same_everywhere(ours, "clip_grad_norm_ with pp_mesh")
    assert_close(ours, expected, "clipopt", rtol=1e-6)
    assert_close(theirs, expected, "torchtitan", rtol=1e-6)
    with pytest.raises(ValueError, match="process_group spans ranks"):
        clipopt.get_total_norm(grads, process_group=pp.get_group())


class _Skip(Exception):
    """A case that cannot run here (an optional package missing)."""


CASES: dict[str, Callable[..., None]] = {
    "functional_stages": case_functional_stages,
    "unflattened_meshes": case_unflattened_meshes,
    "rules_under_stages": case_rules_under_stages,
    "pipeline_schedule": case_pipeline_schedule,
    "torchtitan": case_torchtitan,
}


def worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    forbid_fsdp2_where_it_cannot_run()
    results: dict[str, str] = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=PG_TIMEOUT,
        )
        control = dist.new_group(list(range(WORLD)))
        for name, case in CASES.items():
            try:
                if name == "pipeline_schedule":
                    case(out_dir)
                else:
                    case()
                results[name] = "ok"
            except _Skip as why:
                results[name] = SKIPPED + str(why)
            except Exception:
                results[name] = traceback.format_exc()
            failed = results[name] != "ok" and not results[name].startswith(SKIPPED)
            some, every = all_ranks_failed(control, failed)
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
    import time

    import torch.multiprocessing as mp

    out_dir = tmp_path_factory.mktemp("pipeline")
    context = mp.start_processes(
        worker, args=(free_port(), str(out_dir)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    failure = None
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                failure = f"workers still running after {JOIN_TIMEOUT_S} s"
                break
    except Exception as error:
        failure = f"{type(error).__name__}: {error}"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
    results: dict[str, list[str]] = {name: [] for name in CASES}
    for rank in range(WORLD):
        path = Path(out_dir) / f"rank{rank}.json"
        recorded = json.loads(path.read_text()) if path.exists() else {}
        for name in results:
            default = recorded.get("<setup>") or failure or "not run: an earlier case failed"
            results[name].append(recorded.get(name, default))
    return results


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(name, marks=pytest.mark.integrations) if name == "torchtitan" else name
        for name in CASES
    ],
)
def test_stages_and_meshes(case: str, case_results: dict[str, list[str]]) -> None:
    outcomes = case_results[case]
    if all(o.startswith(SKIPPED) for o in outcomes):
        pytest.skip(outcomes[0][len(SKIPPED) :])
    assert_all_ok(outcomes)
