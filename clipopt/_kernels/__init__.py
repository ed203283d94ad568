"""One rank's norms (:mod:`._norms`) and clip coefficients and scales (:mod:`._scale`)."""
