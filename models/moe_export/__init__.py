"""Builds, exports and describes the MoE block fixtures; see models/README.md."""
