"""Render a benchmark JSON (from ``python -m benchmarks.run --json PATH``) as the
Markdown tables of docs/benchmarks.md: ``python -m benchmarks.markdown PATH``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def results_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| section | case | contender | median ms | min-max ms | ratio | to |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for row in rows:
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}"
        lines.append(
            f"| {row['section']} | {row['case']} | {row['contender']} | {row['median_ms']:.2f} "
            f"| {row['min_ms']:.2f}-{row['max_ms']:.2f} | {ratio} | {row['ratio_to'] or ''} |"
        )
    return "\n".join(lines)


def accuracy_table(errors: dict[str, float]) -> str:
    lines = ["| accuracy (40M float32 elements) | relative error |", "|---|---:|"]
    lines += [f"| {name} | {error:.1e} |" for name, error in errors.items()]
    return "\n".join(lines)


def targets_table(targets: list[dict[str, Any]]) -> str:
    lines = ["| target | this run | goal | held |", "|---|---:|---:|---|"]
    for target in targets:
        goal = f"{'<=' if target['at_most'] else '>='} {target['limit']:g}"
        held = "yes" if target["held"] else "no"
        lines.append(f"| {target['name']} | {target['value']:.2f} | {goal} | {held} |")
    return "\n".join(lines)


def render(results: dict[str, Any]) -> str:
    machine = results["machine"]
    config = results["config"]
    gpu = ""
    if str(config.get("device", "cpu")).startswith("cuda"):
        gpu = f"GPU: {machine.get('cuda')} (CUDA {machine.get('cuda_runtime')}), "
    header = (
        f"{gpu}Machine: {machine['cpu']}, {machine['cpu_count']} cores, "
        f"{machine['torch_threads']} torch threads, torch {machine['torch']}, Python "
        f"{machine['python']}; {machine['date_utc']}, {config['repeats']} interleaved repeats."
    )
    tables = [
        results_table(results["rows"]),
        accuracy_table(results["accuracy_relative_error"]),
        targets_table(results["targets"]),
    ]
    return "\n\n".join([header, *tables]) + "\n"


if __name__ == "__main__":
    print(render(json.loads(Path(sys.argv[1]).read_text())), end="")
