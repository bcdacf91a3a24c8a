"""Fusions of the loop export form (work in progress)."""

FUSIONS: list = []
