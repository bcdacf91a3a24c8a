"""moe-onnx quantize --linears: every MatMul/Gemm with a constant weight matrix (not a router) becomes
onnxruntime's com.microsoft::MatMulNBits; each one's output equals numpy's dequantize-then-matmul of its
initializers, and lies within the quantization step of the float layer; the report lists them with their
bytes and errors; the CLI path; what stays float and why; the errors for bad settings."""

from __future__ import annotations

import functools
import json

import numpy as np
import onnx
import pytest
from fixture_models import op_counts, optimized_whole
from onnx import TensorProto, helper, numpy_helper

import moe_onnx
from moe_onnx.check import check_model
from moe_onnx.cli import main
from moe_onnx.ops.qmoe import unpack_codes
from moe_onnx.rewrite.quantize import QuantizeError
from moe_onnx.runtime import session

BACKEND = "cpp"
SIZES = ((1, 1), (2, 5), (3, 17))
WHOLE = "mixtral__tf5__torchscript"  # H 32, I 48 (the experts' K: block 16), vocabulary 128, 2 layers
ROUTER_REASON = "a router (its scores choose the experts"


def fused_whole() -> onnx.ModelProto:
    return optimized_whole(WHOLE, "moe")[0]


@functools.cache
def quantized_whole(bits: int, block_size: int, zero_points: bool):
    return moe_onnx.quantize(fused_whole(), bits, block_size, zero_points=zero_points, linears=True, backend=BACKEND,
                             sizes=SIZES, accuracy_level=0)  # float activations: the numbers checked below


