"""moe-onnx quantize: every MOE of a fused model becomes a QMOE; its error against fp32 on every fixture
family, the numbers the report gives, exact MXFP4 repacking, the GEMM2 transposition, the weights written
one expert at a time, and the errors for bad arguments."""

from __future__ import annotations

import functools
import json

import numpy as np
import onnx
import pytest
from backends import cached_session
from fixture_models import FIXTURES, MANIFEST, WHOLE_FIXTURES, WHOLE_MANIFEST, op_counts, optimized
from onnx import numpy_helper

import moe_onnx
from moe_onnx.pipeline import quantize as quantize_job
from moe_onnx.rewrite import quantize as quantize_pass
from moe_onnx.check import check_model
from moe_onnx.cli import main
from moe_onnx.ops import DOMAIN
from moe_onnx.ops.moe import GEMM2_BIAS_SWIGLU_CLAMP, LINEARS
from moe_onnx.ops.qmoe import E2M1_VALUES, SCALES, ZERO_POINTS, dequantize, quantize
from moe_onnx.pipeline import quantize_file
from moe_onnx.rewrite.quantize import QuantizeError, QuantizeSettings, mxfp4_exact
from moe_onnx.runtime import session

BACKEND = "cpp"  # the family tests' kernels; the exactness tests run on both backends
BACKENDS = ("cpp", "python")
SIZES = ((1, 1), (2, 5), (3, 17))

# One block fixture per family: its first small export (every K, H and I, a multiple of 32).
FAMILY_FIXTURES = {}
for _name in sorted(MANIFEST):
    _entry = MANIFEST[_name]
    if _entry["size"] == "small" and _entry["hidden_size"] % 32 == 0 and _entry["intermediate_size"] % 32 == 0:
        FAMILY_FIXTURES.setdefault(_entry["family"], _name)

# settings -> the bound on the relative error (max abs error / max |fp32 output|) of every family's output.
# Measured (tests/test_quantize.py's table in the report): int8 per column 0.004-0.013, int4 block 32
# 0.075-0.25, int4 block 32 with zero points 0.06-0.21; the bounds leave about 1.5x of margin.
CONFIGS = {
    "int8_column": (dict(bits=8, block_size=0), 0.02),
    "int4_block32": (dict(bits=4, block_size=32), 0.4),
    "int4_block32_zp": (dict(bits=4, block_size=32, zero_points=True), 0.35),
}


def fused(name: str) -> onnx.ModelProto:
    return optimized(name, "moe")[0]


@functools.cache
def quantized(name: str, config: str):
    settings, _ = CONFIGS[config]
    return moe_onnx.quantize(fused(name), **settings, backend=BACKEND, sizes=SIZES)


def moe_nodes(model: onnx.ModelProto, op_type: str = "MOE") -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == op_type]


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def max_errors(original: onnx.ModelProto, result: onnx.ModelProto, name: str) -> tuple[float, float]:
    """(max abs error, max |fp32|) of output ``output`` over SIZES, inputs drawn independently of the
    report: standard normal hidden states from a generator seeded with the size's index."""
    hidden = MANIFEST[name]["hidden_size"]
    reference, quantized_sess = cached_session(original, BACKEND), session(result, backend=BACKEND)
    error = peak = 0.0
    for index, (batch, seq) in enumerate(SIZES):
        x = np.random.default_rng(index).standard_normal((batch, seq, hidden)).astype(np.float32)
        (expected,), (got,) = reference.run(["output"], {"hidden_states": x}), quantized_sess.run(["output"],
                                                                                                 {"hidden_states": x})
        error = max(error, float(np.abs(got.astype(np.float64) - expected).max()))
        peak = max(peak, float(np.abs(expected).max()))
    return error, peak


# ----------------------------------------------------------------------------- every family

