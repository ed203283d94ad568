"""The CUDA path, traced without a GPU: launches, passes over the grads and host reads.

Under ``FakeTensorMode`` tensors made with ``device="cuda"`` are fake CUDA tensors, so a
step on a CPU-only machine takes the path it takes on a GPU. A ``TorchDispatchMode`` on
top sees every op: an op of the ``aten`` namespace on a CUDA tensor that is not a view,
an alias or an allocation is one launch (a foreach op whose lists ATen would run tensor
by tensor, one a tensor); the reads of the most read grad are the passes over the
grads; a read of a CUDA value on the host (``.item()``, ``.tolist()``, a blocking copy
to the CPU) is recorded by name and answered with 0, so that a step whose documented
read decides "finite" runs on. The CUDA runtime objects of the lagged skip count (an
event and a pinned buffer) come from :func:`clipopt._step._nonfinite.host_copy`, which
the dry run stands in for.

What it does not prove: kernel time, memory bandwidth, how streams overlap. One launch
is one ``aten`` op; a fused or foreach op counts once whatever it does inside.

``python -m benchmarks.dryrun`` prints the table (third step, 64 tensors, with the
growth to 512 tensors) that ``docs/benchmarks.md`` leads with.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import clipopt
from clipopt._step import _nonfinite

aten = torch.ops.aten

_NO_LAUNCH = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.detach.default,
    aten.alias.default,
    aten.lift_fresh.default,
    aten.set_.source_Storage_storage_offset,
    aten.is_same_size.default,
    aten._has_compatible_shallow_copy_type.default,
}
_HOST_READS = {aten._local_scalar_dense.default}
_LAUNCHING = ("aten", "c10d", "_c10d_functional")  # ops, and collectives


def _tensors(tree: Any) -> list[Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor)]


def _on_cuda(tensors: list[Tensor]) -> bool:
    return any(t.device.type == "cuda" for t in tensors)


def _to_host(func: Any, args: tuple[Any, ...], out: Any) -> bool:
    """A copy of a CUDA tensor into a CPU one."""
    if func not in (aten._to_copy.default, aten.copy_.default):
        return False
    sources = _tensors(args[1] if func is aten.copy_.default else args[0])
    results = _tensors(out)
    return _on_cuda(sources) and any(t.device.type == "cpu" for t in results)


def _foreach_launches(func: Any, args: tuple[Any, ...]) -> int:
    """1, or one per tensor for a foreach op that takes ATen's slow route on CUDA: its
    tensor lists not alike (sizes and strides of the tensors at each position, one
    dtype), where it runs the op tensor by tensor (``can_use_fast_route``)."""
    if not func.__name__.startswith("_foreach_"):
        return 1
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], Tensor)]
    if len(lists) < 2:
        return 1
    first = lists[0]
    alike = all(
        a.shape == b.shape and a.stride() == b.stride() and a.dtype == first[0].dtype
        for other in lists[1:]
        for a, b in zip(first, other, strict=True)
    )
    return 1 if alike else len(first)


class Counter(TorchDispatchMode):
    """Counts launches on CUDA tensors, passes over ``grads`` and host reads."""

    def __init__(self, grads: list[Tensor]) -> None:
        super().__init__()
        self.grads = dict.fromkeys((StorageWeakRef(g.untyped_storage()) for g in grads), 0)
        self.launches: list[str] = []
        self.host_reads: list[str] = []
        self.lagged_copies = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        if func in _HOST_READS:
            # A CUDA value is answered with 0 (finite, no skip, no streak); a CPU one,
            # such as a step count kept on the CPU, with 1.
            value = 1
            if _on_cuda(inputs):
                self.host_reads.append(str(func).removeprefix("aten."))
                value = 0
            return float(value) if inputs[0].dtype.is_floating_point else value
        out = func(*args, **kwargs)
        if func.namespace not in _LAUNCHING or func.is_view or func in _NO_LAUNCH:
            return out
        if not _on_cuda(inputs + _tensors(out)):
            return out
        if _to_host(func, args, out):
            # A copy into a pinned buffer without blocking (the lagged skip count) waits
            # for nothing: it is read a step later.
            blocking = not kwargs.get("non_blocking", len(args) > 2 and args[2])
            if blocking:
                self.host_reads.append(f"{func} to the CPU".removeprefix("aten."))
            else:
                self.lagged_copies += 1
        name = str(func).removeprefix("aten.")
        self.launches.extend([name] * _foreach_launches(func, args))
        read = {StorageWeakRef(t.untyped_storage()) for t in inputs} & self.grads.keys()
        for grad in read:
            self.grads[grad] += 1
        return out

    @property
    def passes(self) -> int:
        """The reads of the most read grad: one pass over the grads is one read of each,
        whether by one foreach op or by one op a grad."""
        return max(self.grads.values(), default=0)


def _nothing() -> None:
    pass


def _host_copy(like: Tensor) -> tuple[Tensor, Callable[[], None], Callable[[], None]]:
    """Stands in for the pinned buffer and the event: a CPU buffer, marks that do nothing."""
    return torch.empty((), dtype=like.dtype), _nothing, _nothing


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """Fake CUDA tensors, and the lagged count's event and pinned buffer stood in for."""
    saved = _nonfinite.host_copy
    _nonfinite.host_copy = _host_copy
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        _nonfinite.host_copy = saved


