"""The ``target`` values of :func:`moe_onnx.optimize`: the forms a fused MoE block can take.

A module of its own so that reading them (the CLI's choices, the package root) imports neither
onnxscript nor the fusions.
"""

#: the ``target`` values of :func:`moe_onnx.optimize`
TARGETS = ("moe", "grouped", "ort")
#: the targets whose models use our ops (``"ort"`` writes onnxruntime's contrib MoE instead)
OUR_OPS_TARGETS = ("moe", "grouped")
