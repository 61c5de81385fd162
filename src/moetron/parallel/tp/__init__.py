"""Tensor and sequence parallelism."""
