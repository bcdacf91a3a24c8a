"""Fusing the MoE blocks of exported models into moe_onnx ops.

One module per export form (``tiled``, ``batched_mm``, ``loop``), each a list of ``FUSIONS``
(onnxscript rewrite rules); ``grouped`` turns MOE nodes into the routed chain; ``_driver`` runs
them in order and reports.
"""

from ._driver import OptimizeReport, optimize, optimize_ir

__all__ = ["OptimizeReport", "optimize", "optimize_ir"]
