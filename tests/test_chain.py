"""One clip over several optimizers stepped together (``ClippedOptimizer([muon, adamw])``).

Every step is checked against torch's ``clip_grad_norm_`` over all the parameters
followed by each optimizer's own ``step()``, on a deep copy; checkpoints against an
uninterrupted run; the state dict against one torch optimizer holding all the groups.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_identical
from torch import Tensor, nn
from torch.optim import Optimizer

import clipopt
from clipopt import ClippedOptimizer, OptimizerChain

HAS_MUON = hasattr(torch.optim, "Muon")
needs_muon = pytest.mark.skipif(not HAS_MUON, reason="torch.optim.Muon is in torch 2.9 and later")
MAX_NORM = 0.5  # below every step's norm here: every step clips

Split = Callable[[nn.Module], list[Optimizer]]


class Net(nn.Module):
    """Embeddings, 2-D weights, biases and a norm: what Muon takes and what it does not."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.hidden = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 4)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.out(self.norm(torch.relu(self.hidden(self.embed(tokens))))).pow(2).sum()


def _matrices(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Muon's share (the 2-D weights of the hidden layers), and the rest."""
    hidden = [model.hidden.weight, model.out.weight]  # type: ignore[union-attr]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    return hidden, rest


def muon_adamw(model: nn.Module) -> list[Optimizer]:
    hidden, rest = _matrices(model)
    return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)]


def sgd_adamw(model: nn.Module) -> list[Optimizer]:
    hidden, rest = _matrices(model)
    return [torch.optim.SGD(hidden, lr=0.05, momentum=0.9), torch.optim.AdamW(rest, lr=1e-2)]


SPLITS = [pytest.param(muon_adamw, marks=needs_muon, id="muon+adamw"), sgd_adamw]


def _model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _tokens(step: int) -> Tensor:
    return torch.randint(0, 10, (6, 3), generator=torch.Generator().manual_seed(100 + step))


def _train(model: nn.Module, opt: Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        model(_tokens(step)).backward()
        opt.step()


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("clip", ["torch", "clipopt"])
def test_steps_as_one_clip_over_all_then_each_step(split: Split, clip: str) -> None:
    """Against torch's clip the parameters agree to a few float32 ulps: torch sums the
    per-tensor norms in float32, clipopt in float64, so the norms may differ in the last
    bit (and Muon's bfloat16 Newton-Schulz may round a grad that differs by an ulp the
    other way); against clipopt's own clip, the same formula, every bit agrees."""
    model = _model()
    reference = copy.deepcopy(model)
    opt = ClippedOptimizer(split(model), max_norm=MAX_NORM)
    by_hand = split(reference)
    clip_ = torch.nn.utils.clip_grad_norm_ if clip == "torch" else clipopt.clip_grad_norm_
    exact = clip == "clipopt"
    for step in range(4):
        opt.zero_grad()
        model(_tokens(step)).backward()
        opt.step()
        for inner in by_hand:
            inner.zero_grad()
        reference(_tokens(step)).backward()
        norm = clip_(list(reference.parameters()), MAX_NORM)
        for inner in by_hand:
            inner.step()
        assert opt.last_norm is not None and norm > MAX_NORM
        tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-6, "atol": 1e-7}
        torch.testing.assert_close(opt.last_norm, norm, **tolerance)
        for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-5, "atol": 1e-6}
            torch.testing.assert_close(ours, theirs, **tolerance)
    assert isinstance(opt.optimizer, OptimizerChain)
    assert [type(o) for o in opt.optimizer.optimizers] == [type(o) for o in by_hand]
    assert int(opt.step_count) == 4


