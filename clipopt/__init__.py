"""clipopt: gradient-norm clipping for PyTorch, exact, fast and drop-in."""

from clipopt import distributed
from clipopt._wrapper import OptimizerChain
from clipopt.functional import (
    NonFiniteNormError,
    clip_grad_norm,
    clip_grad_norm_,
    clip_grad_value_,
    clip_grads_with_norm_,
    get_total_norm,
)
from clipopt.optimizer import ClippedOptimizer
from clipopt.rules import (
    AGC,
    AdaGC,
    AutoClip,
    ClipRule,
    SpikeSkip,
    UnitDecision,
    UnitWiseRule,
    ZClip,
)

__all__ = [
    "AGC",
    "AdaGC",
    "AutoClip",
    "ClipRule",
    "ClippedOptimizer",
    "NonFiniteNormError",
    "OptimizerChain",
    "SpikeSkip",
    "UnitDecision",
    "UnitWiseRule",
    "ZClip",
    "clip_grad_norm",
    "clip_grad_norm_",
    "clip_grad_value_",
    "clip_grads_with_norm_",
    "distributed",
    "get_total_norm",
]

__version__ = "0.1.0"  # the one place it is written: pyproject.toml reads it from here
