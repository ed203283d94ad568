"""The CUDA step path, run without a GPU (``benchmarks/dryrun.py``).

Under ``FakeTensorMode`` parameters made with ``device="cuda"`` are fake CUDA tensors: a
step takes the path it takes on a GPU, every op it launches is counted, and every read
of a CUDA tensor's value on the host is caught and named (pipeline stages: one of two,
over torch's fake process group). For every setting and inner
optimizer the third step runs; it reads no CUDA value on the host beyond what the same
inner step under torch's ``clip_grad_norm_(foreach=True)`` reads, except where the docs
say it reads (``nonfinite="raise"``, and ``"skip"`` or ``skip_spikes`` where the skip is
decided on the host: one ``tolist`` of three flags; ``"assert"`` asserts on the device and
reads nothing, nor do the clip readouts); its launches do not grow with the
number of tensors beyond the bounds below; the clip folded into fused AdamW makes one
pass over the grads fewer than torch's clip + the same step.

What it does not show: kernel time, memory traffic, stream behaviour (``make gpu-check``
runs the step on a GPU, ``tests/test_cuda_sync.py`` under the sync detector).
"""

from __future__ import annotations

import pytest

from benchmarks import dryrun

INNERS = list(dryrun.INNERS)
SETTINGS = list(dryrun.settings(dryrun.INNERS["fused AdamW"]))
# Three flags read in one tolist: nonfinite="raise" always, and a skip judged on the
# host (any inner optimizer but a fused one, which takes found_inf on the device).
HOST_FLAGS = 3
ON_THE_HOST = {'nonfinite="raise"', 'nonfinite="skip"', "skip_spikes=SpikeSkip()"}
FUSED = {"fused AdamW", "fused Adam"}
# The folded step's launches over torch's clip + fused AdamW (10; ours 17 with 64 tensors):
# the per-tensor norms combined in float64 (cast there and back: +2); grad_scale =
# max(1, (norm + eps) / max_norm) made directly (add, div, clamp) where torch's
# coefficient and scale are 5 ops (add, reciprocal, mul, clamp, _foreach_mul_: -2), with
# its NaN past 1 / tiny that keeps it equal to the explicit path's 1 / clip_coefficient
# (gt, sub, sqrt, where: +4); the step counter (add_: +1); the clip readouts: whether
# the clip scaled the grads, grad_scale > 1 (gt: +1), added to clipped_count (add_: +1;
# last_clipped_norm is derived when read: +0).
LAUNCHES_OVER_TORCH = 7


def expected_reads(inner: str, setting: str, torch_reads: int) -> int:
    documented = setting == 'nonfinite="raise"' or (setting in ON_THE_HOST and inner not in FUSED)
    return torch_reads + (HOST_FLAGS if documented else 0)


@pytest.mark.parametrize("inner", INNERS)
def test_every_setting_runs_and_reads_only_what_the_docs_say(inner: str) -> None:
    make = dryrun.INNERS[inner]
    baseline = dryrun.count_step(dryrun._torch_clip(make), tensors=4)
    print(f"\n{inner}: torch's clip + step {baseline.launches} launches, {baseline.passes} passes")
    for setting, (step, _) in dryrun.settings(make).items():
        counted = dryrun.count_step(step, tensors=4)
        print(f"  {setting}: {counted.launches} launches, {counted.passes} passes")
        want = expected_reads(inner, setting, len(baseline.host_reads))
        assert len(counted.host_reads) == want, (setting, counted.host_reads)
        assert counted.launches > 0


@pytest.mark.parametrize("setting", SETTINGS)
def test_launches_do_not_grow_with_the_tensors(setting: str) -> None:
    step, _ = dryrun.settings(dryrun.INNERS["fused AdamW"])[setting]
    small = dryrun.count_step(step, tensors=64, steps=2, shape=(2, 2))
    large = dryrun.count_step(step, tensors=512, steps=2, shape=(2, 2))
    assert large.launches - small.launches <= 8, setting


def test_the_per_grad_scale_does_not_grow_with_the_tensors() -> None:
    """``_scale.scale_each_`` over 0-dim and per-row coefficients, alternating: as many
    launches for 512 grads as for 64, every _foreach_mul_ on alike lists."""
    import torch

    from clipopt._kernels import _scale

    def make(params: list[torch.nn.Parameter]) -> dryrun.Step:
        values = torch.rand(len(params), 8, device="cuda").unbind()  # made before counting

        def step() -> None:
            grads = [p.grad for p in params if p.grad is not None]
            given = [v.view(8, 1) if i % 2 else v[0] for i, v in enumerate(values)]
            _scale.scale_each_(grads, given, None)

        return step

    small, large = (dryrun.count_step(make, tensors) for tensors in (64, 512))
    assert 0 < small.launches == large.launches, (small.ops, large.ops)
    assert small.ops.count("_foreach_mul_.List") == 1


def test_the_folded_step_makes_one_pass_fewer_than_torch() -> None:
    make = dryrun.INNERS["fused AdamW"]
    torch_step = dryrun.count_step(dryrun._torch_clip(make), tensors=64)
    folded = dryrun.count_step(dryrun.settings(make)["max_norm=1.0"][0], tensors=64)
    assert torch_step.passes == 3
    assert folded.passes == torch_step.passes - 1
    assert folded.launches <= torch_step.launches + LAUNCHES_OVER_TORCH, folded.ops


def test_the_counter_sees_a_host_read_and_a_slow_foreach() -> None:
    """The counter is live: an ``.item()`` is caught, a foreach op over unlike lists
    counts one launch a tensor."""
    import torch

    def make(params: list[torch.nn.Parameter]) -> dryrun.Step:
        def step() -> None:
            grads = [p.grad for p in params if p.grad is not None]
            torch._foreach_mul_(grads, [torch.ones((), device="cuda") for _ in grads])
            grads[0].sum().item()

        return step

    counted = dryrun.count_step(make, tensors=5)
    assert counted.host_reads == ["_local_scalar_dense.default"]
    assert counted.ops.count("_foreach_mul_.List") == 5
    assert counted.passes == 2  # the foreach op reads them all once, the sum one of them


@pytest.mark.parametrize(
    "setting", ["max_norm=1.0", "track_tensor_norms=True", "AutoClip(per_tensor=True)", "AGC()"]
)
def test_per_tensor_and_unit_norms_are_no_extra_pass(setting: str) -> None:
    """With foreach AdamW, measuring each grad's norm (tracked, a per-tensor rule, AGC's
    units) reads the grads no more often than torch's clip + the same step: the global
    norm is derived from those norms, not measured again."""
    make = dryrun.INNERS["foreach AdamW"]
    baseline = dryrun.count_step(dryrun._torch_clip(make), tensors=8)
    counted = dryrun.count_step(dryrun.settings(make)[setting][0], tensors=8)
    assert counted.passes == baseline.passes, (counted.passes, baseline.passes)
