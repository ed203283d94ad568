"""ClippedOptimizer as OLMo-core trains and checkpoints it, reproduced with torch's APIs.

OLMo-core 3.0.0 requires ``torch<2.14`` and so cannot install over the pinned torch; its
calls are reproduced here instead: its train module saves the optimizer through torch's
``get_optimizer_state_dict`` with ``StateDictOptions(flatten_optimizer_state_dict=True,
cpu_offload=True)`` and ``dcp.save``, and loads through a template from the same
function, ``dcp.load`` and ``set_optimizer_state_dict`` with
``StateDictOptions(flatten_optimizer_state_dict=True, strict=True)``
(``olmo_core/train/train_module/transformer/train_module.py``). torch's functions keep
only ``"state"`` and ``"param_groups"``; the recipe puts
``clipopt.distributed.ClippedOptimizerState`` beside them, and the resumed run must be
the uninterrupted one bit for bit. The rows of the checkpoint table of issue 27 are here
too: every state dict prints and loads with ``weights_only=True``, a decorated
``state_dict`` and a change of the first parameter lose nothing, a plain AdamW loads the
checkpoint with nothing of clipopt, and a load without the clip entry says so. OLMo-core's
``SkipStepOptimizer`` is refused, since wrapped it would never skip.
"""

from __future__ import annotations

import copy
import functools
import io
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import assert_all_ok, assert_identical
from test_distributed import (
    WORLD_SIZE,
    batches,
    free_port,
    full,
    fully_shard_mlp,
    init_gloo,
    local_rows,
    loss_fn,
    mlp,
    rank_outcomes,
    run_cases,
)
from torch import nn
from torch.optim import Optimizer

import clipopt
from clipopt.distributed import ClippedOptimizerState

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
)


# --------------------------------------------------------------------------- SkipStepOptimizer


def _olmo_class(name: str, module: str, base: type, body: dict[str, Any]) -> type:
    kind = type(name, (base,), body)
    kind.__module__ = module
    return kind


# OLMo-core's classes as they are laid out (olmo_core/optim/skip_step_optimizer.py and
# adamw.py): the names and modules the refusal reads, not their arithmetic.
SkipStepOptimizer = _olmo_class(
    "SkipStepOptimizer", "olmo_core.optim.skip_step_optimizer", Optimizer, {}
)
SkipStepAdamW = _olmo_class(
    "SkipStepAdamW",
    "olmo_core.optim.adamw",
    SkipStepOptimizer,
    {"__init__": lambda self, params, lr=1e-3: Optimizer.__init__(self, params, {"lr": lr})},
)


def test_a_skip_step_optimizer_is_refused_naming_spike_skip() -> None:
    w = nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match=r"SkipStepAdamW.*skip_spikes=clipopt\.SpikeSkip\(\)"):
        clipopt.ClippedOptimizer(SkipStepAdamW([w]), 1.0)
    # A class of that name elsewhere is another optimizer, and wraps.
    other = _olmo_class("SkipStepOptimizer", "mine", torch.optim.SGD, {})
    clipopt.ClippedOptimizer(other([w], lr=0.1), 1.0)


