"""One clipped step (:mod:`._clip_step`, top to bottom), how it measures (:mod:`._measure`),
non-finite verdicts (:mod:`._nonfinite`), the fold into fused kernels (:mod:`._fold`), a
rule's coefficients (:mod:`._rule_step`) and the saved ``"clip"`` entry (:mod:`._saved`)."""
