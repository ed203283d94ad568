"""Checks an installed clipopt: it imports from the venv, as pure Python, and clips like
``torch.nn.utils`` on grads that take every CPU path. Run by check_dist.sh."""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys
from pathlib import Path

import torch

import clipopt


def grads() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(70_000, generator=generator),
        torch.randn(300_000, generator=generator).bfloat16(),
        torch.randn(300, 40, generator=generator)[:, ::2],
        torch.randn(500, generator=generator).bfloat16(),
    ]


def check(license_file: bool) -> None:
    """Raises AssertionError where the installed package does not behave."""
    location = Path(clipopt.__file__).parent
    venv = Path(sys.prefix).resolve()
    assert venv in location.resolve().parents, f"clipopt imported from {location}, not {venv}"
    assert importlib.metadata.version("clipopt") == clipopt.__version__
    compiled = [p.name for p in location.rglob("*") if p.suffix in (".so", ".pyd", ".c")]
    assert not compiled, compiled
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
    print(f"check_install: clipopt {clipopt.__version__}, pure Python, from {location}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--license", action="store_true", help="check LICENSE is installed")
    args = parser.parse_args()
    check(args.license)


if __name__ == "__main__":
    sys.exit(main())
