"""Weights behind layout ops (moe_onnx/_ir/weights.py): each expert's slice is read from the source
expert by expert and equals the whole value's slice; lazy initializers are named from the graph alone and
convert an in-memory source once per write."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from fixture_models import original, optimize_form
from moe_onnx._ir.weights import initializer_expert, streamed_initializer, weight

SOURCE = np.arange(4 * 3 * 5, dtype=np.float32).reshape(4, 3, 5)  # [E, A, B]


def layout_chain(*nodes: onnx.NodeProto) -> onnx.ModelProto:
    """SOURCE -> the nodes (each reads the previous output, "x0" being SOURCE) -> output "y"."""
    chain = []
    for i, node in enumerate(nodes):
        node.input[0], node.output[0] = f"x{i}", f"x{i + 1}" if i + 1 < len(nodes) else "y"
        chain.append(node)
    extra = [numpy_helper.from_array(np.array(v, np.int64), name) for name, v in
             (("flat_shape", [4, 15]), ("axis0", [0]), ("shape_eab", [4, 3, 5]), ("two", 2))]
    graph = helper.make_graph(chain, "chain", [], [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)],
                              [numpy_helper.from_array(SOURCE, "x0")] + extra)
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))


def node(op_type: str, *extra_inputs: str, **attributes) -> onnx.NodeProto:
    return helper.make_node(op_type, ["", *extra_inputs], [""], **attributes)


CHAINS = {
    # name: (layout nodes, whether an expert's slice is a view of the source: nothing but indexing copied)
    "transpose last axes": ([node("Transpose", perm=[0, 2, 1])], True),
    "transpose, cast": ([node("Transpose", perm=[0, 2, 1]), node("Cast", to=TensorProto.FLOAT16)], False),
    "reshape keeping experts": ([node("Reshape", "flat_shape"), node("Identity")], True),
    "transpose moving the expert axis": ([node("Transpose", perm=[1, 0, 2])], True),
    "reversing transpose": ([node("Transpose")], True),
    # the expert axis goes through a size-1 axis: the steps run on the whole value, still correct
    "unsqueeze, reshape (whole value)": ([node("Unsqueeze", "axis0"), node("Reshape", "shape_eab")], True),
    "cast, unsqueeze, reshape (whole value)": ([node("Cast", to=TensorProto.FLOAT16), node("Unsqueeze", "axis0"),
                                                node("Reshape", "shape_eab")], False),
    # one expert of a stacked tensor (the dynamo exporter's weight[e]): [A, B], its "experts" are rows of A
    "select expert 2": ([node("Gather", "two", axis=0)], True),
    "select expert 2, transpose": ([node("Gather", "two", axis=0), node("Transpose", perm=[1, 0])], True),
}


@pytest.mark.parametrize("chain", CHAINS)
def test_expert_slices_equal_the_whole_value(chain):
    nodes, is_view = CHAINS[chain]
    model = layout_chain(*nodes)
    expected = ReferenceEvaluator(model).run(None, {})[0]
    graph = ir.from_proto(model).graph
    source = SOURCE.copy()
    graph.initializers["x0"].const_value = ir.Tensor(source)  # read in place, as a memory-mapped tensor is
    w = weight(graph.outputs[0])
    assert w is not None and w.shape == expected.shape
    np.testing.assert_array_equal(w.array(), expected)
    for e in range(w.shape[0]):
        part = w.expert(e)
        np.testing.assert_array_equal(part, expected[e])
        assert np.shares_memory(part, source) == is_view


def test_initializer_names_do_not_depend_on_history():
    """The same model rewritten twice in one process gets the same initializer names."""
    names = [sorted(t.name for t in optimize_form(original("gpt_oss_tiled_tiny"), target="grouped")[0].graph.initializer)
             for _ in range(2)]
    assert names[0] == names[1]


class CountingProtoTensor(ir.serde.TensorProtoTensor):
    """A tensor deserialized from a proto (its numpy() copies all its bytes) that counts its numpy() calls."""

    reads = 0

    def numpy(self) -> np.ndarray:
        self.reads += 1
        return super().numpy()


@pytest.mark.parametrize("chain", ["transpose last axes", "select expert 2, transpose"])
def test_a_lazy_initializer_converts_an_in_memory_source_once_per_write(chain):
    """Reading each expert of a proto-backed source once per expert would copy the whole source each time."""
    model = layout_chain(*CHAINS[chain][0])
    expected = ReferenceEvaluator(model).run(None, {})[0]
    graph = ir.from_proto(model).graph
    source = CountingProtoTensor(numpy_helper.from_array(SOURCE, "x0"))
    graph.initializers["x0"].const_value = source
    w = weight(graph.outputs[0])
    through_layout = streamed_initializer(graph, "through_layout", w.expert, w.dtype, w.shape, [w.source])
    whole = graph.initializers["x0"]
    copied = streamed_initializer(graph, "copied", lambda e: initializer_expert(whole, e), whole.dtype,
                                  SOURCE.shape, [whole])
    for value, want in ((through_layout, expected), (copied, SOURCE)):
        for write in range(2):
            reads = source.reads
            written = ir.serde.serialize_tensor(value.const_value)  # one write: the expert slices, stacked
            np.testing.assert_array_equal(numpy_helper.to_array(written), want)
            assert source.reads == reads + 1, (value.name, write)
