"""The frameworks page's torchtitan recipe, run with the installed torchtitan (0.3.0).

Two gloo processes as ``ParallelDims(pp=2)``: each rank is one pipeline stage with its own
parameters and an ``AutoClip(per_tensor=True)`` wrapper over ``pp_mesh``, built by an
``OptimizersContainer`` subclass that checkpoints the inner AdamW and steps the wrapper.
torchtitan's ``CheckpointManager`` saves every stage into one DCP checkpoint, with
``ClippedOptimizerState`` in its ``states``; a fresh set of objects loads it and must
continue bit for bit as the uninterrupted run, each stage with its own rule state.
With the entry under one key for every stage, the resumed norms differ.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import assert_all_ok, assert_identical
from test_distributed import WORLD_SIZE, rank_outcomes, run_cases
from torch import nn

import clipopt
from clipopt.distributed import ClippedOptimizerState

pytestmark = [
    pytest.mark.integrations,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo"),
]

STEPS = 5
SAVED_AT = 2


def _titan() -> Any:
    try:
        import torchtitan.distributed.parallel_dims as titan_dims
        from torchtitan.components.checkpoint import CheckpointManager
        from torchtitan.components.optimizer import (
            LRSchedulersContainer,
            OptimizersContainer,
            ParamGroupConfig,
        )
    except ImportError as error:  # pragma: no cover - the integrations extra installs it
        pytest.skip(f"torchtitan is not installed: {error}")
    titan_dims.device_type = "cpu"  # torchtitan picks cuda wherever torch is built with it
    return (
        titan_dims,
        CheckpointManager,
        LRSchedulersContainer,
        OptimizersContainer,
        ParamGroupConfig,
    )


class OneKeyForEveryStage:
    """The clip entry under one key whatever the stage: what the per-stage key prevents."""

    def __init__(self, state: ClippedOptimizerState, own_key: str) -> None:
        self.state, self.own_key = state, own_key

    def state_dict(self) -> dict[str, Any]:
        return {"stage": self.state.state_dict()[self.own_key]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state.load_state_dict({self.own_key: state_dict["stage"]})


def case_checkpoint_manager_resumes_each_stage(folder: str) -> None:
    titan_dims, CheckpointManager, Schedulers, OptimizersContainer, ParamGroupConfig = _titan()

    # The recipe: the container keeps checkpointing the inner optimizers (so torchtitan's
    # init_optim_state steps only them) and steps the wrappers.
    class ClippedOptimizersContainer(OptimizersContainer):  # type: ignore[misc,valid-type]
        def __init__(self, config: Any, *, model_parts: list[nn.Module], pp_mesh: Any) -> None:
            super().__init__(config, model_parts=model_parts)
            self.clipped = [
                clipopt.ClippedOptimizer(inner, clipopt.AutoClip(per_tensor=True), pp_mesh=pp_mesh)
                for inner in self.optimizers
            ]

        def step(self, closure: Any = None) -> None:
            for optimizer in self.clipped:
                optimizer.step()

    dims = titan_dims.ParallelDims(
        dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=WORLD_SIZE, ep=1, world_size=WORLD_SIZE
    )
    dims.build_mesh()
    pp_mesh = dims.get_optional_mesh("pp")
    stage = pp_mesh.get_local_rank()
    config = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.05})
        ],
        implementation="for-loop",
    )

    def build(one_key: bool = False, where: str = folder) -> tuple[nn.Module, Any, Any]:
        torch.manual_seed(stage)  # each stage its own layers, named apart
        part = nn.ModuleDict({f"stage{stage}": nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))})
        optimizers = ClippedOptimizersContainer(config, model_parts=[part], pp_mesh=pp_mesh)
        clip: Any = ClippedOptimizerState(optimizers.clipped[0])
        if one_key:
            clip = OneKeyForEveryStage(clip, f"stage{stage}")
        manager = CheckpointManager(
            CheckpointManager.Config(
                enable=True,
                folder="checkpoint",
                interval=1,
                keep_latest_k=0,
                initial_load_model_only=False,
            ),
            dataloader=None,
            model_parts=[part],
            optimizers=optimizers,
            lr_schedulers=Schedulers(optimizers, lambda step: 1.0 / (1 + step)),
            states={"clip": clip},
            sd_adapter=None,
            base_folder=where,
        )
        return part, optimizers, manager

    generator = torch.Generator().manual_seed(10 + stage)
    inputs = [torch.randn(4, 3, generator=generator) * (1 + 3 * (i % 2)) for i in range(STEPS)]

    def train(part: nn.Module, optimizers: Any, manager: Any, steps: range) -> list[Any]:
        norms = []
        for step in steps:
            optimizers.zero_grad()
            part[f"stage{stage}"](inputs[step]).pow(2).sum().backward()
            optimizers.step()
            manager.states["lr_scheduler"].step()
            norms.append(optimizers.clipped[0].last_norm.clone())
            if step + 1 == SAVED_AT:
                assert manager.save(curr_step=SAVED_AT)
        return norms

    part, optimizers, manager = build()
    norms = train(part, optimizers, manager, range(STEPS))
    resumed_part, resumed, resumed_manager = build()
    assert resumed_manager.load(step=SAVED_AT)
    resumed_norms = train(resumed_part, resumed, resumed_manager, range(SAVED_AT, STEPS))
    assert_identical(resumed_norms, norms[SAVED_AT:], "last_norm after the resume")
    for (name, a), (_, b) in zip(
        resumed_part.named_parameters(), part.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    ours, theirs = resumed.clipped[0].state_dict(), optimizers.clipped[0].state_dict()
    assert_identical(ours, theirs, "the wrapper's state dict")
    rule_state = ours["clip"]["rule"]["state"]
    assert len(str(rule_state)) > 0 and int(ours["clip"]["step_count"]) == STEPS
    # The control: with one key for every stage, DCP keeps one stage's entry and the
    # other stage resumes with a rule state not its own; the norm is the stages' global
    # one, so every stage's norms part from the uninterrupted run's.
    shared = os.path.join(folder, "one_key")
    one_part, one_optimizers, one_manager = build(one_key=True, where=shared)
    train(one_part, one_optimizers, one_manager, range(SAVED_AT))
    again_part, again, again_manager = build(one_key=True, where=shared)
    assert again_manager.load(step=SAVED_AT)
    again_norms = train(again_part, again, again_manager, range(SAVED_AT, STEPS))
    assert not all(torch.equal(a, b) for a, b in zip(again_norms, norms[SAVED_AT:], strict=True))
    for manager_ in (manager, resumed_manager, one_manager, again_manager):
        manager_.close()


CASES = {"checkpoint_manager_resumes_each_stage": case_checkpoint_manager_resumes_each_stage}


def worker(rank: int, port: int, out_dir: str) -> None:
    def call(name: str, case: Callable[..., None]) -> None:
        case(os.path.join(out_dir, name))

    run_cases(rank, port, out_dir, CASES, call)


@pytest.fixture(scope="module")
def case_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    _titan()
    return rank_outcomes(worker, tmp_path_factory.mktemp("torchtitan"), CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_torchtitan_checkpoint_manager(case: str, case_results: dict[str, list[str]]) -> None:
    assert_all_ok(case_results[case])
