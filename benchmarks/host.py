"""The host's cost per tensor, and the step under ``torch.compile``: sections of
``python -m benchmarks.run``.

- ``host cost``: on many small tensors (2000 of 500 elements on average) the clip's
  cost is Python per tensor, not bytes. ``clipopt.clip_grad_norm_`` and the clip part of
  ``ClippedOptimizer.step()`` (its inner optimizer's step a no-op) against the memory
  floor, and against the floor of any exact clip of separate grads through torch's
  Python API (the flat floor, plus what such a clip cannot skip per tensor: reading
  ``p.grad``, and telling autograd of the in-place change, as ``mul_`` does).
- ``small model``: the step of a 2-layer, 64-wide GPT (about 0.1M parameters, 27
  tensors), where a step is host time in Python: ``ClippedOptimizer(AdamW)`` against
  torch's ``clip_grad_norm_`` + the same AdamW step, over five interleaved runs; and the
  wrapper's first step (its own set-up and AdamW's state) against a later one.
- ``compiled step``: PyTorch's compiled-optimizer recipe, ``torch.compile(opt.step)``,
  against the eager step, bare AdamW and ``ClippedOptimizer(AdamW)``: compiled vs eager,
  wrapper vs bare. The first calls compile (tens of seconds on the CPU) and are not
  timed; a quick run compiles with ``aot_eager``. It runs only when asked for
  (``--only compiled``): compiling for 2000 tensors takes many minutes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import clipopt
from benchmarks.common import (
    MAX_NORM,
    ShrinkingMaxNorm,
    TinyLM,
    _grads_and_flat_copy,
    make_params,
    many_small_shapes,
    release,
    summarize,
    time_interleaved,
)

__all__ = [
    "HOST_CASE",
    "PER_TENSOR_FLOOR",
    "bench_compiled",
    "bench_host_cost",
    "bench_small_model",
    "host_contenders",
    "per_tensor_floor",
]

HOST_CASE = "many_small float32 p=2"
WRAPPER_CLIP = "ClippedOptimizer: step, inner step a no-op"
PER_TENSOR_FLOOR = "floor + .grad + increment_version"
SMALL_CASE = "GPT 2x64, AdamW"
SMALL_TORCH = "torch clip_grad_norm_ + AdamW step"
SMALL_WRAPPED = "ClippedOptimizer(AdamW) step"
FIRST_CASE = "GPT 2x64, AdamW: first step / later step"
RUNS = 5


class NoStep(torch.optim.Optimizer):
    """An optimizer whose step does nothing: ``ClippedOptimizer.step()`` is then its clip."""

    def __init__(self, params: list[Tensor]) -> None:
        super().__init__(params, {})

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        return None


def _wrapped_clip(params: list[Tensor], max_norm: Callable[[], float]) -> Callable[[], None]:
    wrapped = clipopt.ClippedOptimizer(NoStep(params), max_norm=1.0)

    def step() -> None:
        wrapped.param_groups[0]["clip_max_norm"] = max_norm()
        wrapped.step()

    return step


def per_tensor_floor(params: list[Tensor], floor: Callable[[], object]) -> Callable[[], None]:
    """The flat floor, then the two things an exact in-place clip of separate grads does
    per tensor through torch's Python API whatever its kernels: find each grad
    (``p.grad``), and bump each one's version counter (``mul_`` and ``_foreach_mul_``
    do it inside; a kernel writing through pointers calls ``increment_version``)."""

    def run() -> None:
        floor()
        torch.autograd.graph.increment_version([p.grad for p in params if p.grad is not None])

    return run


def host_contenders(params: list[Tensor], floor: Callable[[], object]) -> dict[str, Any]:
    """The floors, torch's clip, clipopt's, and the wrapper's clip, on the same grads."""

    grads = [p.grad for p in params if p.grad is not None]
    max_norm = ShrinkingMaxNorm.below_norm_of(grads, 2.0)
    return {
        "floor": floor,
        PER_TENSOR_FLOOR: per_tensor_floor(params, floor),
        "torch": lambda: torch.nn.utils.clip_grad_norm_(params, max_norm()),
        "clipopt": lambda: clipopt.clip_grad_norm_(params, max_norm()),
        WRAPPER_CLIP: _wrapped_clip(params, max_norm),
    }


