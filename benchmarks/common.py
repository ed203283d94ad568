"""The benchmark's shared harness: the layouts, timing interleaved contenders, and
the results' table and JSON. Every section of ``benchmarks.run``, ``host`` and ``rules``
times through it."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

RESULTS_DIR = Path(__file__).resolve().parent / "results"


MAX_NORM = 1.0


SHRINK = 0.97


UNCLIPPED_CASE = "transformer float32 p=2, max_norm not reached"  # the CPU layout's


FOLDED_FLOOR = "fused AdamW: floor (sum, step with grad_scale)"


SCALED_STEP = "fused AdamW: step with grad_scale alone"


Shape = tuple[int, ...]


Contenders = dict[str, Callable[[], object]]


@dataclasses.dataclass
class Config:
    """Sizes and repeats: the full run, or a quick one that only checks the script."""

    quick: bool
    repeats: int
    warmup: int
    device: torch.device

    @property
    def accuracy_numel(self) -> int:
        return 100_000 if self.quick else 40_000_000

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def layouts(self) -> dict[str, Callable[[bool], list[Shape]]]:
        """The clip section's layouts; the first is the one the step sections use."""
        return CUDA_LAYOUTS if self.cuda else LAYOUTS

    @property
    def step_layout(self) -> str:
        return next(iter(self.layouts))

    def step_shapes(self) -> list[Shape]:
        return self.layouts[self.step_layout](self.quick)


@dataclasses.dataclass
class Row:
    """One contender in one case: medians and spread in milliseconds, and its ratio."""

    section: str
    case: str
    contender: str
    median_ms: float
    min_ms: float
    max_ms: float
    ratio: float | None = None
    ratio_to: str | None = None


@dataclasses.dataclass
class Target:
    """A goal from the performance issue, checked against this run's numbers."""

    name: str
    value: float
    limit: float
    at_most: bool

    @property
    def held(self) -> bool:
        return self.value <= self.limit if self.at_most else self.value >= self.limit


