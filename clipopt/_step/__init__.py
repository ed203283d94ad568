"""One clipped step (:mod:`._clip_step`, top to bottom) and what it uses: the norms, the
non-finite verdicts, the fold into fused kernels, the saved ``"clip"`` entry."""
