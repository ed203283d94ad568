"""Clip-and-step benchmark: clipopt against torch and the memory floor, in one process.

Run ``python -m benchmarks.run`` (``make bench``); ``--quick`` uses tiny sizes and few
repeats, ``--json PATH`` writes the results there too (they always go to
``benchmarks/results/latest.json``, or ``quick.json`` for a quick run; with
``--device cuda``, ``latest-cuda.json`` and ``quick-cuda.json``). Contenders of
one case run interleaved, in a rotating order, over the repeats, and ratios are taken
between medians of the same run: absolute times on a shared machine drift, ratios much
less.

Sections:

- ``clip``: ``torch.nn.utils.clip_grad_norm_`` vs ``clipopt.clip_grad_norm_`` vs the
  memory floor (``torch.sum``
  + in-place ``mul_`` over one buffer of the same bytes), on three layouts
  (transformer-like, many small tensors, a few large ones), float32 and bfloat16, norm
  types 2 and inf. Every timed call clips (see ``ShrinkingMaxNorm``);
  one more case times clips whose ``max_norm`` is never reached, against a floor that
  only reads.
- ``step``: full optimizer steps on the transformer layout: bare fused AdamW, torch's clip
  + fused AdamW, ``ClippedOptimizer(fused AdamW)``, and the same with foreach SGD.
- ``amp step``: the same fused AdamW step under ``torch.amp.GradScaler``: bare, torch's
  recipe (``unscale_``, clip, ``step``), and ``ClippedOptimizer`` handed to the scaler.
- ``end_to_end``: forward, backward and step of a small transformer, unclipped vs
  ``ClippedOptimizer`` vs torch's clip.
- ``accuracy``: relative error of the L2 norm of one 40M-element float32 grad.
- ``memory``: how far the peak resident memory rises during a step, and the largest
  single allocation, bare vs clipped (on CUDA: how far the peak of allocated device
  memory rises).
- ``host_syncs`` (CUDA only): how many synchronizing CUDA calls one clipped step makes,
  counted by ``torch.cuda.set_sync_debug_mode("warn")``.
- ``rules``: the clip rules' rows, targets and memory record, from :mod:`benchmarks.rules`
  (``python -m benchmarks.rules`` runs them alone), kept apart under ``"rules"``; only
  in a run of every default section.
- ``host cost``, ``small model`` and ``compiled step``: the clip on many small tensors
  against the floor, the wrapper's own Python per tensor with the kernels stubbed out;
  the wrapped step of a 0.1M-parameter GPT against torch's clip + step, and its first
  step against a later one; and ``torch.compile(opt.step)`` against the eager step
  (:mod:`benchmarks.host`).
- ``compiled recipe``: foreach AdamW and SGD on the step layout compiled with inductor:
  the clipped step (a fixed threshold, ZClip, ``nonfinite="skip"``) against the bare
  compiled step and torch's compiled ``clip_grad_norm_`` + step
  (:mod:`benchmarks.compiled`).

``--only SECTION[,SECTION]`` runs only those sections (``clip``, ``step``, ``amp``,
``end_to_end``, ``host``, ``small_model``, ``compiled``, ``compiled_recipe``); targets
whose rows were not measured are left out.
``compiled`` runs only when named: inductor compiling AdamW over 2000 tensors took more
than 20 minutes on the 2-core machine of docs/benchmarks.md.

With ``--device cuda`` (and not ``--quick``) the transformer layout is
``transformer_1b``: 18 blocks of width 2048 and a 50304-token embedding, 219 tensors,
1.009e9 parameters (``transformer_1b_shapes``); the step and amp sections use it too,
and the targets of the GPU check apply (``cuda_targets``) instead of the CPU's.

This module holds the sections and ``main``; the harness they share (layouts, timing,
the table and the JSON) is :mod:`benchmarks.common`, the goals :mod:`benchmarks.targets`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import clipopt
from benchmarks import compiled, host, rules
from benchmarks.common import (
    FOLDED_FLOOR,
    MAX_NORM,
    RESULTS_DIR,
    SCALED_STEP,
    SHRINK,
    Config,
    Contenders,
    Row,
    ShrinkingMaxNorm,
    TinyLM,
    _grads_and_flat_copy,
    format_table,
    machine,
    make_params,
    release,
    results_name,
    summarize,
    time_interleaved,
    transformer_shapes,
    write_results,
)
from benchmarks.targets import (
    check_targets,
    cuda_targets,
)
from clipopt._kernels._norms import CHUNK

# ---------------------------------------------------------------- layouts


def unclipped_case(layout: str) -> str:
    return f"{layout} float32 p=2, max_norm not reached"


def torch_foreach(device: torch.device) -> bool | None:
    """What torch's clip is given: None (its default, per-tensor) on CPU, and on CUDA
    True, the foreach path its default picks there anyway, named so the rows say so."""
    return True if device.type == "cuda" else None


# ---------------------------------------------------------------- timing


# ---------------------------------------------------------------- sections


def clip_contenders(params: list[Tensor], norm_type: float) -> Contenders:
    """torch's clip, clipopt's clip, and the floor over one buffer of the same bytes; for
    bfloat16's 2-norm on the CPU, also what limits clipopt there (``WIDENING``)."""
    grads, flat = _grads_and_flat_copy(params)
    shrink = torch.tensor(SHRINK, device=flat.device)
    max_norm = ShrinkingMaxNorm.below_norm_of(grads, norm_type)
    foreach = torch_foreach(flat.device)

    def floor() -> object:
        total = flat.sum()
        return flat.mul_(shrink), total

    return {
        "torch": lambda: torch.nn.utils.clip_grad_norm_(
            params, max_norm(), norm_type, foreach=foreach
        ),
        "clipopt": lambda: clipopt.clip_grad_norm_(params, max_norm(), norm_type),
        "floor": floor,
        **(widening(grads) if norm_type == 2 and flat.dtype == torch.bfloat16 else {}),
    }


