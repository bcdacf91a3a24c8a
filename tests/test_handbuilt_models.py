"""com.microsoft::MoE / QMoE models as a hand-written script builds them, through ``optimize``.

Such a script (onnxruntime's own MoE tests are written so) makes one contrib node with the token rows
and the router logits as graph inputs and random expert weights as initializers, and saves
``onnx.helper.make_model(graph)``: no com.microsoft import, the IR version and opset onnx.helper writes
by default (onnx 1.23.2: IR 14, opset 28, newer than onnxruntime 1.31.1 loads). onnxruntime adds the
missing import itself (moe_onnx/_ir/inference.py says where); ``optimize`` must read the model the same way.

Each case of CASES goes through ``moe_onnx.optimize`` (some through ``moe-onnx optimize`` and ``check``
too) and its output runs on both backends, compared with onnxruntime's run of the original (written
with the versions onnxruntime loads, which mean the same here) where onnxruntime's CPU kernel computes the
case as documented (``ort``), else with the numpy reference of the contrib semantics
(tests/ort_contrib_reference.py, itself checked against onnxruntime in tests/test_ort_import.py).
Tolerances: TOLERANCES, by element type.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import moe_onnx
import ort_contrib_reference as contrib
from moe_onnx._ir.inference import RUNTIME_DOMAINS, ShapeInferenceError
from moe_onnx.cli import main
from moe_onnx.rewrite import ort_import
from moe_onnx.rewrite._ort_contrib import INPUTS
from moe_onnx.runtime.versions import onnxruntime_versions

BACKENDS = ("cpp", "python")
#: ours against the truth, by the model's element type: fp32 as computed (quantized weights included: both sides
#: dequantize the same codes, int8 activations where both quantize them), fp16 rounded at every step
TOLERANCES = {np.float32: dict(rtol=1e-4, atol=1e-4), np.float16: dict(rtol=5e-3, atol=5e-3)}


@dataclasses.dataclass(frozen=True)
class Case:
    """One hand-built node. ``bits`` 0: MoE with float weights, else QMoE with random codes of that width,
    per column (``block`` 0) or per block of ``block`` inputs, with packed zero points when ``zero_points``.
    ``rank`` 2: the packed token rows [T, H] (tokens of several requests concatenated), 3: [B, S, H].
    ``ort``: onnxruntime's CPU kernel computes the case as documented (tests/test_ort_import.py, ort_cpu_gap)."""

    activation: str = "swiglu"
    fusion: int = 1
    alpha: float = 1.0
    beta: float = 0.0
    limit: float | None = None
    k: int = 2
    experts: int = 4
    hidden: int = 32
    inter: int = 16
    normalize: int = 1
    sparse_mixer: int = 0
    biases: bool = False
    bits: int = 0
    block: int = 0
    zero_points: bool = False
    accuracy_level: int | None = None
    dtype: type = np.float32
    rank: int = 2
    ort: bool = True

    @property
    def op(self) -> str:
        return "QMoE" if self.bits else "MoE"

    @property
    def fc3(self) -> bool:
        return self.activation == "swiglu" and self.fusion == 0

    @property
    def fc1_rows(self) -> int:
        return 2 * self.inter if self.activation == "swiglu" and self.fusion else self.inter


