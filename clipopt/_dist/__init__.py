"""Norms across ranks: meshes and the one all_reduce (``_mesh``), pipeline stages,
global, per-tensor and unit norms, and DeepSpeed's engine as the user attached it."""
