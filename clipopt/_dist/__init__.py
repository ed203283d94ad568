"""Norms across ranks: one reduction for the whole step.

The collectives (:mod:`._collective`), DTensor shards and meshes (:mod:`._mesh`), the
global and per-group norms (:mod:`._reduce`), per-tensor norms of sharded grads
(:mod:`._per_tensor`), and AGC's units: where each lies on this rank
(:mod:`._unit_rows`) and their norms across ranks (:mod:`._units`); a step that
DeepSpeed's ZeRO optimizer calls, and where its norm comes from (:mod:`._deepspeed`).
"""
