"""ClippedOptimizer as DeepSpeed's client optimizer, at ZeRO-0, -1 and -2.

DeepSpeed's optimizers step the client on flat fp32 partitions or fp32 copies of the
parameters (``clipopt._dist._deepspeed`` says how); the user tells the wrapper with
``opt.attach_deepspeed(engine)``. The first part checks, in this process, what the
wrapper sees for itself (param groups rewritten without being told) and how an attached
wrapper measures a ZeRO call, with a stand-in for DeepSpeed's ZeRO optimizer; the
second trains inside the installed DeepSpeed (``DS_ACCELERATOR=cpu``, gloo, 2 ranks in
one spawn, every case in turn as tests/test_distributed.py does) and compares the
norms, the parameters and the counters of every step with one float64 process training
the whole batch, or checks DeepSpeed's refusals and start-up step.
"""

from __future__ import annotations

import functools
import importlib.util
import os
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


class FakeZero:
    """DeepSpeed 0.19.8's ZeRO optimizer as the wrapper sees it: its groups' params
    replaced by flat tensors, stepped one group at a time with ``param_groups`` swapped
    for that group (``_optimizer_step``), through ``step`` as it is at call time."""

    def __init__(self, optimizer: Any, group: Any) -> None:
        self.optimizer = optimizer
        self.single_partition_of_fp32_groups = [g["params"][0] for g in optimizer.param_groups]
        self.real_dp_process_group = [group] * len(optimizer.param_groups)
        self._global_grad_norm: Any = None

    def step(self) -> None:
        original = self.optimizer.param_groups
        for group in list(original):
            self.optimizer.param_groups = [group]
            try:
                self.optimizer.step()
            finally:
                self.optimizer.param_groups = original


def _flat_groups(count: int, seed: int = 0) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(seed)
    groups = []
    for _ in range(count):
        flat = nn.Parameter(torch.randn(6, generator=generator))
        flat.grad = torch.randn(6, generator=generator)
        groups.append({"params": [flat]})
    return groups


def _attached(opt: clipopt.ClippedOptimizer, group: Any) -> FakeZero:
    """The wrapper attached to a stand-in ZeRO optimizer (what ``bind`` returns under
    DeepSpeed's ZeRO-2, which the spawned cases check)."""
    zero = FakeZero(opt, group)
    opt._clip.deepspeed.binding = _deepspeed.Binding("DeepSpeed ZeRO-2", zero)
    return zero


def _flattened(opt: clipopt.ClippedOptimizer) -> None:
    """What DeepSpeed's ZeRO optimizer does to the client's groups: one flat partition."""
    for group in opt.param_groups:
        flat = torch.cat([p.detach().reshape(-1) for p in group["params"]])[:5].clone()
        flat.requires_grad_(True)
        flat.grad = torch.ones_like(flat)
        group["params"] = [flat]


def test_flat_partitions_untold_are_refused_touching_nothing() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 1.0)
    _flattened(opt)
    flat = opt.param_groups[0]["params"][0]
    before = flat.detach().clone()
    with pytest.raises(ValueError, match=r"opt\.attach_deepspeed\(engine\)"):
        opt.step()
    assert torch.equal(flat, before) and torch.equal(flat.grad, torch.ones(5))
    assert int(opt.step_count) == 0 and opt.last_norm is None


def test_parameters_of_the_model_replaced_are_not_refused() -> None:
    """A model's new ``Parameter`` objects (``to_empty`` after meta) are the model's own."""
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1), 1.0)
    fresh = nn.Linear(3, 2)
    opt.param_groups[0]["params"] = list(fresh.parameters())
    fresh(torch.ones(1, 3)).sum().backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in fresh.parameters()])
    opt.step()
    torch.testing.assert_close(opt.last_norm, expected)