WIDENING = "widening to float32 alone"
FLOAT32_NORM = "torch's float32-accumulating norm alone"


def widening(grads: list[Tensor]) -> Contenders:
    """What limits clipopt's exact (float32) bfloat16 2-norm on the CPU, which torch's
    clip, rounded to bfloat16, skips: every grad copied into a float32 scratch ``CHUNK``
    elements at a time (``WIDENING``), and torch's own float32-accumulating norm of every
    grad, ``_foreach_norm(dtype=float32)`` (``FLOAT32_NORM``; it copies each grad first).
    No torch op on the CPU takes a bfloat16 norm into float32 without a copy."""
    if grads[0].device.type != "cpu":
        return {}
    scratch = torch.empty(CHUNK)

    def run() -> None:
        for grad in grads:
            flat = grad.view(-1)
            for start in range(0, flat.numel(), CHUNK):
                piece = flat[start : start + CHUNK]
                scratch[: piece.numel()].copy_(piece)

    return {
        WIDENING: run,
        FLOAT32_NORM: lambda: torch._foreach_norm(grads, 2, dtype=torch.float32),
    }


def unclipped_contenders(params: list[Tensor]) -> Contenders:
    """Clips whose ``max_norm`` is never reached, against a floor that only reads."""
    _, flat = _grads_and_flat_copy(params)
    foreach = torch_foreach(flat.device)
    return {
        "torch": lambda: torch.nn.utils.clip_grad_norm_(params, 1e30, foreach=foreach),
        "clipopt": lambda: clipopt.clip_grad_norm_(params, 1e30),
        "floor (read)": flat.sum,
    }


