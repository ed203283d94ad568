"""Shared test settings and helpers: hypothesis profiles, a float64 reference norm, and a
guard against host syncs.

Profiles (pick one with ``CLIPOPT_HYPOTHESIS_PROFILE=<name>``):

- ``ci`` (default): few examples, derandomized, so ``make test`` stays fast on 2 cores
  and a failure reproduces on every machine.
- ``dev``: more examples, fresh random ones each run.
- ``thorough``: many examples, for a long run before a release.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from hypothesis import HealthCheck, settings
from torch import Tensor

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile(
    "thorough", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("CLIPOPT_HYPOTHESIS_PROFILE", "ci"))


def _float64_norm(tensors: Sequence[Tensor | None], norm_type: float | str) -> float:
    """The p-norm of ``tensors`` taken together, computed on the CPU in float64.

    Built from ``abs``, ``pow``, ``sum`` and ``max`` only, independent of the library's
    kernels and of ``vector_norm``. Sparse tensors count by their dense equivalent.
    """
    p = math.inf if norm_type == "inf" else float(norm_type)
    parts = []
    for t in tensors:
        if t is None:
            continue
        dense = t.detach().to("cpu")
        dense = dense.to_dense() if dense.is_sparse else dense
        wide = torch.complex128 if dense.is_complex() else torch.float64
        parts.append(dense.to(wide).abs().flatten())
    values = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    if values.numel() == 0:
        return 0.0
    if p == math.inf:
        return float(values.max())
    return float(values.pow(p).sum().pow(1.0 / p))


@pytest.fixture(scope="session")
def float64_norm() -> Callable[[Sequence[Tensor | None], float | str], float]:
    """The float64 reference norm (session scope, so hypothesis tests may use it)."""
    return _float64_norm


_SYNCING_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def _no_host_sync() -> Iterator[None]:
    """Make every Tensor method that reads a value on the host raise inside the block."""
    originals = {name: getattr(torch.Tensor, name) for name in _SYNCING_METHODS}

    def forbid(name: str) -> Callable[..., object]:
        def raise_host_read(self: Tensor, *args: object, **kwargs: object) -> object:
            raise AssertionError(f"Tensor.{name} called: a host sync in the step path")

        return raise_host_read

    try:
        for name in _SYNCING_METHODS:
            setattr(torch.Tensor, name, forbid(name))
        yield
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


@pytest.fixture(scope="session")
def no_host_sync() -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A context manager under which ``.item()``, ``bool(t)``, ``float(t)``... raise."""
    return _no_host_sync


COMPAT_MODULES = frozenset(
    {
        "test_smoke.py",
        "test_functional.py",
        "test_optimizer.py",
        "test_wrapping.py",
        "test_fused.py",
        "test_amp.py",
        "test_checkpoint.py",
        "test_chain.py",
        "test_adaptive.py",
        "test_adagc.py",
        "test_agc.py",
        "test_compile.py",
        "test_distributed.py",
        "test_kernels.py",
    }
)
"""The ``compat`` subset, the tests the torch matrix runs on every release: the
functional API, the wrapper and its hooks, fused folding and AMP, checkpoints and resume,
chained optimizers, every clip rule against its reference, torch.compile, 2-rank
distributed layouts, the plans and kernels, and the fence around torch's private APIs."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in COMPAT_MODULES:
            item.add_marker(pytest.mark.compat)
