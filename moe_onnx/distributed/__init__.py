"""Tensor and expert parallelism over MPI (docs/distributed.md)."""