def bench_clip(config: Config) -> list[Row]:
    rows = []
    for layout, shapes_of in config.layouts.items():
        for dtype in (torch.float32, torch.bfloat16):
            params = make_params(shapes_of(config.quick), dtype, config.device)
            for norm_type in (2.0, math.inf):
                case = f"{layout} {str(dtype).removeprefix('torch.')} p={norm_type:g}"
                samples = time_interleaved(clip_contenders(params, norm_type), config)
                rows += summarize("clip", case, samples, "floor")
            if layout == config.step_layout and dtype == torch.float32:
                samples = time_interleaved(unclipped_contenders(params), config)
                rows += summarize("clip", unclipped_case(layout), samples, "floor (read)")
            del params
            release(config.device)
    return rows


def step_contenders(params: list[Tensor], device: torch.device) -> Contenders:
    """Full steps: bare, torch's clip first, and ClippedOptimizer; AdamW and SGD."""
    fused = device.type in ("cpu", "cuda")

    def adamw() -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-6, fused=fused)

    def sgd() -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-6, momentum=0.9, foreach=True)

    contenders: Contenders = {}
    max_norm = ShrinkingMaxNorm()  # the clipped contenders share the grads
    foreach = torch_foreach(device)
    for name, make in (("fused AdamW", adamw), ("foreach SGD", sgd)):
        bare, torch_clipped = make(), make()
        wrapped = clipopt.ClippedOptimizer(make(), max_norm=MAX_NORM)

        def torch_clip_then_step(opt: torch.optim.Optimizer = torch_clipped) -> None:
            torch.nn.utils.clip_grad_norm_(params, max_norm(), foreach=foreach)
            opt.step()

        def clipped_step(opt: clipopt.ClippedOptimizer = wrapped) -> None:
            opt.param_groups[0]["clip_max_norm"] = max_norm()
            opt.step()

        contenders[f"{name}: bare"] = bare.step
        contenders[f"{name}: torch clip + step"] = torch_clip_then_step
        contenders[f"{name}: ClippedOptimizer"] = clipped_step
    if fused:
        contenders[FOLDED_FLOOR] = folded_floor(params, adamw(), max_norm)
        contenders[SCALED_STEP] = folded_floor(params, adamw(), max_norm, read=False)
    return contenders


def folded_floor(
    params: list[Tensor],
    optimizer: torch.optim.Optimizer,
    max_norm: ShrinkingMaxNorm,
    read: bool = True,
) -> Callable[[], None]:
    """The least a folded clip can cost: one ``torch.sum`` per grad (the norm's read) and
    the fused step with a ``grad_scale`` (which writes the divided grads back). It
    shrinks the shared grads by ``SHRINK`` as the clipped contenders do, and so takes
    its turn of ``max_norm``. Without ``read``: the step with ``grad_scale`` alone, the
    floor's first part."""
    grads = [p.grad for p in params if p.grad is not None]
    grad_scale = torch.tensor(1 / SHRINK, device=grads[0].device)

    def run() -> None:
        max_norm()
        for grad in grads if read else ():
            grad.sum()
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]

    return run


def bench_steps(config: Config) -> list[Row]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        params = make_params(config.step_shapes(), dtype, config.device)
        contenders = step_contenders(params, config.device)
        case = f"{config.step_layout} {str(dtype).removeprefix('torch.')}"
        samples = time_interleaved(contenders, config)
        for optimizer in ("fused AdamW", "foreach SGD"):
            mine = {k: v for k, v in samples.items() if k.startswith(optimizer)}
            rows += summarize("step", case, mine, f"{optimizer}: bare")
        del params, contenders
        release(config.device)
    return rows


