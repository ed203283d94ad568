"""One clipped step (:mod:`._clip_step`) and its norms, verdicts, fold and saved entry."""
