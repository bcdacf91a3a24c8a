"""Fusions of the tiled export form (work in progress)."""

FUSIONS: list = []