def _transformer(d: int, vocab: int, blocks: int) -> list[Shape]:
    """An embedding, pre-norm blocks (12 * d * d + 13 * d parameters each), a final norm."""
    shapes: list[Shape] = [(vocab, d)]
    for _ in range(blocks):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,)]  # norm, attention
        shapes += [(d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]  # norm, MLP
    return [*shapes, (d,), (d,)]


def transformer_shapes(quick: bool) -> list[Shape]:
    """An embedding, 6 pre-norm blocks and a final norm: 75 tensors, 23.1M parameters."""
    return _transformer(32, 64, 2) if quick else _transformer(512, 8192, 6)


def transformer_1b_shapes(quick: bool) -> list[Shape]:
    """The GPU layout: a 50304-token embedding, 18 blocks of width 2048 and a final norm,
    219 tensors, 1,009,475,584 parameters (float32 params, grads and AdamW's two moments:
    16 GB). Quick: the quick transformer, to check the script."""
    return transformer_shapes(True) if quick else _transformer(2048, 50304, 18)


def many_small_shapes(quick: bool) -> list[Shape]:
    """2000 tensors of 1 to 999 elements (1M parameters), vectors and narrow matrices."""
    generator = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 1000, (50 if quick else 2000,), generator=generator).tolist()
    return [(n,) if i % 2 else (n // 10 + 1, 10) for i, n in enumerate(sizes)]


def few_large_shapes(quick: bool) -> list[Shape]:
    """4 tensors of 10M elements."""
    return [(10_000 if quick else 10_000_000,)] * 4


LAYOUTS: dict[str, Callable[[bool], list[Shape]]] = {
    "transformer": transformer_shapes,
    "many_small": many_small_shapes,
    "few_large": few_large_shapes,
}


CUDA_LAYOUTS: dict[str, Callable[[bool], list[Shape]]] = {
    "transformer_1b": transformer_1b_shapes,
    "many_small": many_small_shapes,
    "few_large": few_large_shapes,
}


def make_params(shapes: Sequence[Shape], dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    """Parameters with random grads whose total L2 norm is well above ``MAX_NORM``.

    On CUDA the numbers are drawn there (a billion of them on the CPU would take longer
    than the benchmark), by a CUDA generator: other numbers than on the CPU.
    """
    if device.type == "cuda":
        on_device = torch.Generator(device).manual_seed(0)
        params: list[Tensor] = []
        for shape in shapes:
            param = nn.Parameter(torch.randn(shape, generator=on_device, device=device).to(dtype))
            param.grad = torch.randn(shape, generator=on_device, device=device).to(dtype)
            params.append(param)
        return params
    generator = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        param = nn.Parameter(torch.randn(shape, generator=generator).to(device, dtype))
        param.grad = torch.randn(shape, generator=generator).to(device, dtype)
        params.append(param)
    return params


def release(device: torch.device) -> None:
    """Hand the memory of the case just finished back before the next one (CUDA)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(contenders: Contenders, config: Config) -> dict[str, list[float]]:
    """Seconds per call of each contender, run in a rotating order over the repeats."""
    names = list(contenders)
    for name in names:
        for _ in range(config.warmup):
            contenders[name]()
    _sync(config.device)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(config.repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            contenders[name]()
            _sync(config.device)
            samples[name].append(time.perf_counter() - start)
    return samples


def summarize(
    section: str, case: str, samples: dict[str, list[float]], baseline: str | None
) -> list[Row]:
    """One row per contender; ``ratio`` is its median over ``baseline``'s median."""
    medians = {name: statistics.median(times) for name, times in samples.items()}
    rows = []
    for name, times in samples.items():
        ratio = medians[name] / medians[baseline] if baseline else None
        rows.append(
            Row(
                section,
                case,
                name,
                1e3 * medians[name],
                1e3 * min(times),
                1e3 * max(times),
                ratio,
                baseline,
            )
        )
    return rows


class ShrinkingMaxNorm:
    """A ``max_norm`` 3% below the last one handed out, so every timed call clips.

    Contenders share the grads, and each clip leaves their norm at the ``max_norm`` it
    was given: a fixed ``max_norm`` would, from the second call on, give a coefficient
    of exactly 1, which clipopt's CPU scale skips and torch's does not. Shrinking by 3%
    a call keeps every coefficient near 0.97 and the grads far from subnormal numbers
    over a few hundred calls.
    """

    def __init__(self, start: float = MAX_NORM) -> None:
        self.value = start

    @classmethod
    def below_norm_of(cls, grads: list[Tensor], norm_type: float) -> ShrinkingMaxNorm:
        """Starting just below the grads' current ``norm_type`` norm (read here, untimed)."""
        norms = torch.stack([torch.linalg.vector_norm(g.double(), norm_type) for g in grads])
        return cls(torch.linalg.vector_norm(norms, norm_type).item())

    def __call__(self) -> float:
        self.value *= SHRINK
        return self.value


def _grads_and_flat_copy(params: list[Tensor]) -> tuple[list[Tensor], Tensor]:
    """The grads, and one buffer holding a copy of their bytes, for the floors."""
    grads = [p.grad for p in params if p.grad is not None]
    return grads, torch.cat([g.reshape(-1) for g in grads])


def results_name(quick: bool, device: torch.device) -> str:
    """``latest.json`` / ``quick.json`` on the CPU; other devices add theirs to the name."""
    stem = "quick" if quick else "latest"
    return f"{stem}.json" if device.type == "cpu" else f"{stem}-{device.type}.json"


def format_table(rows: list[Row]) -> str:
    lines = [
        f"{'section':<11} {'case':<36} {'contender':<32} {'median ms':>10} "
        f"{'min-max ms':>17} {'ratio':>7}  to"
    ]
    for r in rows:
        spread = f"{r.min_ms:.2f}-{r.max_ms:.2f}"
        ratio = f"{r.ratio:.2f}" if r.ratio is not None else ""
        lines.append(
            f"{r.section:<11} {r.case:<36} {r.contender:<32} {r.median_ms:>10.2f} "
            f"{spread:>17} {ratio:>7}  {r.ratio_to or ''}"
        )
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cuda_runtime": torch.version.cuda,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_results(results: dict[str, Any], *paths: Path | None) -> None:
    """``results`` as JSON at each path given (None: left out), results dir made first."""
    RESULTS_DIR.mkdir(exist_ok=True)
    for path in paths:
        if path is not None:
            path.write_text(json.dumps(results, indent=2))


class TinyLM(nn.Module):
    """A small pre-norm transformer language model, for the end-to-end step."""

    def __init__(self, vocab: int, d: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        block = nn.TransformerEncoderLayer(
            d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        logits: Tensor = self.head(self.blocks(self.embed(tokens)))
        return logits