@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("family", sorted(FAMILY_FIXTURES))
def test_quantized_family_within_bound_and_reported_as_measured(family, config):
    name = FAMILY_FIXTURES[family]
    settings, bound = CONFIGS[config]
    result, report = quantized(name, config)
    original = fused(name)
    assert len(moe_nodes(result, "QMOE")) == len(moe_nodes(original)) == len(report.layers) >= 1
    assert not moe_nodes(result) and check_model(result) == []
    for node, layer in zip(moe_nodes(result, "QMOE"), report.layers):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["quant_type"], attrs["bits"], attrs["block_size"]) == (b"int", settings["bits"],
                                                                              settings["block_size"])
        assert (layer.quant_type, layer.zero_points) == ("int", settings.get("zero_points", False))
        has_zero_points = len(node.input) > ZERO_POINTS[3] and node.input[ZERO_POINTS[3]] != ""
        assert has_zero_points == settings.get("zero_points", False)
    output = next(s for s in report.error.outputs if s.name == "output")
    error, peak = max_errors(original, result, name)
    assert (output.max_abs, output.reference_max) == (error, peak)
    assert output.relative == pytest.approx(error / peak, rel=1e-12)
    assert 0 < output.relative < bound, report.summary()
    assert report.weight_bytes_after < report.weight_bytes_before * (0.3 if settings["bits"] == 8 else 0.2)


@pytest.mark.slow
def test_int4_error_is_larger_than_int8():
    for name in FAMILY_FIXTURES.values():
        int8 = quantized(name, "int8_column")[1].error.outputs[0].relative
        int4 = quantized(name, "int4_block32")[1].error.outputs[0].relative
        assert int4 > 3 * int8, name


@functools.cache
def quantized_whole(name: str, **settings):
    model, _ = moe_onnx.optimize(onnx.load(WHOLE_FIXTURES / WHOLE_MANIFEST[name]["file"]))
    return moe_onnx.quantize(model, **settings, backend=BACKEND, sizes=SIZES)


@pytest.mark.slow
def test_layer_errors_reported_for_each_moe_of_a_whole_model():
    name = "gpt_oss__tf457__torchscript"
    result, report = quantized_whole(name, bits=8)
    assert len(report.layers) == len(report.error.layers) == WHOLE_MANIFEST[name]["moe_layers"] == 2
    (logits,) = report.error.outputs  # random input_ids: the embedding's rows
    assert logits.name == "logits" and 0 < logits.relative < 0.02
    assert all(0 < layer.relative < 0.02 and layer.tokens == 1 + 2 * 5 + 3 * 17 for layer in report.error.layers)
    # the layers are the QMOE outputs, not the model's output
    assert {s.name for s in report.error.layers} == {n.output[0] for n in moe_nodes(result, "QMOE")}
    assert "layer 'node_MOE_1'" in report.summary()
    first, second = report.error.layers
    assert (first.rerouted, first.routing_weight_change) == (0, 0.0)  # its router reads no quantized layer
    assert second.rerouted == 0 and 0 < second.routing_weight_change < 0.01


def test_routing_change_is_reported_where_it_explains_a_layer_error():
    """PhiMoE's sparsemixer masks scores by a threshold: a small change of its input moves a routing
    weight by a lot; the report shows it beside the layer's error."""
    _, report = quantized_whole("phimoe__tf5__dynamo", bits=8)
    first, second = report.error.layers
    assert first.relative < 0.02 and first.routing_weight_change == 0.0
    assert second.routing_weight_change > 0.1 and second.relative > 5 * first.relative
    assert "routing weights moved by up to" in report.summary() and "a routing weight that moves" in report.summary()


def test_accuracy_level_4_is_set_and_close_to_level_0():
    name = FAMILY_FIXTURES["qwen3_moe"]
    result, report = moe_onnx.quantize(fused(name), bits=8, accuracy_level=4, backend=BACKEND, sizes=SIZES)
    (node,) = moe_nodes(result, "QMOE")
    assert {a.name: a.i for a in node.attribute if a.name == "accuracy_level"} == {"accuracy_level": 4}
    level0 = quantized(name, "int8_column")[1].error.outputs[0].relative
    assert level0 <= report.error.outputs[0].relative < 2 * level0 + 0.01


# ----------------------------------------------------------------------------- exactly representable weights