@pytest.mark.parametrize("split", SPLITS)
def test_muon_left_unclipped_and_adamw_clipped_by_its_own_norm(split: Split) -> None:
    """Muon normalises its update, so a clip driven by another group's spike only stalls
    it: its groups marked ``"clip_group": None`` are left out of the norm and never
    scaled (their grads, as the inner step saw them, bit-identical to the backward's),
    and AdamW's are clipped by their own norm, as torch's clip over them alone."""
    model = _model()
    reference = copy.deepcopy(model)
    inners = split(model)
    for group in inners[0].param_groups:
        group["clip_group"] = None
    opt = ClippedOptimizer(inners, max_norm=MAX_NORM)
    by_hand = split(reference)
    seen: list[list[Tensor]] = []
    inners[0].register_step_pre_hook(
        lambda o, args, kwargs: seen.append([p.grad.clone() for p in _matrices(model)[0]])
    )
    for step in range(4):
        opt.zero_grad()
        model(_tokens(step)).backward()
        raw = [p.grad.clone() for p in _matrices(model)[0]]  # type: ignore[union-attr]
        opt.step()
        for inner in by_hand:
            inner.zero_grad()
        reference(_tokens(step)).backward()
        norm = clipopt.clip_grad_norm_(_matrices(reference)[1], MAX_NORM)
        for inner in by_hand:
            inner.step()
        assert norm > MAX_NORM  # AdamW's grads were clipped
        assert_identical(opt.last_norm, norm)
        for got, want in zip(seen[-1], raw, strict=True):
            assert_identical(got, want)
        for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            assert_identical(ours, theirs)
    assert opt.clip_groups == ("default",)


