"""``NonFiniteNormError``, at the bottom layer for every module to raise."""


class NonFiniteNormError(RuntimeError, FloatingPointError):
    """The total gradient norm is NaN or infinite and the caller asked to raise."""


NonFiniteNormError.__module__ = "clipopt"
