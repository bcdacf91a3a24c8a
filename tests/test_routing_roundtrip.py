"""MoeInitRouting and MoeFinalizeRouting invert each other, for every MoeInitRouting layout.

With an identity "expert" between them, the pair gives ``x1 + x2 + sum_j routed[t, j] * scales[t, j] *
(x[t] + bias[e])``, where ``routed`` (computed here from the ids, apart from both references) says which
slots the layout keeps: in the active range, under the capacity, within active_num.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from moe_onnx.ops import DOMAIN, REFERENCE_OPS, MoeOpError
from moe_onnx.ops.finalize_routing import moe_finalize_routing
from moe_onnx.ops.init_routing import moe_init_routing

EXPERTS, TOKENS, HIDDEN, K = 6, 9, 5, 3
LAYOUTS = {
    "dropless_gather": {},
    "dropless_scatter": {"row_idx_type": 1},
    "range_gather": {"active_expert_range": [1, 4]},
    "range_scatter": {"active_expert_range": [2, 6], "row_idx_type": 1},
    "active_num_gather": {"active_num": 11},
    "active_num_scatter": {"active_num": 11, "row_idx_type": 1, "active_expert_range": [0, 3]},
    "drop_pad": {"drop_pad_mode": 1, "expert_capacity": 3},
    "drop_pad_capacity_1": {"drop_pad_mode": 1, "expert_capacity": 1},
    "key_value_scatter": {"expert_tokens_num_type": 2, "row_idx_type": 1, "active_expert_range": [3, 5]},
}


def routed_slots(expert_idx: np.ndarray, attrs: dict) -> np.ndarray:
    """[N, k] bool: the slots the layout keeps, counted slot by slot."""
    ids = expert_idx.reshape(-1).tolist()
    start, end = attrs.get("active_expert_range", (0, EXPERTS))
    capacity, active_num = attrs.get("expert_capacity", 0), attrs.get("active_num", -1)
    keep = []
    for f, e in enumerate(ids):
        in_range = start <= e < end
        earlier_same = sum(1 for g in range(f) if ids[g] == e)
        sorted_before = sum(1 for g, d in enumerate(ids) if start <= d < end and (d, g) < (e, f))
        keep.append(in_range
                    and (not attrs.get("drop_pad_mode") or earlier_same < capacity)
                    and (active_num <= 0 or sorted_before < active_num))
    return np.array(keep).reshape(expert_idx.shape)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    ids = np.stack([rng.permutation(EXPERTS)[:K] for _ in range(TOKENS)])
    ids[ids == 0] = 5
    ids[:6, 0] = 0  # crowd expert 0 past the capacities
    ids[1, 2] = ids[7, 0] = -1  # two slots without an expert
    scales = rng.random((TOKENS, K)).astype(np.float32)
    x1, x2 = rng.standard_normal((2, TOKENS, HIDDEN)).astype(np.float32)
    bias = rng.standard_normal((EXPERTS, HIDDEN)).astype(np.float32)
    return x, ids.astype(np.int32), scales, x1, x2, bias


def _expected(x, ids, scales, x1, x2, bias, attrs):
    routed = routed_slots(ids, attrs)
    expert_bias = bias[np.where(ids >= 0, ids, 0)]
    return x1 + x2 + np.sum((routed * scales)[..., None] * (x[:, None, :] + expert_bias), axis=1)


def _finalize_attrs(attrs):
    return {a: attrs[a] for a in ("drop_pad_mode", "row_idx_type") if a in attrs}


@pytest.mark.parametrize("name", LAYOUTS)
def test_finalize_inverts_init(name):
    attrs = LAYOUTS[name]
    x, ids, scales, x1, x2, bias = _inputs()
    expanded_x, row_idx, *_ = moe_init_routing(x, ids, expert_num=EXPERTS, **attrs)
    (out,) = moe_finalize_routing(expanded_x, row_idx, x1, x2, bias, scales, ids, **_finalize_attrs(attrs))
    np.testing.assert_allclose(out, _expected(x, ids, scales, x1, x2, bias, attrs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["dropless_scatter", "range_gather", "drop_pad"])
def test_finalize_inverts_dynamic_quant(name):
    """Dequantized rows (int8 * expanded_scale) come back within half a quantization step per slot."""
    attrs = LAYOUTS[name]
    x, ids, scales, *_ = _inputs(seed=1)
    expanded_x, row_idx, _, row_scale = moe_init_routing(x, ids, expert_num=EXPERTS, quant_mode=1, **attrs)
    dequantized = expanded_x.astype(np.float32) * row_scale[..., None]
    (out,) = moe_finalize_routing(dequantized, row_idx, scales=scales, **_finalize_attrs(attrs))
    step = np.abs(x).max(axis=1, keepdims=True) / 127
    zeros = np.zeros_like(x)
    expected = _expected(x, ids, scales, zeros, zeros, np.zeros((EXPERTS, HIDDEN), np.float32), attrs)
    assert np.all(np.abs(out - expected) <= step * 0.5 * scales.sum(axis=1, keepdims=True) + 1e-6)


def _chain_model(attrs: dict) -> onnx.ModelProto:
    init = helper.make_node("MoeInitRouting", ["x", "expert_idx"], ["expanded_x", "expanded_row_idx"],
                            domain=DOMAIN, name="init", expert_num=EXPERTS, **attrs)
    finalize = helper.make_node("MoeFinalizeRouting", ["expanded_x", "expanded_row_idx", "x1", "", "bias", "scales",
                                                       "expert_idx"],
                                ["out"], domain=DOMAIN, name="finalize", **_finalize_attrs(attrs))
    f32 = TensorProto.FLOAT
    graph = helper.make_graph(
        [init, finalize], "routing_chain",
        [helper.make_tensor_value_info("x", f32, ["N", HIDDEN]),
         helper.make_tensor_value_info("expert_idx", TensorProto.INT32, ["N", K]),
         helper.make_tensor_value_info("x1", f32, ["N", HIDDEN]),
         helper.make_tensor_value_info("bias", f32, [EXPERTS, HIDDEN]),
         helper.make_tensor_value_info("scales", f32, ["N", K])],
        [helper.make_tensor_value_info("out", f32, ["N", HIDDEN])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)],
                             ir_version=10)


@pytest.mark.parametrize("name", ["dropless_gather", "range_scatter", "active_num_scatter", "drop_pad"])
def test_two_node_model_in_reference_evaluator(name):
    attrs = LAYOUTS[name]
    model = _chain_model(attrs)
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    expanded = next(v.type.tensor_type for v in inferred.graph.value_info if v.name == "expanded_x")
    assert expanded.elem_type == TensorProto.FLOAT
    expected_dims = [EXPERTS, attrs["expert_capacity"], HIDDEN] if attrs.get("drop_pad_mode") else [0, HIDDEN]
    assert [d.dim_value for d in expanded.shape.dim] == expected_dims  # 0: unknown (N * k with N symbolic)

    x, ids, scales, x1, x2, bias = _inputs(seed=2)
    (out,) = ReferenceEvaluator(model, new_ops=REFERENCE_OPS).run(
        None, {"x": x, "expert_idx": ids, "x1": x1, "bias": bias, "scales": scales})
    zeros = np.zeros_like(x)
    np.testing.assert_allclose(out, _expected(x, ids, scales, x1, zeros, bias, attrs), rtol=1e-5, atol=1e-5)


def test_count_output_named_without_flag_fails_inference():
    """A node that names expert_tokens_count_or_cumsum while expert_tokens_num_flag is 0 is rejected."""
    node = helper.make_node("MoeInitRouting", ["x", "expert_idx"], ["ex", "ri", "counts"], domain=DOMAIN,
                            name="init", expert_num=4, expert_tokens_num_flag=0)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8]),
         helper.make_tensor_value_info("expert_idx", TensorProto.INT32, [3, 2])],
        [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in ("ex", "ri", "counts")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)],
                              ir_version=10)
    with pytest.raises(Exception, match=r"MoeInitRouting node 'init': output 'expert_tokens_count_or_cumsum' is "
                                        r"named, but attribute 'expert_tokens_num_flag' is 0"):
        onnx.shape_inference.infer_shapes(model, strict_mode=True)


def test_scatter_index_listing_a_slot_twice_is_rejected():
    x, ids, scales, *_ = _inputs()
    expanded_x, row_idx, *_ = moe_init_routing(x, ids, expert_num=EXPERTS, row_idx_type=1)
    row_idx[1] = row_idx[0]
    with pytest.raises(MoeOpError, match=rf"MoeFinalizeRouting: expanded_row_idx names slot {row_idx[0]} at rows 0 "
                                         r"and 1; expected each slot at most once"):
        moe_finalize_routing(expanded_x, row_idx, scales=scales, row_idx_type=1)
