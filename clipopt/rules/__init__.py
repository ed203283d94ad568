"""The adaptive clip rules, passed as ``max_norm``, and SpikeSkip (``skip_spikes=``).

:class:`AdaGC`, :class:`AutoClip` and :class:`ZClip` are rules on global or per-tensor
norms, :class:`AGC` a unit-wise one; each lives in a module of its own over the
protocols :class:`ClipRule` (:mod:`clipopt.rules._base`, which says what the wrapper
calls and when) and :class:`UnitWiseRule`. See ``docs/adaptive.md``.
"""

from clipopt.rules._adagc import AdaGC
from clipopt.rules._agc import AGC
from clipopt.rules._autoclip import AutoClip
from clipopt.rules._base import ClipRule, Evaluation
from clipopt.rules._spike_skip import SpikeSkip
from clipopt.rules._unit import UnitDecision, UnitWiseRule
from clipopt.rules._zclip import ZClip, ZClipMode, ZClipOption

__all__ = [
    "AGC",
    "AdaGC",
    "AutoClip",
    "ClipRule",
    "Evaluation",
    "SpikeSkip",
    "UnitDecision",
    "UnitWiseRule",
    "ZClip",
    "ZClipMode",
    "ZClipOption",
]
