"""The optimize pass's grouped-query attention (moe_onnx/rewrite/grouped_query.py): the attention MatMuls read the
kv cache itself instead of transformers' repeat_kv copy (Unsqueeze -> Expand -> Reshape to every query head), with
the same outputs, at prefill and decode, for every target; repeats it does not recognize stay as exported."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import moe_onnx

HEADS, KV_HEADS, HEAD_SIZE = 8, 2, 4
KV_FIXTURES = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "kv"


def _repeat_kv(name: str, nodes: list[onnx.NodeProto], axis: int = 2) -> str:
    """transformers' repeat_kv of cache ``name`` [B, KV_HEADS, L, D] as the dynamo exporter writes it: the Expand
    and Reshape shapes read from the cache's own dims."""
    groups = HEADS // KV_HEADS
    nodes += [
        helper.make_node("Shape", [name], [f"{name}_b"], start=0, end=1),
        helper.make_node("Shape", [name], [f"{name}_l"], start=2, end=3),
        helper.make_node("Concat", [f"{name}_b", "kv_heads", "groups", f"{name}_l", "head_size"], [f"{name}_to"],
                         axis=0),
        helper.make_node("Concat", [f"{name}_b", "heads", f"{name}_l", "head_size"], [f"{name}_all"], axis=0),
        helper.make_node("Unsqueeze", [name, f"axis{axis}"], [f"{name}_u"]),
        helper.make_node("Expand", [f"{name}_u", f"{name}_to"], [f"{name}_x"]),
        helper.make_node("Reshape", [f"{name}_x", f"{name}_all"], [f"{name}_rep"]),
    ]
    assert groups > 1
    return f"{name}_rep"


def attention_model(axis: int = 2) -> onnx.ModelProto:
    """Eager GQA attention over a cache: q [B, H, S, D], present key/value [B, Hkv, L, D] and an additive mask
    [B, 1, S, L] -> [B, H, S, D]: softmax(q @ repeat(k)^T * scale + mask) @ repeat(v)."""
    nodes: list[onnx.NodeProto] = []
    key, value = _repeat_kv("key", nodes, axis), _repeat_kv("value", nodes, axis)
    nodes += [
        helper.make_node("Transpose", [key], ["key_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["query", "key_t"], ["scores"]),
        helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
        helper.make_node("Add", ["scaled", "mask"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", value], ["output"]),
    ]
    ints = {"kv_heads": [KV_HEADS], "groups": [HEADS // KV_HEADS], "heads": [HEADS], "head_size": [HEAD_SIZE],
            f"axis{axis}": [axis]}
    initializers = [helper.make_tensor(name, TensorProto.INT64, [len(v)], v) for name, v in ints.items()]
    initializers.append(helper.make_tensor("scale", TensorProto.FLOAT, [], [HEAD_SIZE ** -0.5]))
    cache = ["batch", KV_HEADS, "total", HEAD_SIZE]
    graph = helper.make_graph(nodes, "gqa", [
        helper.make_tensor_value_info("query", TensorProto.FLOAT, ["batch", HEADS, "sequence", HEAD_SIZE]),
        helper.make_tensor_value_info("key", TensorProto.FLOAT, cache),
        helper.make_tensor_value_info("value", TensorProto.FLOAT, cache),
        helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", 1, "sequence", "total"]),
    ], [helper.make_tensor_value_info("output", TensorProto.FLOAT, None)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _feeds(batch: int, sequence: int, past: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(sequence)
    total = past + sequence
    causal = np.where(np.arange(total)[None, :] <= past + np.arange(sequence)[:, None], 0.0, -np.inf)
    return {"query": rng.standard_normal((batch, HEADS, sequence, HEAD_SIZE), np.float32),
            "key": rng.standard_normal((batch, KV_HEADS, total, HEAD_SIZE), np.float32),
            "value": rng.standard_normal((batch, KV_HEADS, total, HEAD_SIZE), np.float32),
            "mask": np.broadcast_to(causal, (batch, 1, sequence, total)).astype(np.float32)}


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _ops(model: onnx.ModelProto) -> list[str]:
    return [node.op_type for node in model.graph.node]


@pytest.mark.parametrize("target", ["moe", "ort"])
def test_attention_reads_the_cache_unrepeated(target):
    """No Expand is left, each MatMul reads the cache itself, the report notes the two MatMuls, and the outputs are
    the repeated form's at prefill (3 tokens after 5) and decode (1 after 9), batch 2."""
    model = attention_model()
    optimized, report = moe_onnx.optimize(model, target)
    assert "Expand" not in _ops(optimized) and "Unsqueeze" not in _ops(optimized)
    assert "GroupedQueryMatMul: 2 attention MatMuls read the kv heads unrepeated" in report.notes
    matmul_inputs = {name for node in optimized.graph.node if node.op_type == "MatMul" for name in node.input}
    assert "value" in matmul_inputs  # the values unrepeated; the keys behind their Transpose
    for sequence, past in ((3, 5), (1, 9)):
        feeds = _feeds(2, sequence, past)
        expected = _run(model, feeds)
        np.testing.assert_allclose(_run(optimized, feeds), expected, rtol=1e-5, atol=1e-6)
        assert expected.shape == (2, HEADS, sequence, HEAD_SIZE)


def test_a_repeat_on_another_axis_stays():
    """kv heads unsqueezed on axis 1 ([B, 1, Hkv, L, D] expanded): not repeat_kv's layout, so the graph stays."""
    model = attention_model(axis=1)
    model.graph.node[2].input[:] = ["key_b", "groups", "kv_heads", "key_l", "head_size"]
    model.graph.node[9].input[:] = ["value_b", "groups", "kv_heads", "value_l", "head_size"]
    optimized, report = moe_onnx.optimize(model)
    assert _ops(optimized).count("Expand") == 2
    assert [note for note in report.notes if note.startswith("GroupedQueryMatMul")] == [
        f"GroupedQueryMatMul: the repeated kv heads '{name}_rep' stay: the repeated heads are not Unsqueeze(kv "
        f"[B, Hkv, L, D], axes=[2])" for name in ("key", "value")]
    feeds = _feeds(2, 3, 5)
    np.testing.assert_array_equal(_run(optimized, feeds), _run(model, feeds))


def test_mimo_fixture_reads_its_cache_unrepeated():
    """The committed MiMo-V2-Flash KV fixture (2 kv heads for 4 query heads, made by `moe-onnx export`): no
    Expand reads a present key or value (test_export_kv checks its tokens and logits against torch's)."""
    model = onnx.load(KV_FIXTURES / "mimo_v2_flash" / "model.onnx", load_external_data=False)
    producers = {output: node for node in model.graph.node for output in node.output}
    expands = [node for node in model.graph.node if node.op_type == "Expand"
               and producers.get(node.input[0]) is not None and producers[node.input[0]].op_type == "Unsqueeze"
               and producers[node.input[0]].input[0].startswith("present.")]
    assert expands == []
