"""moe_onnx._ir.graph, the one walk over a graph and its subgraphs: its order and scopes, and moe_onnx
nodes inside If branches run on both backends (private-domain copies) and pass the checker."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from cases import ALL_CASES, Case
from onnx import helper

from moe_onnx._ir.graph import graphs, walk
from moe_onnx.check import check_model, summarize
from moe_onnx.runtime import run, session

CASES = {c.id: c for c in ALL_CASES}


def _branch(case: Case, model: onnx.ModelProto, suffix: str) -> onnx.GraphProto:
    """The case's node alone in a graph whose outputs carry ``suffix``; its inputs come from the outer scope."""
    node = onnx.NodeProto()
    node.CopyFrom(model.graph.node[0])
    node.name += suffix
    outputs = []
    for i, out in enumerate(model.graph.output):
        node.output[i] += suffix
        outputs.append(helper.make_tensor_value_info(out.name + suffix, out.type.tensor_type.elem_type, None))
    return helper.make_graph([node], f"branch{suffix}", [], outputs)


def in_if_branches(case: Case) -> onnx.ModelProto:
    """The case's model with its node moved into both branches of an If on a new bool input 'cond'."""
    model = case.model()
    graph = model.graph
    cond = helper.make_node("If", ["cond"], [o.name for o in graph.output], name="if",
                            then_branch=_branch(case, model, "_then"), else_branch=_branch(case, model, "_else"))
    inputs = [helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, [])] + list(graph.input)
    outer = helper.make_graph([cond], "outer", inputs, list(graph.output), list(graph.initializer))
    return helper.make_model(outer, opset_imports=list(model.opset_import), ir_version=model.ir_version)


def test_walk_gives_each_node_with_its_scope():
    model = in_if_branches(CASES["MOE-gemm2_fp32"])
    walked = [(node.name, [g.name for g in scope]) for node, scope in walk(model.graph)]
    # make_node orders the attributes by name: else_branch first
    assert walked == [("if", ["outer"]), ("MOE_node_else", ["outer", "branch_else"]),
                      ("MOE_node_then", ["outer", "branch_then"])]
    assert [g.name for g in graphs(model.graph)] == ["outer", "branch_else", "branch_then"]


@pytest.mark.parametrize("backend", ["cpp", "python"])
@pytest.mark.parametrize("case_id", ["MOE-gemm2_fp32", "MoeInitRouting-static_quant_per_tensor",
                                     "MoeInitRouting-bf16"])
def test_ops_in_subgraphs_run_and_check(case_id, backend):
    case = CASES[case_id]
    model = in_if_branches(case)
    assert check_model(model) == []
    assert summarize(model).startswith(f"1 nodes; moe_onnx ops: {case.op} x2")
    sess = session(model, backend=backend)
    for cond in (True, False):
        got = run(sess, {**case.feeds(), "cond": np.array(cond)})
        for g, e in zip(got, case.run_reference(), strict=True):
            assert g.dtype == e.dtype and g.shape == e.shape
            np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=case.rtol, atol=case.atol)