def with_expert_weights(model: onnx.ModelProto, make) -> tuple[onnx.ModelProto, dict[int, np.ndarray]]:
    """A copy of the one-MOE ``model`` whose weights are ``make(shape)``, made in QMOE's [E, N, K] layout and
    stored in MOE's (GEMM2: transposed); returns the copy and the [E, N, K] weights by input position."""
    copy = onnx.ModelProto.FromString(model.SerializeToString())
    (node,) = moe_nodes(copy)
    expert_type = next(a.s.decode() for a in node.attribute if a.name == "expert_type")
    stored = {t.name: t for t in copy.graph.initializer}
    weights = {}
    for index, *_ in LINEARS[expert_type]:
        tensor = stored[node.input[index]]
        transposed = expert_type == GEMM2_BIAS_SWIGLU_CLAMP
        e, a, b = tensor.dims
        weights[index] = make((e, b, a) if transposed else (e, a, b))
        tensor.CopyFrom(numpy_helper.from_array(weights[index].transpose(0, 2, 1) if transposed else weights[index],
                                                tensor.name))
    return copy, weights


def random_mxfp4(shape, seed: int = 0) -> np.ndarray:
    """float32 [E, N, K] of random E2M1 codes times a random power of two per block of 32."""
    rng = np.random.default_rng(seed)
    e, n, k = shape
    codes = rng.integers(0, 16, size=shape)
    exponents = rng.integers(-6, 3, size=(e, n, k // 32)).repeat(32, axis=-1)
    return np.ldexp(E2M1_VALUES[codes], exponents).astype(np.float32)


def random_int8_exact(shape, seed: int = 0) -> np.ndarray:
    """float32 [E, N, K] that symmetric int8 per-column quantization holds exactly: integers in [-127, 127]
    with 127 in every column, times 2^-7."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-127, 128, size=shape)
    q[..., 0] = 127
    return np.ldexp(q, -7).astype(np.float32)


EXPERT_TYPE_FIXTURES = {"GEMM2_BIAS_SWIGLU_CLAMP": FAMILY_FIXTURES["gpt_oss"],
                        "GEMM3_SWIGLU": FAMILY_FIXTURES["mixtral"], "GEMM2_ACT": FAMILY_FIXTURES["nemotron_h"]}


def test_mxfp4_exact_finds_the_codes_of_random_mxfp4_weights():
    weights = random_mxfp4((3, 8, 64), seed=1)
    for matrix in weights:
        packed, scales = mxfp4_exact(matrix)
        assert packed.shape == (8, 32) and scales.shape == (8, 2) and scales.dtype == np.uint8
        restored = dequantize(packed, scales, bits=4, block_size=32, quant_type="mxfp4", k_dim=64)
        np.testing.assert_array_equal(restored, matrix)
    assert mxfp4_exact(np.zeros((2, 32), np.float32)) is not None  # a block of zeros
    off = weights[0].copy()
    off[3, 40] = np.nextafter(off[3, 40], np.float32(np.inf))  # one value one ulp away
    assert mxfp4_exact(off) is None
    assert mxfp4_exact(weights[0][:, :48]) is None  # K not a multiple of 32
    seven = weights[0].copy()
    seven[0, :32] = 0
    seven[0, 0], seven[0, 1] = 6, 7  # 7 is no E2M1 value at the scale that holds 6
    assert mxfp4_exact(seven) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_mxfp4_weights_are_repacked_exactly(backend):
    model, weights = with_expert_weights(fused(FAMILY_FIXTURES["gpt_oss"]), random_mxfp4)
    result, report = moe_onnx.quantize(model, bits=8, accuracy_level=4, backend=backend, sizes=SIZES)
    (layer,) = report.layers
    assert (layer.quant_type, layer.bits, layer.block_size, layer.accuracy_level) == ("mxfp4", 4, 32, 0)
    assert "repacked, not requantized" in report.summary() and "accuracy_level 4 does not apply" in report.summary()
    (node,) = moe_nodes(result, "QMOE")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert (attrs["quant_type"], attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (b"mxfp4", 4, 32, 0)
    values = initializers(result)
    for index, expected in weights.items():
        restored = dequantize(values[node.input[index]], values[node.input[SCALES[index]]], bits=4, block_size=32,
                              quant_type="mxfp4", k_dim=expected.shape[-1])
        np.testing.assert_array_equal(restored, expected)  # exact: what is left is the float32 sums' order
    assert all(s.relative < 1e-5 for s in report.error.outputs + report.error.layers), report.summary()


def test_mxfp4_repack_can_be_turned_off():
    model, _ = with_expert_weights(fused(FAMILY_FIXTURES["gpt_oss"]), random_mxfp4)
    _, report = moe_onnx.quantize(model, bits=8, repack_mxfp4=False, backend=BACKEND, sizes=SIZES)
    assert report.layers[0].quant_type == "int" and report.error.outputs[0].max_abs > 0


def test_fixture_weights_are_not_mxfp4():
    _, report = quantized(FAMILY_FIXTURES["gpt_oss"], "int8_column")
    assert [layer.quant_type for layer in report.layers] == ["int"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("expert_type", EXPERT_TYPE_FIXTURES)
def test_qmoe_of_exactly_representable_weights_equals_moe(expert_type, backend):
    """int8 per column holds these weights exactly, so only the layout can make QMOE differ from MOE:
    GEMM2's transposition (gpt_oss small's down weight is square, 64 x 64: a wrong transposition keeps
    the shapes valid)."""
    model, weights = with_expert_weights(fused(EXPERT_TYPE_FIXTURES[expert_type]), random_int8_exact)
    result, report = moe_onnx.quantize(model, bits=8, backend=backend, sizes=SIZES)
    (node,) = moe_nodes(result, "QMOE")
    values = initializers(result)
    for index, expected in weights.items():
        restored = dequantize(values[node.input[index]], values[node.input[SCALES[index]]], bits=8, block_size=0,
                              k_dim=expected.shape[-1])
        np.testing.assert_array_equal(restored, expected)
    (output,) = [s for s in report.error.outputs if s.name == "output"]
    assert output.relative < 1e-5, report.summary()  # float32 sums in another order; a wrong layout: ~1


# ----------------------------------------------------------------------------- writing

def test_file_quantized_one_expert_at_a_time_with_external_data(tmp_path, monkeypatch):
    name = FAMILY_FIXTURES["mixtral"]
    source = tmp_path / "fused.onnx"
    copy = onnx.ModelProto.FromString(fused(name).SerializeToString())  # onnx.save externalizes it in place
    onnx.save(copy, source, save_as_external_data=True, location="fused.onnx.data", size_threshold=1024)
    calls = []

    def counting_quantize(w, **kwargs):
        calls.append(w.shape)
        return quantize(w, **kwargs)

    monkeypatch.setattr(quantize_pass, "quantize_weight", counting_quantize)
    settings = QuantizeSettings(bits=4, block_size=32, zero_points=True)
    result = quantize_file(source, tmp_path / "out" / "q.onnx", settings, backend=BACKEND, sizes=SIZES)
    experts, n, k = MANIFEST[name]["num_experts"], MANIFEST[name]["intermediate_size"], MANIFEST[name]["hidden_size"]
    assert sorted(calls) == sorted([(n, k)] * experts * 2 + [(k, n)] * experts)  # gate, up, down: each expert once
    assert result.ok and (tmp_path / "out" / "q.onnx.data").exists()
    written = onnx.load(tmp_path / "out" / "q.onnx")
    (node,) = moe_nodes(written, "QMOE")
    values, originals = initializers(written), initializers(fused(name))
    (moe,) = moe_nodes(fused(name))
    for index in (3, 5, 7):  # the expert slices, stacked, are the whole weight quantized at once
        whole = quantize(originals[moe.input[index]], bits=4, block_size=32, symmetric=False)
        for position, part in zip((index, SCALES[index], ZERO_POINTS[index]), whole):
            np.testing.assert_array_equal(values[node.input[position]], part)
    assert 0 < result.report.error.outputs[0].relative < CONFIGS["int4_block32_zp"][1]


def test_error_measured_one_session_at_a_time(tmp_path, sessions_alive_at_creation):
    """The unquantized model runs on every input and is freed before the quantized one loads: the peak is the
    larger model's, not both (docs/cli.md); the error is the one both models give on the same inputs."""
    name = FAMILY_FIXTURES["mixtral"]
    source = tmp_path / "fused.onnx"
    onnx.save(fused(name), source)
    before = len(sessions_alive_at_creation)  # those of optimizing the fixture, when not cached yet
    result = quantize_file(source, tmp_path / "q.onnx", QuantizeSettings(bits=8), backend=BACKEND, sizes=SIZES)
    assert result.ok and sessions_alive_at_creation[before:] == [0, 0]  # the unquantized session, then the quantized
    output = next(s for s in result.report.error.outputs if s.name == "output")
    error, peak = max_errors(fused(name), onnx.load(tmp_path / "q.onnx"), name)
    assert (output.max_abs, output.reference_max) == (error, peak) and 0 < output.relative < CONFIGS["int8_column"][1]


def test_cli_quantize_prints_the_error_and_writes_the_report(tmp_path, capsys):
    source, out, report = tmp_path / "fused.onnx", tmp_path / "q.onnx", tmp_path / "report.json"
    onnx.save(fused(FAMILY_FIXTURES["olmoe"]), source)
    status = main(["quantize", str(source), "-o", str(out), "--bits", "4", "--block-size", "32", "--backend",
                   BACKEND, "--sizes", "1x1,2x5", "--report", str(report)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "1 MOE node -> QMOE (int4, block 32, symmetric" in printed and "output 'output': max abs" in printed
    document = json.loads(report.read_text())
    (output,) = document["error"]["outputs"]
    assert f"max abs {output['max_abs']:.3g}, relative {output['relative']:.3g}" in printed
    assert document["layers"][0]["quant_type"] == "int" and check_model(out) == []
    assert op_counts(onnx.load(out))["QMOE"] == 1


# ----------------------------------------------------------------------------- NaN after quantization

def dead_unit_rms_norm_model() -> onnx.ModelProto:
    """One GEMM3_SWIGLU MOE, then an RMS norm without epsilon (y / sqrt(mean(y^2))). Intermediate unit 0 is
    dead (its gate and up rows are zeros, so its activation is 0), but its down-projection weight, 1.0, is the
    largest of every output column: int8 per column gives those columns the scale 1/127, the live units'
    weights (|w| < 0.004 < scale / 2) round to 0, and the quantized MOE's output is exactly 0, so the norm
    divides 0 by 0. The fp32 MOE's output is small but not 0: its norm is finite."""
    rng = np.random.default_rng(0)
    experts, hidden, inter = 2, 32, 16
    gate, up = (rng.standard_normal((experts, inter, hidden)).astype(np.float32) for _ in range(2))
    gate[:, 0], up[:, 0] = 0.0, 0.0
    down = rng.uniform(-0.003, 0.003, (experts, hidden, inter)).astype(np.float32)
    down[:, :, 0] = 1.0
    nodes = [onnx.helper.make_node("MOE", ["x", "rw", "idx", "gate", "", "up", "", "down"], ["y"], name="moe",
                                   domain=DOMAIN, expert_type="GEMM3_SWIGLU"),
             onnx.helper.make_node("Mul", ["y", "y"], ["squares"]),
             onnx.helper.make_node("ReduceMean", ["squares", "last"], ["mean_square"], keepdims=1),
             onnx.helper.make_node("Sqrt", ["mean_square"], ["rms"]),
             onnx.helper.make_node("Div", ["y", "rms"], ["out"])]
    graph = onnx.helper.make_graph(
        nodes, "dead_unit_rms_norm",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["t", hidden]),
         onnx.helper.make_tensor_value_info("rw", onnx.TensorProto.FLOAT, ["t", 2]),
         onnx.helper.make_tensor_value_info("idx", onnx.TensorProto.INT64, ["t", 2])],
        [onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, ["t", hidden])],
        initializer=[numpy_helper.from_array(value, name) for name, value in
                     (("gate", gate), ("up", up), ("down", down), ("last", np.array([-1], np.int64)))])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18),
                                                        onnx.helper.make_opsetid(DOMAIN, 1)], ir_version=10)


