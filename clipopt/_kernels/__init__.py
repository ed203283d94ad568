"""One rank's norms and scales, on the grads' own device.

Norms of grouped grads (:mod:`._norms`), clip coefficients and in-place scaling
(:mod:`._scale`), the groupings kept across steps (:mod:`._plan`), the C kernel
(``_native.c``) and its Python side (:mod:`._cpu`), and the torch-ops path every CPU
grad takes without it (:mod:`._torch_norms`). Nothing here knows of ranks, rules or
optimizers.
"""
