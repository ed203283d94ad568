"""Builds clipopt's one C extension; everything else is in pyproject.toml."""

from __future__ import annotations

import sys

from setuptools import Extension, setup

# No contraction into FMA and no strict aliasing: the kernels read floats' bits as
# integers, and must give the same sums in every instruction-set clone.
if sys.platform == "win32":
    compile_args = ["/O2", "/fp:precise", "/std:c11"]
    link_args: list[str] = []
else:
    compile_args = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-strict-aliasing"]
    link_args = []
if sys.platform.startswith("linux"):
    # torch's Linux wheels load libgomp.so.1; linking the same soname makes the kernels
    # run on torch's own OpenMP threads. Elsewhere they run on the calling thread.
    compile_args.append("-fopenmp")
    link_args.append("-fopenmp")

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
