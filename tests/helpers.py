"""Assertions shared by the test modules."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor


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