def bench_host_cost(config: Any) -> list[Any]:

    params = make_params(many_small_shapes(config.quick), torch.float32, config.device)
    _, flat = _grads_and_flat_copy(params)
    shrink = torch.tensor(0.97, device=flat.device)

    def floor() -> object:
        total = flat.sum()
        return flat.mul_(shrink), total

    rows = summarize(
        "host cost", HOST_CASE, time_interleaved(host_contenders(params, floor), config), "floor"
    )
    return rows


def small_model_grads(device: torch.device) -> list[Tensor]:
    """The parameters of a 2-layer, 64-wide GPT after one backward."""
    torch.manual_seed(0)
    model = TinyLM(vocab=65, d=64, layers=2).to(device)
    tokens = torch.randint(65, (4, 33), device=device)
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, 65), tokens[:, 1:].reshape(-1)).backward()
    return list(model.parameters())


def bench_small_model(config: Any) -> list[Any]:
    """The wrapped step against torch's clip + step, over ``RUNS`` interleaved runs (their
    samples pooled), and the wrapper's first step against its later ones."""
    params = small_model_grads(config.device)
    torch_opt = torch.optim.AdamW(params, lr=1e-9)
    wrapped = clipopt.ClippedOptimizer(torch.optim.AdamW(params, lr=1e-9), max_norm=MAX_NORM)

    def torch_step() -> None:
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        torch_opt.step()

    contenders = {SMALL_TORCH: torch_step, SMALL_WRAPPED: wrapped.step}
    pooled: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(RUNS):
        for name, times in time_interleaved(contenders, config).items():
            pooled[name] += times
    rows = summarize("small model", SMALL_CASE, pooled, SMALL_TORCH)
    first, later = [], []
    for _ in range(RUNS):
        opt = clipopt.ClippedOptimizer(torch.optim.AdamW(params, lr=1e-9), max_norm=MAX_NORM)
        for times in (first, later, later):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
    rows += summarize("small model", FIRST_CASE, {"first": first, "later": later}, "later")
    return rows


def compiled_contenders(params: list[Tensor], backend: str = "inductor") -> dict[str, Any]:
    """Eager and compiled steps of AdamW, bare and wrapped, each compiled once here."""
    contenders: dict[str, Any] = {}
    for name in ("bare AdamW", "ClippedOptimizer(AdamW)"):
        inner = torch.optim.AdamW(params, lr=torch.tensor(1e-6))
        opt: torch.optim.Optimizer = inner
        if name != "bare AdamW":
            opt = clipopt.ClippedOptimizer(inner, max_norm=1.0)
        compiled = torch.compile(opt.step, backend=backend)
        for _ in range(3):  # compiles, and recompiles on the step count's first changes
            compiled()
        contenders[f"eager: {name}"] = opt.step
        contenders[f"compiled: {name}"] = compiled
    return contenders


def bench_compiled(config: Any) -> list[Any]:

    rows = []
    layouts = config.layouts
    for layout in (config.step_layout, "many_small"):
        params = make_params(layouts[layout](config.quick), torch.float32, config.device)
        # A quick run checks the script: aot_eager traces as inductor does, without
        # minutes of C++ compilation.
        backend = "aot_eager" if config.quick else "inductor"
        samples = time_interleaved(compiled_contenders(params, backend), config)
        rows += summarize("compiled step", f"{layout} float32", samples, "eager: bare AdamW")
        del params, samples
        torch._dynamo.reset()
        release(config.device)
    return rows


def compiled_ratio(rows: list[Any], layout: str, contender: str, baseline: str) -> float:
    medians = {
        row.contender: row.median_ms
        for row in rows
        if (row.section, row.case) == ("compiled step", f"{layout} float32")
    }
    ratio: float = medians[contender] / medians[baseline]
    return ratio if math.isfinite(ratio) else math.nan