def test_the_first_step_on_copies_is_the_start_up_step() -> None:
    """DeepSpeed's fp16/bf16 optimizer steps the client once on zero grads of fp32
    copies inside ``deepspeed.initialize``: not counted, not shown to the rule; a later
    step on the copies, untold, is refused."""
    model = nn.Linear(3, 2)
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), clipopt.AutoClip(percentile=50.0)
    )
    copies = [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
    opt.param_groups[0]["params"] = copies
    for c in copies:
        c.grad = torch.zeros_like(c)
    opt.step()
    assert int(opt.step_count) == 0 and opt.rule is not None
    assert opt.rule.last_threshold is None
    with pytest.raises(ValueError, match="attach_deepspeed"):
        opt.step()


def test_one_group_reduces_over_the_data_parallel_group(world_of_one: Any) -> None:
    groups = _flat_groups(1)
    grad = groups[0]["params"][0].grad.clone()
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(groups, lr=0.0), 1.0, norm_type=3.0)
    _attached(opt, world_of_one).step()
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

    opt = wrapper(track_tensor_norms=True)
    _refused(opt, _attached(opt, world_of_one), "track_tensor_norms")
    opt = wrapper(max_norm=clipopt.AGC(0.01))
    _refused(opt, _attached(opt, world_of_one), "unit-wise rules")
    opt = wrapper(max_norm=clipopt.AutoClip(per_tensor=True))
    _refused(opt, _attached(opt, world_of_one), "per-tensor")
    opt = wrapper(2, norm_type=1.0)
    zero = _attached(opt, world_of_one)
    zero._global_grad_norm = torch.tensor(1.0)
    _refused(opt, zero, "norm_type=2 and per_group=False")
    opt = wrapper(2, per_group=True)
    zero = _attached(opt, world_of_one)
    zero._global_grad_norm = torch.tensor(1.0)
    _refused(opt, zero, "norm_type=2 and per_group=False")
    opt = wrapper(2)
    _refused(opt, _attached(opt, world_of_one), "compute_grad_norm")
    opt = wrapper(2)
    zero = _attached(opt, world_of_one)
    zero._global_grad_norm = torch.tensor(1.0)
    grads = [p.grad.clone() for g in opt.param_groups for p in g["params"]]
    with pytest.raises(ValueError, match="step the engine, not the wrapper"):
        opt.step()  # every group at once: not DeepSpeed's call
    assert all(
        torch.equal(p.grad, g)
        for p, g in zip([p for g in opt.param_groups for p in g["params"]], grads, strict=True)
    )
    # A pp_mesh of one stage is none; one of two stages is what a scope then holds.
    staged = NormScope()
    staged.pp_group = world_of_one
    call = _deepspeed.ZeroStep("DeepSpeed ZeRO-2", 0, 1, world_of_one, None)
    with pytest.raises(ValueError, match="remove pp_mesh"):
        _deepspeed.zero_source(call, staged, [2.0], False, False)

    groups = _flat_groups(1)
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(groups, lr=0.1),
        1.0,
        process_group=world_of_one,
        replicated_params=groups[0]["params"],
    )
    _refused(opt, _attached(opt, world_of_one), "remove replicated_params")

    opt = wrapper(process_group=world_of_one)
    # A world of one cannot hold another group of ranks: DeepSpeed's is said to be [0, 1].
    real = _deepspeed._ranks
    monkeypatch.setattr(_deepspeed, "_ranks", lambda g: [0, 1] if g == "dp" else real(g))
    _refused(opt, _attached(opt, "dp"), r"process_group spans ranks \[0\].*ranks \[0, 1\]")


def test_several_groups_take_deepspeeds_norm(world_of_one: Any) -> None:
    """Each call sees one group; the norm of them all is DeepSpeed's, and every group is
    scaled by the coefficient it gives."""
    groups = _flat_groups(2)
    grads = [g["params"][0].grad.clone() for g in groups]
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(groups, lr=1.0), 0.5)
    zero = _attached(opt, world_of_one)
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
    zero = _attached(opt, world_of_one)
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


