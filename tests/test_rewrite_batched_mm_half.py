"""The batched_mm fusions on float16 and bfloat16 exports (moe_onnx/rewrite/batched_mm.py, ``...Float32Sum``):
transformers sums the weighted slots in float32 and casts the sum back, and its routers leave the routing weights
in the tokens' type (Qwen3-MoE: a Cast back after the float32 renormalization; GPT-OSS: a top-k Softmax at the
tokens' type) or in float32 (Mixtral: the expert outputs are widened before the Mul). The blocks here are built
as torch.onnx's dynamo exporter writes them at float16 (the Casts, and GPT-OSS's gate clamp as ``Min``), without
torch; tests/test_export_kv.py exports real checkpoints where torch is installed."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import moe_onnx
from fixture_models import nodes, op_counts, producer
from moe_onnx.check import check_model

T_ELEM = {np.float16: TensorProto.FLOAT16, ml_dtypes.bfloat16: TensorProto.BFLOAT16}
E, K, H, I = 4, 2, 16, 8
LIMIT = 7.0


def _const(name: str, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def built_block(family: str, dtype, *, sum_cast_to=None, widen_to=TensorProto.FLOAT) -> onnx.ModelProto:
    """One router and batched_mm experts block over tokens [T, H] of ``dtype``, as the dynamo exporter writes
    ``family`` (qwen3_moe, mixtral, gpt_oss) at that type. ``sum_cast_to`` (default: the tokens' type) is the
    type the float32 sum is cast back to, ``widen_to`` the type the Casts before the sum widen to."""
    elem = T_ELEM[dtype]
    rng = np.random.default_rng(7)

    def weights(name, *shape):
        return _const(name, (0.3 * rng.standard_normal(shape)).astype(dtype))

    inits = [weights("router_HE", H, E), _const("k", [K]), _const("last", [-1]), _const("one", [1]),
             _const("repeat", [1, K, 1]), _const("rows", [-1, H]), _const("sum_shape", [-1, K, H])]
    chain = [helper.make_node("MatMul", ["hidden", "router_HE"], ["logits"])]
    if family == "qwen3_moe":  # softmax at T, widened; renormalized in float32; cast back to T
        chain += [helper.make_node("Softmax", ["logits"], ["probs_t"], axis=-1),
                  helper.make_node("Cast", ["probs_t"], ["probs"], to=TensorProto.FLOAT),
                  helper.make_node("TopK", ["probs", "k"], ["top", "idx"], axis=-1),
                  helper.make_node("ReduceSum", ["top", "last"], ["total"], keepdims=1),
                  helper.make_node("Div", ["top", "total"], ["renormalized"]),
                  helper.make_node("Cast", ["renormalized"], ["routing"], to=elem)]
    elif family == "mixtral":  # the logits widened; the routing weights stay float32
        chain += [helper.make_node("Cast", ["logits"], ["logits_f"], to=TensorProto.FLOAT),
                  helper.make_node("Softmax", ["logits_f"], ["probs"], axis=-1),
                  helper.make_node("TopK", ["probs", "k"], ["top", "idx"], axis=-1),
                  helper.make_node("ReduceSum", ["top", "last"], ["total"], keepdims=1),
                  helper.make_node("Div", ["top", "total"], ["routing"])]
    else:  # gpt_oss: top-k of the logits, softmax over k at T
        chain += [helper.make_node("TopK", ["logits", "k"], ["top", "idx"], axis=-1),
                  helper.make_node("Softmax", ["top"], ["routing"], axis=1)]
    chain += [helper.make_node("Unsqueeze", ["hidden", "one"], ["tokens_T1H"]),
              helper.make_node("Expand", ["tokens_T1H", "repeat"], ["tokens_TkH3"]),
              helper.make_node("Reshape", ["tokens_TkH3", "rows"], ["tokens_TkH"]),
              helper.make_node("Reshape", ["idx", "last"], ["expert_Tk"]),
              helper.make_node("Unsqueeze", ["expert_Tk", "last"], ["expert_Tk1"])]
    if family == "gpt_oss":
        inits += [weights("gate_up_EH2I", E, H, 2 * I), weights("gate_up_bias_E2I", E, 2 * I),
                  weights("down_EIH", E, I, H), weights("down_bias_EH", E, H),
                  _const("even", [0]), _const("odd", [1]), _const("end", [2 * I]), _const("two", [2]),
                  _const("limit", np.array(LIMIT, dtype)), _const("neg_limit", np.array(-LIMIT, dtype)),
                  _const("alpha", np.array(1.702, dtype)), _const("plus", np.array(1.0, dtype))]
        for name, x, out in (("gate_up", "tokens_TkH", "gate_up_Tk2I"), ("down", "act", "down_TkH")):
            chain += [helper.make_node("GatherND", [f"{name}_{'EH2I' if name == 'gate_up' else 'EIH'}", "expert_Tk1"],
                                       [f"{name}_w"]),
                      helper.make_node("GatherND", [f"{name}_bias_{'E2I' if name == 'gate_up' else 'EH'}",
                                                    "expert_Tk1"], [f"{name}_b"]),
                      helper.make_node("Unsqueeze", [x, "one"], [f"{name}_row"]),
                      helper.make_node("MatMul", [f"{name}_row", f"{name}_w"], [f"{name}_mm"]),
                      helper.make_node("Squeeze", [f"{name}_mm", "one"], [f"{name}_sq"]),
                      helper.make_node("Add", [f"{name}_sq", f"{name}_b"], [f"{name}_biased"]),
                      helper.make_node("Unsqueeze", [f"{name}_biased", "one"], [f"{name}_noop"]),
                      helper.make_node("Squeeze", [f"{name}_noop", "one"], [out])]
            if name == "gate_up":
                chain += [helper.make_node("Slice", [out, "even", "end", "last", "two"], ["gate_half"]),
                          helper.make_node("Min", ["gate_half", "limit"], ["gate"]),
                          helper.make_node("Slice", [out, "odd", "end", "last", "two"], ["up_half"]),
                          helper.make_node("Clip", ["up_half", "neg_limit", "limit"], ["up"]),
                          helper.make_node("Mul", ["gate", "alpha"], ["gate_alpha"]),
                          helper.make_node("Sigmoid", ["gate_alpha"], ["sig"]),
                          helper.make_node("Mul", ["gate", "sig"], ["glu"]),
                          helper.make_node("Add", ["up", "plus"], ["up_plus_one"]),
                          helper.make_node("Mul", ["up_plus_one", "glu"], ["act"])]
    else:
        inits += [weights("gate_up_E2IH", E, 2 * I, H), weights("down_EHI", E, H, I)]
        for name, x, out in (("gate_up", "tokens_TkH", "gate_up_Tk2I"), ("down", "act", "down_TkH")):
            chain += [helper.make_node("GatherND", [f"{name}_{'E2IH' if name == 'gate_up' else 'EHI'}",
                                                    "expert_Tk1"], [f"{name}_w"]),
                      helper.make_node("Unsqueeze", [x, "last"], [f"{name}_col"]),
                      helper.make_node("MatMul", [f"{name}_w", f"{name}_col"], [f"{name}_mm"]),
                      helper.make_node("Squeeze", [f"{name}_mm", "last"], [out])]
            if name == "gate_up":
                chain += [helper.make_node("Split", [out], ["first", "second"], axis=1, num_outputs=2),
                          helper.make_node("Sigmoid", ["first"], ["sig"]),
                          helper.make_node("Mul", ["first", "sig"], ["silu"]),
                          helper.make_node("Mul", ["silu", "second"], ["act"])]
    chain += [helper.make_node("Reshape", ["routing", "last"], ["routing_flat"]),
              helper.make_node("Unsqueeze", ["routing_flat", "last"], ["routing_Tk1"])]
    if family == "mixtral":  # float32 products
        chain += [helper.make_node("Cast", ["down_TkH"], ["down_f"], to=widen_to),
                  helper.make_node("Mul", ["down_f", "routing_Tk1"], ["weighted"]),
                  helper.make_node("Reshape", ["weighted", "sum_shape"], ["slots"]),
                  helper.make_node("ReduceSum", ["slots", "one"], ["sum"], keepdims=0)]
    else:  # products at T, widened before the sum
        chain += [helper.make_node("Mul", ["down_TkH", "routing_Tk1"], ["weighted"]),
                  helper.make_node("Reshape", ["weighted", "sum_shape"], ["slots_t"]),
                  helper.make_node("Cast", ["slots_t"], ["slots"], to=widen_to),
                  helper.make_node("ReduceSum", ["slots", "one"], ["sum"], keepdims=0)]
    out_elem = elem if sum_cast_to is None else sum_cast_to
    chain.append(helper.make_node("Cast", ["sum"], ["output"], to=out_elem))
    graph = helper.make_graph(chain, family, [helper.make_tensor_value_info("hidden", elem, ["T", H])],
                              [helper.make_tensor_value_info("output", out_elem, ["T", H])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


FAMILIES = {"qwen3_moe": "BatchedMmSwigluFloat32Sum", "mixtral": "BatchedMmSwigluFloat32Sum",
            "gpt_oss": "BatchedMmGptOssFloat32Sum"}


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_half_precision_block_fuses(family, dtype):
    """The block becomes one MOE at the tokens' type and its router one MoeGatingTopK; MOE takes the routing
    weights in the tokens' type: Mixtral's float32 ones through a Cast, which the report notes."""
    model, report = moe_onnx.optimize(built_block(family, dtype))
    assert report.fused == {FAMILIES[family]: 1, "RouterToMoeGatingTopK": 1}, report.summary()
    assert report.near_misses == []
    assert check_model(model) == []
    counts = op_counts(model)
    assert (counts["MOE"], counts["MoeGatingTopK"], counts["ReduceSum"], counts["GatherND"]) == (1, 1, 0, 0)
    (moe,) = nodes(model, "MOE")
    # MoeGatingTopK gives its weights in its logits' type: Mixtral's widened logits, then a Cast to T
    routing = producer(model, moe.input[1])
    if family == "mixtral":
        assert routing.op_type == "Cast" and routing.attribute[0].i == T_ELEM[dtype]
        routing = producer(model, routing.input[0])
    assert routing.op_type == "MoeGatingTopK"
    assert producer(model, moe.output[0]) is moe and model.graph.output[0].name == moe.output[0]
    name = "FLOAT16" if dtype is np.float16 else "BFLOAT16"
    rounded = [f"the export multiplies the {name} expert outputs by float32 routing weights; MOE takes them "
               f"rounded to {name}"]
    assert [note for note in report.notes if "routing weights" in note] == (rounded if family == "mixtral" else [])


@pytest.mark.parametrize("family", FAMILIES)
def test_half_precision_block_numbers(family):
    """float16: the fused block (our kernels, both backends) computes onnxruntime's run of the export within
    float16's rounding (MOE accumulates in float32; the export rounds each expert's output to float16)."""
    before = built_block(family, np.float16)
    fused, _ = moe_onnx.optimize(before)
    assert op_counts(fused)["MOE"] == 1
    hidden = np.random.default_rng(3).standard_normal((13, H)).astype(np.float16)
    expected = ort.InferenceSession(before.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"hidden": hidden})[0].astype(np.float32)
    assert np.abs(expected).max() > 0.5
    for backend in ("cpp", "python"):
        got = moe_onnx.session(fused, backend=backend).run(None, {"hidden": hidden})[0]
        assert got.dtype == np.float16
        np.testing.assert_allclose(got.astype(np.float32), expected, rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("family, mutation, reason", [
    ("qwen3_moe", dict(sum_cast_to=TensorProto.FLOAT), "the weighted sum is FLOAT, the tokens are FLOAT16"),
    ("qwen3_moe", dict(widen_to=TensorProto.FLOAT16), "the weighted sum casts slots to FLOAT16, expected FLOAT"),
    ("mixtral", dict(sum_cast_to=TensorProto.FLOAT), "the weighted sum is FLOAT, the tokens are FLOAT16"),
])
def test_half_precision_block_other_types_stay(family, mutation, reason):
    """A sum left in float32 (MOE gives the tokens' type) or Casts that do not widen to float32 stay unfused,
    the check that failed named."""
    before = built_block(family, np.float16, **mutation)
    model, report = moe_onnx.optimize(before)
    assert report.fused.get(FAMILIES[family], 0) == 0
    assert any(reason in miss["reason"] for miss in report.near_misses), report.summary()
    assert op_counts(model)["MOE"] == 0
