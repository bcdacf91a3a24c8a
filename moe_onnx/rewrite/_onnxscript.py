"""The private onnxscript names the rewriter uses, in one place.

onnxscript keeps these outside its public ``onnxscript.rewriter`` API; if a release moves them,
this is the one file to change. Checked against onnxscript 0.7.2 (onnx-ir 1.1.0).
"""

from onnxscript.rewriter._context import TapeBuilder  # the ``op`` builder rewrite functions receive

__all__ = ["TapeBuilder"]
