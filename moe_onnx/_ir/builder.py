"""Building nodes and putting them in a graph: the one builder and the one replace every pass uses.

The builder is ``TapeBuilder``, the ``op`` onnxscript's rewrite functions receive, so a pass builds as
a rule does: ``op.Mul(a, b)`` -> a value, ``op.TopK(x, k, _outputs=2)`` -> two, ``_domain``,
``_version`` and ``_name`` for the node; the nodes and initializers it made are in ``op.nodes`` and
``op.initializers``. The functions here take any such ``op``, a rule's included: :func:`const`,
:func:`int64s`, and :func:`typed` (a built value's type and shape, for a pass after this one that
reads them before shape inference runs again). :func:`insert` puts what a builder made before a node;
:func:`replace` puts it in place of one.

onnxscript keeps ``TapeBuilder`` outside its public ``onnxscript.rewriter`` API: this is the only
import of private onnxscript names, the one file to change if a release moves them. Checked against
onnxscript 0.7.2 (onnx-ir 1.1.0).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter._context import TapeBuilder

__all__ = ["TapeBuilder", "const", "insert", "int64s", "replace", "typed"]


def const(op: TapeBuilder, value, dtype: ir.DataType | None = None) -> ir.Value:
    """A Constant node holding ``value`` (an array, or a number or list made an array of ``dtype``)."""
    array = np.array(value, dtype=None if dtype is None else dtype.numpy(), order="C")
    return op.Constant(value=ir.tensor(array))


def int64s(op: TapeBuilder, values: Sequence[int]) -> ir.Value:
    """A Constant node's 1-D int64 tensor (shapes, axes, Slice operands of emitted nodes)."""
    return const(op, list(values), ir.DataType.INT64)


def typed(value: ir.Value, dtype: ir.DataType | None, shape: Sequence | None) -> ir.Value:
    """``value`` as a tensor of ``dtype`` and ``shape`` (None: unknown; the dims copied); returns ``value``."""
    value.type = None if dtype is None else ir.TensorType(dtype)
    value.shape = None if shape is None else ir.Shape(list(shape))
    return value


def insert(node: ir.Node, op: TapeBuilder) -> None:
    """Put the nodes ``op`` made before ``node`` in its graph, and register the initializers it made there."""
    graph = node.graph
    for value in op.initializers:
        graph.register_initializer(value)
    graph.insert_before(node, op.nodes)


def replace(node: ir.Node, outputs: ir.Value | Sequence[ir.Value], op: TapeBuilder | None = None) -> None:
    """Put the nodes and initializers ``op`` made (None: none) where ``node`` was, and remove ``node``.

    ``outputs`` (one value per output of ``node``, in order) take over its outputs: their readers,
    their places among the graph's outputs, their names, and their types and shapes where known.
    A replacing value may be one the graph had (a node replaced by one of its inputs); it keeps its
    own type and shape where the old output has none.
    """
    outputs = [outputs] if isinstance(outputs, ir.Value) else list(outputs)
    if len(outputs) != len(node.outputs):
        raise ValueError(f"replace: node '{node.name}' ({node.op_type}) has {len(node.outputs)} outputs; "
                         f"{len(outputs)} values were given to take them over")
    if op is not None:
        insert(node, op)
    for old, new in zip(node.outputs, outputs):
        name, old.name = old.name, None  # one value of a name in the graph at a time
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        if name is not None:
            new.name = name
        if old.type is not None:
            new.type = old.type
        if old.shape is not None:
            new.shape = old.shape
    node.graph.remove(node, safe=True)
