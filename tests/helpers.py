"""Assertions shared by the test modules."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.torch_version import TorchVersion

FSDP2_ON_CPU = TorchVersion(torch.__version__) >= (2, 9)
"""Whether torch's FSDP2 (``fully_shard``) trains correctly on CPU with gloo, as the
distributed tests run it: from 2.9. In 2.6 it records CUDA-style stream events that CPU
streams lack; in 2.7 it reduce-scatters with ``ReduceOp.AVG``, which gloo lacks; in 2.8 it
sums the ranks' grads where it should average them (every grad comes out world-size times
the one-process grad, and so does every norm of them, clipopt's and torch's alike)."""

FSDP2_UNAVAILABLE = f"FSDP2 cannot run on CPU with gloo in torch {torch.__version__}"


def forbid_fsdp2_where_it_cannot_run() -> None:
    """In a worker: make ``fully_shard`` raise :data:`FSDP2_UNAVAILABLE` where torch's
    FSDP2 cannot run here, so that its cases are reported as skipped, not failed."""
    if FSDP2_ON_CPU or torch.cuda.is_available():
        return
    import torch.distributed.fsdp as fsdp

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(FSDP2_UNAVAILABLE)

    fsdp.fully_shard = unavailable  # type: ignore[assignment]


def assert_all_ok(outcomes: list[str]) -> None:
    """Every rank's outcome is "ok". A case skips where every rank failed only because
    FSDP2 cannot run here, or because clipopt refused a layout whose torch internal this
    run leaves unused (the refusal is then what the public path does)."""
    failures = [f"rank {r}:\n{o}" for r, o in enumerate(outcomes) if o != "ok"]
    if failures and all(FSDP2_UNAVAILABLE in o for o in outcomes):
        pytest.skip(FSDP2_UNAVAILABLE)
    assert not failures, "\n".join(failures)


def assert_identical(
    ours: Any, theirs: Any, where: str = "", nan_equal: bool = False, rtol: float = 0.0
) -> None:
    """Bit-exact equality of nested dicts, lists, tuples, tensors and plain values.

    Tensors must agree in dtype, shape, device and every bit (within ``rtol`` where one is
    given); containers in type, keys and length. With ``nan_equal`` a NaN matches a NaN in
    the same place (a skipped step's recorded norm, say); otherwise NaN fails, as ``==``
    does.
    """
    if isinstance(theirs, Tensor):
        assert isinstance(ours, Tensor), where
        layout = (ours.dtype, ours.shape, ours.device)
        assert layout == (theirs.dtype, theirs.shape, theirs.device), f"{where}: {layout}"
        atol = rtol * 1e-2
        torch.testing.assert_close(
            ours, theirs, rtol=rtol, atol=atol, equal_nan=nan_equal, msg=where
        )
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict), where
        assert ours.keys() == theirs.keys(), f"{where}: {sorted(ours)} != {sorted(theirs)}"
        for key in theirs:
            assert_identical(ours[key], theirs[key], f"{where}/{key}", nan_equal, rtol)
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_identical(a, b, f"{where}[{i}]", nan_equal, rtol)
    elif nan_equal and isinstance(theirs, float) and math.isnan(theirs):
        assert isinstance(ours, float) and math.isnan(ours), where
    else:
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"


def assert_same(ours: Any, theirs: Any, where: str = "") -> None:
    """:func:`assert_identical` where a NaN matches a NaN in the same place."""
    assert_identical(ours, theirs, where, nan_equal=True)


@contextlib.contextmanager
def sync_is_an_error() -> Iterator[None]:
    """Make any operation that waits for the GPU raise inside the block (torch's sync
    debug mode); the work queued before it is waited for first."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def assert_same_picture(png: Path, committed: Path, max_changed: float = 0.001) -> None:
    """``png`` draws what ``committed`` draws: the same size, and at most ``max_changed``
    of its pixels different. Not byte for byte: a model's matmuls round differently in
    the last bit on other CPUs (AVX2 against AVX-512), which moves a curve by a pixel here
    and there; a changed curve, label or threshold changes thousands."""
    import matplotlib.image

    ours, theirs = matplotlib.image.imread(png), matplotlib.image.imread(committed)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    changed = (abs(ours - theirs) > 1 / 255).any(axis=-1).mean()
    assert changed <= max_changed, f"{changed:.4%} of the pixels differ from {committed}"