GPT_OSS = dict(alpha=1.702, beta=1.0, limit=7.0, biases=True)
CASES = {
    # swiglu_fusion 1, 2, 0; the activation types; alpha, beta, limit
    "swiglu_interleaved": Case(),
    "swiglu_interleaved_gpt_oss": Case(**GPT_OSS),
    "swiglu_concatenated_gpt_oss": Case(fusion=2, **GPT_OSS, ort=False),
    "swiglu_fc3": Case(fusion=0, ort=False),
    "swiglu_beta_half_no_limit": Case(beta=0.5, alpha=1.5),
    "relu_k1": Case(activation="relu", k=1, normalize=0, biases=True),
    "gelu_k_equals_e": Case(activation="gelu", k=4, biases=True),
    "silu_alpha_unused": Case(activation="silu", alpha=2.0, beta=3.0),
    "identity_rank3": Case(activation="identity", rank=3, biases=True),
    "fp16_rank3_k3_of_8": Case(dtype=np.float16, rank=3, k=3, experts=8),
    "phi3_sparse_mixer": Case(sparse_mixer=1, normalize=0, ort=False),
    # QMoE: 4 and 8 bits, per column and block-wise (16..128), zero points, accuracy levels
    "int4_per_column": Case(bits=4),
    "int4_per_column_zp_gpt_oss": Case(bits=4, zero_points=True, **GPT_OSS),
    "int4_block16_zp": Case(bits=4, block=16, zero_points=True),
    "int4_block32_acc4": Case(bits=4, block=32, accuracy_level=4, hidden=64, inter=32),
    "int4_block128_concatenated": Case(bits=4, block=128, fusion=2, hidden=128, inter=128, ort=False),
    "int4_fc3_zp": Case(bits=4, block=16, fusion=0, zero_points=True, ort=False),
    "int4_fp16_k_equals_e": Case(bits=4, block=16, dtype=np.float16, k=4),
    "int8_per_column_zp": Case(bits=8, zero_points=True),
    "int8_block64": Case(bits=8, block=64, hidden=64, inter=64),
    "int8_block128_zp_rank3": Case(bits=8, block=128, zero_points=True, hidden=128, inter=128, rank=3),
    "int8_sparse_mixer": Case(bits=8, sparse_mixer=1, normalize=0, ort=False),
    "int4_relu": Case(activation="relu", bits=4, block=16, biases=True, ort=False),
    # 2 bits: widened to 4 (the same codes and zero points)
    "int2_per_column": Case(bits=2),
    "int2_per_column_zp_gpt_oss": Case(bits=2, zero_points=True, **GPT_OSS),
    "int2_block32_zp": Case(bits=2, block=32, zero_points=True, hidden=64, inter=32),
    "int2_block16_acc4": Case(bits=2, block=16, accuracy_level=4),
    "int2_fc3_zp": Case(bits=2, block=16, fusion=0, zero_points=True, ort=False),
}


# ----------------------------------------------------------------------------- the script

