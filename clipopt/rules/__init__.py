"""The adaptive clip rules, passed as ``max_norm``, SpikeSkip (``skip_spikes=``) and the
protocols :class:`ClipRule` and :class:`UnitWiseRule`; see ``docs/adaptive.md``."""

from clipopt.rules._adagc import AdaGC as AdaGC
from clipopt.rules._agc import AGC as AGC
from clipopt.rules._autoclip import AutoClip as AutoClip
from clipopt.rules._base import ClipRule as ClipRule
from clipopt.rules._base import Evaluation as Evaluation
from clipopt.rules._spike_skip import SpikeSkip as SpikeSkip
from clipopt.rules._unit import UnitDecision as UnitDecision
from clipopt.rules._unit import UnitWiseRule as UnitWiseRule
from clipopt.rules._zclip import ZClip as ZClip
from clipopt.rules._zclip import ZClipMode as ZClipMode
from clipopt.rules._zclip import ZClipOption as ZClipOption