def dense_model() -> onnx.ModelProto:
    """A model without MOE exercising every form of linear layer: K 40 (padded to whole blocks), a weight
    behind a Transpose that a Gather also reads (a tied embedding), a Gemm with transB and a bias, a weight two
    MatMuls read, a K of 8 (below the block size) and a float16 MatMul."""
    rng = np.random.default_rng(7)

    def init(name, shape, dtype=np.float32):  # scaled so that every layer keeps the values near 1
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(dtype), name)

    nodes = [
        helper.make_node("MatMul", ["x", "w_in"], ["h1"], name="in_proj"),  # [40, 64]
        helper.make_node("Gather", ["embed", "ids"], ["emb"], name="embed_lookup"),  # embed [96, 64]
        helper.make_node("Add", ["h1", "emb"], ["h1e"]),
        helper.make_node("Transpose", ["embed"], ["embed_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["h1e", "embed_t"], ["h2"], name="tied_head"),  # K 64, N 96
        helper.make_node("Reshape", ["h2", "rows"], ["h2r"]),
        helper.make_node("Gemm", ["h2r", "g_w", "g_b"], ["g"], name="gemm", transB=1),  # g_w [48, 96]
        helper.make_node("MatMul", ["g", "w_back"], ["y4"], name="back_proj"),  # [48, 40]
        helper.make_node("MatMul", ["y4", "w_in"], ["y5"], name="in_proj_again"),  # reads w_in again
        helper.make_node("MatMul", ["y5", "w_down"], ["y6"], name="down"),  # [64, 8]
        helper.make_node("MatMul", ["y6", "w_small"], ["y"], name="small"),  # K 8
        helper.make_node("Cast", ["y5"], ["y5h"], to=TensorProto.FLOAT16),
        helper.make_node("MatMul", ["y5h", "w_half"], ["zh"], name="half"),  # float16 [64, 24]
        helper.make_node("Cast", ["zh"], ["z"], to=TensorProto.FLOAT),
    ]
    initializers = [init("w_in", (40, 64)), init("embed", (96, 64)), init("g_w", (48, 96)), init("g_b", (48,)),
                    init("w_back", (48, 40)), init("w_down", (64, 8)), init("w_small", (8, 16)),
                    init("w_half", (64, 24), np.float16), numpy_helper.from_array(np.array([-1, 96]), "rows")]
    graph = helper.make_graph(
        nodes, "dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 40]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return onnx.shape_inference.infer_shapes(model)  # as optimize leaves it: a weight behind a Transpose needs them


@functools.cache
def quantized_dense(bits: int, block_size: int, zero_points: bool):
    return moe_onnx.quantize(dense_model(), bits, block_size, zero_points=zero_points, linears=True, backend=BACKEND,
                             sizes=SIZES, accuracy_level=0)


def constant_weight_matmuls(model: onnx.ModelProto) -> list[str]:
    weights = {t.name for t in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]


def with_outputs(model: onnx.ModelProto, names) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    declared = {o.name for o in copy.graph.output}
    copy.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in dict.fromkeys(names) if n not in declared)
    return copy


def layer_values(model: onnx.ModelProto, nodes, feeds) -> dict[str, np.ndarray]:
    """Every input and output of ``nodes`` in a run of ``model`` on ``feeds``."""
    names = [n for node in nodes for n in (*node.input, *node.output) if n]
    names = [n for n in dict.fromkeys(names) if n not in {t.name for t in model.graph.initializer}]
    return dict(zip(names, session(with_outputs(model, names), backend=BACKEND).run(names, feeds)))


def dequantized(node: onnx.NodeProto, weights: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(the weight [N, K] float64 that MatMulNBits ``node`` multiplies by, its quantization step per element):
    (code - zero point) * scale from its B, scales and zero points, as its contract states."""
    attrs = {a.name: a.i for a in node.attribute}
    k, n, bits, block = attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"]
    blocks = -(-k // block)
    packed, scales = weights[node.input[1]], weights[node.input[2]].astype(np.float64)
    assert packed.shape == (n, blocks, block * bits // 8) and packed.dtype == np.uint8 and scales.shape == (n, blocks)
    codes = unpack_codes(packed.reshape(n, -1), bits, blocks * block).reshape(n, blocks, block).astype(np.float64)
    if len(node.input) > 3 and node.input[3]:
        zero_points = unpack_codes(weights[node.input[3]], bits, blocks).astype(np.float64)
    else:
        zero_points = np.full((n, blocks), 1 << (bits - 1), np.float64)
    matrix = ((codes - zero_points[..., None]) * scales[..., None]).reshape(n, -1)[:, :k]
    step = np.repeat(scales, block, axis=1)[:, :k]
    return matrix, step


def check_against_numpy(original: onnx.ModelProto, result: onnx.ModelProto, feeds, zero_points: bool) -> int:
    """Each MatMulNBits of ``result``, on the inputs it gets in a run of ``result``: its output equals A @ the
    dequantized weight (+ bias) within float32 rounding, and the float layer's A @ W within the step: half a
    step per weight (one step with zero points, where the top code may be clipped). Returns how many."""
    float_weights = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in original.graph.initializer}
    original_nodes = {n.name: n for n in original.graph.node}
    producers = {o: n for n in original.graph.node for o in n.output}
    weights = {t.name: numpy_helper.to_array(t) for t in result.graph.initializer}
    matmuls = [n for n in result.graph.node if n.op_type == "MatMulNBits"]
    values = layer_values(result, matmuls, feeds)
    for node in matmuls:
        a, got = values[node.input[0]].astype(np.float64), values[node.output[0]].astype(np.float64)
        matrix, step = dequantized(node, weights)
        bias = weights[node.input[5]] if len(node.input) > 5 else 0.0
        expected = a @ matrix.T + bias
        rounding = np.abs(a) @ np.abs(matrix).T + np.abs(bias)
        tolerance = (1e-3 if weights[node.input[2]].dtype == np.float16 else 1e-5) * rounding + 1e-6
        assert (np.abs(got - expected) <= tolerance).all(), node.name
        source = original_nodes[node.name]
        weight_name = source.input[1]
        if weight_name in producers:  # behind a Transpose
            weight_name = producers[weight_name].input[0]
            float_matrix = float_weights[weight_name]
        else:
            float_matrix = float_weights[weight_name] if source.op_type == "Gemm" else float_weights[weight_name].T
        float_output = a @ float_matrix.T + bias
        bound = np.abs(a) @ ((1.0 if zero_points else 0.5) * step).T * (1 + 1e-4) + tolerance
        assert (np.abs(got - float_output) <= bound).all(), node.name
    return len(matmuls)


# ----------------------------------------------------------------------------- a whole tiny causal LM

@pytest.mark.parametrize("bits, block_size, zero_points", [(4, 16, False), (4, 16, True), (8, 16, False)])
def test_every_linear_of_a_whole_model_becomes_matmulnbits_except_the_routers(bits, block_size, zero_points):
    original = fused_whole()
    result, report = quantized_whole(bits, block_size, zero_points)
    routers = [n.name for n in original.graph.node if n.op_type == "MatMul" and "/mlp/gate/" in n.name]
    linears = [name for name in constant_weight_matmuls(original) if name not in routers]
    assert len(routers) == 2 and len(linears) == 9  # q, k, v, o of 2 layers and lm_head
    assert sorted(n.name for n in result.graph.node if n.op_type == "MatMulNBits") == sorted(linears)
    assert sorted(constant_weight_matmuls(result)) == sorted(routers)
    assert op_counts(result)["QMOE"] == 2 and {o.domain: o.version for o in result.opset_import}["com.microsoft"] == 1
    assert [linear.node for linear in report.linears] == linears
    assert [(s.node, s.reason[:len(ROUTER_REASON)]) for s in report.linears_float] == [(r, ROUTER_REASON)
                                                                                      for r in routers]
    for node in (n for n in result.graph.node if n.op_type == "MatMulNBits"):
        attrs = {a.name: a.i for a in node.attribute}
        assert attrs == {"K": 32, "N": 128 if "lm_head" in node.name else 32, "bits": bits, "block_size": block_size,
                         "accuracy_level": 0}
        assert (len(node.input) == 4) == zero_points
    feeds = {"input_ids": np.random.default_rng(3).integers(0, 128, (2, 7)), "attention_mask": np.ones((2, 7), np.int64)}
    assert check_against_numpy(original, result, feeds, zero_points) == 9


def test_report_gives_each_linear_bytes_and_error():
    result, report = quantized_whole(4, 16, True)
    head = report.linears[-1]
    # [K, N] float32 -> B [N, 2 blocks, 8] + scales [N, 2] float32 + zero points [N, 1]
    assert (head.node, head.k, head.n, head.weight_bytes_before, head.weight_bytes_after) == (
        "/model/lm_head/MatMul", 32, 128, 32 * 128 * 4, 128 * 16 + 128 * 2 * 4 + 128)
    assert not head.float_kept and head.shares_weight_of is None
    assert [s.name for s in report.error.linears] == [linear.output for linear in report.linears]
    (logits,) = report.error.outputs
    assert report.error.linears[-1] == logits  # lm_head's output is the logits
    attention = report.error.linears[0]  # layer 0's q_proj reads the embedding, exactly as before
    assert 0 < attention.relative < 0.2 and attention.relative < logits.relative
    summary = report.summary()
    assert "9 linear layers -> com.microsoft::MatMulNBits (int4, block 16, with zero points, accuracy_level 0)" in summary
    assert f"linear weights: {8 * 4096 + 16384:,} -> {sum(x.weight_bytes_after for x in report.linears):,}" in summary
    assert f"linear '/model/lm_head/MatMul' (output 'logits'): max abs {logits.max_abs:.3g}" in summary
    assert "left float: /model/model/layers.0/mlp/gate/MatMul" in summary
    document = report.document()
    assert document["linears"][-1]["weight_bytes_after"] == head.weight_bytes_after
    assert document["error"]["linears"][-1]["max_abs"] == logits.max_abs


def test_int8_linears_stay_close_until_a_token_is_rerouted():
    """The first layer's linears see the float model's inputs: int8 keeps them within 1% (measured 0.5-0.7%).
    Past the first MoE block a token the router sends elsewhere moves the rest (the report says how many)."""
    _, report = quantized_whole(8, 16, False)
    first_layer = [linear for linear in report.error.linears if "layers.0/" in linear.name]
    assert len(first_layer) == 4 and all(0 < linear.relative < 0.01 for linear in first_layer), first_layer
    rerouted = sum(layer.rerouted for layer in report.error.layers)
    assert rerouted > 0 or report.error.outputs[0].relative < 0.03, report.error.outputs[0]


def test_target_ort_keeps_matmulnbits(tmp_path):
    result, _ = quantized_whole(4, 16, False)
    exported, _ = moe_onnx.optimize(result, target="ort")
    counts = op_counts(exported)
    assert counts["MatMulNBits"] == 9 and counts["QMoE"] == 2 and counts["QMOE"] == 0
    source = {n.name: n for n in result.graph.node if n.op_type == "MatMulNBits"}
    for node in (n for n in exported.graph.node if n.op_type == "MatMulNBits"):
        assert node.domain == "com.microsoft" and list(node.input) == list(source[node.name].input)


# ----------------------------------------------------------------------------- every form of linear

@pytest.mark.parametrize("bits, block_size, zero_points", [(4, 16, False), (4, 32, True), (8, 32, False)])
def test_dense_model_linears_padded_transposed_gemm_shared_and_float16(bits, block_size, zero_points):
    original = dense_model()
    result, report = quantized_dense(bits, block_size, zero_points)
    quantized = {linear.node: linear for linear in report.linears}
    assert set(quantized) == {"in_proj", "tied_head", "gemm", "back_proj", "in_proj_again", "down", "half"}
    assert [(s.node, s.reason) for s in report.linears_float] == [
        ("small", f"K = 8 is below the block size {block_size} (the block would be mostly padding)")]
    assert quantized["in_proj_again"].shares_weight_of == "in_proj" and quantized["in_proj_again"].weight_bytes_after == 0
    assert quantized["tied_head"].float_kept and "embed" in {t.name for t in result.graph.initializer}
    assert not quantized["in_proj"].float_kept and "w_in" not in {t.name for t in result.graph.initializer}
    padded = -(-40 // block_size) * block_size
    assert f"in_proj: MatMul (weight w_in), K 40, N 64, K padded to {padded}" in report.summary()
    assert quantized["tied_head"].op == "MatMul (weight embed <- transpose)"
    gemm = next(n for n in result.graph.node if n.name == "gemm")
    assert gemm.op_type == "MatMulNBits" and gemm.input[5] == "g_b" and gemm.input[4] == ""
    half = next(n for n in result.graph.node if n.name == "half")
    scales = next(t for t in result.graph.initializer if t.name == half.input[2])
    assert scales.data_type == TensorProto.FLOAT16 and quantized["half"].weight_bytes_before == 64 * 24 * 2
    assert op_counts(result)["Transpose"] == 0  # only the quantized head read it
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((2, 3, 40)).astype(np.float32), "ids": rng.integers(0, 96, (2, 3))}
    assert check_against_numpy(original, result, feeds, zero_points) == 7
    assert check_model(result) == []
    assert report.summary().startswith("quantize: 7 linear layers -> com.microsoft::MatMulNBits")  # no MOE lines


def test_whole_model_defaults_to_int8_activations():
    """--linears without an accuracy_level: every QMOE and MatMulNBits at 4 (int8 activations, as llama.cpp's Q4_0
    mix multiplies); the experts alone keep their MOE's level (0)."""
    def levels(model: onnx.ModelProto) -> dict[str, set[int]]:
        found: dict[str, set[int]] = {}
        for node in model.graph.node:
            if node.op_type in ("QMOE", "MatMulNBits"):
                found.setdefault(node.op_type, set()).add(
                    next((a.i for a in node.attribute if a.name == "accuracy_level"), 0))
        return found

    whole, report = moe_onnx.quantize(fused_whole(), 4, 16, linears=True, measure=False)
    assert levels(whole) == {"QMOE": {4}, "MatMulNBits": {4}}
    assert "9 linear layers -> com.microsoft::MatMulNBits (int4, block 16, symmetric, accuracy_level 4)" in (
        report.summary())
    experts, _ = moe_onnx.quantize(fused_whole(), 4, 16, measure=False)
    assert levels(experts) == {"QMOE": {0}}


# ----------------------------------------------------------------------------- the token embedding

@pytest.mark.parametrize("bits, zero_points", [(4, False), (4, True), (8, False)])
def test_embedding_becomes_gatherblockquantized(bits, zero_points):
    """With embedding the token embedding's Gather becomes com.microsoft::GatherBlockQuantized: the rows onnxruntime
    gathers are numpy's (code - zero point) * scale of its initializers (zero point 2^(bits-1) when symmetric), within
    half a quantization step of the float table (a step with zero points); the float table stays for the tied
    lm_head (not quantized here), which the report says."""
    original = dense_model()
    result, report = moe_onnx.quantize(original, bits, 16, zero_points=zero_points, embedding=True, measure=False)
    (node,) = [n for n in result.graph.node if n.op_type == "GatherBlockQuantized"]
    assert {a.name: a.i for a in node.attribute} == {"gather_axis": 0, "quantize_axis": 1, "block_size": 16,
                                                     "bits": bits}
    assert [(e.node, e.vocabulary, e.hidden, e.float_kept) for e in report.embeddings] == [("embed_lookup", 96, 64,
                                                                                            True)]
    weights = {t.name: numpy_helper.to_array(t) for t in result.graph.initializer}
    packed, scales = weights[node.input[0]], weights[node.input[2]].astype(np.float64)
    assert packed.dtype == np.uint8 and packed.shape == (96, 64 * bits // 8) and scales.shape == (96, 4)
    codes = unpack_codes(packed, bits, 64).reshape(96, 4, 16).astype(np.float64)
    zero = (unpack_codes(weights[node.input[3]], bits, 4).astype(np.float64) if zero_points
            else np.full((96, 4), 1 << (bits - 1), np.float64))
    table = ((codes - zero[..., None]) * scales[..., None]).reshape(96, 64)
    ids = np.random.default_rng(5).integers(0, 96, (2, 7))
    gathered = layer_values(result, [node], {"x": np.zeros((2, 7, 40), np.float32), "ids": ids})[node.output[0]]
    np.testing.assert_allclose(gathered, table[ids], rtol=1e-6, atol=1e-7)
    float_table = numpy_helper.to_array(next(t for t in original.graph.initializer if t.name == "embed"))
    step = np.repeat(scales, 16, axis=1)[ids]
    assert (np.abs(gathered - float_table[ids]) <= (1.0 if zero_points else 0.5) * step * (1 + 1e-4) + 1e-7).all()
    assert "1 token embedding -> com.microsoft::GatherBlockQuantized" in report.summary()


# ----------------------------------------------------------------------------- the command line

def test_cli_quantize_linears_writes_a_checked_model_and_report(tmp_path, capsys):
    source, out, report = tmp_path / "fused.onnx", tmp_path / "q.onnx", tmp_path / "report.json"
    onnx.save(fused_whole(), source)
    status = main(["quantize", str(source), "-o", str(out), "--bits", "4", "--block-size", "16", "--linears",
                   "--backend", BACKEND, "--sizes", "1x1,2x5", "--report", str(report)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "9 linear layers -> com.microsoft::MatMulNBits (int4, block 16, symmetric" in printed
    document = json.loads(report.read_text())
    assert len(document["linears"]) == len(document["error"]["linears"]) == 9 and len(document["linears_float"]) == 2
    assert check_model(out) == [] and op_counts(onnx.load(out))["MatMulNBits"] == 9


def test_cli_quantize_linears_of_external_data_reads_the_weights_chunk_by_chunk(tmp_path, capsys):
    source, out = tmp_path / "dense.onnx", tmp_path / "q.onnx"
    onnx.save(dense_model(), source, save_as_external_data=True, location="dense.data", size_threshold=64)
    assert main(["quantize", str(source), "-o", str(out), "--bits", "4", "--block-size", "16", "--linears",
                 "--no-measure"]) == 0, capsys.readouterr()
    assert check_model(out) == [] and op_counts(onnx.load(out))["MatMulNBits"] == 7
    expected, _ = quantized_dense(4, 16, False)
    got = {t.name: numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}
    for tensor in expected.graph.initializer:
        np.testing.assert_array_equal(got[tensor.name], numpy_helper.to_array(tensor), err_msg=tensor.name)


@pytest.mark.parametrize("argv, message", [
    (["--bits", "4", "--linears"], "moe-onnx quantize: linears: MatMulNBits quantizes in blocks along K; block_size 0 "
                                   "(per column) is not available: give a block size (a power of two in [16, 256])"),
    (["--bits", "4", "--block-size", "24", "--linears"], "moe-onnx quantize: block_size is 24; expected 0"),
])
def test_cli_bad_linear_settings_exit_2_in_one_line(argv, message, tmp_path, capsys):
    source, out = tmp_path / "dense.onnx", tmp_path / "q.onnx"
    onnx.save(dense_model(), source)
    assert main(["quantize", str(source), "-o", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and not out.exists()


def test_model_with_nothing_to_quantize_is_refused():
    model = dense_model()
    with pytest.raises(QuantizeError) as caught:
        moe_onnx.quantize(model, 4, 128, linears=True, measure=False)  # every K is below 128
    assert str(caught.value) == ("the model has no MOE node and no linear layer (MatMul or Gemm with a constant weight "
                                 "matrix) to quantize (8 left float; 'in_proj': K = 40 is below the block size 128 (the "
                                 "block would be mostly padding))")
