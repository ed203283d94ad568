"""The GPU check's compiled steps: inductor on CUDA, and the whole step in a CUDA graph.

Three checks, each against an eager twin that takes the same grads at every step:

- ``inductor``: ``torch.compile(opt.step)`` (the default backend) for foreach and fused
  AdamW: the same parameters and ``last_norm`` as eager at every step, and no graph
  compiled after the third step.
- ``cuda-graph``: the pattern of ``capturable=True`` optimizers: a few warm-up steps on
  a side stream, then one ``opt.step()`` captured whole by ``torch.cuda.graph`` with
  static grads; every replay (new grads copied into the static ones first) must equal
  an eager step, and the ``last_norm`` tensor captured must hold each replay's norm.
- ``reduce-overhead``: ``torch.compile(opt.step, mode="reduce-overhead")`` (inductor with
  CUDA graphs), against eager, ``last_norm`` after each step.

``python -m benchmarks.gpu_compile`` runs them on CUDA (exit 2 without it); with
``--device cpu`` only the ``inductor`` check runs (the others need CUDA and say so),
which is how it is checked on a machine without a GPU. Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import clipopt

__all__ = ["CHECKS", "main", "run_checks"]

STEPS = 12
WARM_UP = 3
MAX_NORM = 0.5
SHAPES = [(64, 32), (32,), (16, 64), (16,)]


def _params(device: torch.device) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=generator).to(device)) for s in SHAPES]


def _grads(step: int, device: torch.device) -> list[Tensor]:
    """The grads of ``step``: norms around 10, so that every step clips."""
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=generator).to(device) for s in SHAPES]


def _pair(
    device: torch.device, **adamw: Any
) -> tuple[list[torch.nn.Parameter], clipopt.ClippedOptimizer, list[torch.nn.Parameter], Any]:
    """Two identical wrapped AdamW optimizers: one to compile or capture, one eager."""
    ours, twin = _params(device), _params(device)
    opt = clipopt.ClippedOptimizer(torch.optim.AdamW(ours, lr=0.01, **adamw), MAX_NORM)
    eager = clipopt.ClippedOptimizer(torch.optim.AdamW(twin, lr=0.01, **adamw), MAX_NORM)
    return ours, opt, twin, eager


def _same(ours: Sequence[Tensor], theirs: Sequence[Tensor], what: str) -> None:
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _set_grads(params: list[torch.nn.Parameter], grads: list[Tensor]) -> None:
    for p, g in zip(params, grads, strict=True):
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)  # in place: a captured graph reads these very tensors


def check_inductor(device: torch.device, backend: str = "inductor") -> str:
    """The compiled step equals eager, foreach and fused, with no graph after warm-up."""
    counts = []
    for adamw in ({"foreach": True}, {"fused": True}):
        torch._dynamo.reset()
        ours, opt, twin, eager = _pair(device, **adamw)
        step = torch.compile(opt.step, backend=backend)
        counters = torch._dynamo.utils.counters
        counters.clear()
        warm = 0
        for i in range(STEPS):
            grads = _grads(i, device)
            _set_grads(ours, grads)
            _set_grads(twin, grads)
            step()
            eager.step()
            assert opt.last_norm is not None and eager.last_norm is not None
            _same([opt.last_norm], [eager.last_norm], f"{adamw} step {i} last_norm")
            _same(ours, twin, f"{adamw} step {i} parameters")
            if i + 1 == WARM_UP:
                warm = counters["stats"]["unique_graphs"]
        graphs = counters["stats"]["unique_graphs"]
        assert graphs == warm, f"{adamw}: {warm} graphs after step {WARM_UP}, {graphs} after"
        assert int(opt.step_count) == STEPS
        counts.append(f"{next(iter(adamw))}: {graphs} graphs")
    return ", ".join(counts)


def check_cuda_graph(device: torch.device) -> str:
    """One whole clipped step captured by ``torch.cuda.graph``, replayed on new grads."""
    ours, opt, twin, eager = _pair(device, foreach=True, capturable=True)
    for i in range(WARM_UP):  # warm up on a side stream, as torch's capture recipe says
        grads = _grads(i, device)
        _set_grads(ours, grads)
        _set_grads(twin, grads)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            opt.step()
        torch.cuda.current_stream().wait_stream(side)
        eager.step()
    _same(ours, twin, "after the warm-up")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()  # recorded, not run: the parameters are as after the warm-up
    captured_norm = opt.last_norm
    assert captured_norm is not None
    for i in range(WARM_UP, STEPS):
        grads = _grads(i, device)
        _set_grads(ours, grads)  # into the static grads the graph reads
        _set_grads(twin, grads)
        graph.replay()
        eager.step()
        torch.cuda.synchronize()
        assert eager.last_norm is not None
        _same([captured_norm], [eager.last_norm], f"replay {i} last_norm")
        _same(ours, twin, f"replay {i} parameters")
    assert int(opt.step_count) == STEPS, f"step_count {int(opt.step_count)} after {STEPS}"
    return f"{STEPS - WARM_UP} replays equal the eager steps"


def check_reduce_overhead(device: torch.device) -> str:
    """``mode="reduce-overhead"``: inductor's CUDA graphs around the compiled step."""
    torch._dynamo.reset()
    ours, opt, twin, eager = _pair(device, foreach=True, capturable=True)
    step = torch.compile(opt.step, mode="reduce-overhead")
    for i in range(STEPS):
        grads = _grads(i, device)
        _set_grads(ours, grads)
        _set_grads(twin, grads)
        torch.compiler.cudagraph_mark_step_begin()
        step()
        eager.step()
        assert opt.last_norm is not None and eager.last_norm is not None
        _same([opt.last_norm.clone()], [eager.last_norm], f"step {i} last_norm")
        _same(ours, twin, f"step {i} parameters")
    skips = dict(torch._dynamo.utils.counters["inductor"])
    return f"{STEPS} steps equal the eager ones; inductor counters {skips}"


CHECKS: dict[str, Callable[[torch.device], str]] = {
    "inductor": check_inductor,
    "cuda-graph": check_cuda_graph,
    "reduce-overhead": check_reduce_overhead,
}
NEEDS_CUDA = {"cuda-graph", "reduce-overhead"}
WITHOUT_CUDA = "needs CUDA"  # what a check that cannot run here reports


def run_checks(device: torch.device) -> dict[str, dict[str, str]]:
    """Every check that can run on ``device``: ``{name: {"status", "detail"}}``."""
    results = {}
    for name, check in CHECKS.items():
        if name in NEEDS_CUDA and device.type != "cuda":
            results[name] = {"status": "skipped", "detail": WITHOUT_CUDA}
            continue
        try:
            results[name] = {"status": "ok", "detail": check(device)}
        except Exception:  # reported, and the exit status says it failed
            results[name] = {"status": "FAILED", "detail": traceback.format_exc()}
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (all checks) or cpu")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_compile: torch.cuda.is_available() is False; nothing was run")
        return 2
    results = run_checks(device)
    for name, result in results.items():
        print(f"{result['status']:<8} {name}: {result['detail']}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 1 if any(r["status"] == "FAILED" for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
