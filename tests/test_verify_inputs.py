"""How verify (and quantize's error measurement) draws a model's inputs, and the tolerance it compares with.

The model is decoder-shaped as onnxruntime-genai's builder writes one: token ids into an embedding table,
learned positions, onnxruntime's com.microsoft::GroupQueryAttention with a KV cache (past_key_values.0.*,
present.0.*) whose seqlens_k and total length come from the attention mask, and a com.microsoft::MoE block
that optimize imports. GroupQueryAttention refuses a mask that is not all ones up to each sequence's length
("seqlens_k[0] = 6 is too small for sequence_length 8") and a cache whose length does not fit the mask.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import moe_onnx
from moe_onnx.cli import main
from moe_onnx.verify import PRECISION_TOLERANCE, InputDrawer, integer_input_ranges, model_precision, verify

VOCAB, HIDDEN, HEADS, KV_HEADS, EXPERTS, INTER, POSITIONS = 50, 32, 4, 2, 4, 16, 64
HEAD = HIDDEN // HEADS
CACHE = ["batch_size", KV_HEADS, "past_sequence_length", HEAD]


def decoder(dtype=np.float32) -> onnx.ModelProto:
    """One decoder layer with a KV cache and an MoE block, in ``dtype``; logits over VOCAB tokens."""
    rng = np.random.default_rng(0)
    element = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))

    def weight(*shape, fan_in):
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(dtype)

    weights = {"embed": weight(VOCAB, HIDDEN, fan_in=1), "positions": weight(POSITIONS, HIDDEN, fan_in=100),
               "wq": weight(HIDDEN, HIDDEN, fan_in=HIDDEN), "wk": weight(HIDDEN, KV_HEADS * HEAD, fan_in=HIDDEN),
               "wv": weight(HIDDEN, KV_HEADS * HEAD, fan_in=HIDDEN), "wo": weight(HIDDEN, HIDDEN, fan_in=HIDDEN),
               "router": weight(HIDDEN, EXPERTS, fan_in=HIDDEN), "lm_head": weight(HIDDEN, VOCAB, fan_in=HIDDEN),
               "fc1": weight(EXPERTS, 2 * INTER, HIDDEN, fan_in=HIDDEN),
               "fc2": weight(EXPERTS, HIDDEN, INTER, fan_in=INTER),
               "rows_shape": np.array([-1, HIDDEN], np.int64), "one": np.array([1], np.int64)}
    node = helper.make_node
    nodes = [
        node("Gather", ["embed", "input_ids"], ["tokens"]),
        node("Gather", ["positions", "position_ids"], ["position"]),
        node("Add", ["tokens", "position"], ["x"]),
        node("MatMul", ["x", "wq"], ["q"]), node("MatMul", ["x", "wk"], ["k"]), node("MatMul", ["x", "wv"], ["v"]),
        node("ReduceSum", ["attention_mask", "one"], ["attended"], keepdims=0),
        node("Sub", ["attended", "one"], ["last"]),
        node("Cast", ["last"], ["seqlens_k"], to=TensorProto.INT32),
        node("Shape", ["attention_mask"], ["mask_shape"]),
        node("Gather", ["mask_shape", "one"], ["total"], axis=0),
        node("Cast", ["total"], ["total_int32"], to=TensorProto.INT32),
        node("Squeeze", ["total_int32"], ["total_sequence_length"]),
        node("GroupQueryAttention", ["q", "k", "v", "past_key_values.0.key", "past_key_values.0.value", "seqlens_k",
                                     "total_sequence_length"], ["attention", "present.0.key", "present.0.value"],
             domain="com.microsoft", num_heads=HEADS, kv_num_heads=KV_HEADS),
        node("MatMul", ["attention", "wo"], ["attention_out"]),
        node("Add", ["x", "attention_out"], ["h"]),
        node("Reshape", ["h", "rows_shape"], ["rows"]),
        node("MatMul", ["rows", "router"], ["router_logits"]),
        node("MoE", ["rows", "router_logits", "fc1", "", "fc2"], ["moe_rows"], domain="com.microsoft", k=2,
             activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=1),
        node("Shape", ["h"], ["h_shape"]),
        node("Reshape", ["moe_rows", "h_shape"], ["moe"]),
        node("Add", ["h", "moe"], ["out"]),
        node("MatMul", ["out", "lm_head"], ["logits"]),
    ]
    present = ["batch_size", KV_HEADS, "total_sequence_length", HEAD]
    graph = helper.make_graph(nodes, "decoder", [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("past_key_values.0.key", element, CACHE),
        helper.make_tensor_value_info("past_key_values.0.value", element, CACHE),
    ], [helper.make_tensor_value_info("logits", element, ["batch_size", "sequence_length", VOCAB]),
        helper.make_tensor_value_info("present.0.key", element, present),
        helper.make_tensor_value_info("present.0.value", element, present)],
        [numpy_helper.from_array(array, name) for name, array in weights.items()])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _drawer(model: onnx.ModelProto) -> InputDrawer:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return InputDrawer.of(sess, model)


def test_a_cache_model_runs_each_size_as_a_prompt_and_the_next_token():
    drawer = _drawer(decoder())
    assert (drawer.size_dims, drawer.past_dims, drawer.total_dims) == (
        ["batch_size", "sequence_length"], ["past_sequence_length"], ["total_sequence_length"])
    prompt, step = drawer.runs((2, 5))
    assert prompt == {"batch_size": 2, "sequence_length": 5, "past_sequence_length": 0, "total_sequence_length": 5}
    assert step == {"batch_size": 2, "sequence_length": 1, "past_sequence_length": 5, "total_sequence_length": 6}
    feeds = drawer.feeds(step, seed=3)
    assert feeds["attention_mask"].shape == (2, 6) and (feeds["attention_mask"] == 1).all()
    assert feeds["position_ids"].tolist() == [[5], [5]]
    assert feeds["past_key_values.0.key"].shape == (2, KV_HEADS, 5, HEAD)
    assert drawer.feeds(prompt)["position_ids"].tolist() == [[0, 1, 2, 3, 4]] * 2
    ids = drawer.feeds(prompt, seed=1)["input_ids"]
    assert ids.min() >= 0 and ids.max() < VOCAB and ids.max() >= 2  # the vocabulary, not {0, 1}


@pytest.mark.parametrize("dtype, tolerance, largest", [(np.float32, 1e-4, 1e-5), (np.float16, 16 * 2.0 ** -11, 8e-3)])
def test_verify_compares_a_decoder_with_a_cache_at_every_size(dtype, tolerance, largest, tmp_path, capsys):
    """Through the command line: every run compared (a prompt and a next token per size), within the
    tolerance of the model's precision, which the report states."""
    original, out, report = tmp_path / "decoder.onnx", tmp_path / "out.onnx", tmp_path / "report.json"
    onnx.save(decoder(dtype), original)
    assert main(["optimize", str(original), "-o", str(out), "--verify", "--sizes", "1x1,2x5",
                 "--report", str(report)]) == 0, capsys.readouterr().out
    printed = capsys.readouterr().out
    precision = np.dtype(dtype).name
    assert f"tolerance: |a - b| <= {tolerance:.2e} + {tolerance:.2e} * |b| (a {precision} model)" in printed
    document = json.loads(report.read_text())["verify"]
    assert (document["ok"], document["tolerance"], document["precision"]) == (True, tolerance, precision)
    assert [(s["sizes"]["past_sequence_length"], s["sizes"]["total_sequence_length"]) for s in document["sizes"]] == [
        (0, 1), (1, 2), (0, 5), (5, 6)]
    assert all(s["compared"] and s["ok"] for s in document["sizes"])
    assert 0 < max(s["max_abs_diff"] for s in document["sizes"]) < largest


