"""One rank's norms and scales, on the grads' own device.

Norms and scaling of grouped grads (:mod:`._norms`), the groupings kept across steps
(:mod:`._plan`), the C kernel (``_native.c``) and its Python side (:mod:`._cpu`), and the
torch-ops path every CPU grad takes without it (:mod:`._torch_norms`). Nothing here
knows of ranks, rules or optimizers.
"""