def amp_contenders(params: list[Tensor], device: torch.device) -> Contenders:
    """Fused AdamW steps under ``GradScaler``: bare, torch's recipe, ClippedOptimizer.

    The scale is held at 1 (and never grown) so that repeated unscaling leaves the shared
    grads' size alone; the kernels cost the same whatever the scale's value.
    """
    fused = device.type in ("cpu", "cuda")
    max_norm = ShrinkingMaxNorm()

    def adamw() -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-6, fused=fused)

    def scaler() -> torch.amp.GradScaler:
        made = torch.amp.GradScaler(device.type, init_scale=1.0, growth_interval=2**30)
        made.scale(torch.zeros((), device=device))  # creates the scale, as scaling a loss would
        return made

    bare, torch_clipped = adamw(), adamw()
    wrapped = clipopt.ClippedOptimizer(adamw(), max_norm=MAX_NORM)
    scalers = {"bare": scaler(), "torch": scaler(), "clipopt": scaler()}

    def bare_step() -> None:
        scalers["bare"].step(bare)
        scalers["bare"].update()

    def torch_recipe() -> None:
        scalers["torch"].unscale_(torch_clipped)
        torch.nn.utils.clip_grad_norm_(params, max_norm(), foreach=torch_foreach(device))
        scalers["torch"].step(torch_clipped)
        scalers["torch"].update()

    def clipped_step() -> None:
        wrapped.param_groups[0]["clip_max_norm"] = max_norm()
        scalers["clipopt"].step(wrapped)
        scalers["clipopt"].update()

    return {
        "GradScaler + fused AdamW: bare": bare_step,
        "torch: unscale_, clip, step": torch_recipe,
        "GradScaler + ClippedOptimizer": clipped_step,
        **scaler_kernels(params, device),
    }


def scaler_kernels(params: list[Tensor], device: torch.device) -> Contenders:
    """The kernel ``GradScaler`` runs over every grad, alone: as its inf check with a
    scale of 1 (what ``GradScaler.step`` still runs for an optimizer that declares
    ``_step_supports_amp_scaling``) and as the unscale it would replace. The unscale
    alternates between 1/2 and 2, so the shared grads keep their size."""
    grads = [p.grad for p in params if p.grad is not None]
    found_inf = torch.zeros(1, device=device)
    one = torch.ones(1, device=device)
    inverse_scales = [torch.full((1,), 0.5, device=device), torch.full((1,), 2.0, device=device)]

    def inf_check() -> None:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one)

    def unscale() -> None:
        inverse_scales.reverse()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inverse_scales[0])

    return {
        "GradScaler's inf check alone (scale 1)": inf_check,
        "GradScaler's unscale alone": unscale,
    }


def bench_amp(config: Config) -> list[Row]:
    params = make_params(config.step_shapes(), torch.float32, config.device)
    samples = time_interleaved(amp_contenders(params, config.device), config)
    del params
    release(config.device)
    case = f"{config.step_layout} float32"
    return summarize("amp step", case, samples, "GradScaler + fused AdamW: bare")


def bench_end_to_end(config: Config) -> list[Row]:
    """Forward + backward + fused AdamW step: unclipped, ClippedOptimizer, torch's clip."""
    vocab, d, layers, batch, seq = (64, 16, 1, 2, 8) if config.quick else (4096, 256, 4, 8, 128)
    torch.manual_seed(0)
    model = TinyLM(vocab, d, layers).to(config.device)
    tokens = torch.randint(vocab, (batch, seq + 1), device=config.device)
    params = list(model.parameters())
    fused = config.device.type in ("cpu", "cuda")
    unclipped = torch.optim.AdamW(params, lr=1e-5, fused=fused)
    torch_clipped = torch.optim.AdamW(params, lr=1e-5, fused=fused)
    wrapped = clipopt.ClippedOptimizer(
        torch.optim.AdamW(params, lr=1e-5, fused=fused), max_norm=MAX_NORM
    )

    def train_step(step: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            model.zero_grad(set_to_none=True)
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            loss.backward()  # type: ignore[no-untyped-call]
            return step()

        return run

    def torch_clip_then_step() -> None:
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=torch_foreach(config.device))
        torch_clipped.step()

    contenders = {
        "unclipped": train_step(unclipped.step),
        "ClippedOptimizer": train_step(wrapped.step),
        "torch clip + step": train_step(torch_clip_then_step),
    }
    n_params = sum(p.numel() for p in params)
    case = f"TinyLM {n_params / 1e6:.1f}M params, batch {batch}x{seq}"
    return summarize("end_to_end", case, time_interleaved(contenders, config), "unclipped")


