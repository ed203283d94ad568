"""Adaptive clip rules: objects passed as ``max_norm`` that choose the threshold each step.

A rule turns the step's pre-clip norms into clip coefficients and thresholds, from state
it keeps in tensors on the grads' device, and updates that state from the norms after
the step; nothing in either reads a tensor on the host. :class:`ClipRule` is the
protocol (a base class); :class:`AdaGC`, :class:`AutoClip` and :class:`ZClip` are rules, and
:class:`SpikeSkip` is not a rule but the ``skip_spikes=`` setting of
:class:`~clipopt.ClippedOptimizer`, which skips whole steps. See ``docs/adaptive.md``.

The wrapper calls, once per ``step()``:

1. ``coefficients, thresholds = rule.decide(norms)``: ``norms`` is the global norm (a
   0-dim tensor), or with ``per_tensor = True`` a 1-D tensor with one norm per grad (in
   the order of the param groups and their params, params without a grad left out).
   The two results have the shape of ``norms``. Nothing changes.
2. the step is applied (or skipped);
3. ``rule.commit(norms, coefficients, thresholds)``: the rule's :meth:`ClipRule.update`
   and the monitoring counters (:attr:`ClipRule.last_threshold`,
   :attr:`ClipRule.clipped_count`).

Non-finite norms never enter a rule's history (the reference packages would keep a NaN
in theirs for good); what such a step does is the wrapper's ``nonfinite`` policy.
"""

from clipopt._adagc import AdaGC
from clipopt._autoclip import AutoClip
from clipopt._rule import ClipRule
from clipopt._spike_skip import SpikeSkip
from clipopt._zclip import ZClip, ZClipMode, ZClipOption

__all__ = ["AdaGC", "AutoClip", "ClipRule", "SpikeSkip", "ZClip", "ZClipMode", "ZClipOption"]
