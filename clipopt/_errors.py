"""``NonFiniteNormError``, at the bottom layer so that every module can raise it."""


class NonFiniteNormError(RuntimeError, FloatingPointError):
    """The total gradient norm is NaN or infinite and the caller asked to raise (a
    ``RuntimeError`` like torch's, and a ``FloatingPointError``)."""


NonFiniteNormError.__module__ = "clipopt"