def test_quantize_measures_the_error_of_a_decoder_with_a_cache(tmp_path, capsys):
    fused, _ = moe_onnx.optimize(decoder())
    onnx.save(fused, tmp_path / "fused.onnx")
    report = tmp_path / "report.json"
    assert main(["quantize", str(tmp_path / "fused.onnx"), "-o", str(tmp_path / "q.onnx"), "--bits", "8",
                 "--sizes", "1x1,2x5", "--report", str(report)]) == 0, capsys.readouterr().out
    (logits, _, _) = json.loads(report.read_text())["error"]["outputs"]
    assert logits["name"] == "logits" and 0 < logits["max_abs"] < 0.05


def test_the_vocabulary_of_a_block_quantized_embedding():
    gather = helper.make_node("GatherBlockQuantized", ["table", "input_ids", "scales"], ["x"], domain="com.microsoft",
                              gather_axis=0, quantize_axis=1, block_size=16)
    graph = helper.make_graph(
        [gather], "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.zeros((70, 8), np.uint8), "table"),
         numpy_helper.from_array(np.ones((70, 1), np.float32), "scales")])
    assert integer_input_ranges(helper.make_model(graph)) == {"input_ids": 70}


def test_the_precision_is_the_narrowest_float_type_of_the_model():
    assert model_precision(decoder(np.float16)) == "float16" and model_precision(decoder()) == "float32"
    model = decoder()
    model.graph.initializer.append(helper.make_tensor("b", TensorProto.BFLOAT16, [1], [0]))
    assert model_precision(model) == "bfloat16" and PRECISION_TOLERANCE["bfloat16"] == 16 * 2.0 ** -8
    assert verify(model, model, backend="python", sizes=[(1, 2)], time_it=False).tolerance == 16 * 2.0 ** -8
