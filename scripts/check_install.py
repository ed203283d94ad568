"""Checks an installed clipopt: it imports, reports its C kernel as expected, and clips
like ``torch.nn.utils`` on grads that take every CPU path. Run by check_dist.sh."""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys
from pathlib import Path

import torch

import clipopt
from clipopt._kernels import _cpu


def grads() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(70_000, generator=generator),
        torch.randn(300, 40, generator=generator)[:, ::2],
        torch.randn(500, generator=generator).bfloat16(),
    ]


def check(expect_native: bool, license_file: bool) -> None:
    """Raises AssertionError where the installed package does not behave."""
    location = Path(clipopt.__file__).parent
    venv = Path(sys.prefix).resolve()
    assert venv in location.resolve().parents, f"clipopt imported from {location}, not {venv}"
    assert importlib.metadata.version("clipopt") == clipopt.__version__
    assert _cpu.available() is expect_native, (_cpu.available(), expect_native)
    built = sorted(p.name for p in (location / "_kernels").glob("_native*"))
    assert any(name.endswith((".so", ".pyd")) for name in built) is expect_native, built
    if license_file:
        files = importlib.metadata.files("clipopt") or []
        assert any(f.name == "LICENSE" for f in files), "LICENSE is not in the installed package"
    for p in (1.0, 2.0, math.inf):
        ours = [torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype)) for g in grads()]
        theirs = [torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype)) for g in grads()]
        for a, b, g, h in zip(ours, theirs, grads(), grads(), strict=True):
            a.grad, b.grad = g, h
        values = torch.cat([g.double().reshape(-1) for g in grads()]).abs()
        exact = float(values.max() if p == math.inf else values.pow(p).sum().pow(1 / p))
        norm = clipopt.clip_grad_norm_(ours, 1.0, p)
        assert math.isclose(float(norm), exact, rel_tol=2e-6), (float(norm), exact)
        # torch's float32 1-norm is off by 1e-5 here: its scale is compared on our norm
        torch.nn.utils.clip_grads_with_norm_(theirs, 1.0, norm)
        for a, b in zip(ours, theirs, strict=True):
            assert a.grad is not None and b.grad is not None
            assert torch.equal(a.grad, b.grad)
    huge = clipopt.get_total_norm([torch.full((4000,), 1e20)[::2]])
    assert math.isclose(float(huge), 2000**0.5 * 1e20, rel_tol=1e-5), huge
    print(f"check_install: clipopt {clipopt.__version__}, C kernel in use: {_cpu.available()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expect-native", choices=["yes", "no"], required=True)
    parser.add_argument("--license", action="store_true", help="check LICENSE is installed")
    args = parser.parse_args()
    check(args.expect_native == "yes", args.license)


if __name__ == "__main__":
    sys.exit(main())
