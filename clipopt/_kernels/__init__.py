"""One rank's norms (:mod:`._norms`) and clip coefficients and scales (:mod:`._scale`),
by torch's own ops on the grads' devices. Nothing here knows of ranks, rules or
optimizers.
"""
