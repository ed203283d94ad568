"""Clip groups: param groups named by ``"clip_group"`` share one norm and one threshold.

Each named clip group is checked against ``torch.nn.utils.clip_grad_norm_`` applied to
its own parameters, a group named None against an unclipped step, ``per_group=True``
against naming each group, and the norms against float64 references (a hypothesis
property, and two gloo ranks under FSDP2 with one all_reduce a step).
"""

from __future__ import annotations

import copy
import io
import math
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import assert_all_ok, assert_same
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import clipopt
from clipopt._dist import _deepspeed

SIZES = ((3, 4), (5,), (2, 3), (4,), (6,))


def _params(seed: int = 0, sizes: tuple[tuple[int, ...], ...] = SIZES) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=generator)) for s in sizes]


def _set_grads(params: list[nn.Parameter], seed: int, scale: float = 10.0) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * scale


def _float64_norm(grads: list[Tensor], p: float) -> float:
    flat = torch.cat([g.double().reshape(-1) for g in grads])
    return float(torch.linalg.vector_norm(flat, p))


def _named(params: list[nn.Parameter], names: list[Any], **extra: dict[str, Any]) -> list[Any]:
    """One param group a parameter, with its ``clip_group`` name and extra settings."""
    return [
        {"params": [p], "clip_group": name, **extra.get(str(name), {})}
        for p, name in zip(params, names, strict=True)
    ]


# ------------------------------------------------------------------ the norms and scales


def test_two_clip_groups_equal_torch_clip_applied_to_each() -> None:
    """Clip group "a" (param groups 0 and 2, interleaved with "b"), clip group 1 (an int
    name) with another threshold and order: each as torch's clip of its parameters."""
    params = _params()
    names = ["a", 1, "a", 1, "a"]
    settings_of = {"1": {"clip_max_norm": 0.5, "clip_norm_type": 1.0}}
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(_named(params, names, **settings_of), lr=0.1), max_norm=2.0
    )
    _set_grads(params, seed=1)
    refs = [nn.Parameter(p.detach().clone()) for p in params]
    for ref, p in zip(refs, params, strict=True):
        ref.grad = p.grad.clone()  # type: ignore[union-attr]
    norm_a = torch.nn.utils.clip_grad_norm_([refs[0], refs[2], refs[4]], 2.0)
    norm_b = torch.nn.utils.clip_grad_norm_([refs[1], refs[3]], 0.5, norm_type=1.0)
    torch.optim.SGD(refs, lr=0.1).step()
    opt.step()
    assert opt.clip_groups == ("a", 1)
    assert opt.last_group_norms is not None
    torch.testing.assert_close(opt.last_group_norms, torch.stack([norm_a, norm_b]))
    expected_last = torch.linalg.vector_norm(torch.stack([norm_a, norm_b]).double())
    torch.testing.assert_close(opt.last_norm, expected_last.float())
    for p, ref in zip(params, refs, strict=True):
        torch.testing.assert_close(p.grad, ref.grad, rtol=1e-6, atol=0)
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)
    assert [n.item() for n in opt.last_group_norms] != [0.0, 0.0]
    assert float(norm_a) > 2.0 and float(norm_b) > 0.5  # both were clipped


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_none_group_is_stepped_as_if_unclipped_and_in_no_norm(fused: bool) -> None:
    """The None group's grads and parameters are bit-identical to the same inner step
    without a wrapper; an inf in its grads reaches no norm (nonfinite="raise" passes)."""
    params, plain = _params(), _params()
    names = ["a", None, "a", "b", None]
    opt = clipopt.ClippedOptimizer(
        torch.optim.AdamW(_named(params, names), lr=0.1, fused=fused), 1.0, nonfinite="raise"
    )
    bare = torch.optim.AdamW([{"params": [p]} for p in plain], lr=0.1, fused=fused)
    unclipped = [1, 4]
    for step in range(3):
        _set_grads(params, seed=step)
        _set_grads(plain, seed=step)
        for i in unclipped:
            params[i].grad[0] = plain[i].grad[0] = math.inf  # type: ignore[index]
        clipped = [params[i].grad.clone() for i in (0, 2, 3)]  # type: ignore[union-attr]
        opt.step()
        bare.step()
        for i in unclipped:  # bit for bit (NaN where the inf went)
            for ours, theirs in ((params[i].grad, plain[i].grad), (params[i], plain[i])):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
        assert opt.last_group_norms is not None
        expected = [_float64_norm(clipped[:2], 2.0), _float64_norm(clipped[2:], 2.0)]
        torch.testing.assert_close(
            opt.last_group_norms.double(), torch.tensor(expected, dtype=torch.float64)
        )
    assert opt.clip_groups == ("a", "b")
    assert int(opt.step_count) == 3


