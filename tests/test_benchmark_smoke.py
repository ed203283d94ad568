"""The benchmark keeps running: its quick mode, in-process, reports every section.

Structure only: speed is measured by ``python -m benchmarks.run``, never asserted here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import common, host, run
from benchmarks import compiled as recipes


@pytest.fixture(scope="module")
def quick_results(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[dict[str, Any], Path]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny sizes: threads only add scheduling noise on a busy machine
    try:
        path = tmp_path_factory.mktemp("bench") / "quick.json"
        every = ",".join(run.SECTIONS)
        yield run.main(["--quick", "--repeats", "2", "--only", every, "--json", str(path)]), path
    finally:
        torch.set_num_threads(threads)


def test_every_section_and_contender_is_reported(
    quick_results: tuple[dict[str, Any], Path],
) -> None:
    results, _ = quick_results
    rows = results["rows"]
    cases = {(r["section"], r["case"]) for r in rows}
    for layout in common.LAYOUTS:
        for dtype in ("float32", "bfloat16"):
            for p in ("2", "inf"):
                case = ("clip", f"{layout} {dtype} p={p}")
                assert case in cases
                contenders = {r["contender"] for r in rows if (r["section"], r["case"]) == case}
                limits = {run.WIDENING, run.FLOAT32_NORM}
                limit = limits if (dtype, p) == ("bfloat16", "2") else set()
                assert contenders == {"torch", "clipopt", "floor", *limit}
    step_contenders = {r["contender"] for r in rows if r["section"] == "step"}
    for optimizer in ("fused AdamW", "foreach SGD"):
        for kind in ("bare", "torch clip + step", "ClippedOptimizer"):
            assert f"{optimizer}: {kind}" in step_contenders
    unclipped = {r["contender"] for r in rows if r["case"] == common.UNCLIPPED_CASE}
    assert unclipped == {"torch", "clipopt", "floor (read)"}
    amp = {r["contender"] for r in rows if r["section"] == "amp step"}
    one = common.make_params([(3,)], torch.float32, torch.device("cpu"))
    assert amp == set(run.amp_contenders(one, torch.device("cpu")))
    e2e = {r["contender"] for r in rows if r["section"] == "end_to_end"}
    assert e2e == {"unclipped", "ClippedOptimizer", "torch clip + step"}
    host_cases = {r["case"] for r in rows if r["section"] == "host cost"}
    assert host_cases == {host.HOST_CASE}
    small = {(r["case"], r["contender"]) for r in rows if r["section"] == "small model"}
    assert small == {
        (host.SMALL_CASE, host.SMALL_TORCH),
        (host.SMALL_CASE, host.SMALL_WRAPPED),
        (host.FIRST_CASE, "first"),
        (host.FIRST_CASE, "later"),
    }
    compiled = {(r["case"], r["contender"]) for r in rows if r["section"] == "compiled step"}
    for layout in ("transformer", "many_small"):
        for kind in ("eager", "compiled"):
            for name in ("bare AdamW", "ClippedOptimizer(AdamW)"):
                assert (f"{layout} float32", f"{kind}: {name}") in compiled
    recipe = {(r["case"], r["contender"]) for r in rows if r["section"] == recipes.SECTION}
    for kind in recipes.KINDS:
        case = recipes.recipe_case("transformer", kind)
        for name in (
            recipes.BARE,
            recipes.TORCH_RECIPE,
            recipes.FLOORED,
            *recipes.CLIPPED.values(),
        ):
            assert (case, name) in recipe
    names = {t["name"] for t in results["targets"]}
    assert "many_small fp32: ClippedOptimizer's clip / floor" in names
    assert "GPT 2x64: ClippedOptimizer(AdamW) / torch clip + step" in names
    assert "step transformer bf16: ClippedOptimizer(fused AdamW) / folded floor" in names


def test_rows_hold_consistent_times_and_ratios(quick_results: tuple[dict[str, Any], Path]) -> None:
    results, _ = quick_results
    for row in results["rows"]:
        assert 0 < row["min_ms"] <= row["median_ms"] <= row["max_ms"] < math.inf
        if row["contender"] == row["ratio_to"]:
            assert row["ratio"] == 1.0
        assert row["ratio"] > 0


def test_accuracy_memory_and_targets_are_reported(
    quick_results: tuple[dict[str, Any], Path],
) -> None:
    results, _ = quick_results
    errors = results["accuracy_relative_error"]
    assert any(k.endswith("clipopt.get_total_norm") for k in errors)
    assert all(0 <= e < 1e-3 for e in errors.values())
    memory = results["memory"]
    assert memory["tensors"] == len(common.transformer_shapes(quick=True))
    for name in ("bare fused AdamW", "ClippedOptimizer(fused AdamW)", "torch clip + fused AdamW"):
        assert memory[name]["largest_allocation_bytes"] >= 0
        growth = memory[name]["peak_rss_growth_bytes"]
        assert growth is None or growth >= 0
    names = [t["name"] for t in results["targets"]]
    recipe = [n for n in names if n.startswith("compiled ")]
    assert len(recipe) == len(recipes.KINDS) * len(recipes.CLIPPED) * 3
    clip_cases = {r["case"] for r in results["rows"] if r["section"] == "clip"}
    # one per clip case; the inf-norm's lead, the step, two folded steps, end to end,
    # three of host cost, two of the small model; and memory where measured
    assert len(names) - len(recipe) - len(clip_cases) in (10, 11)
    assert all(isinstance(t["held"], bool) for t in results["targets"])


def test_json_written_where_asked_and_in_results_dir(
    quick_results: tuple[dict[str, Any], Path],
) -> None:
    results, path = quick_results
    written = json.loads(path.read_text())
    assert written == json.loads(json.dumps(results))
    assert json.loads((common.RESULTS_DIR / "quick.json").read_text())["config"]["quick"] is True
    assert results["machine"]["torch"] == torch.__version__


def test_markdown_renders_every_row_and_target(
    quick_results: tuple[dict[str, Any], Path],
) -> None:
    from benchmarks import markdown

    _, path = quick_results
    results = json.loads(path.read_text())
    page = markdown.render(results)
    table_rows = [line for line in page.splitlines() if line.startswith("| ")]
    headers = 3  # one header line per table
    expected = len(results["rows"]) + len(results["accuracy_relative_error"])
    assert len(table_rows) == headers + expected + len(results["targets"])
    for target in results["targets"]:
        assert f"| {target['name']} | {target['value']:.2f} |" in page


def _total_norm(params: list[torch.Tensor], norm_type: float) -> float:
    grads = [p.grad.double() for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]), norm_type).item()


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_every_timed_clip_really_clips(norm_type: float) -> None:
    """A clip whose coefficient is exactly 1 writes nothing in clipopt: the timed calls
    must shrink the grads every time, for both contenders, in any order."""
    params = common.make_params(common.transformer_shapes(True), torch.float32, torch.device("cpu"))
    contenders = run.clip_contenders(params, norm_type)
    for name in ["torch", "clipopt", "clipopt", "torch"] * 10:
        before = _total_norm(params, norm_type)
        contenders[name]()
        assert _total_norm(params, norm_type) < 0.99 * before, name


@pytest.mark.parametrize("make", [run.step_contenders, run.amp_contenders])
def test_every_timed_clipped_step_really_clips(make: Any) -> None:
    params = common.make_params(common.transformer_shapes(True), torch.float32, torch.device("cpu"))
    contenders = make(params, torch.device("cpu"))
    unclipped = set(run.scaler_kernels(params, torch.device("cpu")))
    clipped = [name for name in contenders if not name.endswith("bare") and name not in unclipped]
    for name in clipped * 5:
        before = _total_norm(params, 2.0)
        contenders[name]()
        assert _total_norm(params, 2.0) < 0.99 * before, name


def test_the_scaler_kernels_keep_the_grads_size() -> None:
    """Timed over and over on shared grads, the unscale must not drift them to 0 or inf."""
    params = common.make_params(common.transformer_shapes(True), torch.float32, torch.device("cpu"))
    kernels = run.scaler_kernels(params, torch.device("cpu"))
    before = _total_norm(params, 2.0)
    for name in list(kernels) * 4:
        kernels[name]()
    assert _total_norm(params, 2.0) == before


def test_the_rule_rows_targets_and_memory_are_reported(
    quick_results: tuple[dict[str, Any], Path],
) -> None:
    from benchmarks import rules

    results, _ = quick_results
    section = results["rules"]
    one = common.make_params([(3,)], torch.float32, torch.device("cpu"))
    reported = {r["contender"] for r in section["rows"]}
    racers = {rules.OURS_VS_AUTOCLIP, rules.THEIRS, rules.CLIP_FLOOR}
    assert set(rules.rule_step_contenders(one)) | racers == reported
    floored = {
        r["contender"]: r["ratio_to"] for r in section["rows"] if r["case"].endswith("floor")
    }
    assert floored == dict.fromkeys(
        (*rules.PER_TENSOR_RULES, rules.PER_TENSOR_FLOOR), rules.PER_TENSOR_FLOOR
    )
    assert set(section["memory"]) == set(rules.MEMORY_RULES)
    for seen in section["memory"].values():
        assert [m["steps"] for m in seen] == [500, 2_000] and seen[0]["state_bytes"] > 0
    assert all(isinstance(t["held"], bool) for t in section["targets"])


def test_the_per_tensor_floor_scales_each_grad_and_steps_without_grad_scale() -> None:
    """The floor's timed call multiplies every grad by SHRINK (they shrink as under the
    clipped contenders) and runs the fused step as a bare one would on those grads."""
    from benchmarks import rules

    floor_params = common.make_params(
        common.transformer_shapes(True), torch.float32, torch.device("cpu")
    )
    bare_params = [torch.nn.Parameter(p.detach().clone()) for p in floor_params]
    for ours, theirs in zip(floor_params, bare_params, strict=True):
        theirs.grad = ours.grad.clone()  # type: ignore[union-attr]
    optimizer = torch.optim.AdamW(floor_params, lr=1e-2, fused=True)
    floor = rules.per_tensor_floor(floor_params, optimizer, common.ShrinkingMaxNorm())
    bare = torch.optim.AdamW(bare_params, lr=1e-2, fused=True)
    shrink = torch.tensor(common.SHRINK, dtype=torch.float32)
    for _ in range(3):
        floor()
        for p in bare_params:
            p.grad.mul_(shrink)  # type: ignore[union-attr]
        bare.step()
    for ours, theirs in zip(floor_params, bare_params, strict=True):
        assert torch.equal(ours.grad, theirs.grad) and torch.equal(ours, theirs)  # type: ignore[arg-type]


def test_the_autoclip_race_starts_both_from_the_same_history() -> None:
    """Prefilled alike, one step of each clips the same grads the same way: the timed
    clips do the same work."""
    from benchmarks import rules

    config = common.Config(quick=True, repeats=1, warmup=0, device=torch.device("cpu"))
    contenders, ours, theirs = rules.autoclip_pair(config)
    original = common.make_params(
        common.transformer_shapes(True), torch.float32, torch.device("cpu")
    )
    for step in contenders.values():
        step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=0)
    assert any(not torch.equal(a.grad, o.grad) for a, o in zip(ours, original, strict=True))


def test_only_runs_the_sections_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown sections"):
        run.main(["--quick", "--only", "clip,nonsense"])
    path = tmp_path / "host.json"
    results = run.main(["--quick", "--repeats", "2", "--only", "host", "--json", str(path)])
    assert {r["section"] for r in results["rows"]} == {"host cost"}
    assert all(t["name"].startswith("many_small") for t in results["targets"])
    assert json.loads(path.read_text())["rows"] == results["rows"]


def test_per_tensor_floor_runs_the_floor_and_bumps_every_grad_once() -> None:
    """The floor of any exact clip does the flat floor's work and tells autograd of one
    in-place change per grad, as ``mul_`` would; parameters without a grad are skipped."""
    params = common.make_params([(50,), (4, 5), (3,)], torch.float32, torch.device("cpu"))
    params[2].grad = None
    grads = [p.grad for p in params[:2] if p.grad is not None]
    versions = [g._version for g in grads]
    calls: list[int] = []
    host.per_tensor_floor(params, lambda: calls.append(1))()
    assert calls == [1]
    assert [g._version for g in grads] == [v + 1 for v in versions]


def test_the_gpu_compile_check_runs_its_cpu_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """``make gpu-check``'s compiled-step checks: the one that needs no CUDA passes here
    (traced by ``aot_eager``, as inductor traces it), the others say why they did not."""
    from benchmarks import gpu_compile

    def traced(device: torch.device) -> str:
        return gpu_compile.check_inductor(device, backend="aot_eager")

    monkeypatch.setitem(gpu_compile.CHECKS, "inductor", traced)
    results = gpu_compile.run_checks(torch.device("cpu"))
    assert results["inductor"]["status"] == "ok", results["inductor"]["detail"]
    for name in gpu_compile.NEEDS_CUDA:
        assert results[name] == {"status": "skipped", "detail": gpu_compile.WITHOUT_CUDA}
