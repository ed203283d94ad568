"""The exception clipopt raises for a non-finite gradient norm, at the bottom layer so
that every module can raise it without importing the API that documents it."""

from __future__ import annotations

__all__ = ["NonFiniteNormError"]


class NonFiniteNormError(RuntimeError, FloatingPointError):
    """The total gradient norm is NaN or infinite and the caller asked to raise.

    A ``RuntimeError`` like torch's, so existing ``except RuntimeError`` code keeps
    working, and a ``FloatingPointError`` for code written against ``ClippedOptimizer``.
    """


NonFiniteNormError.__module__ = "clipopt"
