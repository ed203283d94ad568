"""A rule written from docs/adaptive.md's "Writing a rule" works in ClippedOptimizer: the
page's own ``EmaClip``, taken from the page, clips as a float64 reference of its rule
does, globally and per tensor, through a checkpoint, and compiled."""

from __future__ import annotations

import copy
import doctest
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import clipopt

PAGE = Path(__file__).resolve().parents[1] / "docs" / "adaptive.md"
SHAPES = [(4, 3), (3,), (2, 2)]


def page_rule() -> type[clipopt.ClipRule]:
    """The rule class the page defines, run from the page's own doctest source."""
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("## Writing a rule") : text.index("### Unit-wise rules")]
    examples = doctest.DocTestParser().get_examples(section)
    source = next(e.source for e in examples if e.source.startswith("class EmaClip"))
    namespace: dict[str, Any] = {"torch": torch, "clipopt": clipopt, "math": math}
    exec(compile(source, str(PAGE), "exec"), namespace)
    rule: type[clipopt.ClipRule] = namespace["EmaClip"]
    return rule


EmaClip = page_rule()


def grad_stream(steps: int, seed: int = 0) -> list[list[Tensor]]:
    """Float64 grads with a spike every seventh step and a non-finite one at step 9."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        scale = 20.0 if step % 7 == 6 else 1.0
        grads = [torch.randn(s, generator=generator, dtype=torch.float64) * scale for s in SHAPES]
        if step == 9:
            grads[1][0] = math.inf
        out.append(grads)
    return out


def reference(
    stream: list[list[Tensor]], factor: float, beta: float, per_tensor: bool
) -> tuple[list[Tensor], int]:
    """The rule by hand, in float64 Python numbers: SGD(lr=0.1) on zeros with each
    step's grads clipped at ``factor`` times the EMA of the past finite norms; a step
    with a non-finite norm skipped (``nonfinite="skip"``). Returns the params and the
    count of steps not skipped with some coefficient below 1."""
    params = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    rows = len(SHAPES) if per_tensor else 1
    ema, seen, clipped = [0.0] * rows, [0] * rows, 0
    for grads in stream:
        each = [float(torch.linalg.vector_norm(g)) for g in grads]
        total = math.sqrt(sum(n * n for n in each))
        norms = each if per_tensor else [total]
        thresholds = [factor * e if s else math.inf for e, s in zip(ema, seen, strict=True)]
        coefficients = [min(1.0, t / (n + 1e-6)) for t, n in zip(thresholds, norms, strict=True)]
        for i, n in enumerate(norms):
            if math.isfinite(n):
                ema[i] = beta * ema[i] + (1 - beta) * n if seen[i] else n
                seen[i] += 1
        if not math.isfinite(total):
            continue
        clipped += any(c < 1 for c in coefficients)  # a skipped step is no clip
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            p -= 0.1 * g * coefficients[i if per_tensor else 0]
    return params, clipped


def run(rule: clipopt.ClipRule, stream: list[list[Tensor]], compiled: bool = False) -> Any:
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in SHAPES]
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(params, lr=0.1), max_norm=rule, nonfinite="skip")
    step = torch.compile(opt.step, backend="eager") if compiled else opt.step
    for grads in stream:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        step()
    return params, opt


@pytest.mark.parametrize("per_tensor", [False, True], ids=["global", "per-tensor"])
def test_the_page_rule_clips_as_its_float64_reference(per_tensor: bool) -> None:
    stream = grad_stream(30)
    params, opt = run(EmaClip(factor=1.5, beta=0.8, per_tensor=per_tensor), stream)
    want, clipped = reference(stream, 1.5, 0.8, per_tensor)
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-14)
    assert int(opt.clipped_count) == clipped > 0
    assert int(opt.skip_count) == 1
    assert opt.rule.last_threshold.shape == ((len(SHAPES),) if per_tensor else ())


def test_the_page_rule_resumes_bit_exactly_from_a_checkpoint() -> None:
    stream = grad_stream(20, seed=1)
    straight_params, straight = run(EmaClip(per_tensor=True), stream)
    first_params, first = run(EmaClip(per_tensor=True), stream[:8])
    saved = copy.deepcopy(first.state_dict())
    params = [torch.nn.Parameter(p.detach().clone()) for p in first_params]
    resumed = clipopt.ClippedOptimizer(
        torch.optim.SGD(params, lr=0.1), max_norm=EmaClip(per_tensor=True), nonfinite="skip"
    )
    resumed.load_state_dict(saved)
    for grads in stream[8:]:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        resumed.step()
    assert all(torch.equal(a, b) for a, b in zip(params, straight_params, strict=True))
    for key in ("ema", "seen"):
        assert torch.equal(resumed.rule.state[key], straight.rule.state[key])
    assert torch.equal(resumed.clipped_count, straight.clipped_count)


def test_a_checkpoint_of_another_setting_or_a_malformed_state_is_refused() -> None:
    _, opt = run(EmaClip(), grad_stream(3))
    with pytest.raises(ValueError, match="factor"):
        run(EmaClip(factor=3.0), [])[1].load_state_dict(opt.state_dict())
    saved = opt.state_dict()
    saved["clip"]["rule"]["state"]["seen"] = torch.zeros(2, dtype=torch.int64)
    target = run(EmaClip(), grad_stream(3))[1]
    before = copy.deepcopy(target.rule.state)
    with pytest.raises(ValueError, match="one shape"):
        target.load_state_dict(saved)
    assert all(torch.equal(target.rule.state[k], v) for k, v in before.items())


def test_the_page_rule_compiles_to_the_eager_result() -> None:
    stream = grad_stream(12, seed=2)
    eager, _ = run(EmaClip(per_tensor=True), stream)
    compiled, _ = run(EmaClip(per_tensor=True), stream, compiled=True)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))
