"""ClippedOptimizer as DeepSpeed's client optimizer under ZeRO-1 and -2.

DeepSpeed's ZeRO optimizer steps the client on flat fp32 partitions of each param group,
once per group (``clipopt._dist._deepspeed`` says how). The first part checks the
recognition and the refusals in this process, with a stand-in for DeepSpeed's
``_optimizer_step`` (a function whose module is DeepSpeed's); the second trains inside
the installed DeepSpeed (``DS_ACCELERATOR=cpu``, gloo, 2 ranks in one spawn, every case
in turn as tests/test_distributed.py does) and compares the norms, the parameters and
the counters of every step with one float64 process training the whole batch.
"""

from __future__ import annotations

import importlib.util
import os
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import assert_all_ok
from test_distributed import WORLD_SIZE, free_port, init_gloo, rank_outcomes, run_cases
from torch import Tensor, nn

import clipopt
from clipopt._dist import _deepspeed
from clipopt._dist._reduce import NormScope

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
)


# --------------------------------------------------------------------------- one process


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[Any]:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    init_gloo(0, 1, free_port())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _module_function(module: str, source: str, name: str) -> Callable[..., Any]:
    """``name`` defined by ``source`` in a namespace whose ``__name__`` is ``module``."""
    namespace: dict[str, Any] = {"__name__": module}
    exec(compile(source, f"<{module}>", "exec"), namespace)
    function = namespace[name]
    assert isinstance(function, types.FunctionType)
    return function


# DeepSpeed's ``DeepSpeedZeroOptimizer._optimizer_step``, as 0.19.8 calls the client.
_ZERO_STEP = _module_function(
    _deepspeed.ZERO_MODULE,
    "def _optimizer_step(self, group_no):\n"
    "    original_param_groups = self.optimizer.param_groups\n"
    "    self.optimizer.param_groups = [original_param_groups[group_no]]\n"
    "    try:\n"
    "        return self.optimizer.step()\n"
    "    finally:\n"
    "        self.optimizer.param_groups = original_param_groups\n",
    "_optimizer_step",
)


class FakeZero:
    """What ``zero_step`` reads of DeepSpeed's optimizer; its groups hold flat tensors."""

    def __init__(self, optimizer: Any, group: Any, clip_grad: float = 0.0) -> None:
        self.optimizer = optimizer
        count = len(optimizer.param_groups)
        self.bit16_groups = [[] for _ in range(count)]
        self.real_dp_process_group = [group] * count
        self.clip_grad = clip_grad
        self.partition_gradients = True
        self.is_moe_param_group = [False] * count
        self._global_grad_norm: Any = None

    def step(self) -> None:
        for index in range(len(self.bit16_groups)):
            _ZERO_STEP(self, index)


def _flat_groups(count: int, seed: int = 0) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(seed)
    groups = []
    for _ in range(count):
        flat = nn.Parameter(torch.randn(6, generator=generator))
        flat.grad = torch.randn(6, generator=generator)
        groups.append({"params": [flat]})
    return groups


def test_outside_deepspeed_nothing_is_recognised() -> None:
    assert _deepspeed.zero_step() is None


def test_zeros_call_is_recognised_with_its_group_and_count(world_of_one: Any) -> None:
    seen: list[_deepspeed.ZeroStep | None] = []

    class Probe:
        def __init__(self) -> None:
            self.param_groups: list[Any] = [{}, {}]

        def step(self) -> None:
            seen.append(_deepspeed.zero_step(depth=0))

    zero = FakeZero(Probe(), world_of_one)
    zero.step()
    assert [(s.group_index, s.group_count, s.last_call) for s in seen if s] == [
        (0, 2, False),
        (1, 2, True),
    ]
    assert all(s is not None and s.caller == "DeepSpeed ZeRO-2" and s.supported for s in seen)


def test_deepspeeds_untested_optimizers_are_recognised_as_such() -> None:
    for module, caller in _deepspeed.UNTESTED.items():
        probe = _module_function(module, "def step(probe):\n    return probe()\n", "step")
        call = probe(lambda: _deepspeed.zero_step(depth=0))
        assert call is not None and not call.supported and call.caller == caller
        with pytest.raises(ValueError, match="has not tested"):
            _deepspeed.zero_scope(call, NormScope(), [2.0], False, False)


def test_one_group_reduces_over_the_data_parallel_group(world_of_one: Any) -> None:
    groups = _flat_groups(1)
    grad = groups[0]["params"][0].grad.clone()
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(groups, lr=0.0), 1.0, norm_type=3.0)
    FakeZero(opt, world_of_one).step()
    expected = torch.linalg.vector_norm(grad.double(), 3.0)
    torch.testing.assert_close(opt.last_norm.double(), expected, rtol=1e-6, atol=0)
    assert int(opt.step_count) == 1