def test_per_group_equals_naming_each_group() -> None:
    runs = []
    for per_group in (True, False):
        params = _params()
        groups: list[dict[str, Any]] = [{"params": [p]} for p in params]
        groups[1]["clip_max_norm"], groups[2]["clip_norm_type"] = 0.5, math.inf
        if not per_group:
            for index, group in enumerate(groups):
                group["clip_group"] = index
        opt = clipopt.ClippedOptimizer(
            torch.optim.SGD(groups, lr=0.1, momentum=0.9), 1.0, per_group=per_group
        )
        records = []
        for step in range(3):
            _set_grads(params, seed=step)
            opt.step()
            records.append((opt.last_norm.clone(), opt.last_group_norms.clone()))  # type: ignore[union-attr]
        runs.append((params, records, opt.clip_groups))
    (params_a, records_a, names_a), (params_b, records_b, names_b) = runs
    assert names_a == names_b == tuple(range(len(SIZES)))
    for (norm_a, groups_a), (norm_b, groups_b) in zip(records_a, records_b, strict=True):
        assert torch.equal(norm_a, norm_b) and torch.equal(groups_a, groups_b)
    for a, b in zip(params_a, params_b, strict=True):
        assert torch.equal(a, b)


def test_tracked_tensor_norms_leave_out_the_none_group() -> None:
    params = _params()
    named = [{"params": [p], "param_names": [f"p{i}"]} for i, p in enumerate(params)]
    for group, name in zip(named, ["a", None, "b", "a", None], strict=True):
        group["clip_group"] = name
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(named, lr=0.1), 1.0, track_tensor_norms=True)
    _set_grads(params, seed=0)
    grads = {f"p{i}": p.grad.clone() for i, p in enumerate(params)}  # type: ignore[union-attr]
    opt.step()
    tracked = opt.last_tensor_norms
    assert tracked is not None and sorted(tracked) == ["p0", "p2", "p3"]
    for name, norm in tracked.items():
        assert math.isclose(float(norm), _float64_norm([grads[name]], 2.0), rel_tol=1e-6)


RULES: dict[str, Callable[[], clipopt.ClipRule]] = {
    "zclip": lambda: clipopt.ZClip(warmup_steps=2),
    "autoclip-per-tensor": lambda: clipopt.AutoClip(50.0, 8, per_tensor=True),
    "agc": lambda: clipopt.AGC(clipping=0.05),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_a_rule_clips_its_one_clip_group_and_leaves_the_none_group(rule: str) -> None:
    """A rule over clip group "a" and a None group: "a" steps as a wrapper with the same
    rule over its parameters alone, the None group as the bare optimizer."""
    params, alone, plain = _params(), _params(), _params()
    names = ["a", None, "a", None, "a"]
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(_named(params, names), lr=0.1), RULES[rule]())
    mine = [0, 2, 4]
    reference = clipopt.ClippedOptimizer(
        torch.optim.SGD([alone[i] for i in mine], lr=0.1), RULES[rule]()
    )
    bare = torch.optim.SGD([plain[1], plain[3]], lr=0.1)
    for step in range(5):
        scale = 100.0 if step == 3 else 1.0  # a spike the rules clip
        for group in (params, alone, plain):
            _set_grads(group, seed=step, scale=scale)
        opt.step()
        reference.step()
        bare.step()
        torch.testing.assert_close(opt.last_norm, reference.last_norm, rtol=1e-6, atol=0)
        for i in mine:
            torch.testing.assert_close(params[i], alone[i], rtol=1e-6, atol=1e-7)
        for i in (1, 3):
            assert torch.equal(params[i], plain[i])
    assert opt.rule is not None and reference.rule is not None
    torch.testing.assert_close(opt.clipped_count, reference.clipped_count)
    assert int(reference.clipped_count) > 0  # the comparison can fail


# ------------------------------------------------------------------ refusals


def _state(opt: clipopt.ClippedOptimizer) -> Any:
    return copy.deepcopy(
        (opt.state_dict(), [p.grad for g in opt.param_groups for p in g["params"]])
    )


