"""Moved to :mod:`clipopt._dist._units`; kept for ``clipopt.rules._agc``'s import."""

from clipopt._dist._units import Rows, unit_shape

__all__ = ["Rows", "unit_shape"]