def test_one_scheduler_per_optimizer_sets_its_groups_lr() -> None:
    """Each optimizer's scheduler sets its own groups' lr, and sees its optimizer step
    (an error filter: torch warns when a scheduler steps before its optimizer)."""
    model = _model()
    sgd, adamw = sgd_adamw(model)
    opt = ClippedOptimizer([sgd, adamw], max_norm=MAX_NORM)
    schedulers = [
        torch.optim.lr_scheduler.StepLR(sgd, step_size=2, gamma=0.5),
        torch.optim.lr_scheduler.LambdaLR(adamw, lambda k: 1.0 / (k + 1)),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(5):
            _train(model, opt, range(step, step + 1))
            for scheduler in schedulers:
                scheduler.step()
            lrs = [group["lr"] for group in opt.param_groups]
            assert lrs == [0.05 * 0.5 ** ((step + 1) // 2), 1e-2 * (1.0 / (step + 2))]
            assert lrs == [*schedulers[0].get_last_lr(), *schedulers[1].get_last_lr()]


@pytest.mark.parametrize("split", SPLITS)
def test_a_checkpoint_resumes_bit_exact(split: Split) -> None:
    straight = _model()
    straight_opt = ClippedOptimizer(split(straight), max_norm=MAX_NORM)
    _train(straight, straight_opt, range(6))

    first = _model()
    first_opt = ClippedOptimizer(split(first), max_norm=MAX_NORM)
    _train(first, first_opt, range(3))
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = _model(seed=1)  # other weights: nothing leaks through
    resumed_opt = ClippedOptimizer(split(resumed), max_norm=MAX_NORM)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    _train(resumed, resumed_opt, range(3, 6))

    assert_identical(dict(resumed.state_dict()), dict(straight.state_dict()))
    assert_identical(resumed_opt.state_dict(), straight_opt.state_dict())
    assert_identical(resumed_opt.last_norm, straight_opt.last_norm)
    assert int(resumed_opt.step_count) == int(straight_opt.step_count) == 6


def test_the_state_dict_is_one_torch_optimizers_with_all_the_groups() -> None:
    """Two SGDs chained save what one SGD with their two groups saves (parameters
    numbered across both), and each loads the other's dict."""
    chained, single = _model(), _model()
    chain_groups = _matrices(chained)
    chain = OptimizerChain([torch.optim.SGD(g, lr=0.1, momentum=0.9) for g in chain_groups])
    groups = [{"params": g} for g in _matrices(single)]
    one = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    _train(chained, ClippedOptimizer(chain, max_norm=MAX_NORM), range(2))
    _train(single, ClippedOptimizer(one, max_norm=MAX_NORM), range(2))
    assert_identical(chain.state_dict(), one.state_dict())
    assert [g["params"] for g in chain.state_dict()["param_groups"]] == [[0, 1], [2, 3, 4, 5, 6]]
    loaded = OptimizerChain([torch.optim.SGD(g, lr=0.1, momentum=0.9) for g in chain_groups])
    loaded.load_state_dict(one.state_dict())
    assert_identical(loaded.state_dict(), one.state_dict())
    assert len(chain.state) == len(one.state) == 7
    assert all(
        torch.equal(chain.state[p]["momentum_buffer"], one.state[q]["momentum_buffer"])
        for p, q in zip(chained.parameters(), single.parameters(), strict=True)
    )


class _WithExtra(torch.optim.SGD):
    """An optimizer whose state dict has a top-level key of its own."""

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "note": torch.tensor(7)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.note = state_dict.pop("note")
        super().load_state_dict(state_dict)


def test_an_inner_dicts_own_keys_are_kept_and_given_back() -> None:
    model = _model()
    hidden, rest = _matrices(model)
    chain = OptimizerChain([torch.optim.SGD(hidden, lr=0.1), _WithExtra(rest, lr=0.1)])
    saved = chain.state_dict()
    assert_identical(saved["chain"], [{}, {"note": torch.tensor(7)}])
    chain.load_state_dict(saved)
    assert_identical(chain.optimizers[1].note, torch.tensor(7))  # type: ignore[attr-defined]
    assert "chain" not in OptimizerChain([torch.optim.SGD(hidden, lr=0.1)]).state_dict()


def _snapshot(opt: ClippedOptimizer) -> list[Any]:
    """What a failed load must leave: every inner optimizer's groups and state objects,
    and the whole state dict's values."""
    chain = opt.optimizer
    assert isinstance(chain, OptimizerChain)
    held = [(o.param_groups, o.state, [dict(g) for g in o.param_groups]) for o in chain.optimizers]
    return [held, copy.deepcopy(opt.state_dict())]


def _assert_unchanged(opt: ClippedOptimizer, before: list[Any]) -> None:
    chain = opt.optimizer
    assert isinstance(chain, OptimizerChain)
    for (groups, state, values), o in zip(before[0], chain.optimizers, strict=True):
        assert o.param_groups is groups and o.state is state
        assert [dict(g) for g in o.param_groups] == values
    assert_identical(opt.state_dict(), before[1])


def _bad_group_count(saved: dict[str, Any], opt: ClippedOptimizer) -> None:
    saved["param_groups"].pop()


def _bad_group_size(saved: dict[str, Any], opt: ClippedOptimizer) -> None:
    saved["param_groups"][1]["params"].pop()


def _bad_shape_in_the_second(saved: dict[str, Any], opt: ClippedOptimizer) -> None:
    saved["state"][6]["exp_avg"] = torch.zeros(3)  # AdamW's: its load succeeds, the check not


def _second_load_raises(saved: dict[str, Any], opt: ClippedOptimizer) -> None:
    """AdamW's own load raises, after SGD's has loaded."""
    saved["param_groups"][0]["lr"] = 0.5

    def refuse(*args: object) -> None:
        raise RuntimeError("AdamW refuses")

    opt.optimizer.optimizers[1].register_load_state_dict_pre_hook(refuse)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("spoil", "error", "match"),
    [
        (_bad_group_count, ValueError, r"has 1 param groups; the chain has 1 \+ 1"),
        (
            _bad_group_size,
            ValueError,
            r"param_groups'\]\[1\] has 4 .* optimizers\[1\] \(AdamW\) .* has 5",
        ),
        (_bad_shape_in_the_second, ValueError, r"'exp_avg' .* shape \(3,\)"),
        (_second_load_raises, RuntimeError, "AdamW refuses"),
    ],
)
def test_a_bad_load_changes_nothing(
    spoil: Callable[[dict[str, Any], ClippedOptimizer], None], error: type[Exception], match: str
) -> None:
    model = _model()
    opt = ClippedOptimizer(sgd_adamw(model), max_norm=MAX_NORM)
    _train(model, opt, range(2))
    saved = copy.deepcopy(opt.state_dict())
    before = _snapshot(opt)
    spoil(saved, opt)
    with pytest.raises(error, match=match):
        opt.load_state_dict(saved)
    _assert_unchanged(opt, before)
    _train(model, opt, range(2, 3))  # and it still steps


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda a, b: [], ValueError, r"non-empty list of optimizers, got \[\]"),
        (lambda a, b: [torch.optim.SGD(a, lr=0.1), b], TypeError, r"optimizers\[1\] .* list"),
        (
            lambda a, b: [torch.optim.SGD(a, lr=0.1), ClippedOptimizer(torch.optim.SGD(b), 1.0)],
            TypeError,
            r"optimizers\[1\] is a ClippedOptimizer",
        ),
        (
            lambda a, b: [opt := torch.optim.SGD(a, lr=0.1), opt],
            ValueError,
            r"optimizers\[1\] is optimizers\[0\]",
        ),
        (
            lambda a, b: [torch.optim.SGD(a, lr=0.1), torch.optim.AdamW([*b, a[0]])],
            ValueError,
            r"shape \(16, 8\) is in optimizers\[0\] \(SGD\) and optimizers\[1\] \(AdamW\)",
        ),
    ],
)
def test_a_bad_list_is_refused_naming_the_index(make: Any, error: type, match: str) -> None:
    a, b = _matrices(_model())
    with pytest.raises(error, match=match):
        ClippedOptimizer(make(a, b), max_norm=1.0)


