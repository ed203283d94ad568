"""The exception clipopt raises for a non-finite gradient norm, and where its warnings
point, at the bottom layer so that every module can use them without importing the API
that documents them."""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["NonFiniteNormError", "user_stacklevel"]

_INTERNAL = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep for path in (__file__, torch.__file__)
)


class NonFiniteNormError(RuntimeError, FloatingPointError):
    """The total gradient norm is NaN or infinite and the caller asked to raise.

    A ``RuntimeError`` like torch's, so existing ``except RuntimeError`` code keeps
    working, and a ``FloatingPointError`` for code written against ``ClippedOptimizer``.
    """


NonFiniteNormError.__module__ = "clipopt"


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the function that calls this one, so
    that the warning names the first frame outside clipopt and torch: the user's line,
    however deep the call came (a step through torch's hooks and ``no_grad`` wrappers, a
    constructor, torch's DCP functions calling a state-dict hook)."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
        _INTERNAL
    ):
        frame = frame.f_back
        level += 1
    return level