def test_an_output_the_quantized_model_makes_nan_is_an_infinite_error(tmp_path, capsys):
    """The error of an output the quantized model makes NaN where the fp32 model has numbers is inf, not 0
    (Python's max(0.0, nan) is 0.0), in the report of the API and of the CLI."""
    model = dead_unit_rms_norm_model()
    quantized_model, report = moe_onnx.quantize(model, bits=8, backend=BACKEND, sizes=SIZES)
    feeds = {"x": np.ones((2, 32), np.float32), "rw": np.ones((2, 2), np.float32), "idx": np.zeros((2, 2), np.int64)}
    (expected,), (got,) = session(model, BACKEND).run(None, feeds), session(quantized_model, BACKEND).run(None, feeds)
    assert np.isfinite(expected).all() and np.isnan(got).all()  # the construction holds
    (output,) = report.error.outputs
    assert (output.name, output.max_abs, output.relative) == ("out", np.inf, np.inf)
    assert "output 'out': max abs inf, relative inf" in report.summary()
    (layer,) = report.error.layers  # the MOE's own output is finite on both sides: a finite error
    assert 0 < layer.max_abs < np.inf and layer.relative == pytest.approx(1.0)

    source, out, document = tmp_path / "model.onnx", tmp_path / "q.onnx", tmp_path / "report.json"
    onnx.save(model, source)
    assert main(["quantize", str(source), "-o", str(out), "--bits", "8", "--backend", BACKEND, "--report",
                 str(document)]) == 0
    assert "output 'out': max abs inf, relative inf" in capsys.readouterr().out
    (written,) = json.loads(document.read_text())["error"]["outputs"]
    assert (written["max_abs"], written["relative"]) == (np.inf, np.inf)


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("settings, message", [
    (dict(bits=3), "bits is 3; expected 4 or 8"),
    (dict(bits=4, block_size=24), "block_size is 24; expected 0 (one scale per output column) or a power of two "
                                  "in [16, 256]"),
    (dict(bits=4, block_size=512), "block_size is 512; expected 0"),
    (dict(bits=8, accuracy_level=2), "accuracy_level is 2; expected one of 0, 3, 4"),
])
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(QuantizeError, match=None) as caught:
        moe_onnx.quantize(fused(FAMILY_FIXTURES["mixtral"]), **settings, measure=False)
    assert str(caught.value).startswith(message)


