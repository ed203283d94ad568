"""Builds clipopt's one C extension; everything else is in pyproject.toml."""

from __future__ import annotations

import sys

from setuptools import Extension, setup

if sys.platform == "win32":
    compile_args = ["/O2", "/fp:precise"]
    link_args: list[str] = []
else:
    # No contraction into FMA and no strict aliasing: the reductions read floats' bits
    # as integers, and must give the same sums in every instruction-set clone.
    compile_args = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-strict-aliasing", "-fopenmp"]
    link_args = ["-fopenmp"]

setup(
    ext_modules=[
        Extension(
            "clipopt._native",
            sources=["clipopt/_native.c"],
            extra_compile_args=compile_args,
            extra_link_args=link_args,
        )
    ]
)
