"""Norms across ranks: one reduction for the whole step.

The collectives (:mod:`._collective`), DTensor shards and meshes (:mod:`._mesh`), the
global and per-group norms (:mod:`._reduce`), per-tensor norms of sharded grads
(:mod:`._per_tensor`), and AGC's units: where each lies on this rank
(:mod:`._unit_rows`) and their norms across ranks (:mod:`._units`); DeepSpeed's engine
as the user attached it, and where a ZeRO call's norm comes from (:mod:`._deepspeed`).
"""
