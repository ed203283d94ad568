"""One clipped step: measure, decide, apply, and what a checkpoint keeps of it.

The settings and the clip state (:mod:`._clip_state`), non-finite steps and skip counts
(:mod:`._nonfinite`), the step's parts (:mod:`._parts`), measuring (:mod:`._monitor`), a
rule's decision (:mod:`._rule_step`), the fold into fused optimizers (:mod:`._fold`), the
decision itself (:mod:`._decide`), and the saved ``"clip"`` entry (:mod:`._saved`).
"""