def relative_error(got: Tensor, exact: Tensor) -> float:
    return float((got.double() - exact).abs() / exact)


def bench_accuracy(config: Config) -> dict[str, float]:
    """Relative L2-norm error of one large float32 grad, against float64."""
    generator = torch.Generator().manual_seed(0)
    results = {}
    n = config.accuracy_numel
    cases = {
        "randn": torch.randn(n, generator=generator),
        "bf16-valued in [1, 2)": (torch.rand(n, generator=generator) + 1).bfloat16().float(),
    }
    for name, grad in cases.items():
        exact = grad.double().norm()
        grad = grad.to(config.device)
        results[f"{name}: clipopt.get_total_norm"] = relative_error(
            clipopt.get_total_norm([grad]).cpu(), exact
        )
        results[f"{name}: torch.nn.utils.get_total_norm"] = relative_error(
            torch.nn.utils.get_total_norm([grad]).cpu(), exact
        )
    return results


def _largest_allocation(fn: Callable[[], object]) -> int:
    """Bytes of the largest single allocation any op made while ``fn`` ran (CPU)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _peak_rss_growth(fn: Callable[[], object]) -> int | None:
    """Bytes the process's peak resident memory rose above its size before ``fn``.

    Linux only: writing 5 to ``/proc/self/clear_refs`` resets the peak (VmHWM).
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    before = _status_kib("VmRSS")
    fn()
    return 1024 * max(0, _status_kib("VmHWM") - before)


def _peak_cuda_growth(fn: Callable[[], object], device: torch.device) -> int:
    """Bytes the peak of allocated CUDA memory rose above what was allocated before ``fn``."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)


def bench_memory(config: Config) -> dict[str, Any]:
    """Peak memory of a step, bare vs clipped, on the step layout (CPU and CUDA)."""
    if config.device.type not in ("cpu", "cuda"):
        return {}
    params = make_params(config.step_shapes(), torch.float32, config.device)
    bare = torch.optim.AdamW(params, lr=1e-6, fused=True)
    wrapped = clipopt.ClippedOptimizer(
        torch.optim.AdamW(params, lr=1e-6, fused=True), max_norm=MAX_NORM
    )
    torch_clipped = torch.optim.AdamW(params, lr=1e-6, fused=True)

    def torch_clip_then_step() -> None:
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=torch_foreach(config.device))
        torch_clipped.step()

    for step in (bare.step, wrapped.step, torch_clip_then_step):
        step()  # create the optimizer state outside the measurement
    result: dict[str, Any] = {
        "tensors": len(params),
        "grad_bytes": sum(p.numel() * p.element_size() for p in params),
    }
    for name, step in (
        ("bare fused AdamW", bare.step),
        ("ClippedOptimizer(fused AdamW)", wrapped.step),
        ("torch clip + fused AdamW", torch_clip_then_step),
    ):
        if config.cuda:
            result[name] = {"peak_cuda_growth_bytes": _peak_cuda_growth(step, config.device)}
        else:
            result[name] = {
                "peak_rss_growth_bytes": _peak_rss_growth(step),
                "largest_allocation_bytes": _largest_allocation(step),
            }
    return result


def _syncs_counted(fn: Callable[[], object]) -> int:
    """How many synchronizing CUDA calls ``fn`` makes: each warns in sync debug mode."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