def _unchanged(before: Any, opt: clipopt.ClippedOptimizer) -> None:
    assert_same(_state(opt), before)


BAD_GROUPS: dict[str, tuple[list[dict[str, Any]], dict[str, Any], type[Exception], str]] = {
    "a float name": (
        [{"clip_group": 1.5}],
        {},
        TypeError,
        r"param_groups\[0\]\['clip_group'\] must be a str, an int or None, got 1\.5",
    ),
    "a bool name": ([{}, {"clip_group": True}], {}, TypeError, r"param_groups\[1\].*got True"),
    "two thresholds in one clip group": (
        [{"clip_group": "a"}, {"clip_group": "b"}, {"clip_group": "a", "clip_max_norm": 0.5}],
        {},
        ValueError,
        r"param_groups\[0\] and param_groups\[2\] are in clip group 'a' but have "
        r"'clip_max_norm' 1\.0 and 0\.5",
    ),
    "two orders in one clip group": (
        [{}, {"clip_norm_type": 1.0}, {"clip_group": None}],
        {},
        ValueError,
        r"param_groups\[0\] and param_groups\[1\] are in clip group 'default' but have "
        r"'clip_norm_type' 2\.0 and 1\.0",
    ),
    "per_group with names": (
        [{}, {"clip_group": "b"}],
        {"per_group": True},
        ValueError,
        r"per_group=True .* param_groups\[1\]\['clip_group'\] is 'b'",
    ),
    "a rule over two clip groups": (
        [{"clip_group": "a"}, {"clip_group": "b"}],
        {"max_norm": clipopt.ZClip()},
        ValueError,
        r"clip groups \['a', 'b'\] in 'clip_group', but max_norm is ZClip",
    ),
    "every group None": (
        [{"clip_group": None}, {"clip_group": None}],
        {},
        ValueError,
        r"every param group has 'clip_group': None",
    ),
}


def _groups_of(extras: list[dict[str, Any]], params: list[nn.Parameter]) -> list[Any]:
    return [{"params": [p], **extra} for p, extra in zip(params, extras, strict=False)]


@pytest.mark.parametrize("case", list(BAD_GROUPS))
def test_bad_clip_groups_are_refused_at_construction(case: str) -> None:
    extras, kwargs, error, match = BAD_GROUPS[case]
    inner = torch.optim.SGD(_groups_of(extras, _params()), lr=0.1)
    before = copy.deepcopy(inner.state_dict())
    with pytest.raises(error, match=match):
        clipopt.ClippedOptimizer(inner, **{"max_norm": 1.0, **kwargs})
    assert inner.state_dict() == before


BAD_ADDS: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any], type[Exception], str]] = {
    # the first group, the added one, the wrapper's arguments, the error
    "a float name": ({}, {"clip_group": 1.5}, {}, TypeError, r"param_groups\[1\].*got 1\.5"),
    "two thresholds in one clip group": (
        {"clip_group": "a"},
        {"clip_group": "a", "clip_max_norm": 0.5},
        {},
        ValueError,
        r"param_groups\[0\] and param_groups\[1\] are in clip group 'a' but have "
        r"'clip_max_norm' 1\.0 and 0\.5",
    ),
    "per_group with names": (
        {},
        {"clip_group": "b"},
        {"per_group": True},
        ValueError,
        r"per_group=True .* param_groups\[1\]\['clip_group'\] is 'b'",
    ),
    "a rule over two clip groups": (
        {"clip_group": "a"},
        {"clip_group": "b"},
        {"max_norm": clipopt.ZClip()},
        ValueError,
        r"clip groups \['a', 'b'\]",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ADDS))
def test_bad_clip_groups_are_refused_by_add_param_group(case: str) -> None:
    first, added, kwargs, error, match = BAD_ADDS[case]
    params = _params()
    inner = torch.optim.SGD([{"params": [params[0]], **first}], lr=0.1)
    opt = clipopt.ClippedOptimizer(inner, **{"max_norm": 1.0, **kwargs})
    before = _state(opt)
    with pytest.raises(error, match=match):
        opt.add_param_group({"params": [params[1]], **added})
    assert len(opt.param_groups) == 1
    _unchanged(before, opt)