def test_a_copy_is_not_attached(world_of_one: Any) -> None:
    import copy

    opt = clipopt.ClippedOptimizer(torch.optim.SGD(_flat_groups(1), lr=0.1), 1.0)
    _attached(opt, world_of_one)
    twin = copy.deepcopy(opt)
    assert twin._clip.deepspeed.binding is None
    assert twin._clip.deepspeed.params[0] is twin.param_groups[0]["params"][0]


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


def _engine(
    stage: int,
    two: bool,
    max_norm: Any,
    attach: bool = True,
    **config: Any,
) -> tuple[Any, Any]:
    import deepspeed

    model = _model()
    opt = _wrapper(model, two, max_norm)
    config = {
        "train_micro_batch_size_per_gpu": ROWS // WORLD_SIZE,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": stage > 0,
        **config,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    if attach:
        opt.attach_deepspeed(engine)
    return engine, opt


def _train(engine: Any, opt: clipopt.ClippedOptimizer, steps: int = STEPS) -> list[Tensor]:
    rank, half = dist.get_rank(), ROWS // WORLD_SIZE
    dtype = next(engine.module.parameters()).dtype
    norms = []
    for batch in _batches()[:steps]:
        loss = engine(batch[rank * half : (rank + 1) * half].to(dtype)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        assert opt.last_norm is not None
        norms.append(opt.last_norm.clone())
    return norms


def _close(actual: Tensor, expected: Tensor, what: str, rtol: float = RTOL) -> None:
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    error = float(torch.linalg.vector_norm(a - e))
    assert error <= rtol * float(torch.linalg.vector_norm(e)), f"{what}: {a} vs {e}"


def _decorated(step: Callable[..., Any], depth: int) -> Callable[..., Any]:
    """``step`` under ``depth`` logging-style decorators: as many frames more."""
    for _ in range(depth):

        def outer(inner: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(inner)
            def logged(*args: Any, **kwargs: Any) -> Any:
                return inner(*args, **kwargs)

            return logged

        step = outer(step)
    return step


def _case(
    stage: int,
    two: bool,
    rule: bool = False,
    wrap: Callable[[Any], Any] | None = None,
    rtol: float = RTOL,
    reload: bool = False,
) -> Callable[[], None]:
    def case() -> None:
        max_norm = (lambda: clipopt.AutoClip(percentile=50.0)) if rule else (lambda: 0.3)
        engine, opt = _engine(stage, two, max_norm())
        if wrap is not None:
            opt.step = wrap(opt.step)  # DeepSpeed calls the client's step as it finds it
        if reload:  # new param-group dicts, as a resume makes them
            opt.load_state_dict(opt.state_dict())
        norms = _train(engine, opt)
        expected, model, reference = _reference(two, max_norm())
        for step, (ours, theirs) in enumerate(zip(norms, expected, strict=True)):
            _close(ours, theirs, f"norm of step {step}", rtol)
        for (name, p), q in zip(engine.module.named_parameters(), model.parameters(), strict=True):
            _close(p, q, name, rtol)
        assert int(opt.step_count) == STEPS == int(reference.step_count)
        if rule:
            assert opt.rule is not None and reference.rule is not None
            _close(opt.rule.last_threshold, reference.rule.last_threshold, "threshold", rtol)
            assert int(opt.clipped_count) == int(reference.clipped_count)

    return case


def _refused_at_attach(stage: int, match: str, **config: Any) -> Callable[[], None]:
    def case() -> None:
        engine, opt = _engine(stage, False, 0.3, attach=False, **config)
        with pytest.raises(ValueError, match=match):
            opt.attach_deepspeed(engine)
        assert opt._clip.deepspeed.binding is None

    return case


def case_untold_zero_is_refused_at_step() -> None:
    engine, opt = _engine(2, False, 0.3, attach=False)
    with pytest.raises(ValueError, match=r"opt\.attach_deepspeed\(engine\)"):
        _train(engine, opt, steps=1)
    assert int(opt.step_count) == 0 and opt.last_norm is None


def _start_up_step_is_not_a_step(**precision: Any) -> Callable[[], None]:
    """DeepSpeed's bf16 or fp16 optimizer at stage 0 steps the wrapper on zero grads inside
    deepspeed.initialize: AutoClip's threshold is the median of the real steps' norms."""

    def case() -> None:
        engine, opt = _engine(0, False, clipopt.AutoClip(percentile=50.0), **precision)
        assert opt.optimizer.state, "DeepSpeed's start-up step made the AdamW's state"
        assert int(opt.step_count) == 0 and opt.last_norm is None
        norms = _train(engine, opt)
        assert int(opt.step_count) == STEPS and opt.rule is not None
        assert opt.rule.last_threshold is not None
        earlier = torch.stack(norms[:-1]).double()
        _close(opt.rule.last_threshold, torch.quantile(earlier, 0.5), "threshold")

    return case


COMPILED = functools.partial(torch.compile, backend="aot_eager")
COMPILED_RTOL = 1e-4
"""A compiled step rounds its float32 AdamW update otherwise than eager: the third step's
norm is 0.4395357 compiled, in one process without DeepSpeed as here, and 0.4395407 in
float64 (1.1e-5 relative). A partition's norm is off by tens of percent."""
CLIPPING = r"'gradient_clipping': 0"
LOSS_SCALE = r"static 'fp16': \{'loss_scale'"
FP16 = {"fp16": {"enabled": True, "loss_scale": 0}}
UNTESTED = r"which clipopt has not tested: use ZeRO-0, -1 or -2 without offload"
CASES: dict[str, Callable[[], None]] = {
    "zero0_two_groups": _case(0, True),  # DeepSpeed averages whole grads: nothing to do
    "zero1_one_group": _case(1, False),
    "zero2_one_group": _case(2, False),
    "zero1_two_groups": _case(1, True),
    "zero2_two_groups": _case(2, True),
    "zero2_two_groups_rule_reloaded": _case(2, True, rule=True, reload=True),
    "zero2_two_groups_decorated": _case(2, True, wrap=lambda step: _decorated(step, 12)),
    "zero2_one_group_compiled": _case(2, False, wrap=COMPILED, rtol=COMPILED_RTOL),
    "zero2_two_groups_compiled": _case(2, True, rule=True, wrap=COMPILED, rtol=COMPILED_RTOL),
    "untold_zero2_refused": case_untold_zero_is_refused_at_step,
    "zero0_gradient_clipping_refused": _refused_at_attach(0, CLIPPING, gradient_clipping=0.05),
    "zero2_gradient_clipping_refused": _refused_at_attach(2, CLIPPING, gradient_clipping=1.0),
    "zero0_fp16_dynamic_refused": _refused_at_attach(0, LOSS_SCALE, **FP16),
    "zero2_fp16_dynamic_refused": _refused_at_attach(2, LOSS_SCALE, **FP16),
    "zero3_refused": _refused_at_attach(3, UNTESTED),
    "zero2_offload_refused": _refused_at_attach(
        2,
        UNTESTED,
        zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
        zero_force_ds_cpu_optimizer=False,  # DeepSpeed refuses a client optimizer otherwise
    ),
    "zero0_bf16_start_up_step": _start_up_step_is_not_a_step(bf16={"enabled": True}),
    "zero0_fp16_start_up_step": _start_up_step_is_not_a_step(
        fp16={"enabled": True, "loss_scale": 1024}
    ),
}


def _cpu_takes_fp16() -> bool:
    """What DeepSpeed's CPU accelerator asks before it accepts ``fp16``: oneDNN's fp16
    (avx512_fp16 or amx_fp16 on x86)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


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
    if "fp16" in case and not _cpu_takes_fp16():
        pytest.skip("DeepSpeed's CPU accelerator refuses fp16 on a CPU without oneDNN fp16")
    assert_all_ok(deepspeed_results[case])