def bench_host_syncs(config: Config) -> dict[str, int]:
    """Synchronizing CUDA calls in one call of each, after a warm-up call (CUDA only).

    The control reads a norm with ``.item()``: it must count at least one, or the
    counter is not live and the zeros mean nothing.
    """
    if not config.cuda:
        return {}
    params = make_params(transformer_shapes(True), torch.float32, config.device)
    grads = [p.grad for p in params if p.grad is not None]

    def wrapped(make: Callable[[], torch.optim.Optimizer], **kwargs: Any) -> Callable[[], object]:
        return clipopt.ClippedOptimizer(make(), max_norm=MAX_NORM, **kwargs).step

    def adamw() -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-6, fused=True)

    def sgd() -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-6, momentum=0.9, foreach=True)

    calls: Contenders = {
        "clipopt.clip_grad_norm_": lambda: clipopt.clip_grad_norm_(params, MAX_NORM),
        "ClippedOptimizer(fused AdamW)": wrapped(adamw),
        "ClippedOptimizer(fused AdamW), nonfinite='skip'": wrapped(adamw, nonfinite="skip"),
        "ClippedOptimizer(foreach SGD)": wrapped(sgd),
        "control: get_total_norm(...).item()": lambda: clipopt.get_total_norm(grads).item(),
    }
    counts = {}
    for name, call in calls.items():
        call()  # buffers, optimizer state and counters are made on the first call
        counts[name] = _syncs_counted(call)
    return counts


# ---------------------------------------------------------------- report


SECTIONS: dict[str, Callable[[Config], list[Row]]] = {
    "clip": bench_clip,
    "step": bench_steps,
    "amp": bench_amp,
    "end_to_end": bench_end_to_end,
    "host": host.bench_host_cost,
    "small_model": host.bench_small_model,
    "compiled": host.bench_compiled,
    "compiled_recipe": compiled.bench_recipes,
}
DEFAULT_SECTIONS = [name for name in SECTIONS if name != "compiled"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per contender")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--only",
        default=",".join(DEFAULT_SECTIONS),
        help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every section, print the table and targets, write JSON; return the results."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False on this machine")
    config = Config(
        quick=args.quick,
        repeats=args.repeats or (3 if args.quick else 21),
        warmup=1 if args.quick else 3,
        device=device,
    )
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"--only: unknown sections {unknown}; choose from {list(SECTIONS)}")
    everything = set(DEFAULT_SECTIONS) <= set(only)
    rows = [row for name in SECTIONS if name in only for row in SECTIONS[name](config)]
    accuracy = bench_accuracy(config) if everything else {}
    memory = bench_memory(config) if everything else {}
    release(config.device)
    syncs = bench_host_syncs(config) if everything else {}
    # The CPU's targets name CPU costs (torch's slow CPU inf norm, a cache-bound step);
    # on CUDA only the GPU check's own targets are checked.
    if config.cuda:
        targets = cuda_targets(rows, memory, syncs, config.step_layout) if everything else []
    else:
        targets = check_targets(rows, memory, config.step_layout, config.quick)
        targets += compiled.recipe_targets(rows, config.step_layout)
    results: dict[str, Any] = {
        "machine": machine(),
        "config": {
            "quick": config.quick,
            "repeats": config.repeats,
            "device": str(config.device),
            "step_layout": config.step_layout,
            "step_params": sum(math.prod(s) for s in config.step_shapes()),
        },
        "rows": [dataclasses.asdict(r) for r in rows],
        "accuracy_relative_error": accuracy,
        "memory": memory,
        "host_syncs": syncs,
        "targets": [{**dataclasses.asdict(t), "held": t.held} for t in targets],
    }
    print(format_table(rows))
    print("\naccuracy (relative error of the L2 norm, vs float64):")
    for name, error in accuracy.items():
        print(f"  {name:<48} {error:.1e}")
    if syncs:
        print("\nsynchronizing CUDA calls in one call (after a warm-up call):")
        for name, count in syncs.items():
            print(f"  {name:<56} {count}")
    print("\ntargets:")
    for t in targets:
        sign = "<=" if t.at_most else ">="
        print(f"  {'held' if t.held else 'MISSED':<7} {t.name:<62} {t.value:7.2f} {sign} {t.limit}")
    if everything:
        results["rules"] = rules.run_section(config)
    own = RESULTS_DIR / results_name(config.quick, config.device) if everything else None
    write_results(results, own, args.json)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
