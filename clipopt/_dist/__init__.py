"""Norms across ranks: meshes, pipeline stages, global, per-tensor and unit norms, DeepSpeed."""