@pytest.mark.parametrize("case", [c for c in BAD_GROUPS if c != "per_group with names"])
def test_bad_clip_groups_set_after_construction_are_refused_by_the_step(case: str) -> None:
    extras, kwargs, error, match = BAD_GROUPS[case]
    params = _params()
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD([{"params": [p]} for p in params[: len(extras)]], lr=0.1),
        **{"max_norm": 1.0, **kwargs},
    )
    _set_grads(params, seed=0)
    for group, extra in zip(opt.param_groups, extras, strict=True):
        group.update(extra)
    before = _state(opt)
    with pytest.raises(error, match=match):
        opt.step()
    _unchanged(before, opt)
    assert opt.last_norm is None and int(opt.step_count) == 0


def test_load_state_dict_refuses_bad_clip_groups_and_changes_nothing() -> None:
    params = _params()
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(_named(params, ["a", "b"] * 2 + ["a"]), 0.1), 1.0
    )
    _set_grads(params, seed=0)
    opt.step()
    saved = opt.state_dict()
    bad = copy.deepcopy(saved)
    bad["param_groups"][3]["clip_max_norm"] = 0.25
    before = _state(opt)
    with pytest.raises(ValueError, match=r"param_groups\[1\] and param_groups\[3\].*'b'"):
        opt.load_state_dict(bad)
    _unchanged(before, opt)
    wrong = copy.deepcopy(saved)
    wrong["clip"]["last_group_norms"] = torch.ones(5)
    with pytest.raises(ValueError, match=r"last_group_norms'\] has 5 entries for 2"):
        opt.load_state_dict(wrong)
    _unchanged(before, opt)


def test_deepspeed_zero_refuses_clip_groups_touching_nothing() -> None:
    """Under ZeRO-1/2 the wrapper sees DeepSpeed's flat partitions one group a call."""
    flat = nn.Parameter(torch.randn(6))
    flat.grad = torch.randn(6)
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD([{"params": [flat], "clip_group": "a"}], lr=0.1), 1.0
    )

    zero = types.SimpleNamespace(single_partition_of_fp32_groups=[flat], real_dp_process_group=[0])
    opt._clip.deepspeed.binding = _deepspeed.Binding("DeepSpeed ZeRO-2", zero)
    before = (flat.detach().clone(), flat.grad.clone())
    with pytest.raises(ValueError, match=r"DeepSpeed ZeRO-2 .* remove 'clip_group'"):
        opt.step()
    assert torch.equal(flat, before[0]) and torch.equal(flat.grad, before[1])
    assert opt.last_norm is None


# ------------------------------------------------------------------ checkpoints


def test_a_checkpoint_round_trip_keeps_the_clip_groups() -> None:
    def made() -> tuple[list[nn.Parameter], clipopt.ClippedOptimizer]:
        params = _params()
        groups = _named(params, ["a", "b", None, "b", "a"], b={"clip_max_norm": 0.5})
        return params, clipopt.ClippedOptimizer(torch.optim.Adam(groups, lr=0.1), 1.0)

    params, opt = made()
    for step in range(2):
        _set_grads(params, seed=step)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed_params, resumed = made()
    for group in resumed.param_groups:  # the names come from the checkpoint
        group.pop("clip_group")
    with torch.no_grad():
        for mine, theirs in zip(resumed_params, params, strict=True):
            mine.copy_(theirs)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.clip_groups == opt.clip_groups == ("a", "b")
    assert torch.equal(resumed.last_group_norms, opt.last_group_norms)  # type: ignore[arg-type]
    for step in range(2, 4):
        _set_grads(params, seed=step)
        _set_grads(resumed_params, seed=step)
        opt.step()
        resumed.step()
        assert torch.equal(resumed.last_group_norms, opt.last_group_norms)  # type: ignore[arg-type]
    for a, b in zip(params, resumed_params, strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ the property

NAMES = st.sampled_from(["a", "b", 0, None, "default"])


@settings(max_examples=40, deadline=None)
@given(
    names=st.lists(NAMES, min_size=1, max_size=5),
    orders=st.dictionaries(NAMES, st.sampled_from([1.0, 2.0, 3.0, math.inf])),
    seed=st.integers(0, 2**16),
    absent=st.booleans(),
)
def test_each_clip_group_norm_is_the_float64_norm_of_its_grads(
    names: list[Any], orders: dict[Any, float], seed: int, absent: bool
) -> None:
    if all(n is None for n in names):
        names = [*names, "a"]
    params = _params(seed, sizes=tuple((k + 1,) for k in range(len(names))))
    groups: list[dict[str, Any]] = []
    for p, name in zip(params, names, strict=True):
        group: dict[str, Any] = {"params": [p], "clip_norm_type": orders.get(name, 2.0)}
        if not (absent and name == "default"):
            group["clip_group"] = name  # absent: "default" by leaving the key out
        groups.append(group)
    if all("clip_group" not in g for g in groups):
        groups[0]["clip_group"] = names[0]
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(groups, lr=0.0), math.inf)
    _set_grads(params, seed)
    grads = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    opt.step()
    order = list(dict.fromkeys(n for n in names if n is not None))
    assert opt.clip_groups == tuple(order)
    expected = [
        _float64_norm([g for g, n in zip(grads, names, strict=True) if n == k], orders.get(k, 2.0))
        for k in order
    ]
    got = [opt.last_norm] if opt.last_group_norms is None else list(opt.last_group_norms)
    assert (opt.last_group_norms is None) == (len(order) == 1)
    for value, ref in zip(got, expected, strict=True):
        assert math.isclose(float(value), ref, rel_tol=1e-5)  # type: ignore[arg-type]
    for p, g in zip(params, grads, strict=True):  # max_norm inf: measured, not scaled
        assert torch.equal(p.grad, g)  # type: ignore[arg-type]


