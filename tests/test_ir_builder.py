"""The one builder and the one replace (moe_onnx/_ir/builder.py): what a replaced node's outputs hand
over (readers, graph outputs, names, types, shapes), the initializers a builder made, and the helpers."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx.reference import ReferenceEvaluator

from moe_onnx._ir.builder import TapeBuilder, const, insert, int64s, replace, typed

FLOAT = ir.DataType.FLOAT
X = np.arange(24, dtype=np.float32).reshape(4, 6) - 10


def _model(build) -> tuple[ir.Model, dict[str, ir.Node]]:
    """A model of input x [4, 6] float whose nodes ``build(op, x)`` makes; it returns the graph outputs
    (float, of any shape where they have none)."""
    op = TapeBuilder()
    x = ir.val("x", FLOAT, [4, 6])
    outputs = build(op, x)
    for value in outputs:
        value.dtype = FLOAT
    graph = ir.Graph([x], outputs, nodes=op.nodes, initializers=op.initializers, opset_imports={"": 18}, name="g")
    return ir.Model(graph, ir_version=10), {node.op_type: node for node in op.nodes}


def _run(model: ir.Model) -> list[np.ndarray]:
    """The model's outputs on X (ReferenceEvaluator runs the nodes in graph order: a node before its inputs
    fails)."""
    return ReferenceEvaluator(ir.serde.serialize_model(model)).run(None, {"x": X})


def _split(op, x):
    """Split x into two named, typed halves a and b; graph outputs b and Relu(a)."""
    a, b = op.Split(x, axis=1, num_outputs=2, _outputs=2)
    for value, name in ((a, "a"), (b, "b")):
        value.name = name
        typed(value, FLOAT, [4, 3])
    c = op.Relu(a)
    c.name = "c"
    return [b, c]


def _slices(x) -> tuple[TapeBuilder, ir.Value, ir.Value]:
    """A builder making x's two column halves with Slice."""
    op = TapeBuilder()
    first = op.Slice(x, int64s(op, [0]), int64s(op, [3]), int64s(op, [1]))
    second = op.Slice(x, int64s(op, [3]), int64s(op, [6]), int64s(op, [1]))
    return op, first, second


def test_replace_hands_over_every_output():
    model, nodes = _model(_split)
    expected = _run(model)
    split, relu = nodes["Split"], nodes["Relu"]
    op, first, second = _slices(model.graph.inputs[0])
    replace(split, (first, second), op)
    assert split not in list(model.graph) and [n.op_type for n in model.graph][-1] == "Relu"
    assert relu.inputs[0] is first  # the readers
    assert list(model.graph.outputs) == [second, relu.outputs[0]]  # the graph outputs, in place
    assert (first.name, second.name) == ("a", "b")
    for value in (first, second):
        assert value.dtype == FLOAT and list(value.shape) == [4, 3]
    assert [a.tolist() for a in _run(model)] == [a.tolist() for a in expected]


def test_replace_registers_the_initializers_the_builder_made():
    model, nodes = _model(lambda op, x: [op.Neg(x)])
    x = model.graph.inputs[0]
    op = TapeBuilder()
    w = op.initializer(ir.tensor(np.full((1, 6), 2, np.float32)), name="w")
    replace(nodes["Neg"], op.Mul(x, w), op)
    assert model.graph.initializers["w"] is w
    np.testing.assert_array_equal(_run(model)[0], X * 2)


def test_replace_by_a_value_the_graph_has():
    """A node replaced by its input: the input takes over the graph output, its name and type; it keeps its
    own shape, which the old output did not have."""
    model, nodes = _model(lambda op, x: [op.Identity(op.Abs(x))])
    identity, abs_ = nodes["Identity"], nodes["Abs"]
    old = identity.outputs[0]
    old.name = "y"
    kept = typed(abs_.outputs[0], ir.DataType.DOUBLE, [4, 6])
    replace(identity, kept)
    assert list(model.graph.outputs) == [kept] and kept.name == "y"
    assert kept.dtype == FLOAT and list(kept.shape) == [4, 6]
    assert [n.op_type for n in model.graph] == ["Abs"]
    np.testing.assert_array_equal(_run(model)[0], np.abs(X))


def test_replace_wants_one_value_per_output():
    model, nodes = _model(_split)
    op, first, _ = _slices(model.graph.inputs[0])
    nodes["Split"].name = "halves"
    with pytest.raises(ValueError, match=r"node 'halves' \(Split\) has 2 outputs; 1 values were given"):
        replace(nodes["Split"], first, op)
    assert len(list(model.graph)) == 2  # nothing changed


def test_insert_puts_the_nodes_before_the_node():
    model, nodes = _model(lambda op, x: [op.Relu(x)])
    relu = nodes["Relu"]
    op = TapeBuilder()
    shift = op.initializer(ir.tensor(np.array(1, np.float32)), name="shift")
    shifted = op.Add(relu.inputs[0], shift)
    insert(relu, op)
    relu.replace_input_with(0, shifted)
    assert [n.op_type for n in model.graph] == ["Add", "Relu"] and "shift" in model.graph.initializers
    np.testing.assert_array_equal(_run(model)[0], np.maximum(X + 1, 0))


def test_constants_and_types():
    op = TapeBuilder()
    half = const(op, 0.5, ir.DataType.FLOAT16)
    axes = int64s(op, [0, -1])
    flags = const(op, np.array([[True], [False]]))
    values = [node.attributes["value"].as_tensor().numpy() for node in op.nodes]
    assert [(v.dtype, v.shape) for v in values] == [(np.float16, ()), (np.int64, (2,)), (np.bool_, (2, 1))]
    assert values[1].tolist() == [0, -1] and all(node.op_type == "Constant" for node in op.nodes)
    assert half.producer() is op.nodes[0] and axes.producer() is op.nodes[1] and flags.producer() is op.nodes[2]
    dims = ir.Shape(["T", 4])
    value = typed(op.Relu(half), ir.DataType.FLOAT16, dims)
    assert value.dtype == ir.DataType.FLOAT16 and list(value.shape) == list(dims) and value.shape is not dims
    assert typed(value, None, None).type is None and value.shape is None