Step = Callable[[], Any]
MakeStep = Callable[[list[nn.Parameter]], Step]


@dataclass
class Count:
    """One step's launches, passes over the grads, host reads and the ops launched."""

    launches: int
    passes: int
    host_reads: list[str]
    ops: list[str] = field(repr=False)


def count_step(
    make: MakeStep, tensors: int, steps: int = 3, shape: tuple[int, ...] = (8, 8)
) -> Count:
    """The last of ``steps`` steps of ``make(params)`` over ``tensors`` fake CUDA params
    (as one of two pipeline stages where ``make`` is a :func:`_staged` one)."""
    stages = fake_stages() if getattr(make, "stages", False) else contextlib.nullcontext()
    with stages, fake_cuda():
        params = [nn.Parameter(torch.randn(shape, device="cuda")) for _ in range(tensors)]
        step = make(params)
        counter = Counter([])
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn_like(p)
            counter = Counter([p.grad for p in params if p.grad is not None])
            with counter:
                step()
    return Count(len(counter.launches), counter.passes, counter.host_reads, counter.launches)


# Inner optimizers ---------------------------------------------------------------------

Inner = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def _torch_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    import torch_optimizer

    optimizer: torch.optim.Optimizer = torch_optimizer.Lamb(params, lr=1e-3)
    return optimizer


def _muon_adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Muon over every other weight, foreach AdamW over the rest: one clip over both."""
    muon = torch.optim.Muon(params[::2], lr=0.02)
    return clipopt.OptimizerChain([muon, torch.optim.AdamW(params[1::2], lr=1e-3, foreach=True)])


INNERS: dict[str, Inner] = {
    "fused AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "foreach AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "fused Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
    "foreach SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True),
    "torch_optimizer Lamb": _torch_optimizer,
}
if hasattr(torch.optim, "Muon"):  # torch 2.9 and later
    INNERS["Muon + foreach AdamW (chained)"] = _muon_adamw


def _torch_clip(inner: Inner, norm_type: float = 2.0) -> MakeStep:
    def make(params: list[nn.Parameter]) -> Step:
        optimizer = inner(params)

        def step() -> None:
            torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type, foreach=True)
            optimizer.step()

        return step

    return make


def _owner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Where a group is added: a chain's last optimizer (a chain cannot tell which of its
    optimizers would step it), else ``optimizer``."""
    if isinstance(optimizer, clipopt.OptimizerChain):
        return optimizer.optimizers[-1]
    return optimizer