def test_block_size_that_does_not_divide_k_names_node_and_weight():
    name = "mixtral_batched_mm_tiny"  # H 32, I 16: block 32 divides the gate's K, not the down's
    with pytest.raises(QuantizeError) as caught:
        moe_onnx.quantize(fused(name), bits=4, block_size=32, measure=False)
    assert str(caught.value) == ("MOE node 'node_MOE_0': block_size 32 does not divide K = 16, the inputs of "
                                 "weight_2 ([E, N, K] = [4, 32, 16]); choose a block size that divides every K of the "
                                 "model, or 0 (per column)")


def test_model_without_moe_is_refused():
    with pytest.raises(QuantizeError, match=r"the model has no MOE node .* run that first"):
        moe_onnx.quantize(onnx.load(FIXTURES / "mixtral_batched_mm_small.onnx"), bits=8, measure=False)


@pytest.mark.parametrize("argv, message", [
    (["--bits", "3"], "moe-onnx quantize: bits is 3; expected 4 or 8"),
    (["--bits", "4", "--block-size", "24"], "moe-onnx quantize: block_size is 24"),
    (["--bits", "4", "--seed", "-1"],
     "moe-onnx quantize: error: argument --seed: '-1' is not a seed (an integer >= 0)"),
])
def test_cli_bad_settings_exit_2_and_write_nothing(argv, message, tmp_path, capsys):
    source, out = tmp_path / "fused.onnx", tmp_path / "q.onnx"
    onnx.save(fused(FAMILY_FIXTURES["mixtral"]), source)
    try:
        status = main(["quantize", str(source), "-o", str(out), *argv])
    except SystemExit as refused:  # argparse's refusal
        status = refused.code
    assert status == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_a_negative_seed_is_refused_before_anything_is_written(tmp_path):
    source, out = tmp_path / "fused.onnx", tmp_path / "q.onnx"
    onnx.save(fused(FAMILY_FIXTURES["mixtral"]), source)
    with pytest.raises(QuantizeError, match=r"^seed is -1; expected an integer >= 0$"):
        quantize_file(source, out, QuantizeSettings(bits=8), seed=-1)
    assert not out.exists()


