"""Clip-rule benchmark rows: what a rule adds to a clipped step, against autoclip, and
whether 100,000 steps grow memory.

Run ``python -m benchmarks.rules`` for these rows alone (``--quick`` for tiny sizes;
results in ``benchmarks/results/rules.json``, ``rules-quick.json``); ``python -m
benchmarks.run`` runs them too, after its own sections. Sections:

- ``rule step``: a ``ClippedOptimizer(fused AdamW)`` step on the transformer layout with
  each rule, against the same step with a fixed ``max_norm`` (every call of that one
  clips), plus
  ``track_tensor_norms=True``. AutoClip keeps ``history=10_000`` norms; its cost does not
  depend on how many are filled (its sorted copy is the whole history, unfilled slots
  ``+inf``), so none are prefilled. The per-tensor rules (their coefficients cannot
  fold into the fused kernel) are also rowed against their floor: one per-tensor norm
  read of the grads, one ``torch._foreach_mul_`` by per-tensor coefficients and the
  fused step without ``grad_scale``.
- ``rule vs autoclip``: on the transformer and many_small layouts, the clip alone (the
  inner step a no-op) of ``AutoClip(percentile=90, history=1000, per_tensor=True)`` against
  ``autoclip.torch.QuantileClip`` with its defaults (``quantile=0.9``,
  ``history_length=1000``, ``global_threshold=False``: one history per parameter), at
  step 3,000: both histories are prefilled with the same 1,000 norms per parameter (the
  last 1,000 of 3,000 steps, which is all either keeps), then steps are timed, beside
  the memory floor of any clip (one ``sum`` and one ``mul_`` over a buffer of the same
  bytes): autoclip / floor bounds what autoclip / clipopt can reach on the machine.
- ``rule memory``: resident memory, live Python objects and the rule's state bytes after
  1,000 and after 100,000 steps of a tiny model (500 and 2,000 with ``--quick``;
  ``--no-memory`` leaves these out).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import clipopt
from benchmarks.common import (
    LAYOUTS,
    MAX_NORM,
    RESULTS_DIR,
    SHRINK,
    Config,
    Contenders,
    Row,
    ShrinkingMaxNorm,
    Target,
    format_table,
    machine,
    make_params,
    summarize,
    time_interleaved,
    transformer_shapes,
    write_results,
)

FIXED = "fixed max_norm"
HISTORY = 10_000
AUTOCLIP_STEP = 3_000
AUTOCLIP_HISTORY = 1_000  # QuantileClip's default history_length
OURS_VS_AUTOCLIP = "clipopt AutoClip(per_tensor=True)"
THEIRS = "autoclip QuantileClip (per parameter)"
CLIP_FLOOR = "floor (sum, mul_ of one buffer)"
PER_TENSOR_FLOOR = "floor: per-tensor norms, _foreach_mul_, fused AdamW"
AUTOCLIP_LAYOUTS = ("transformer", "many_small")  # the target is the transformer's

RuleFactory = Callable[[], "float | clipopt.ClipRule"]
STEP_RULES: dict[str, Callable[[], clipopt.ClipRule]] = {
    "AutoClip(history=10_000)": lambda: clipopt.AutoClip(10.0, HISTORY),
    "AutoClip(history=10_000, per_tensor)": lambda: clipopt.AutoClip(
        10.0, HISTORY, per_tensor=True
    ),
    "ZClip": lambda: clipopt.ZClip(),
    "AdaGC": lambda: clipopt.AdaGC(),
    "AGC": lambda: clipopt.AGC(),
}
PER_TENSOR_RULES = ("AutoClip(history=10_000, per_tensor)", "AdaGC", "AGC")
MEMORY_RULES: dict[str, Callable[[], tuple[clipopt.ClipRule | float, clipopt.SpikeSkip | None]]] = {
    "AutoClip(history=10_000)": lambda: (clipopt.AutoClip(10.0, HISTORY), None),
    "AutoClip(per_tensor, history=1000)": lambda: (
        clipopt.AutoClip(10.0, 1000, per_tensor=True),
        None,
    ),
    "ZClip": lambda: (clipopt.ZClip(), None),
    "SpikeSkip(window=128)": lambda: (1.0, clipopt.SpikeSkip()),
    "AdaGC": lambda: (clipopt.AdaGC(), None),
    "AGC": lambda: (clipopt.AGC(), None),
}


class NoStep(torch.optim.Optimizer):
    """An inner optimizer whose step does nothing: what remains of a clipped step is the
    clip (measure, rule, scale)."""

    def __init__(self, params: list[Tensor]) -> None:
        super().__init__(params, {})

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        return None


# ---------------------------------------------------------------- rule step


def per_tensor_floor(
    params: list[Tensor], optimizer: torch.optim.Optimizer, max_norm: ShrinkingMaxNorm
) -> Callable[[], None]:
    """The least a rule with a coefficient per grad can cost: one ``torch._foreach_norm``
    of the grads, one ``torch._foreach_mul_`` of them by a 0-dim coefficient each, and
    the fused step without ``grad_scale``. The coefficients are ``SHRINK``, so the
    shared grads shrink as under the clipped contenders; it takes its turn of
    ``max_norm`` as they do."""
    grads = [p.grad for p in params if p.grad is not None]
    coefficients = list(torch.full((len(grads),), SHRINK, device=grads[0].device).unbind())

    def run() -> None:
        max_norm()
        torch._foreach_norm(grads, 2.0)
        torch._foreach_mul_(grads, coefficients)
        optimizer.step()

    return run


def rule_step_contenders(params: list[Tensor]) -> Contenders:
    """Clipped fused AdamW steps: a fixed (shrinking) max_norm, each rule, tracking, and
    the floor of the per-tensor rules."""
    max_norm = ShrinkingMaxNorm()  # the contenders share the grads: every call clips

    def adamw() -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-6, fused=True)

    fixed = clipopt.ClippedOptimizer(adamw(), max_norm=MAX_NORM)
    tracked = clipopt.ClippedOptimizer(adamw(), max_norm=MAX_NORM, track_tensor_norms=True)

    def step(opt: clipopt.ClippedOptimizer) -> Callable[[], None]:
        def run() -> None:
            opt.param_groups[0]["clip_max_norm"] = max_norm()
            opt.step()

        return run

    def ruled(opt: clipopt.ClippedOptimizer) -> Callable[[], None]:
        def run() -> None:
            max_norm()  # takes its turn, so the fixed contenders' threshold keeps shrinking
            opt.step()

        return run

    contenders: Contenders = {FIXED: step(fixed), "fixed + track_tensor_norms": step(tracked)}
    for name, make in STEP_RULES.items():
        contenders[name] = ruled(clipopt.ClippedOptimizer(adamw(), max_norm=make()))
    spikes = clipopt.ClippedOptimizer(adamw(), MAX_NORM, skip_spikes=clipopt.SpikeSkip())
    contenders["fixed + SpikeSkip"] = step(spikes)
    contenders[PER_TENSOR_FLOOR] = per_tensor_floor(params, adamw(), max_norm)
    return contenders


def bench_rule_steps(config: Config) -> list[Row]:
    params = make_params(transformer_shapes(config.quick), torch.float32, config.device)
    samples = time_interleaved(rule_step_contenders(params), config)
    case = "transformer float32, fused AdamW"
    floored = {name: samples[name] for name in (*PER_TENSOR_RULES, PER_TENSOR_FLOOR)}
    return summarize("rule step", case, samples, FIXED) + summarize(
        "rule step", f"{case}, per-tensor rules / their floor", floored, PER_TENSOR_FLOOR
    )


# ---------------------------------------------------------------- against autoclip


def _history(grad: Tensor, generator: torch.Generator) -> Tensor:
    """1,000 past norms of one grad: its norm times factors in [0.2, 1), so that the 90th
    percentile is below it and the first clips scale every grad (later ones multiply by
    a coefficient near 1: both clips multiply every grad whatever it is)."""
    scale = torch.rand(AUTOCLIP_HISTORY, generator=generator, dtype=torch.float64) * 0.8 + 0.2
    return (torch.linalg.vector_norm(grad.double()) * scale).to(grad.dtype)


def autoclip_pair(
    config: Config, layout: str = "transformer"
) -> tuple[Contenders, list[Tensor], list[Tensor]]:
    """Both clips on their own copies of the same grads of ``layout``, histories
    prefilled alike; and those two lists of parameters (ours, theirs)."""
    from autoclip.torch import QuantileClip

    shapes = LAYOUTS[layout](config.quick)
    ours_params = make_params(shapes, torch.float32, config.device)
    their_params = make_params(shapes, torch.float32, config.device)
    generator = torch.Generator().manual_seed(1)
    histories = [_history(p.grad, generator).to(config.device) for p in ours_params]  # type: ignore[arg-type]

    rule = clipopt.AutoClip(90.0, AUTOCLIP_HISTORY, per_tensor=True)
    ours = clipopt.ClippedOptimizer(NoStep(ours_params), max_norm=rule)
    count = torch.full((len(histories),), AUTOCLIP_STEP, dtype=torch.int64, device=config.device)
    prefilled = {"buffer": torch.stack(histories), "count": count}
    rule.load_state_dict({**rule.state_dict(), "state": prefilled})

    theirs = QuantileClip(their_params)  # quantile=0.9, history_length=1000, per parameter
    for param, history in zip(their_params, histories, strict=True):
        theirs.state[param]["history"] = history.clone()
    flat = torch.cat([p.grad.reshape(-1) for p in ours_params])  # type: ignore[union-attr]
    shrink = torch.tensor(0.97, device=flat.device)

    def floor() -> object:
        total = flat.sum()
        return flat.mul_(shrink), total

    contenders = {OURS_VS_AUTOCLIP: ours.step, THEIRS: theirs.step, CLIP_FLOOR: floor}
    return contenders, ours_params, their_params


def bench_autoclip(config: Config) -> list[Row]:
    rows = []
    for layout in AUTOCLIP_LAYOUTS:
        samples = time_interleaved(autoclip_pair(config, layout)[0], config)
        case = f"{layout} float32, clip only, at step {AUTOCLIP_STEP:,}"
        rows += summarize("rule vs autoclip", case, samples, THEIRS)
    return rows


# ---------------------------------------------------------------- memory


def _rss_bytes() -> int | None:
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return 1024 * int(line.split()[1])
    return None


def state_bytes(opt: clipopt.ClippedOptimizer) -> int:
    """Bytes of every tensor in the rule's and SpikeSkip's state dicts."""
    entry = opt.state_dict()["clip"]
    found = 0
    stack: list[Any] = [entry.get("rule"), entry.get("skip_spikes")]
    while stack:
        item = stack.pop()
        if isinstance(item, Tensor):
            found += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found


def memory_after(
    make: Callable[[], Any], checkpoints: Sequence[int]
) -> list[dict[str, int | None]]:
    """RSS, live Python objects and rule-state bytes after each number of steps."""
    rule, spikes = make()
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((8, 4), (4,), (3, 3))]
    pool = [[torch.randn(p.shape, generator=generator) for p in params] for _ in range(97)]
    for p in params:
        p.grad = torch.zeros_like(p)
    inner = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    opt = clipopt.ClippedOptimizer(inner, max_norm=rule, skip_spikes=spikes)
    seen: list[dict[str, int | None]] = []
    done = 0
    for target in checkpoints:
        while done < target:
            for p, g in zip(params, pool[done % len(pool)], strict=True):
                p.grad.copy_(g)  # type: ignore[union-attr]
            opt.step()
            done += 1
        held = state_bytes(opt)  # first: a first state_dict() call makes objects of its own
        gc.collect()
        seen.append(
            {
                "steps": done,
                "rss_bytes": _rss_bytes(),
                "python_objects": len(gc.get_objects()),
                "state_bytes": held,
            }
        )
    return seen


def bench_rule_memory(config: Config) -> dict[str, Any]:
    checkpoints = (500, 2_000) if config.quick else (1_000, 100_000)
    return {name: memory_after(make, checkpoints) for name, make in MEMORY_RULES.items()}


# ---------------------------------------------------------------- targets and main


def _median(rows: list[Row], section: str, contender: str, case: str = "") -> float:
    return next(
        r.median_ms
        for r in rows
        if (r.section, r.contender) == (section, contender) and r.case.startswith(case)
    )


def rule_targets(rows: list[Row], memory: dict[str, Any]) -> list[Target]:
    """Each rule's step over the fixed one (<= 1.05), AutoClip per tensor against
    autoclip (>= 10x), and no growth of RSS (<= 1 MiB) or objects (<= 0) from the first
    checkpoint to the last."""
    fixed = _median(rows, "rule step", FIXED)
    targets = [
        Target(f"rule step: {name} / {FIXED}", _median(rows, "rule step", name) / fixed, 1.05, True)
        for name in [*STEP_RULES, "fixed + SpikeSkip", "fixed + track_tensor_norms"]
    ]
    targets.append(
        Target(
            f"clip at step {AUTOCLIP_STEP:,}: autoclip / clipopt (per tensor)",
            _median(rows, "rule vs autoclip", THEIRS, "transformer")
            / _median(rows, "rule vs autoclip", OURS_VS_AUTOCLIP, "transformer"),
            10.0,
            at_most=False,
        )
    )
    targets.append(
        Target(
            "  what limits it here: autoclip / the floor of any clip",
            _median(rows, "rule vs autoclip", THEIRS, "transformer")
            / _median(rows, "rule vs autoclip", CLIP_FLOOR, "transformer"),
            10.0,
            at_most=False,
        )
    )
    for name, (first, last) in ((n, (m[0], m[-1])) for n, m in memory.items()):
        if first["rss_bytes"] is not None:
            growth = (last["rss_bytes"] - first["rss_bytes"]) / 2**20
            targets.append(Target(f"memory {name}: RSS growth (MiB)", growth, 1.0, True))
        objects = last["python_objects"] - first["python_objects"]
        targets.append(Target(f"memory {name}: Python objects grown", objects, 0, True))
        grown = last["state_bytes"] - first["state_bytes"]
        targets.append(Target(f"memory {name}: state bytes grown", grown, 0, True))
    return targets


def bench_rules(
    config: Config, memory_rows: bool = True
) -> tuple[list[Row], dict[str, Any], list[Target]]:
    """Every section of this module: rows, the memory record, the targets."""
    rows = bench_rule_steps(config) + bench_autoclip(config)
    memory = bench_rule_memory(config) if memory_rows else {}
    return rows, memory, rule_targets(rows, memory)


def print_targets(targets: list[Target]) -> None:
    for t in targets:
        sign = "<=" if t.at_most else ">="
        print(f"  {'held' if t.held else 'MISSED':<7} {t.name:<62} {t.value:7.2f} {sign} {t.limit}")


def run_section(config: Config, memory_rows: bool = True) -> dict[str, Any]:
    """Run, print and return this module's rows, memory record and targets."""
    rows, memory, targets = bench_rules(config, memory_rows)
    print("\nclip rules:")
    print(format_table(rows))
    print("\nrule memory (after each number of steps):")
    for name, seen in memory.items():
        print(f"  {name:<36} {seen}")
    print("\nrule targets:")
    print_targets(targets)
    return {
        "rows": [dataclasses.asdict(r) for r in rows],
        "memory": memory,
        "targets": [{**dataclasses.asdict(t), "held": t.held} for t in targets],
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """These rows alone, on the CPU; results also in ``benchmarks/results/rules*.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per contender")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--no-memory", action="store_true", help="timed rows only")
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 21)
    config = Config(args.quick, repeats, 1 if args.quick else 3, torch.device("cpu"))
    results = {"machine": machine(), "config": {"quick": config.quick, "repeats": repeats}}
    results["rules"] = run_section(config, memory_rows=not args.no_memory)
    own = RESULTS_DIR / ("rules-quick.json" if config.quick else "rules.json")
    write_results(results, own, args.json)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
