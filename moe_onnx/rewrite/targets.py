"""The ``target`` values of :func:`moe_onnx.optimize`: the forms a fused MoE block can take; and its
``compute`` values: the accuracy its expert GEMMs may use (:mod:`moe_onnx.rewrite.compute`).

A module of its own so that reading them (the CLI's choices, the package root) imports neither
onnxscript nor the fusions.
"""

#: the ``target`` values of :func:`moe_onnx.optimize`
TARGETS = ("moe", "grouped", "ort")
#: the targets whose models use our ops (``"ort"`` writes onnxruntime's contrib MoE instead)
OUR_OPS_TARGETS = ("moe", "grouped")
#: the ``compute`` values of :func:`moe_onnx.optimize`: exact float32, or bfloat16 GEMM operands allowed
COMPUTES = ("fp32", "bf16")
