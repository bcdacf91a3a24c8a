"""Fusions of the batched_mm export form (work in progress)."""

FUSIONS: list = []