def _two_groups(inner: Inner, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """``inner`` over half the parameters; the rest a group of its own."""
    optimizer = inner(params[::2])
    _owner(optimizer).add_param_group({"params": params[1::2], "clip_max_norm": 2.0})
    return optimizer


def _clip_groups(inner: Inner, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Two clip groups, "a" and "b", and a group left unclipped."""
    optimizer = inner(params[::3])
    optimizer.param_groups[0]["clip_group"] = "a"
    owner = _owner(optimizer)
    owner.add_param_group({"params": params[1::3], "clip_group": "b", "clip_max_norm": 2.0})
    owner.add_param_group({"params": params[2::3], "clip_group": None})
    return optimizer


def _clipped(inner: Inner, groups: int = 1, **kwargs: Any) -> MakeStep:
    """A wrapper's step; a callable argument is called for each wrapper (a fresh rule)."""

    def make(params: list[nn.Parameter]) -> Step:
        builders = {1: inner, 2: lambda ps: _two_groups(inner, ps)}
        optimizer = builders.get(groups, lambda ps: _clip_groups(inner, ps))(params)
        made = {k: v() if callable(v) else v for k, v in kwargs.items()}
        return clipopt.ClippedOptimizer(optimizer, **made).step

    return make


def _rules() -> dict[str, Callable[[], Any]]:
    return {
        "AutoClip()": lambda: clipopt.AutoClip(history=16),
        "AutoClip(per_tensor=True)": lambda: clipopt.AutoClip(history=16, per_tensor=True),
        "ZClip()": lambda: clipopt.ZClip(warmup_steps=1),
        "AdaGC()": clipopt.AdaGC,
        "AGC()": clipopt.AGC,
    }


@contextlib.contextmanager
def fake_stages() -> Iterator[Any]:
    """A group joining two pipeline stages in this one process: torch's fake process
    group (its collectives return at once), torn down after."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the dry run's pipeline stages need no process group initialised")
    from clipopt._dist import _stages

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    # The stages' first-step check of their clip layouts reads the result of a collective
    # on the host, which a fake group cannot give; it is tested on real ranks in
    # tests/test_distributed_stages_agree.py, and the dry run counts a later step.
    check_layout = _stages.check_layout
    _stages.check_layout = lambda *args: None
    try:
        yield dist.group.WORLD
    finally:
        _stages.check_layout = check_layout
        dist.destroy_process_group()


def _staged(inner: Inner, **kwargs: Any) -> MakeStep:
    """A wrapper's step as one of two pipeline stages (``pp_mesh``), under
    :func:`fake_stages`."""
    import torch.distributed as dist

    make = _clipped(inner, pp_mesh=lambda: dist.group.WORLD, **kwargs)
    make.stages = True  # type: ignore[attr-defined]
    return make


def settings(inner: Inner) -> dict[str, tuple[MakeStep, tuple[str, ...]]]:
    """Every setting over ``inner``: its step, and the host reads its docs name."""
    rows: dict[str, tuple[MakeStep, tuple[str, ...]]] = {
        "max_norm=1.0": (_clipped(inner, max_norm=1.0), ()),
        "norm_type=inf": (_clipped(inner, max_norm=1.0, norm_type=float("inf")), ()),
        "per_group=True": (_clipped(inner, groups=2, max_norm=1.0, per_group=True), ()),
        "clip groups (2, and None)": (_clipped(inner, groups=3, max_norm=1.0), ()),
        'nonfinite="skip"': (_clipped(inner, max_norm=1.0, nonfinite="skip"), ()),
        'nonfinite="raise"': (_clipped(inner, max_norm=1.0, nonfinite="raise"), ()),
        'nonfinite="assert"': (_clipped(inner, max_norm=1.0, nonfinite="assert"), ()),
        "track_tensor_norms=True": (_clipped(inner, max_norm=1.0, track_tensor_norms=True), ()),
        "skip_spikes=SpikeSkip()": (
            _clipped(inner, max_norm=1.0, skip_spikes=lambda: clipopt.SpikeSkip(min_history=2)),
            (),
        ),
    }
    for name, rule in _rules().items():
        rows[name] = (_clipped(inner, max_norm=rule), ())
    rows["pp_mesh (2 stages)"] = (_staged(inner, max_norm=1.0), ())
    rows["pp_mesh, AutoClip()"] = (_staged(inner, max_norm=_rules()["AutoClip()"]), ())
    return rows


def table(inner_names: list[str], small: int = 64, large: int = 512) -> list[dict[str, Any]]:
    """One row per setting and inner optimizer: counts at ``small`` tensors, growth to ``large``."""
    rows: list[dict[str, Any]] = []
    for inner_name in inner_names:
        inner = INNERS[inner_name]
        cases = {"torch clip_grad_norm_(foreach=True) + step": (_torch_clip(inner), ())}
        cases.update(settings(inner))
        for name, (make, _) in cases.items():
            here, there = count_step(make, small), count_step(make, large)
            rows.append(
                {
                    "inner": inner_name,
                    "setting": name,
                    "launches": here.launches,
                    "passes": here.passes,
                    "growth": there.launches - here.launches,
                    "host_reads": len(here.host_reads),
                }
            )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| inner | setting | launches | passes over the grads | growth 64 -> 512 tensors "
        "| host reads |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['inner']} | {r['setting']} | {r['launches']} | {r['passes']} "
            f"| {r['growth']:+d} | {r['host_reads']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", action="append", choices=list(INNERS))
    args = parser.parse_args(argv)
    rows = table(args.inner or list(INNERS))
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