def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes packed along the last axis, the first in the low bits (padded with zeros to a whole byte)."""
    per_byte = 8 // bits
    pad = -codes.shape[-1] % per_byte
    codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], pad), codes.dtype)], axis=-1)
    grouped = codes.reshape(*codes.shape[:-1], -1, per_byte).astype(np.uint8)
    return np.bitwise_or.reduce(grouped << (np.arange(per_byte, dtype=np.uint8) * bits), axis=-1).astype(np.uint8)


@dataclasses.dataclass
class Built:
    model: onnx.ModelProto
    reference_inputs: dict  # the reference's keyword arguments for the weights


def build(case: Case, seed: int = 0) -> Built:
    """The model as the script writes it: ``helper.make_model(graph)``, nothing more."""
    rng = np.random.default_rng(seed)
    t = case.dtype
    e, h, i = case.experts, case.hidden, case.inter
    shapes = {"fc1": (e, case.fc1_rows, h), "fc2": (e, h, i), "fc3": (e, i, h)}
    fcs = ("fc1", "fc2", "fc3") if case.fc3 else ("fc1", "fc2")
    initializers, reference = {}, {}
    for fc in fcs:
        rows, k = shapes[fc][1:]
        if case.biases:
            initializers[f"{fc}_experts_bias"] = reference[f"{fc}_bias"] = \
                (rng.standard_normal((e, rows)) * 0.1).astype(t)
        if not case.bits:
            initializers[f"{fc}_experts_weights"] = reference[fc] = \
                (rng.standard_normal(shapes[fc]) / np.sqrt(k)).astype(t)
            continue
        blocks = k // case.block if case.block else 1
        codes = rng.integers(0, 1 << case.bits, shapes[fc], dtype=np.uint8)
        # weights of about unit variance over K (codes minus zero point: about 2^bits / sqrt(12) apart)
        scales = rng.uniform(0.5, 1.5, (e, rows, blocks)) * np.sqrt(12 / k) / (1 << case.bits)
        scales = (scales if case.block else scales[..., 0]).astype(t)
        initializers[f"{fc}_experts_weights"] = reference[fc] = _pack(codes, case.bits)
        initializers[f"{fc}_scales"] = reference[f"{fc}_scales"] = scales
        if case.zero_points:
            zero_points = rng.integers(0, 1 << case.bits, (e, rows, blocks), dtype=np.uint8)
            packed = _pack(zero_points, case.bits) if case.block else _pack(zero_points[..., 0], case.bits)
            initializers[f"{fc}_zero_points"] = reference[f"{fc}_zero_points"] = packed
    names = INPUTS[case.op]
    inputs = ["input", "router_probs"] + [name if name in initializers else "" for name in names[2:]]
    while not inputs[-1]:
        inputs.pop()
    attributes = dict(k=case.k, activation_type=case.activation, swiglu_fusion=case.fusion,
                      activation_alpha=case.alpha, activation_beta=case.beta, normalize_routing_weights=case.normalize,
                      use_sparse_mixer=case.sparse_mixer)
    if case.limit is not None:
        attributes["swiglu_limit"] = case.limit
    if case.bits:
        attributes["expert_weight_bits"] = case.bits
        if case.block:
            attributes["block_size"] = case.block
        if case.accuracy_level is not None:
            attributes["accuracy_level"] = case.accuracy_level
    node = helper.make_node(case.op, inputs, ["output"], "moe", domain="com.microsoft", **attributes)
    element = helper.np_dtype_to_tensor_dtype(np.dtype(t))
    rows = ["tokens", h] if case.rank == 2 else ["batch", "sequence", h]
    graph = helper.make_graph(
        [node], "handbuilt_moe",
        [helper.make_tensor_value_info("input", element, rows),
         helper.make_tensor_value_info("router_probs", element, [None, e])],
        [helper.make_tensor_value_info("output", element, rows)],
        [numpy_helper.from_array(array, name) for name, array in initializers.items()])
    return Built(helper.make_model(graph), reference)


def feeds(case: Case, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (7, case.hidden) if case.rank == 2 else (2, 3, case.hidden)
    tokens = int(np.prod(shape[:-1]))
    return {"input": rng.standard_normal(shape).astype(case.dtype),
            "router_probs": (rng.standard_normal((tokens, case.experts)) * 2).astype(case.dtype)}


# ----------------------------------------------------------------------------- the truth and ours

def loadable(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the IR version and opset onnxruntime loads (a contrib node alone means the same with them)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.ir_version, opset = onnxruntime_versions()
    next(o for o in copy.opset_import if o.domain == "").version = opset
    return copy


def reference(case: Case, built: Built, x: dict[str, np.ndarray]) -> np.ndarray:
    attributes = dict(k=case.k, activation_type=case.activation, swiglu_fusion=case.fusion,
                      activation_alpha=case.alpha, activation_beta=case.beta, swiglu_limit=case.limit,
                      normalize_routing_weights=case.normalize, use_sparse_mixer=case.sparse_mixer)
    args = dict(built.reference_inputs)
    if not case.bits:
        weights = {name: args.get(name) for name in ("fc1", "fc1_bias", "fc2", "fc2_bias", "fc3", "fc3_bias")}
        return contrib.moe(x["input"], x["router_probs"], **weights, **attributes)
    return contrib.qmoe(x["input"], x["router_probs"], **{name: args.get(name) for name in (
        "fc1", "fc1_scales", "fc1_bias", "fc2", "fc2_scales", "fc2_bias", "fc3", "fc3_scales", "fc3_bias",
        "fc1_zero_points", "fc2_zero_points", "fc3_zero_points")}, expert_weight_bits=case.bits,
        block_size=case.block, **attributes)


@functools.cache
def truth(name: str) -> tuple[np.ndarray, str]:
    """What the optimized model must give on ``feeds``: onnxruntime's run of the original where its CPU
    kernel computes the case as documented, else the reference; with the name of the source."""
    case, built = CASES[name], built_case(name)
    x = feeds(case)
    if case.ort:
        options = ort.SessionOptions()
        options.log_severity_level = 4
        session = ort.InferenceSession(loadable(built.model).SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        return session.run(["output"], x)[0], "onnxruntime"
    return reference(case, built, x), "reference"


@functools.cache
def built_case(name: str) -> Built:
    return build(CASES[name])


@functools.cache
def optimized(name: str):
    return moe_onnx.optimize(built_case(name).model)


def run_ours(model: onnx.ModelProto, case: Case, backend: str) -> np.ndarray:
    return moe_onnx.session(model, backend=backend).run(["output"], feeds(case))[0]


# ----------------------------------------------------------------------------- the table

def test_the_models_are_built_as_a_script_builds_them():
    model = built_case("swiglu_interleaved").model
    assert [(o.domain, o.version) for o in model.opset_import] == [("", onnx.defs.onnx_opset_version())]
    assert model.ir_version == onnx.IR_VERSION


DECLARATION_NOTE = "the model uses domain 'com.microsoft' without importing it: read as version 1, as onnxruntime does"


def _imports(model: onnx.ModelProto) -> dict[str, int]:
    return {o.domain: o.version for o in model.opset_import}


@pytest.mark.parametrize("name", sorted(CASES))
def test_optimize_imports_the_node(name):
    model, report = optimized(name)
    assert report.fused.get(ort_import.RULE) == 1 and report.near_misses == [], report.summary()
    assert any(DECLARATION_NOTE in note for note in report.notes), report.summary()
    assert [n for n in model.graph.node if n.domain == "com.microsoft"] == []
    ir_version, opset = onnxruntime_versions()  # onnx.helper's defaults are newer than onnxruntime loads
    assert model.ir_version == ir_version and _imports(model) == {"": opset, moe_onnx.DOMAIN: 1}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_node_stays_with_the_declaration_onnxruntime_assumed(backend):
    case = Case(limit=7.0)  # a clamp with activation_beta 0: our ops have no such SwiGLU
    built = build(case)
    model, report = moe_onnx.optimize(built.model)
    (miss,) = report.near_misses
    assert miss["node"] == "moe" and miss["reason"].startswith("MoE: swiglu_limit 7.0 with activation_beta 0.0"), miss
    assert "\n" not in miss["reason"] and any(DECLARATION_NOTE in note for note in report.notes)
    assert [n.op_type for n in model.graph.node] == ["MoE"] and _imports(model)["com.microsoft"] == 1
    options = ort.SessionOptions()
    options.log_severity_level = 4
    original = ort.InferenceSession(loadable(built.model).SerializeToString(), options,
                                    providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(run_ours(model, case, backend), original.run(["output"], feeds(case))[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_numbers(name, backend):
    case = CASES[name]
    model, _ = optimized(name)
    want, source = truth(name)
    got = run_ours(model, case, backend)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), **TOLERANCES[case.dtype],
                               err_msg=f"{name} against {source}")


@pytest.mark.parametrize("name", ["swiglu_interleaved_gpt_oss", "int4_block16_zp", "int2_per_column"])
def test_cli_check_and_optimize(name, tmp_path, capsys):
    source, out = tmp_path / "handbuilt.onnx", tmp_path / "optimized.onnx"
    onnx.save(built_case(name).model, source)
    assert main(["check", str(source)]) == 0
    printed = capsys.readouterr().out
    assert "OK" in printed and "note: the model uses domain 'com.microsoft' without importing it" in printed
    assert main(["optimize", str(source), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "note: the model uses domain 'com.microsoft'" in printed and "OrtMoeImport: 1 block fused" in printed
    assert main(["check", str(out)]) == 0
    want, source_name = truth(name)
    np.testing.assert_allclose(run_ours(onnx.load(out), CASES[name], "cpp"), want, **TOLERANCES[np.float32],
                               err_msg=source_name)


# ----------------------------------------------------------------------------- how onnxruntime reads a model

def test_runtime_domains_are_those_onnxruntime_adds(tmp_path):
    """The versions RUNTIME_DOMAINS gives are the imports onnxruntime writes into a model that leaves them out
    (our libraries' domains too, once a session of this process registered them: not onnxruntime's own)."""
    saved = tmp_path / "as_onnxruntime_reads_it.onnx"
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.optimized_model_filepath = str(saved)
    ort.InferenceSession(loadable(built_case("swiglu_interleaved").model).SerializeToString(), options,
                         providers=["CPUExecutionProvider"])
    added = {o.domain: o.version for o in onnx.load(saved).opset_import
             if o.domain not in ("", "ai.onnx") and not o.domain.startswith(moe_onnx.DOMAIN)}
    assert added == RUNTIME_DOMAINS


def _unknown_domain_model() -> onnx.ModelProto:
    model = build(CASES["relu_k1"]).model
    model.graph.node[0].domain = "com.example"
    return model


def test_other_shape_inference_failures_are_one_line_from_the_api():
    with pytest.raises(ShapeInferenceError) as raised:
        moe_onnx.optimize(_unknown_domain_model())
    message = str(raised.value)
    assert "\n" not in message and "No opset import for domain com.example" in message, message


def test_other_shape_inference_failures_are_one_line_from_the_cli(tmp_path, capsys):
    source = tmp_path / "unknown_domain.onnx"
    onnx.save(_unknown_domain_model(), source)
    assert main(["optimize", str(source), "-o", str(tmp_path / "out.onnx")]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[")]  # not progress
    assert len(errors) == 1 and errors[0].startswith(f"moe-onnx optimize: {source}: the input model is invalid"), errors
    assert "No opset import for domain 'com.example'" in errors[0]
    assert not (tmp_path / "out.onnx").exists()
