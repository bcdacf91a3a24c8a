"""Building nodes outside a rewrite rule and putting them in a graph.

``TapeBuilder`` is the ``op`` builder onnxscript's rewrite functions receive (``op.Mul(a, b)`` -> a
value; the nodes and initializers it made are in ``op.nodes`` and ``op.initializers``). onnxscript
keeps it outside its public ``onnxscript.rewriter`` API: this is the only import of private
onnxscript names, the one file to change if a release moves them. Checked against onnxscript 0.7.2
(onnx-ir 1.1.0).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter._context import TapeBuilder

__all__ = ["TapeBuilder", "int64s", "replace_node"]


def int64s(op, values: Sequence[int]) -> ir.Value:
    """A Constant node's 1-D int64 tensor (shapes, axes, Slice operands of emitted nodes)."""
    return op.Constant(value=ir.tensor(np.array(values, np.int64)))


def replace_node(node: ir.Node, nodes: Sequence[ir.Node], initializers: Sequence[ir.Value], output: ir.Value) -> None:
    """Put ``nodes`` (and their new ``initializers``) where ``node`` was; ``output`` takes over its only
    output: its readers, name, type and shape."""
    graph = node.graph
    for value in initializers:
        graph.register_initializer(value)
    graph.insert_before(node, nodes)
    old = node.outputs[0]
    name, old.name = old.name, None
    ir.convenience.replace_all_uses_with(old, output, replace_graph_outputs=True)
    output.name, output.type, output.shape = name, old.type, old.shape
    graph.remove(node, safe=True)