def test_adding_a_group_is_refused_on_the_chain_and_seen_from_an_inner_optimizer() -> None:
    model = _model()
    sgd, adamw = sgd_adamw(model)
    head = nn.Linear(4, 1)
    opt = ClippedOptimizer([sgd, adamw], max_norm=MAX_NORM)
    with pytest.raises(ValueError, match=r"optimizers\[0\] \(SGD\), optimizers\[1\] \(AdamW\)"):
        opt.add_param_group({"params": list(head.parameters())})
    assert len(opt.param_groups) == 2
    adamw.add_param_group({"params": list(head.parameters())})
    assert opt.param_groups[2]["params"] == list(head.parameters())
    opt.zero_grad()
    (model(_tokens(0)) + head(torch.ones(4)).sum() * 1e3).backward()
    grads = [
        p.grad.clone() for group in opt.param_groups for p in group["params"] if p.grad is not None
    ]
    opt.step()
    expected = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads]))
    torch.testing.assert_close(opt.last_norm.double(), expected)
    assert opt.max_norm == MAX_NORM  # the group without settings has the defaults


def test_attaching_deepspeed_is_refused() -> None:
    opt = ClippedOptimizer(sgd_adamw(_model()), max_norm=MAX_NORM)
    with pytest.raises(ValueError, match="OptimizerChain"):
        opt.attach_deepspeed(object())


def test_a_closure_is_evaluated_once_and_its_loss_returned() -> None:
    model = _model()
    opt = ClippedOptimizer(sgd_adamw(model), max_norm=MAX_NORM)
    losses: list[Tensor] = []

    def closure() -> Tensor:
        opt.zero_grad()
        losses.append(model(_tokens(0)))
        losses[-1].backward()
        return losses[-1]

    assert opt.step(closure) is losses[0] and len(losses) == 1
    assert opt.last_norm is not None and int(opt.step_count) == 1


def test_the_state_view_reads_and_makes_no_entry() -> None:
    model = _model()
    chain = OptimizerChain(sgd_adamw(model))
    stranger = nn.Parameter(torch.zeros(1))
    assert stranger not in chain.state and len(chain.state) == 0
    _train(model, ClippedOptimizer(chain, max_norm=MAX_NORM), range(1))
    assert len(chain.state) == 7 and stranger not in chain.state
    assert [len(o.state) for o in chain.optimizers] == [2, 5]
    with pytest.raises(TypeError):
        chain.state[stranger] = {}  # type: ignore[index]
    with pytest.raises(AttributeError, match=r"chain\.optimizers"):
        chain.param_groups = []


def test_each_optimizers_own_hooks_fire_once_a_step() -> None:
    model = _model()
    chain = OptimizerChain(sgd_adamw(model))
    fired: list[str] = []
    for name, o in (("sgd", chain.optimizers[0]), ("adamw", chain.optimizers[1]), ("chain", chain)):
        o.register_step_post_hook(lambda *args, name=name: fired.append(name))
    _train(model, ClippedOptimizer(chain, max_norm=MAX_NORM), range(2))
    assert fired == ["sgd", "adamw", "chain"] * 2