def _refused(opt: clipopt.ClippedOptimizer, zero: FakeZero, match: str) -> None:
    grads = [p.grad.clone() for g in opt.param_groups for p in g["params"]]
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    with pytest.raises(ValueError, match=match):
        zero.step()
    after = [p for g in opt.param_groups for p in g["params"]]
    assert all(torch.equal(p.grad, g) for p, g in zip(after, grads, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(after, params, strict=True))
    assert int(opt.step_count) == 0 and opt.last_norm is None


def test_what_cannot_be_right_under_zero_is_refused_touching_nothing(
    world_of_one: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def wrapper(count: int = 1, max_norm: Any = 1.0, **kwargs: Any) -> clipopt.ClippedOptimizer:
        return clipopt.ClippedOptimizer(
            torch.optim.SGD(_flat_groups(count), lr=0.1), max_norm, **kwargs
        )

    opt = wrapper()
    _refused(opt, FakeZero(opt, world_of_one, clip_grad=1.0), r"'gradient_clipping': 0")
    opt = wrapper(track_tensor_norms=True)
    _refused(opt, FakeZero(opt, world_of_one), "track_tensor_norms")
    opt = wrapper(max_norm=clipopt.AGC(0.01))
    _refused(opt, FakeZero(opt, world_of_one), "unit-wise rules")
    opt = wrapper(max_norm=clipopt.AutoClip(per_tensor=True))
    _refused(opt, FakeZero(opt, world_of_one), "per-tensor")
    opt = wrapper(2, norm_type=1.0)
    zero = FakeZero(opt, world_of_one)
    zero._global_grad_norm = torch.tensor(1.0)
    _refused(opt, zero, "norm_type=2 and per_group=False")
    opt = wrapper(2, per_group=True)
    _refused(opt, zero, "norm_type=2 and per_group=False")
    opt = wrapper(2)
    _refused(opt, FakeZero(opt, world_of_one), "compute_grad_norm")
    # A pp_mesh of one stage is none; one of two stages is what a scope then holds.
    staged = NormScope()
    staged.pp_group = world_of_one
    call = _deepspeed.ZeroStep("DeepSpeed ZeRO-2", True, dp_group=world_of_one)
    with pytest.raises(ValueError, match="remove pp_mesh"):
        _deepspeed.zero_scope(call, staged, [2.0], False, False)
    moe = wrapper()
    zero = FakeZero(moe, world_of_one)
    zero.is_moe_param_group = [True]
    _refused(moe, zero, "MoE expert")

    opt = wrapper(process_group=world_of_one)
    # A world of one cannot hold another group of ranks: DeepSpeed's is said to be [0, 1].
    real = _deepspeed._ranks
    monkeypatch.setattr(_deepspeed, "_ranks", lambda g: [0, 1] if g == "dp" else real(g))
    zero = FakeZero(opt, "dp")
    _refused(opt, zero, r"process_group spans ranks \[0\].*ranks \[0, 1\]")


def test_several_groups_take_deepspeeds_norm(world_of_one: Any) -> None:
    """Each call sees one group; the norm of them all is DeepSpeed's, and every group is
    scaled by the coefficient it gives."""
    groups = _flat_groups(2)
    grads = [g["params"][0].grad.clone() for g in groups]
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(groups, lr=1.0), 0.5)
    zero = FakeZero(opt, world_of_one)
    total = torch.linalg.vector_norm(torch.cat(grads).double())
    zero._global_grad_norm = total.float()
    before = [g["params"][0].detach().clone() for g in groups]
    zero.step()
    coefficient = 0.5 / (total + 1e-6)
    for group, grad, start in zip(groups, grads, before, strict=True):
        expected = start.double() - coefficient * grad.double()
        torch.testing.assert_close(
            group["params"][0].detach().double(), expected, rtol=1e-6, atol=1e-7
        )
    torch.testing.assert_close(opt.last_norm.double(), total, rtol=1e-6, atol=0)


def test_several_groups_count_one_step_and_commit_the_rule_once(world_of_one: Any) -> None:
    groups = _flat_groups(3)
    rule = clipopt.AutoClip(percentile=50.0)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(groups, lr=0.1), rule)
    twin_groups = _flat_groups(3)
    twin = clipopt.ClippedOptimizer(torch.optim.SGD(twin_groups, lr=0.1), clipopt.AutoClip(50.0))
    zero = FakeZero(opt, world_of_one)
    for _ in range(3):
        norm = torch.linalg.vector_norm(torch.cat([g["params"][0].grad for g in groups]))
        zero._global_grad_norm = norm
        zero.step()
        twin.step()  # one process stepping all groups at once
    assert int(opt.step_count) == 3
    torch.testing.assert_close(opt.last_norm, twin.last_norm, rtol=1e-6, atol=0)
    torch.testing.assert_close(opt.rule.last_threshold, twin.rule.last_threshold, rtol=1e-6, atol=0)
    for a, b in zip(groups, twin_groups, strict=True):
        torch.testing.assert_close(a["params"][0], b["params"][0], rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- DeepSpeed itself

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
STEPS = 4
ROWS = 8  # the whole batch; each rank trains on its half
RTOL = 1e-5  # DeepSpeed trains in float32, the reference in float64


def _model(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)


def _groups(model: nn.Module, two: bool) -> list[dict[str, Any]]:
    """One group, or decay / no decay as training scripts split them."""
    params = list(model.parameters())
    if not two:
        return [{"params": params, "weight_decay": 0.1}]
    return [
        {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
    ]


def _batches() -> list[Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(ROWS, 4, generator=generator) for _ in range(STEPS)]


def _wrapper(model: nn.Module, two: bool, max_norm: Any) -> clipopt.ClippedOptimizer:
    return clipopt.ClippedOptimizer(torch.optim.AdamW(_groups(model, two), lr=0.1), max_norm)


def _reference(two: bool, max_norm: Any) -> tuple[list[Tensor], nn.Module, Any]:
    """One process, float64, the whole batch: each step's norm (torch's), the trained
    model and the wrapper that clipped it."""
    model = _model(torch.float64)
    opt = _wrapper(model, two, max_norm)
    norms = []
    for batch in _batches():
        opt.zero_grad()
        model(batch.double()).pow(2).mean().backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        opt.step()
    return norms, model, opt


def _engine(stage: int, two: bool, max_norm: Any, clipping: float = 0.0) -> tuple[Any, Any]:
    import deepspeed

    model = _model()
    opt = _wrapper(model, two, max_norm)
    config = {
        "train_micro_batch_size_per_gpu": ROWS // WORLD_SIZE,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clipping,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": stage > 0,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine, opt


def _train(engine: Any, opt: clipopt.ClippedOptimizer) -> list[Tensor]:
    rank, half = dist.get_rank(), ROWS // WORLD_SIZE
    norms = []
    for batch in _batches():
        loss = engine(batch[rank * half : (rank + 1) * half]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        assert opt.last_norm is not None
        norms.append(opt.last_norm.clone())
    return norms


def _close(actual: Tensor, expected: Tensor, what: str) -> None:
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    error = float(torch.linalg.vector_norm(a - e))
    assert error <= RTOL * float(torch.linalg.vector_norm(e)), f"{what}: {a} vs {e}"


def _case(stage: int, two: bool, rule: bool = False) -> Callable[[], None]:
    def case() -> None:
        max_norm = (lambda: clipopt.AutoClip(percentile=50.0)) if rule else (lambda: 0.3)
        engine, opt = _engine(stage, two, max_norm())
        norms = _train(engine, opt)
        expected, model, reference = _reference(two, max_norm())
        for step, (ours, theirs) in enumerate(zip(norms, expected, strict=True)):
            _close(ours, theirs, f"norm of step {step}")
        for (name, p), q in zip(engine.module.named_parameters(), model.parameters(), strict=True):
            _close(p, q, name)
        assert int(opt.step_count) == STEPS == int(reference.step_count)
        if rule:
            assert opt.rule is not None and reference.rule is not None
            _close(opt.rule.last_threshold, reference.rule.last_threshold, "threshold")
            assert int(opt.rule.clipped_count) == int(reference.rule.clipped_count)

    return case


def case_gradient_clipping_is_refused() -> None:
    engine, opt = _engine(2, False, 0.3, clipping=1.0)
    with pytest.raises(ValueError, match=r"'gradient_clipping': 0"):
        _train(engine, opt)
    assert int(opt.step_count) == 0


CASES: dict[str, Callable[[], None]] = {
    "zero0_two_groups": _case(0, True),  # DeepSpeed averages whole grads: nothing to do
    "zero1_one_group": _case(1, False),
    "zero2_one_group": _case(2, False),
    "zero1_two_groups": _case(1, True),
    "zero2_two_groups": _case(2, True),
    "zero2_two_groups_rule": _case(2, True, rule=True),
    "gradient_clipping_refused": case_gradient_clipping_is_refused,
}


def worker(rank: int, port: int, out_dir: str) -> None:
    """Every case on this rank, inside DeepSpeed on its CPU accelerator."""
    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
    )

    def call(name: str, case: Callable[[], None]) -> None:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        case()

    run_cases(rank, port, out_dir, CASES, call)


@pytest.fixture(scope="module")
def deepspeed_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    return rank_outcomes(worker, tmp_path_factory.mktemp("deepspeed"), CASES)


@pytest.mark.integrations
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed (the integrations extra)")
@pytest.mark.parametrize("case", list(CASES))
def test_zero_matches_one_float64_process(
    case: str, deepspeed_results: dict[str, list[str]]
) -> None:
    assert_all_ok(deepspeed_results[case])