def test_a_quantized_model_says_so(tmp_path, capsys):
    """Quantizing a model whose experts are QMOE already says so (not "run optimize first"), and what else
    --linears would quantize."""
    source, out = tmp_path / "fused.onnx", tmp_path / "q.onnx"
    onnx.save(fused(FAMILY_FIXTURES["mixtral"]), source)
    assert main(["quantize", str(source), "-o", str(out), "--bits", "8", "--no-measure"]) == 0
    capsys.readouterr()
    assert main(["quantize", str(out), "-o", str(tmp_path / "qq.onnx"), "--bits", "4"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (  # after the progress lines
        "moe-onnx quantize: the model's 1 expert block is quantized already (QMOE, int 8-bit): nothing is left to "
        "quantize (--linears and --embedding quantize the other layers)")
    assert not (tmp_path / "qq.onnx").exists()


def test_cli_unfused_model_exit_2(tmp_path, capsys):
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(FIXTURES / "mixtral_batched_mm_small.onnx"), "-o", str(out), "--bits", "8"]) == 2
    assert "the model has no MOE node" in capsys.readouterr().err and not out.exists()


def test_moe_inside_a_subgraph_is_left_with_a_note():
    rng = np.random.default_rng(0)
    experts, hidden, inter = 4, 32, 16
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
               for name, shape in (("gate", (experts, inter, hidden)), ("up", (experts, inter, hidden)),
                                   ("down", (experts, hidden, inter)))]

    def moe(output: str, name: str) -> onnx.NodeProto:
        return onnx.helper.make_node("MOE", ["x", "rw", "idx", "gate", "", "up", "", "down"], [output], name=name,
                                     domain=DOMAIN, expert_type="GEMM3_SWIGLU")

    def branch(node: onnx.NodeProto, output: str) -> onnx.GraphProto:
        return onnx.helper.make_graph([node], f"branch_{output}", [],
                                      [onnx.helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None)])

    when = onnx.helper.make_node("If", ["cond"], ["z"], then_branch=branch(moe("z_then", "nested"), "z_then"),
                                 else_branch=branch(onnx.helper.make_node("Identity", ["x"], ["z_else"]), "z_else"))
    graph = onnx.helper.make_graph(
        [moe("y", "top"), when], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["t", hidden]),
         onnx.helper.make_tensor_value_info("rw", onnx.TensorProto.FLOAT, ["t", 2]),
         onnx.helper.make_tensor_value_info("idx", onnx.TensorProto.INT64, ["t", 2]),
         onnx.helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, [])],
        [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["t", hidden]) for name in ("y", "z")],
        initializer=weights)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18),
                                                         onnx.helper.make_opsetid(DOMAIN, 1)])
    result, report = moe_onnx.quantize(model, bits=8, measure=False)
    assert [layer.node for layer in report.layers] == ["top"]
    assert report.notes == ["1 MOE node(s) inside subgraphs (If/Loop/Scan bodies) stay unquantized: 'nested'"]
    (when,) = [n for n in result.graph.node if n.op_type == "If"]
    (then_branch,) = [a.g for a in when.attribute if a.name == "then_branch"]
    assert [n.op_type for n in then_branch.node] == ["MOE"] and len(moe_nodes(result, "QMOE")) == 1


def test_cli_refuses_to_overwrite_its_input(tmp_path, capsys):
    source = tmp_path / "fused.onnx"
    onnx.save(fused(FAMILY_FIXTURES["mixtral"]), source)
    before = source.read_bytes()
    assert main(["quantize", str(source), "-o", str(source), "--bits", "8"]) == 2
    assert "is the same file as the input" in capsys.readouterr().err and source.read_bytes() == before


def test_a_failed_measurement_is_a_problem_not_a_traceback(tmp_path, capsys, monkeypatch):
    source, out = tmp_path / "fused.onnx", tmp_path / "q.onnx"
    onnx.save(fused(FAMILY_FIXTURES["mixtral"]), source)

    def failing_session(model, backend):
        raise RuntimeError(f"no kernel for QMOE on {backend}\nmore lines")

    monkeypatch.setattr(quantize_job, "session", failing_session)
    assert main(["quantize", str(source), "-o", str(out), "--bits", "8"]) == 1
    printed = capsys.readouterr().out
    assert "the error could not be measured on the cpp backend: no kernel for QMOE on cpp" in printed
    assert "more lines" not in printed and check_model(out) == []
