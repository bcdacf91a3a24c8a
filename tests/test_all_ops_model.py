"""A model using all four ops runs in ReferenceEvaluator: the grouped chain equals the MOE node.

MoeInitRouting -> MoeRowParallelLinear (gate, up) -> SiLU(gate) * up -> MoeRowParallelLinear (down)
-> MoeFinalizeRouting is the "grouped" form of a GEMM3_SWIGLU expert block.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from cases.moe import GEMM3, make_inputs
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from moe_onnx import DOMAIN
from moe_onnx.ops import OPS, REFERENCE_OPS


def grouped_and_fused_model(experts: int, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    ours = dict(domain=DOMAIN)
    nodes = [
        helper.make_node("MoeInitRouting", ["x", "idx"], ["rows", "row_idx", "cumsum"], name="init",
                         expert_num=experts, **ours),
        helper.make_node("Concat", ["zero", "cumsum"], ["offsets"], axis=0),
        helper.make_node("MoeRowParallelLinear", ["rows", "offsets", "w_gate"], ["gate"], name="gate", **ours),
        helper.make_node("MoeRowParallelLinear", ["rows", "offsets", "w_up"], ["up"], name="up", **ours),
        helper.make_node("Sigmoid", ["gate"], ["gate_sigmoid"]),
        helper.make_node("Mul", ["gate", "gate_sigmoid"], ["gate_silu"]),
        helper.make_node("Mul", ["gate_silu", "up"], ["act"]),
        helper.make_node("MoeRowParallelLinear", ["act", "offsets", "w_down"], ["down"], name="down", **ours),
        helper.make_node("MoeFinalizeRouting", ["down", "row_idx", "", "", "", "scales"], ["grouped"],
                         name="finalize", **ours),
        helper.make_node("MOE", ["x", "scales", "idx", "w_gate", "", "w_up", "", "w_down"], ["fused"], name="moe",
                         expert_type=GEMM3, **ours),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "H"]),
              helper.make_tensor_value_info("idx", TensorProto.INT32, ["T", "k"]),
              helper.make_tensor_value_info("scales", TensorProto.FLOAT, ["T", "k"])]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["T", "H"]) for n in ("grouped", "fused")]
    initializers = [numpy_helper.from_array(np.zeros(1, np.int64), "zero")]
    initializers += [numpy_helper.from_array(w, name) for name, w in weights.items()]
    graph = helper.make_graph(nodes, "grouped_vs_fused", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])


@pytest.mark.parametrize("tokens, experts, k", [(9, 4, 2), (1, 4, 1), (5, 3, 3), (0, 4, 2)])
def test_grouped_chain_equals_moe(tokens, experts, k):
    x, scales, idx, w_gate, _, w_up, _, w_down = make_inputs(tokens=tokens, experts=experts, k=k,
                                                             expert_type=GEMM3, index_dtype=np.int32)
    model = grouped_and_fused_model(experts, {"w_gate": w_gate, "w_up": w_up, "w_down": w_down})
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    assert {v.name for v in inferred.graph.value_info} >= {"rows", "row_idx", "offsets", "gate", "down"}

    grouped, fused = ReferenceEvaluator(model, new_ops=REFERENCE_OPS).run(None, {"x": x, "idx": idx, "scales": scales})
    expected, = OPS["MOE"].reference(x, scales, idx, w_gate, None, w_up, None, w_down, expert_type=GEMM3)
    np.testing.assert_array_equal(fused, expected)
    np.testing.assert_allclose(grouped, expected, rtol=1e-5, atol=1e-5)
