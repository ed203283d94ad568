"""``track_tensor_norms``: each grad's pre-clip norm of the last step, by name.

- the norms against ``torch.linalg.vector_norm`` of each grad in float64, the global
  norm derived from them against ``torch.nn.utils.get_total_norm`` and a float64 sum;
- names from ``named_parameters()`` (torch's ``param_names``), else positional;
- every grad is read once per step, by one batched norm pass and no other norm kernel,
  also for a per-tensor rule (which used to measure twice);
- no host read; nothing new in the checkpoint; bad settings refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

import clipopt
from clipopt._kernels import _norms


def model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    return net.to(dtype)


def backward(net: torch.nn.Module, scale: float = 1.0) -> list[Tensor]:
    """Fresh grads (copies returned, for the reference)."""
    net.zero_grad(set_to_none=True)
    x = torch.randn(9, 5, dtype=next(net.parameters()).dtype)
    (net(x).pow(2).sum() * scale).backward()
    return [p.grad.detach().clone() for p in net.parameters() if p.grad is not None]


def reference(grads: list[Tensor], p: float) -> list[float]:
    """Each grad's p-norm in float64, from abs/pow/sum/max (independent of torch's norm)."""
    wide = [g.double().abs().flatten() for g in grads]
    if p == math.inf:
        return [float(w.max()) for w in wide]
    return [float(w.pow(p).sum().pow(1 / p)) for w in wide]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_norms_and_names_match_float64_per_grad(norm_type: float, fused: bool) -> None:
    net = model()
    inner = torch.optim.AdamW(net.named_parameters(), lr=0.01, fused=fused)
    opt = clipopt.ClippedOptimizer(inner, 0.1, norm_type, track_tensor_norms=True)
    assert opt.last_tensor_norms is None
    for _ in range(3):
        grads = backward(net, 10.0)
        opt.step()
    tracked = opt.last_tensor_norms
    assert tracked is not None
    assert list(tracked) == [name for name, _ in net.named_parameters()]
    for value, expected, torch_norm in zip(
        tracked.values(),
        reference(grads, norm_type),
        (torch.linalg.vector_norm(g.double(), norm_type) for g in grads),
        strict=True,
    ):
        assert value.shape == () and value.dtype == torch.float32
        assert value.item() == pytest.approx(expected, rel=2e-7)
        assert value.item() == pytest.approx(float(torch_norm), rel=2e-7)
    total = torch.nn.utils.get_total_norm(grads, norm_type)
    torch.testing.assert_close(opt.last_norm, total, rtol=3e-7, atol=0)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 0.5])
def test_the_derived_global_norm_is_exact_in_float64(norm_type: float) -> None:
    net = model(torch.float64)
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.0), math.inf, norm_type, track_tensor_norms=True
    )
    plain = clipopt.ClippedOptimizer(torch.optim.SGD(net.parameters(), lr=0.0), math.inf, norm_type)
    grads = backward(net)
    opt.step()
    plain.step()
    wide = torch.cat([g.abs().flatten() for g in grads])
    expected = wide.max() if norm_type == math.inf else wide.pow(norm_type).sum() ** (1 / norm_type)
    torch.testing.assert_close(opt.last_norm, expected, rtol=1e-14, atol=0)
    torch.testing.assert_close(
        opt.last_norm, torch.nn.utils.get_total_norm(grads, norm_type), rtol=1e-14, atol=0
    )
    torch.testing.assert_close(opt.last_norm, plain.last_norm, rtol=1e-14, atol=0)


def test_positional_names_count_over_groups_and_skip_missing_grads() -> None:
    net = model()
    params = list(net.parameters())
    inner = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:]}], lr=0.1)
    opt = clipopt.ClippedOptimizer(inner, math.inf, track_tensor_norms=True)
    backward(net)
    params[1].grad = None
    grads = [p.grad.clone() for p in params if p.grad is not None]
    opt.step()
    tracked = opt.last_tensor_norms
    assert tracked is not None and list(tracked) == ["0", "2", "3"]
    assert [v.item() for v in tracked.values()] == pytest.approx(reference(grads, 2.0), rel=2e-7)


def test_which_layer_spiked_is_one_lookup_per_group() -> None:
    net = model()
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(net.named_parameters(), lr=0.01),
        1.0,
        per_group=True,
        track_tensor_norms=True,
    )
    backward(net)
    net[2].weight.grad.mul_(1000.0)  # type: ignore[index,union-attr]
    grads = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    opt.step()
    tracked = opt.last_tensor_norms
    assert tracked is not None
    assert max(tracked, key=lambda name: tracked[name]) == "2.weight"
    assert opt.last_group_norms is not None
    expected = math.sqrt(sum(n * n for n in reference(grads, 2.0)))
    assert opt.last_group_norms.item() == pytest.approx(expected, rel=2e-7)


def test_groups_with_their_own_norm_types() -> None:
    net = model()
    params = list(net.parameters())
    inner = torch.optim.SGD(
        [{"params": params[:2], "clip_norm_type": 1.0}, {"params": params[2:]}], lr=0.0
    )
    opt = clipopt.ClippedOptimizer(inner, math.inf, per_group=True, track_tensor_norms=True)
    grads = backward(net)
    opt.step()
    tracked = opt.last_tensor_norms
    assert tracked is not None
    expected = reference(grads[:2], 1.0) + reference(grads[2:], 2.0)
    assert [v.item() for v in tracked.values()] == pytest.approx(expected, rel=2e-7)
    groups = [sum(expected[:2]), math.sqrt(expected[2] ** 2 + expected[3] ** 2)]
    assert opt.last_group_norms is not None
    assert opt.last_group_norms.tolist() == pytest.approx(groups, rel=2e-7)


# ---------------------------------------------------------------- one read of the grads


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[int]]]:
    """The ids of the grads each norm-kernel call (``_foreach_norm``, one call per group of
    tensors) reads, gathered per step by the test; the global norm's own pass over the
    grads fails the test."""
    calls: list[list[int]] = []
    original_foreach = torch._foreach_norm

    def counting(tensors: list[Tensor], *args: Any, **kwargs: Any) -> Any:
        calls.append([id(t) for t in tensors])
        return original_foreach(tensors, *args, **kwargs)

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a second pass over the grads")

    monkeypatch.setattr(torch, "_foreach_norm", counting)
    monkeypatch.setattr(_norms, "grouped_total_norm", forbidden)
    yield calls


RULES: dict[str, Callable[[], float | clipopt.ClipRule]] = {
    "fixed": lambda: 1.0,
    "autoclip": lambda: clipopt.AutoClip(50.0, 5),
    "autoclip-per-tensor": lambda: clipopt.AutoClip(50.0, 5, per_tensor=True),
    "zclip": lambda: clipopt.ZClip(warmup_steps=2),
    "adagc": lambda: clipopt.AdaGC(warmup_steps=2),
}


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_every_grad_is_read_once_per_step(
    name: str, fused: bool, reads: list[list[int]], no_host_sync: Callable[[], Any]
) -> None:
    net = model()
    # torch's unfused CPU Adam reads its step count on the host itself: SGD there.
    inner = (
        torch.optim.AdamW(net.named_parameters(), lr=0.01, fused=True)
        if fused
        else torch.optim.SGD(net.named_parameters(), lr=0.01, momentum=0.9)
    )
    opt = clipopt.ClippedOptimizer(inner, RULES[name](), track_tensor_norms=True)
    for step in range(4):
        backward(net)
        reads.clear()
        with no_host_sync():
            opt.step()
            tracked = opt.last_tensor_norms
        grads = [id(p.grad) for p in net.parameters()]
        assert [i for call in reads for i in call] == grads, f"step {step}"
        assert tracked is not None and len(tracked) == len(grads)


def test_a_per_tensor_rule_reuses_its_norms_without_tracking(reads: list[list[int]]) -> None:
    net = model()
    rule = clipopt.AutoClip(50.0, 5, per_tensor=True)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), rule)
    for _ in range(3):
        grads = backward(net)
        reads.clear()
        opt.step()
        assert [i for call in reads for i in call] == [id(p.grad) for p in net.parameters()]
    assert opt.last_tensor_norms is None  # not asked for
    assert opt.last_norm is not None
    torch.testing.assert_close(
        opt.last_norm, torch.nn.utils.get_total_norm(grads), rtol=3e-7, atol=0
    )


# ---------------------------------------------------------------- state and settings


def test_not_in_the_checkpoint_and_cleared_by_a_load() -> None:
    net = model()
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.01), 1.0, track_tensor_norms=True
    )
    backward(net)
    opt.step()
    saved = opt.state_dict()
    plain = clipopt.ClippedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), 1.0)
    plain.step()
    assert sorted(saved["clip"]) == sorted(plain.state_dict()["clip"])
    assert opt.last_tensor_norms is not None
    opt.load_state_dict(saved)
    assert opt.last_tensor_norms is None
    backward(net)
    opt.step()
    assert opt.last_tensor_norms is not None


def test_without_tracking_there_is_nothing() -> None:
    net = model()
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), 1.0)
    backward(net)
    opt.step()
    assert opt.track_tensor_norms is False and opt.last_tensor_norms is None


def test_a_closure_records_its_last_evaluation() -> None:
    net = model()
    opt = clipopt.ClippedOptimizer(
        torch.optim.LBFGS(net.parameters(), max_iter=3), 1.0, track_tensor_norms=True
    )
    x = torch.randn(9, 5)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = net(x).pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    tracked = opt.last_tensor_norms
    assert tracked is not None and opt.last_norm is not None
    combined = torch.stack(list(tracked.values())).double().norm()
    torch.testing.assert_close(combined.float(), opt.last_norm, rtol=3e-7, atol=0)


def test_bad_settings_are_refused_naming_the_value() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(TypeError, match="track_tensor_norms must be a bool, got 'yes'"):
        clipopt.ClippedOptimizer(torch.optim.SGD(params), 1.0, track_tensor_norms="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"track_tensor_norms=True .* process_group"):
        clipopt.ClippedOptimizer(
            torch.optim.SGD(params),
            1.0,
            process_group=object(),  # type: ignore[arg-type]
            track_tensor_norms=True,
        )
