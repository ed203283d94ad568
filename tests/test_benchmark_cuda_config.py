"""The benchmark's CUDA configuration, checked on the CPU without allocating it.

``make gpu-check`` runs ``python -m benchmarks.run --device cuda`` on a GPU machine that
may be lent for minutes: a layout that does not add up, a target that looks for a row
under the wrong name, or results written over the CPU's file must fail here first.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from benchmarks import common, markdown, run, targets

CUDA = torch.device("cuda")  # a device object only: nothing is allocated on it here
H200_BYTES = 139 * 2**30


def _numel(shapes: list[common.Shape]) -> int:
    return sum(math.prod(shape) for shape in shapes)


def test_the_1b_layout_holds_a_billion_parameters() -> None:
    shapes = common.transformer_1b_shapes(quick=False)
    assert len(shapes) == 1 + 18 * 12 + 2
    assert _numel(shapes) == 1_009_475_584
    assert abs(_numel(shapes) / 1e9 - 1) < 0.01
    d, vocab = 2048, 50304
    assert shapes[0] == (vocab, d)
    assert _numel(shapes) == vocab * d + 18 * (12 * d * d + 13 * d) + 2 * d


def test_the_1b_steps_fit_on_one_h200() -> None:
    """The step section's optimizers all live at once: fused AdamW x 5 (bare, torch's
    clip, ClippedOptimizer, the two floors: two moments each) and foreach SGD x 3 (one
    momentum each), over float32 params and grads."""
    n = _numel(common.transformer_1b_shapes(quick=False))
    params_and_grads = 2 * 4 * n
    state = (5 * 2 + 3 * 1) * 4 * n
    assert params_and_grads + state < 0.8 * H200_BYTES


def test_the_cuda_config_uses_the_1b_layout_and_the_cpu_one_does_not() -> None:
    cuda = common.Config(quick=False, repeats=1, warmup=0, device=CUDA)
    cpu = common.Config(quick=False, repeats=1, warmup=0, device=torch.device("cpu"))
    assert cuda.step_layout == "transformer_1b" and list(cuda.layouts)[1:] == [
        "many_small",
        "few_large",
    ]
    assert _numel(cuda.step_shapes()) == 1_009_475_584
    assert cpu.layouts is common.LAYOUTS and cpu.step_layout == "transformer"
    assert cpu.step_shapes() == common.transformer_shapes(quick=False)
    quick = common.Config(quick=True, repeats=1, warmup=0, device=CUDA)
    assert quick.step_shapes() == common.transformer_shapes(quick=True)


def test_cuda_results_do_not_overwrite_the_cpu_ones() -> None:
    names = {
        common.results_name(quick, device)
        for quick in (False, True)
        for device in (torch.device("cpu"), CUDA)
    }
    assert names == {"latest.json", "quick.json", "latest-cuda.json", "quick-cuda.json"}


def test_torch_contenders_take_the_foreach_path_on_cuda_only() -> None:
    assert run.torch_foreach(CUDA) is True
    assert run.torch_foreach(torch.device("cpu")) is None  # torch's own default


def test_cuda_targets_find_every_row_they_read() -> None:
    """The GPU targets read rows by name: run the clip and step sections at the quick
    size on the CPU and check every target finds its rows and every sync count its
    target (the control at least one, the others none)."""
    config = common.Config(quick=True, repeats=1, warmup=0, device=torch.device("cpu"))
    rows = run.bench_clip(config) + run.bench_steps(config)
    syncs = {"ClippedOptimizer(fused AdamW)": 0, "control: .item()": 1}
    memory = {
        "tensors": 75,
        "bare fused AdamW": {"peak_cuda_growth_bytes": 1000},
        "ClippedOptimizer(fused AdamW)": {"peak_cuda_growth_bytes": 2000},
    }
    found = targets.cuda_targets(rows, memory, syncs, config.step_layout)
    by_name = {t.name: t for t in found}
    assert len(by_name) == 3 + len(syncs) + 1
    assert all(t.value > 0 and math.isfinite(t.value) for t in found[:3])
    assert by_name["cuda host syncs in one call: ClippedOptimizer(fused AdamW)"].held
    assert by_name["cuda host syncs counted, control: .item()"].held
    missed = targets.cuda_targets(rows, {}, {"x": 1, "control: y": 0}, config.step_layout)
    assert [t.held for t in missed[3:]] == [False, False]
    folded = next(t for t in found if t.name.endswith("ClippedOptimizer(fused AdamW) / floor"))
    assert folded.limit == 1.05 and folded.at_most
    assert run.bench_host_syncs(config) == {}


def test_asking_for_cuda_without_it_says_so() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    with pytest.raises(SystemExit, match=r"torch\.cuda\.is_available\(\) is False"):
        run.main(["--device", "cuda", "--quick"])


def test_markdown_names_the_gpu(tmp_path: Path) -> None:
    results = {
        "machine": {
            "cpu": "x",
            "cpu_count": 16,
            "torch_threads": 16,
            "torch": "2.13.0",
            "python": "3.11",
            "date_utc": "now",
            "cuda": "NVIDIA H200",
            "cuda_runtime": "12.8",
        },
        "config": {"quick": False, "repeats": 21, "device": "cuda"},
        "rows": [],
        "accuracy_relative_error": {},
        "targets": [],
    }
    assert markdown.render(results).startswith("GPU: NVIDIA H200 (CUDA 12.8), Machine: x")
    results["config"]["device"] = "cpu"  # type: ignore[index]
    assert markdown.render(results).startswith("Machine: x, 16 cores")
