"""Pipeline stages that disagree on their param groups are refused; a stage without
grads ends the step as the others do.

Two gloo ranks on 127.0.0.1, each one pipeline stage, ``pp_mesh`` the world group; one
spawn runs every case, each recorded "ok" or its traceback per rank. The process group's
timeout is short, so a rank left waiting in a collective fails its case in
``PG_TIMEOUT`` seconds: a refusal must reach every rank, and none may hang.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import assert_all_ok
from test_distributed import WORLD_SIZE, CountAllReduce, rank_outcomes, run_cases
from torch import Tensor, nn

import clipopt

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
)

PG_TIMEOUT = datetime.timedelta(seconds=10)
JOIN_TIMEOUT_S = 120.0


def stage_model(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """This rank's stage: a layer of its own, seeded by the rank."""
    torch.manual_seed(dist.get_rank())
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(dtype)


def backward(model: nn.Module) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(7 + dist.get_rank()))
    model(x.to(next(model.parameters()).dtype)).pow(2).sum().backward()


def weights_and_biases(model: nn.Module, **bias_settings: Any) -> list[dict[str, Any]]:
    named = list(model.named_parameters())
    return [
        {"params": [q for n, q in named if n.endswith("weight")]},
        {"params": [q for n, q in named if n.endswith("bias")], **bias_settings},
    ]


def step_refused(groups: list[dict[str, Any]], match: str, **kwargs: Any) -> None:
    """The wrapper's first step raises a ValueError naming ``match`` and changes no grad."""
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(groups, lr=0.1), 0.5, pp_mesh=dist.group.WORLD, **kwargs
    )
    params = [q for group in groups for q in group["params"]]
    before = [(q.detach().clone(), q.grad.clone()) for q in params]
    with pytest.raises(ValueError, match=match):
        opt.step()
    for (value, grad), q in zip(before, params, strict=True):
        assert torch.equal(value, q) and torch.equal(grad, q.grad), "a refused step changes nothing"
    assert int(opt.step_count) == 0


def case_group_counts_differ() -> None:
    """per_group=True, stage 0 with two param groups and stage 1 with one: refused on
    every rank, naming per_group and the counts (it hung in the stages' all_reduce)."""
    model = stage_model()
    backward(model)
    groups = weights_and_biases(model)
    if dist.get_rank() == 1:
        groups = [{"params": [q for g in groups for q in g["params"]]}]
    step_refused(groups, r"per_group=True.*1 and 2 param groups", per_group=True)


def case_group_settings_out_of_order() -> None:
    """per_group=True, two groups on each stage, their clip settings in other orders:
    refused on every rank (each stage clipped by another stage's group's norm)."""
    model = stage_model()
    backward(model)
    norm_types = [{}, {"clip_norm_type": 1.0}]
    if dist.get_rank() == 1:
        norm_types.reverse()
    groups = weights_and_biases(model)
    for group, settings in zip(groups, norm_types, strict=True):
        group.update(settings)
    step_refused(groups, r"pp_mesh.*clip settings", per_group=True)
    model.zero_grad()
    backward(model)
    thresholds = weights_and_biases(model, clip_max_norm=0.1 if dist.get_rank() else 0.2)
    step_refused(thresholds, r"pp_mesh.*clip settings", per_group=True)


def case_stages_that_agree() -> None:
    """The same layout on both stages (per_group, or two clip groups): the check costs
    one all_reduce at the first step only, and the group norms equal the float64 norms
    of both stages' groups."""
    for names in (None, ("weights", "biases")):
        model = stage_model()
        groups = weights_and_biases(model, clip_norm_type=1.0)
        for group, name in zip(groups, names or (), strict=False):
            group["clip_group"] = name
        opt = clipopt.ClippedOptimizer(
            torch.optim.SGD(groups, lr=0.0),
            math.inf,
            per_group=names is None,
            pp_mesh=dist.group.WORLD,
        )
        check_two_stage_norms(model, opt)


def case_clip_groups_differ() -> None:
    """Clip groups named in another order on each stage: refused on every rank."""
    model = stage_model()
    backward(model)
    groups = weights_and_biases(model)
    names = ["a", "b"] if dist.get_rank() == 0 else ["b", "a"]
    for group, name in zip(groups, names, strict=True):
        group["clip_group"] = name
    step_refused(groups, r"pp_mesh.*clip groups \['[ab]', '[ab]'\]")


def check_two_stage_norms(model: nn.Module, opt: clipopt.ClippedOptimizer) -> None:
    """Two steps: one all_reduce more at the first (the layouts' check), and the group
    norms equal the float64 norms of both stages' groups (L2, then L1)."""
    calls = []
    for _ in range(2):
        model.zero_grad()
        backward(model)
        with CountAllReduce() as counter:
            opt.step()
        calls.append(counter.calls)
    assert calls == [2, 1], calls
    mine = [[q.grad.double().flatten() for q in g["params"]] for g in opt.param_groups]
    everyone: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(everyone, mine)
    expected = [
        torch.linalg.vector_norm(torch.cat([t for rank in everyone for t in rank[i]]), p)
        for i, p in enumerate((2.0, 1.0))
    ]
    assert opt.last_group_norms is not None
    torch.testing.assert_close(opt.last_group_norms.double(), torch.stack(expected))


def assert_same_bits(value: Tensor | None, what: str) -> None:
    """``value`` has the same dtype and the same bits on every rank."""
    assert value is not None, what
    dtypes: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(dtypes, (str(value.dtype), value.detach().cpu().reshape(-1)))
    first_dtype, first_bits = dtypes[0]
    for dtype, bits in dtypes:
        assert dtype == first_dtype, f"{what}: dtypes {[d for d, _ in dtypes]}"
        assert torch.equal(bits, first_bits), f"{what}: {[b for _, b in dtypes]}"


def case_stage_without_grads() -> None:
    """Stage 1 has no grads this step (float64 and float32 models; one norm, per_group,
    tracked per tensor): its last_norm has stage 0's dtype and bits."""
    for dtype in (torch.float64, torch.float32):
        for kwargs in ({}, {"per_group": True}, {"track_tensor_norms": True}):
            model = stage_model(dtype)
            groups = weights_and_biases(model) if kwargs.get("per_group") else model.parameters()
            opt = clipopt.ClippedOptimizer(
                torch.optim.SGD(groups, lr=0.1), 1e9, pp_mesh=dist.group.WORLD, **kwargs
            )
            if dist.get_rank() == 0:
                backward(model)
            opt.step()
            what = f"{dtype} {kwargs}"
            assert_same_bits(opt.last_norm, f"last_norm {what}")
            if kwargs.get("per_group"):
                assert_same_bits(opt.last_group_norms, f"last_group_norms {what}")


# The group counts last: where a rank is left waiting, gloo breaks the group for good.
CASES: dict[str, Callable[[], None]] = {
    "stage_without_grads": case_stage_without_grads,
    "stages_that_agree": case_stages_that_agree,
    "clip_groups_differ": case_clip_groups_differ,
    "group_settings_out_of_order": case_group_settings_out_of_order,
    "group_counts_differ": case_group_counts_differ,
}


def worker(rank: int, port: int, out_dir: str) -> None:
    run_cases(rank, port, out_dir, CASES, timeout=PG_TIMEOUT)


@pytest.fixture(scope="module")
def case_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    out_dir = tmp_path_factory.mktemp("stages_agree")
    return rank_outcomes(worker, out_dir, CASES, timeout_s=JOIN_TIMEOUT_S)


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_stages_agree(case: str, case_results: dict[str, list[str]]) -> None:
    assert_all_ok(case_results[case])