# --------------------------------------------------------------------------- torch's DCP functions


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[Any]:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    init_gloo(0, 1, free_port())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _run(
    steps: int, seed: int = 0, kind: type[clipopt.ClippedOptimizer] = clipopt.ClippedOptimizer
) -> tuple[nn.Module, clipopt.ClippedOptimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    inner = torch.optim.AdamW(groups, lr=0.05)
    opt = kind(inner, clipopt.AutoClip(50.0), skip_spikes=clipopt.SpikeSkip())
    _steps(model, opt, steps, seed)
    return model, opt


def _steps(model: nn.Module, opt: clipopt.ClippedOptimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(100 + seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 3, generator=generator)).pow(2).sum().backward()
        opt.step()


def _options(flatten: bool, **more: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=flatten, **more)


def _train_module_state(model: nn.Module, opt: Optimizer, options: Any) -> dict[str, Any]:
    """OLMo-core's train-module state dict (its optimizer handed to torch's functions),
    with the recipe's ``"clip"`` entry beside it."""
    from torch.distributed.checkpoint import state_dict as dcp_sd

    return {
        "model": dcp_sd.get_model_state_dict(model, options=options),
        "optim": dcp_sd.get_optimizer_state_dict(model, opt, options=options),
        "clip": ClippedOptimizerState(opt),
    }


def _save_and_load(
    model: nn.Module,
    opt: clipopt.ClippedOptimizer,
    fresh_model: nn.Module,
    fresh: clipopt.ClippedOptimizer,
    path: Path,
    flatten: bool = True,
) -> None:
    """Save as OLMo-core's checkpointer does and load into ``fresh`` the same way."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dcp_sd

    dcp.save(
        _train_module_state(model, opt, _options(flatten, cpu_offload=True)), checkpoint_id=path
    )
    load_opts = _options(flatten, strict=True)
    loaded = _train_module_state(fresh_model, fresh, load_opts)
    dcp.load(loaded, checkpoint_id=path)
    dcp_sd.set_model_state_dict(fresh_model, loaded["model"], options=load_opts)
    dcp_sd.set_optimizer_state_dict(fresh_model, fresh, loaded["optim"], options=load_opts)


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_olmo_cores_calls_with_the_clip_entry_resume_bit_exactly(
    world_of_one: Any, tmp_path: Path, flatten: bool
) -> None:
    """The wrapper handed to torch's functions as OLMo-core's train module does, the clip
    state in its own entry: no warning, and the resumed run is the uninterrupted one.
    torch's initialisation step reaches the fresh wrapper (it has no state yet), and the
    loaded clip entry replaces what it counted."""
    model, opt = _run(3)
    fresh_model, fresh = _run(0, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _save_and_load(model, opt, fresh_model, fresh, tmp_path, flatten)
    assert_identical(fresh.state_dict(), opt.state_dict())
    _steps(model, opt, 2, seed=5)
    _steps(fresh_model, fresh, 2, seed=5)
    assert_identical(fresh.state_dict(), opt.state_dict())
    for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert int(fresh.step_count) == 5


def _decorated(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def logged(*args: Any, **kwargs: Any) -> Any:
        calls.append(method.__name__)
        return method(*args, **kwargs)

    return logged


calls: list[str] = []


class DecoratedClippedOptimizer(clipopt.ClippedOptimizer):
    """A subclass whose ``state_dict`` is decorated three deep (logging, timing...)."""

    @_decorated
    @_decorated
    @_decorated
    def state_dict(self) -> dict[str, Any]:
        return super().state_dict()


def test_a_subclass_with_a_decorated_state_dict_keeps_its_clip_state(
    world_of_one: Any, tmp_path: Path
) -> None:
    model, opt = _run(3, kind=DecoratedClippedOptimizer)
    fresh_model, fresh = _run(1, seed=3, kind=DecoratedClippedOptimizer)
    calls.clear()
    _save_and_load(model, opt, fresh_model, fresh, tmp_path)
    assert calls, "torch's functions called the decorated state_dict"
    assert_identical(fresh.state_dict()["clip"], opt.state_dict()["clip"])


@pytest.mark.parametrize("change", ["reversed_order", "first_frozen_at_save"])
def test_which_parameter_comes_first_does_not_matter(
    world_of_one: Any, tmp_path: Path, change: str
) -> None:
    """The clip state is no parameter's: reordering the parameters, or unfreezing the
    first one, between save and load restores it all the same."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dcp_sd
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    def build(reverse: bool, frozen: bool) -> tuple[nn.Module, clipopt.ClippedOptimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        model[0].weight.requires_grad_(not frozen)
        params = list(model.parameters())
        inner = torch.optim.AdamW(params[::-1] if reverse else params, lr=0.05)
        return model, clipopt.ClippedOptimizer(inner, clipopt.AutoClip(50.0))

    model, opt = build(reverse=False, frozen=change == "first_frozen_at_save")
    _steps(model, opt, 3, seed=0)
    dcp.save(
        {
            "optim": dcp_sd.get_optimizer_state_dict(model, opt.optimizer),
            "clip": ClippedOptimizerState(opt),
        },
        checkpoint_id=tmp_path,
    )
    fresh_model, fresh = build(reverse=change == "reversed_order", frozen=False)
    fresh_model.load_state_dict(model.state_dict())
    loaded = {
        "optim": dcp_sd.get_optimizer_state_dict(fresh_model, fresh.optimizer),
        "clip": ClippedOptimizerState(fresh),
    }
    partial = change == "first_frozen_at_save"  # the unfrozen weight has no saved moments
    dcp.load(loaded, checkpoint_id=tmp_path, planner=DefaultLoadPlanner(allow_partial_load=partial))
    assert_identical(fresh.state_dict()["clip"], opt.state_dict()["clip"])
    assert int(fresh.step_count) == 3


def test_every_state_dict_prints_and_loads_weights_only(world_of_one: Any, tmp_path: Path) -> None:
    """Plain data: repr, logging's formatting and torch.save + torch.load(weights_only=True)
    of each state dict clipopt makes, after enough AutoClip steps that a history of them
    as one int would pass Python's 4300-digit limit for printing an int."""
    from torch.distributed.checkpoint import state_dict as dcp_sd

    model, opt = _run(60)
    dicts = {
        "wrapper": opt.state_dict(),
        "ClippedOptimizerState": ClippedOptimizerState(opt).state_dict(),
        "torch's nested": dcp_sd.get_optimizer_state_dict(model, opt),
        "torch's flattened": dcp_sd.get_optimizer_state_dict(model, opt, options=_options(True)),
        "torch's both": dcp_sd.get_state_dict(model, opt)[1],
    }
    for name, state_dict in dicts.items():
        assert repr(state_dict) and str(state_dict), name
        assert logging.Formatter().format(
            logging.LogRecord("x", logging.INFO, "", 0, "%s", (state_dict,), None)
        )
        path = tmp_path / "dict.pt"
        torch.save(state_dict, path)
        assert_identical(torch.load(path, weights_only=True), state_dict, name)
    for name in ("torch's nested", "torch's flattened", "torch's both"):
        assert "clip" not in dicts[name] and "clipopt" not in repr(dicts[name]), name


def test_a_checkpoint_loads_into_a_plain_adamw_with_nothing_of_clipopt(
    world_of_one: Any, tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dcp_sd

    model, opt = _run(3)
    dcp.save(_train_module_state(model, opt, _options(True)), checkpoint_id=tmp_path)
    fresh_model, _ = _run(0, seed=3)  # no grads: torch creates the AdamW's state
    plain = torch.optim.AdamW(fresh_model.parameters(), lr=0.05)
    loaded = {"optim": dcp_sd.get_optimizer_state_dict(fresh_model, plain, options=_options(True))}
    dcp.load(loaded, checkpoint_id=tmp_path)
    dcp_sd.set_optimizer_state_dict(fresh_model, plain, loaded["optim"], options=_options(True))
    names = {name for state in plain.state.values() for name in state}
    assert names == {"step", "exp_avg", "exp_avg_sq"}, names
    by_name = dcp_sd.get_optimizer_state_dict(fresh_model, plain)["state"]
    assert_identical(by_name, dcp_sd.get_optimizer_state_dict(model, opt.optimizer)["state"])


def test_a_load_without_the_clip_entry_warns_once_naming_the_fix(world_of_one: Any) -> None:
    """torch's functions keep only "state" and "param_groups": handed the wrapper, they
    load no clip state. The wrapper says so, once, naming ClippedOptimizerState, and
    keeps its clip state; once one is made for it, the same load is expected and quiet."""
    from torch.distributed.checkpoint import state_dict as dcp_sd

    model, opt = _run(2)
    saved = dcp_sd.get_optimizer_state_dict(model, opt)
    fresh_model, fresh = _run(1, seed=3)
    clip_before = fresh.state_dict()["clip"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp_sd.set_optimizer_state_dict(fresh_model, fresh, saved)
    assert [str(w.message) for w in caught] == [
        str(w.message) for w in caught if "ClippedOptimizerState(optimizer)" in str(w.message)
    ] and len(caught) == 1, [str(w.message) for w in caught]
    assert_identical(fresh.state_dict()["clip"], clip_before)
    assert_identical(fresh.optimizer.state_dict()["state"], opt.optimizer.state_dict()["state"])
    ClippedOptimizerState(fresh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dcp_sd.set_optimizer_state_dict(fresh_model, fresh, saved)


def test_a_partial_load_of_a_checkpoint_without_the_clip_entry_warns(
    world_of_one: Any, tmp_path: Path
) -> None:
    """A strict ``dcp.load`` of a checkpoint saved without the clip entry raises (a missing
    key); a partial one hands ``ClippedOptimizerState`` back the bytes it gave as the
    template. Not a silent reset: it warns, naming the stage's key, and keeps the clip
    state as it is."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    model, opt = _run(2)
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path)
    before = copy.deepcopy(opt.state_dict()["clip"])
    loaded = {"model": model.state_dict(), "clip": ClippedOptimizerState(opt)}
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match=r"Missing key .*: clip\.stage0"):
        dcp.load(loaded, checkpoint_id=tmp_path)
    with pytest.warns(UserWarning, match=r"no 'stage0'.*kept as it is"):
        dcp.load(
            loaded, checkpoint_id=tmp_path, planner=DefaultLoadPlanner(allow_partial_load=True)
        )
    assert_identical(opt.state_dict()["clip"], before)


def test_torchs_initialisation_step_is_a_step_of_a_wrapper_handed_to_it(world_of_one: Any) -> None:
    """torch's functions step an optimizer that has no state and no grads (zero grads,
    lr 0) to create its state. Handed the wrapper, that is one of its steps, as any other;
    handed the inner optimizer, as the recipes do, the wrapper is left alone."""
    from torch.distributed.checkpoint import state_dict as dcp_sd

    for hand_inner in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        opt = clipopt.ClippedOptimizer(torch.optim.AdamW(model.parameters()), 1.0)
        dcp_sd.get_optimizer_state_dict(model, opt.optimizer if hand_inner else opt)
        assert len(opt.optimizer.state) == 2
        if hand_inner:
            assert int(opt.step_count) == 0 and opt.last_norm is None
        else:
            assert int(opt.step_count) == 1 and torch.equal(opt.last_norm, torch.tensor(0.0))


def test_clipped_optimizer_state_refuses_bad_input_touching_nothing(world_of_one: Any) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="ClippedOptimizer, got SGD"):
        ClippedOptimizerState(torch.optim.SGD(model.parameters(), lr=0.1))
    _, opt = _run(2)
    entry = ClippedOptimizerState(opt)
    saved = entry.state_dict()
    assert list(saved) == ["stage0"] and isinstance(saved["stage0"], bytes)
    bad_clip = opt.state_dict()["clip"]
    bad_clip["step_count"] = torch.tensor(-1)
    buffer = io.BytesIO()
    torch.save(bad_clip, buffer)
    before = copy.deepcopy(opt.state_dict())
    for bad, error, match in (
        ({}, ValueError, "no 'stage0'"),
        ({"stage0": {"last_norm": None}}, TypeError, "must be the bytes"),
        ({"stage0": buffer.getvalue()}, ValueError, "step_count"),
    ):
        with pytest.raises(error, match=match):
            entry.load_state_dict(bad)
        assert_identical(opt.state_dict(), before)


# --------------------------------------------------------------------------- 2 ranks, FSDP2


def case_fsdp2_train_module_resume(checkpoint_dir: str) -> None:
    """OLMo-core's train module: FSDP2, the wrapper as its optimizer with its
    ``max_grad_norm`` off, model and optimizer saved and loaded with its options, the
    clip state in the recipe's ``"clip"`` entry."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dcp_sd
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    inputs = [local_rows(x) for x in batches(5, 8, 3, seed=13)]
    save_opts = _options(True, cpu_offload=True)
    load_opts = _options(True, strict=True)

    def build() -> tuple[nn.Module, clipopt.ClippedOptimizer]:
        model = mlp(seed=21)
        fully_shard_mlp(model, mesh)
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        return model, clipopt.ClippedOptimizer(inner, clipopt.ZClip(warmup_steps=2))

    def train(model: nn.Module, opt: clipopt.ClippedOptimizer, xs: list[Any]) -> list[Any]:
        norms = []
        for x in xs:
            opt.zero_grad()
            loss_fn(model(x)).backward()
            opt.step()
            norms.append(opt.last_norm)
        return norms

    model, opt = build()
    train(model, opt, inputs[:3])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        dcp.save(_train_module_state(model, opt, save_opts), checkpoint_id=checkpoint_dir)
        restored_model, restored = build()
        loaded = _train_module_state(restored_model, restored, load_opts)
        dcp.load(loaded, checkpoint_id=checkpoint_dir)
        dcp_sd.set_model_state_dict(restored_model, loaded["model"], options=load_opts)
        dcp_sd.set_optimizer_state_dict(
            restored_model, restored, loaded["optim"], options=load_opts
        )
    assert_identical(restored.state_dict()["clip"], opt.state_dict()["clip"])
    norms = train(model, opt, inputs[3:])
    restored_norms = train(restored_model, restored, inputs[3:])
    for a, b in zip(norms, restored_norms, strict=True):
        assert torch.equal(a, b), (a, b)
    for a, b in zip(model.parameters(), restored_model.parameters(), strict=True):
        assert torch.equal(full(a.detach()), full(b.detach()))
    assert_identical(restored.state_dict()["clip"], opt.state_dict()["clip"])
    assert int(restored.step_count) == 5


CASES = {"fsdp2_train_module_resume": case_fsdp2_train_module_resume}


def worker(rank: int, port: int, out_dir: str) -> None:
    def call(name: str, case: Callable[..., None]) -> None:
        case(os.path.join(out_dir, "checkpoint"))

    run_cases(rank, port, out_dir, CASES, call)


@pytest.fixture(scope="module")
def case_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    return rank_outcomes(worker, tmp_path_factory.mktemp("olmo_core"), CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_resume_as_olmo_core_checkpoints(
    case: str, case_results: dict[str, list[str]]
) -> None:
    assert_all_ok(case_results[case])
