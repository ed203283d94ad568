"""Re-exports for ``_step._rule_step`` and tests (moved to :mod:`clipopt._step._measure`)."""

from clipopt._step._measure import Coefficient, Measurement, collect_grads

__all__ = ["Coefficient", "Measurement", "collect_grads"]