def test_grad_scaler_unscales_the_chains_grads_once() -> None:
    """A power-of-2 scale unscales exactly: the step is the unscaled one, bit for bit."""
    model, reference = _model(), _model()
    opt = ClippedOptimizer(sgd_adamw(model), max_norm=MAX_NORM)
    plain = ClippedOptimizer(sgd_adamw(reference), max_norm=MAX_NORM)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for step in range(3):
        opt.zero_grad()
        scaler.scale(model(_tokens(step))).backward()
        scaler.step(opt)
        scaler.update()
        _train(reference, plain, range(step, step + 1))
        assert_identical(opt.last_norm, plain.last_norm)
    assert_identical(dict(model.state_dict()), dict(reference.state_dict()))


@pytest.mark.parametrize(
    "settings",
    [
        {"max_norm": MAX_NORM},
        {"max_norm": MAX_NORM, "per_group": True},
        {"max_norm": MAX_NORM, "norm_type": "inf", "nonfinite": "skip"},
        {"max_norm": "AutoClip"},
    ],
    ids=["global", "per_group", "inf-skip", "AutoClip"],
)
def test_two_chained_sgds_step_as_one_sgd_with_both_groups(settings: dict[str, Any]) -> None:
    """Every setting sees the chain's groups as one optimizer's: the same norms, the
    same steps, bit for bit."""
    runs = []
    for chained in (True, False):
        model = _model()
        groups = _matrices(model)
        if chained:
            inner: Optimizer | list[Optimizer] = [torch.optim.SGD(g, lr=0.1) for g in groups]
        else:
            inner = torch.optim.SGD([{"params": g} for g in groups], lr=0.1)
        made = {
            k: clipopt.AutoClip(history=4) if v == "AutoClip" else v for k, v in settings.items()
        }
        opt = ClippedOptimizer(inner, **made)
        _train(model, opt, range(3))
        runs.append((dict(model.state_dict()), opt.last_norm, opt.last_group_norms))
    assert_identical(runs[0], runs[1])


@pytest.mark.parametrize("split", SPLITS)
def test_torch_distributed_checkpoints_functions_take_the_chain_as_one_optimizer(
    split: Split,
) -> None:
    """``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (keyed by parameter
    name) save the chain and load it into a fresh one, which resumes bit for bit."""
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    model = _model()
    opt = ClippedOptimizer(split(model), max_norm=MAX_NORM)
    _train(model, opt, range(3))
    saved = copy.deepcopy(dcp_state_dict.get_optimizer_state_dict(model, opt.optimizer))
    assert [g["params"][:1] for g in saved["param_groups"]] == [["hidden.weight"], ["embed.weight"]]
    resumed = _model(seed=1)
    resumed.load_state_dict(model.state_dict())
    resumed_opt = ClippedOptimizer(split(resumed), max_norm=MAX_NORM)
    dcp_state_dict.set_optimizer_state_dict(resumed, resumed_opt.optimizer, saved)
    assert_identical(resumed_opt.optimizer.state_dict(), opt.optimizer.state_dict())
    _train(model, opt, range(3, 5))
    _train(resumed, resumed_opt, range(3, 5))
    assert_identical(dict(resumed.state_dict()), dict(model.state_dict()))


def test_a_compiled_chain_step_steps_as_the_eager_one_and_compiles_once() -> None:
    """``torch.compile(opt.step)`` over a chain: the same steps as eager (to rounding:
    the compiled graph may order float32 ops differently), and no recompile once warm."""
    torch._dynamo.reset()
    eager_model, compiled_model = _model(), _model()
    eager = ClippedOptimizer(sgd_adamw(eager_model), max_norm=MAX_NORM)
    compiled = ClippedOptimizer(sgd_adamw(compiled_model), max_norm=MAX_NORM)
    step = torch.compile(compiled.step, backend="aot_eager")
    for index in range(5):
        _train(eager_model, eager, range(index, index + 1))
        compiled.zero_grad()
        compiled_model(_tokens(index)).backward()
        with torch._dynamo.config.patch(error_on_recompile=index >= 2):
            step()
        torch.testing.assert_close(compiled.last_norm, eager.last_norm, rtol=1e-5, atol=0)
    for ours, theirs in zip(compiled_model.parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