# ------------------------------------------------------------------ two ranks, FSDP2

RTOL = 1e-5


def case_fsdp2_clip_groups() -> None:
    """FSDP2 over two ranks: two clip groups (L2 and L1, one spanning two layers) and an
    unclipped layer, against a float64 single-process run; one all_reduce a step."""
    from test_distributed import CountAllReduce, batches, fully_shard_mlp, local_rows, loss_fn
    from test_distributed import mlp as make_mlp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    inputs = batches(3, 8, 3)

    def grouped(model: nn.Sequential) -> list[dict[str, Any]]:
        layers = [model[0], model[2], model[4]]
        return [
            {"params": list(layers[0].parameters()), "clip_group": "a"},
            {"params": list(layers[1].parameters()), "clip_group": None},
            {"params": [layers[2].weight], "clip_group": "b", "clip_norm_type": 1.0},
            {"params": [layers[2].bias], "clip_group": "a"},
        ]

    reference = make_mlp().double()
    ref_groups = grouped(reference)
    ref_opt = torch.optim.SGD(ref_groups, lr=0.05)
    ref_norms = []
    for x in inputs:
        ref_opt.zero_grad()
        loss_fn(reference(x.double())).backward()
        a = ref_groups[0]["params"] + ref_groups[3]["params"]
        norm_a = torch.nn.utils.clip_grad_norm_(a, 0.5)
        norm_b = torch.nn.utils.clip_grad_norm_(ref_groups[2]["params"], 0.5, norm_type=1.0)
        ref_norms.append(torch.stack([norm_a, norm_b]))
        ref_opt.step()
    assert all(float(n.min()) > 0.5 for n in ref_norms), "the data should make both clip"

    model = make_mlp()
    fully_shard_mlp(model, mesh)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(grouped(model), lr=0.05), 0.5)
    for step, x in enumerate(inputs):
        opt.zero_grad()
        loss_fn(model(local_rows(x))).backward()
        with CountAllReduce() as counter:
            opt.step()
        assert counter.calls == 1, f"step {step}: {counter.calls} all_reduce calls"
        assert opt.last_group_norms is not None
        torch.testing.assert_close(
            opt.last_group_norms.double(), ref_norms[step], rtol=RTOL, atol=0
        )
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        full = ours.full_tensor()  # type: ignore[attr-defined]
        torch.testing.assert_close(full.double(), theirs.detach(), rtol=RTOL, atol=1e-6)


CASES: dict[str, Callable[[], None]] = {"fsdp2_clip_groups": case_fsdp2_clip_groups}


def worker(rank: int, port: int, out_dir: str) -> None:
    from test_distributed import run_cases

    run_cases(rank, port, out_dir, CASES)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_fsdp2_clip_groups_match_a_float64_single_process_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from test_distributed import rank_outcomes

    results = rank_outcomes(worker, tmp_path_factory.mktemp("clip_groups"), CASES)
    assert_all_ok(results["fsdp2_clip_groups"])
