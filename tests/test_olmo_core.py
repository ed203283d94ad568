"""ClippedOptimizer as OLMo-core trains and checkpoints it, reproduced with torch's APIs.

OLMo-core 3.0.0 requires ``torch<2.14`` and so cannot install over the pinned torch; its
calls are reproduced here instead: its train module saves the optimizer through torch's
``get_optimizer_state_dict`` with ``StateDictOptions(flatten_optimizer_state_dict=True,
cpu_offload=True)`` and ``dcp.save``, and loads through a template from the same
function, ``dcp.load`` and ``set_optimizer_state_dict`` with
``StateDictOptions(flatten_optimizer_state_dict=True, strict=True)``
(``olmo_core/train/train_module/transformer/train_module.py``). The wrapper's ``"clip"``
entry must survive that, flattened or not, bit for bit; and OLMo-core's
``SkipStepOptimizer`` is refused, since wrapped it would never skip.
"""

from __future__ import annotations

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
from clipopt import _torch_dcp

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


INNERS: dict[str, Callable[[Any], Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05),  # no state at all
}


def _run(inner: str, steps: int, seed: int = 0) -> tuple[nn.Module, clipopt.ClippedOptimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    opt = clipopt.ClippedOptimizer(
        INNERS[inner](groups), clipopt.AutoClip(50.0), skip_spikes=clipopt.SpikeSkip()
    )
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


@pytest.mark.parametrize("inner", list(INNERS))
@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_torchs_functions_keep_the_clip_entry_through_dcp_and_resume_bit_exactly(
    world_of_one: Any, tmp_path: Path, inner: str, flatten: bool
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dcp_sd

    model, opt = _run(inner, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        saved = dcp_sd.get_optimizer_state_dict(model, opt, options=_options(flatten))
        dcp.save({"optim": saved}, checkpoint_id=str(tmp_path))

        fresh_model, fresh = _run(inner, 0)
        fresh_model.load_state_dict(model.state_dict())
        template = dcp_sd.get_optimizer_state_dict(fresh_model, fresh, options=_options(flatten))
        assert int(fresh.step_count) == 0 and fresh.last_norm is None  # torch's init step
        loaded = {"optim": template}
        dcp.load(loaded, checkpoint_id=str(tmp_path))
        dcp_sd.set_optimizer_state_dict(
            fresh_model, fresh, loaded["optim"], options=_options(flatten, strict=True)
        )
    assert_identical(fresh.state_dict(), opt.state_dict())
    _steps(model, opt, 2, seed=5)
    _steps(fresh_model, fresh, 2, seed=5)
    assert_identical(fresh.state_dict(), opt.state_dict())
    for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert int(fresh.step_count) == 5


@pytest.mark.parametrize(
    "options",
    [
        {"full_state_dict": True, "cpu_offload": True},
        {"full_state_dict": True, "cpu_offload": True, "broadcast_from_rank0": True},
    ],
    ids=["full", "broadcast"],
)
def test_full_state_dicts_keep_the_clip_entry(world_of_one: Any, options: dict[str, Any]) -> None:
    from torch.distributed.checkpoint import state_dict as dcp_sd

    model, opt = _run("adamw", 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        saved = dcp_sd.get_optimizer_state_dict(model, opt, options=_options(False, **options))
        fresh_model, fresh = _run("adamw", 0)
        fresh_model.load_state_dict(model.state_dict())
        dcp_sd.set_optimizer_state_dict(
            fresh_model, fresh, saved, options=_options(False, **options)
        )
    ours, theirs = fresh.state_dict(), opt.state_dict()
    assert_identical(ours["clip"], theirs["clip"])
    assert_identical(ours["state"], theirs["state"])  # (torch's full dicts list the betas)


def test_the_carried_entry_is_not_the_inners_optimizers(world_of_one: Any) -> None:
    """Saved through torch's functions the entry rides in one parameter's state; the inner
    optimizer's own state is untouched, and its plain state dict never carries it."""
    from torch.distributed.checkpoint import state_dict as dcp_sd

    model, opt = _run("adamw", 2)
    inner_before = opt.optimizer.state_dict()
    saved = dcp_sd.get_optimizer_state_dict(model, opt)
    carriers = [k for k, v in saved["state"].items() if _torch_dcp.CARRIED_KEY in v]
    assert carriers == ["0.weight"]
    assert all(_torch_dcp.CARRIED_KEY not in v for v in opt.optimizer.state.values())
    assert_identical(opt.optimizer.state_dict(), inner_before)
    assert all(_torch_dcp.CARRIED_KEY not in v for v in opt.state_dict()["state"].values())


def test_a_checkpoint_without_the_entry_loads_the_inner_state_and_warns(world_of_one: Any) -> None:
    """An unwrapped run (or one saved before clipopt carried the entry) has no "clip":
    the inner state loads, the wrapper keeps its own and says so."""
    from torch.distributed.checkpoint import state_dict as dcp_sd

    model, opt = _run("adamw", 2)
    plain = dcp_sd.get_optimizer_state_dict(model, opt.optimizer)
    fresh_model, fresh = _run("adamw", 1, seed=3)
    clip_before = fresh.state_dict()["clip"]
    with pytest.warns(UserWarning, match=r"carries no 'clip' entry.*keeps its current one"):
        dcp_sd.set_optimizer_state_dict(fresh_model, fresh, plain)
    assert_identical(fresh.state_dict()["clip"], clip_before)
    assert_identical(fresh.optimizer.state_dict()["state"], opt.optimizer.state_dict()["state"])


def test_a_bad_carried_value_is_refused_before_anything_loads(world_of_one: Any) -> None:
    from torch.distributed.checkpoint import state_dict as dcp_sd

    model, opt = _run("adamw", 2)
    saved = dcp_sd.get_optimizer_state_dict(model, opt)
    saved["state"]["0.weight"][_torch_dcp.CARRIED_KEY] = "not an entry"
    fresh_model, fresh = _run("adamw", 1, seed=3)
    before = fresh.state_dict()
    with pytest.raises(TypeError, match=_torch_dcp.CARRIED_KEY):
        dcp_sd.set_optimizer_state_dict(fresh_model, fresh, saved)
    assert_identical(fresh.state_dict(), before)


# --------------------------------------------------------------------------- 2 ranks, FSDP2


def case_fsdp2_train_module_resume(checkpoint_dir: str) -> None:
    """OLMo-core's train module: FSDP2, the wrapper as its optimizer with its
    ``max_grad_norm`` off, model and optimizer saved and loaded with its options."""
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

    def state(model: nn.Module, opt: clipopt.ClippedOptimizer, opts: Any) -> dict[str, Any]:
        return {
            "model": dcp_sd.get_model_state_dict(model, options=opts),
            "optim": dcp_sd.get_optimizer_state_dict(model, opt, options=opts),
        }

    model, opt = build()
    train(model, opt, inputs[:3])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        dcp.save(state(model, opt, save_opts), checkpoint_id=checkpoint_dir)
        restored_model, restored = build()
        loaded = state(restored_model, restored, load_opts)
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
