"""Re-exports for tests (moved to :mod:`clipopt._step._measure`)."""

from clipopt._step._measure import measure_from_squares, measure_per_tensor

__all__ = ["measure_from_squares", "measure_per_tensor"]
