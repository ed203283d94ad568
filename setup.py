"""Builds clipopt's one C extension, if it can; everything else is in pyproject.toml.

The extension is optional: where it cannot be built (no C compiler, say), the install
goes on without it and clipopt computes the same norms with torch ops, more slowly.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

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


class OptionalBuildExt(build_ext):
    """``build_ext`` that reports a failed build of the C kernel and carries on."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as error:  # no compiler at all: setuptools raises before compiling
            self._skip(error)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as error:  # the compiler or linker failed
            self._skip(error)

    @staticmethod
    def _skip(error: BaseException) -> None:
        print(
            "WARNING: clipopt: the C kernel (clipopt._kernels._native) could not be built "
            f"({type(error).__name__}: {error}); installing without it. clipopt gives the "
            "same results through torch ops, more slowly; "
            "clipopt._kernels._cpu.available() is False.",
            file=sys.stderr,
        )


setup(
    cmdclass={"build_ext": OptionalBuildExt},
    ext_modules=[
        Extension(
            "clipopt._kernels._native",
            sources=["clipopt/_kernels/_native.c"],
            depends=sorted(str(p) for p in Path("clipopt/_kernels/csrc").glob("*.h")),
            extra_compile_args=compile_args,
            extra_link_args=link_args,
            optional=True,
        )
    ],
)
