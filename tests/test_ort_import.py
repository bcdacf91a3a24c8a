"""Import of onnxruntime's com.microsoft::MoE / QMoE (moe_onnx/rewrite/ort_import.py).

The models are built as onnxruntime-genai's model builder writes them (a router MatMul whose logits
are the node's ``router_probs``; the experts as initializers). The imported model must give the
numbers onnxruntime gives running the original on CPU wherever that kernel takes the configuration
(``ORT_CPU_GAPS`` lists where it does not, each checked in ``test_onnxruntime_cpu_gaps``); elsewhere
the numpy reference of the contrib semantics (tests/ort_contrib_reference.py) is the truth, itself
checked against the CPU kernel on every configuration it takes. Every fixture family's experts
(models/fixtures) go through it too, and where the family's block is a plain MoE node (softmax
routing, no shared expert) the import gives torch's numbers.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import moe_onnx
import ort_contrib_reference as contrib
from backends import PLAIN, cached_session
from moe_onnx.check import check_model
from moe_onnx.cli import main
from fixture_models import MANIFEST, moe_node, optimized, reference_data
from moe_onnx.ops.qmoe import quantize
from moe_onnx.rewrite import ort_import
from moe_onnx.rewrite._ort_contrib import INPUTS

FP32_TOL = dict(rtol=1e-4, atol=1e-4)
FP16_TOL = dict(rtol=2e-2, atol=2e-2)  # onnxruntime's fp16 kernel rounds every intermediate to fp16
BACKENDS = ("python", "cpp")


# ----------------------------------------------------------------------------- building genai-style models

@dataclasses.dataclass(frozen=True)
class Config:
    """One MoE/QMoE node configuration; ``quant`` = (bits, block_size, zero points) or "fp4" for QMoE."""

    activation: str = "swiglu"
    fusion: int = 1
    alpha: float = 1.0
    beta: float = 0.0
    limit: float | None = None
    normalize: int = 1
    sparse_mixer: int = 0
    bias: bool = False
    k: int = 2
    dtype: type = np.float32
    quant: tuple | str | None = None
    router_weights: bool = False
    accuracy_level: int | None = None
    bits_override: dict | None = None  # QMoE per-projection widths, e.g. {"fc2": 8}
    gated_silu: bool = False  # activation silu with fc3: silu(fc1) * fc3 (genai's older Mixtral form)
    experts: int = 4
    hidden: int = 32
    inter: int = 16

    @property
    def op(self) -> str:
        return "MoE" if self.quant is None else "QMoE"

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"

    @property
    def fc3(self) -> bool:
        return (self.gated and self.fusion == 0) or self.gated_silu

    def attributes(self) -> dict:
        attrs = dict(k=self.k, activation_type=self.activation, swiglu_fusion=self.fusion, activation_alpha=self.alpha,
                     activation_beta=self.beta, normalize_routing_weights=self.normalize,
                     use_sparse_mixer=self.sparse_mixer)
        if self.limit is not None:
            attrs["swiglu_limit"] = self.limit
        if self.quant == "fp4":
            attrs.update(expert_weight_bits=4, quant_type="fp4", block_size=32)
        elif self.quant is not None:
            bits, block, _ = self.quant
            attrs["expert_weight_bits"] = bits
            if block:
                attrs["block_size"] = block
            for fc, width in (self.bits_override or {}).items():
                attrs[f"{fc}_expert_weight_bits"] = width
        if self.accuracy_level is not None:
            attrs["accuracy_level"] = self.accuracy_level
        return attrs


@dataclasses.dataclass
class Experts:
    """Float expert weights in the contrib layout: fc1 [E, N1, H], fc2 [E, H, I], fc3 [E, I, H], biases."""

    fc1: np.ndarray
    fc2: np.ndarray
    fc3: np.ndarray | None = None
    fc1_bias: np.ndarray | None = None
    fc2_bias: np.ndarray | None = None
    fc3_bias: np.ndarray | None = None


def random_experts(config: Config, seed: int = 0) -> Experts:
    rng = np.random.default_rng(seed)
    e, h, i = config.experts, config.hidden, config.inter

    def w(*shape):
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)
    rows = 2 * i if config.gated and config.fusion else i
    experts = Experts(w(e, rows, h), w(e, h, i), w(e, i, h) if config.fc3 else None)
    if config.bias:
        experts.fc1_bias, experts.fc2_bias = w(e, rows), w(e, h)
        experts.fc3_bias = w(e, i) if config.fc3 else None
    return experts


def _e8m0(name: str, exponents: np.ndarray) -> onnx.TensorProto:
    return helper.make_tensor(name, TensorProto.FLOAT8E8M0, exponents.shape, exponents.tobytes(), raw=True)


def node_inputs(config: Config, experts: Experts, seed: int = 0) -> tuple[dict, dict]:
    """(the contrib node's initializers by input name, the reference's keyword arguments)."""
    t = config.dtype
    fcs = {"fc1": experts.fc1, "fc2": experts.fc2, "fc3": experts.fc3}
    biases = {"fc1": experts.fc1_bias, "fc2": experts.fc2_bias, "fc3": experts.fc3_bias}
    arrays, reference = {}, {}
    for fc, w in fcs.items():
        if w is None:
            continue
        if biases[fc] is not None:
            arrays[f"{fc}_experts_bias"] = reference[f"{fc}_bias"] = biases[fc].astype(t)
        if config.quant is None:
            arrays[f"{fc}_experts_weights"] = reference[fc] = w.astype(t)
            continue
        if config.quant == "fp4":
            rng = np.random.default_rng(seed + len(arrays))
            codes = rng.integers(0, 256, (w.shape[0], w.shape[1], w.shape[2] // 2), dtype=np.uint8)
            exponents = rng.integers(122, 128, (w.shape[0], w.shape[1], w.shape[2] // 32), dtype=np.uint8)
            arrays[f"{fc}_experts_weights"], arrays[f"{fc}_scales"] = codes, _e8m0(f"{fc}_scales", exponents)
            reference.update({fc: codes, f"{fc}_scales": exponents})
            continue
        bits, block, zero_points = config.quant
        bits = (config.bits_override or {}).get(fc, bits)
        q, scales, zp = quantize(w, bits=bits, block_size=block, symmetric=not zero_points)
        arrays[f"{fc}_experts_weights"], arrays[f"{fc}_scales"] = q, scales.astype(t)
        reference.update({fc: q, f"{fc}_scales": scales.astype(t), f"{fc}_bits": bits})
        if zp is not None:
            arrays[f"{fc}_zero_points"] = reference[f"{fc}_zero_points"] = zp
    for fc in ("fc1", "fc2", "fc3"):
        reference.setdefault(fc, None)
        reference.setdefault(f"{fc}_bias", None)
    return arrays, reference


def genai_model(config: Config, arrays: dict, router: np.ndarray, router_bias: np.ndarray | None = None,
                rank: int = 2, global_scales: dict | None = None) -> onnx.ModelProto:
    """hidden_states [T, H] (rank 2) or [B, S, H] (rank 3) -> router MatMul (+ bias) -> MoE/QMoE -> output."""
    t = helper.np_dtype_to_tensor_dtype(np.dtype(config.dtype))
    inits = [numpy_helper.from_array(router.astype(config.dtype), "router.weight")]
    nodes = []
    tokens = "hidden_states"
    if rank == 3:
        inits.append(numpy_helper.from_array(np.array([-1, config.hidden], np.int64), "rows"))
        nodes.append(helper.make_node("Reshape", ["hidden_states", "rows"], ["tokens"]))
        tokens = "tokens"
    nodes.append(helper.make_node("MatMul", [tokens, "router.weight"], ["router_logits"]))
    logits = "router_logits"
    if router_bias is not None:
        inits.append(numpy_helper.from_array(router_bias.astype(config.dtype), "router.bias"))
        nodes.append(helper.make_node("Add", ["router_logits", "router.bias"], ["router_logits_biased"]))
        logits = "router_logits_biased"
    names = INPUTS["QMoE" if config.quant is not None else "MoE"]
    given = dict(arrays, **(global_scales or {}))
    inputs = ["hidden_states", logits]
    for name in names[2:]:
        if name == "router_weights" and config.router_weights:
            nodes.append(helper.make_node("Sigmoid", [logits], ["router_weights"]))
            inputs.append("router_weights")
        elif name in given:
            array = given[name]
            inits.append(array if isinstance(array, onnx.TensorProto) else numpy_helper.from_array(array, name))
            inputs.append(name)
        else:
            inputs.append("")
    while not inputs[-1]:
        inputs.pop()
    nodes.append(helper.make_node(config.op, inputs, ["output"], "layer0/moe", domain="com.microsoft",
                                  **config.attributes()))
    shape = ["T", config.hidden] if rank == 2 else ["batch", "seq", config.hidden]
    graph = helper.make_graph(nodes, "genai_moe", [helper.make_tensor_value_info("hidden_states", t, shape)],
                              [helper.make_tensor_value_info("output", t, shape)], inits)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18),
                                                                 helper.make_opsetid("com.microsoft", 1)])


@dataclasses.dataclass
class Built:
    config: Config
    model: onnx.ModelProto
    router: np.ndarray
    router_bias: np.ndarray | None
    reference_args: dict

    def reference(self, x: np.ndarray) -> np.ndarray:
        """The contrib semantics (ort_contrib_reference) on ``x``."""
        c = self.config
        tokens = x.reshape(-1, c.hidden)
        logits = tokens.astype(np.float32) @ self.router.astype(c.dtype).astype(np.float32)
        if self.router_bias is not None:
            logits = logits + self.router_bias.astype(c.dtype).astype(np.float32)
        logits = logits.astype(c.dtype)
        common = dict(k=c.k, activation_type=c.activation, swiglu_fusion=c.fusion, activation_alpha=c.alpha,
                      activation_beta=c.beta, swiglu_limit=c.limit, normalize_routing_weights=c.normalize,
                      use_sparse_mixer=c.sparse_mixer)
        if c.router_weights:
            common["router_weights"] = 1.0 / (1.0 + np.exp(-logits.astype(np.float32)))
        if c.quant is None:
            return contrib.moe(x, logits, **self.reference_args, **common)
        args = dict(self.reference_args)
        widths = {fc: args.pop(f"{fc}_bits", None) for fc in ("fc1", "fc2", "fc3")}
        quant = dict(quant_type="fp4", block_size=32) if c.quant == "fp4" else dict(block_size=c.quant[1])
        return contrib.qmoe(x, logits, **args, fc1_bits=widths["fc1"], fc2_bits=widths["fc2"],
                            fc3_bits=widths["fc3"], **quant, **common)


def build(config: Config, experts: Experts | None = None, router: np.ndarray | None = None,
          router_bias: np.ndarray | None = None, rank: int = 2, seed: int = 0) -> Built:
    rng = np.random.default_rng(seed + 7)
    experts = experts or random_experts(config, seed)
    router = rng.standard_normal((config.hidden, config.experts)).astype(np.float32) if router is None else router
    arrays, reference_args = node_inputs(config, experts, seed)
    globals_ = None
    if config.quant == "fp4":
        globals_ = {f"{fc}_global_scale": np.ones(config.experts, np.float32) for fc in ("fc1", "fc2")}
    return Built(config, genai_model(config, arrays, router, router_bias, rank, globals_), router, router_bias,
                 reference_args)


def hidden(config: Config, tokens: int, seed: int = 1, rank: int = 2) -> np.ndarray:
    shape = (tokens, config.hidden) if rank == 2 else (1, tokens, config.hidden)
    return np.random.default_rng(seed).standard_normal(shape).astype(config.dtype)


def ort_cpu(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return cached_session(model, PLAIN).run(["output"], {"hidden_states": x})[0]


def run_ours(model: onnx.ModelProto, x: np.ndarray, backend: str) -> np.ndarray:
    return cached_session(model, backend).run(["output"], {"hidden_states": x})[0]


def imported(built: Built, target: str = "moe"):
    model, report = moe_onnx.optimize(built.model, target)
    assert report.fused.get(ort_import.RULE) == 1 and report.near_misses == [], report.summary()
    assert not [n for n in model.graph.node if n.domain == "com.microsoft"]
    return model, report


def tolerance(config: Config) -> dict:
    return FP16_TOL if config.dtype == np.float16 else FP32_TOL


# ----------------------------------------------------------------------------- onnxruntime's CPU kernel

def ort_cpu_gap(config: Config) -> str | None:
    """Why onnxruntime 1.31.1's CPU kernel does not compute ``config`` as the contrib docs say (None: it does).
    Found by running it; test_onnxruntime_cpu_gaps keeps each one checked."""
    if config.fc3:
        return "no fc3: MoE returns NOT_IMPLEMENTED, QMoE refuses swiglu_fusion 0"
    if config.gated and config.fusion != 1:
        return "SwiGLU only interleaved (swiglu_fusion 1): refuses 2"
    if config.sparse_mixer:
        return "ignores use_sparse_mixer (plain softmax top-k)"
    if config.op == "MoE" and config.dtype == np.float16 and not config.normalize:
        return "fp16 MoE with normalize_routing_weights 0 outputs zeros"
    if config.op == "QMoE":
        if config.quant == "fp4":
            return "no CPU kernel for quant_type fp4"
        if config.bits_override:
            return "mixed widths not implemented on CPU"
        if not config.gated:
            return "QMoE with relu/gelu/silu/identity returns garbage (uninitialized values)"
        if not config.normalize and not config.router_weights:
            return "QMoE without router_weights always normalizes the routing weights"
    return None


def int8_activations(config: Config) -> bool:
    """onnxruntime's CPU QMoE quantizes the activations to int8 for block-wise experts only: 4 bits at
    accuracy_level 4, 8 bits at every level (its docs; per column it keeps float activations, found by trying). The import's QMOE does too (accuracy_level 4), with the
    same numbers; the reference (float activations) differs from both by the activation rounding."""
    if not isinstance(config.quant, tuple):
        return False
    bits, block, _ = config.quant
    return bool(block) and (bits == 8 or config.accuracy_level == 4)


# ----------------------------------------------------------------------------- the configurations

GPT_OSS = Config(alpha=1.702, beta=1.0, limit=7.0, normalize=1, bias=True)  # genai's GPT-OSS MoE
MIXTRAL = Config(normalize=1)  # Mixtral, Qwen3-MoE: swiglu fused, renormalized
QWEN2 = Config(normalize=0)  # Qwen2-MoE, OLMoE: no renormalization
PHI = Config(sparse_mixer=1, normalize=0)  # Phi-3.5-MoE
CONFIGS = {
    "gpt_oss": GPT_OSS,
    "gpt_oss_fp16": dataclasses.replace(GPT_OSS, dtype=np.float16),
    "mixtral": MIXTRAL,
    "mixtral_fp16": dataclasses.replace(MIXTRAL, dtype=np.float16),
    "qwen2_no_renormalize": QWEN2,
    "qwen2_fp16": dataclasses.replace(QWEN2, dtype=np.float16),
    "phi35_sparse_mixer": PHI,
    "swiglu_concatenated": dataclasses.replace(MIXTRAL, fusion=2),
    "swiglu_fc3": dataclasses.replace(MIXTRAL, fusion=0),
    "swiglu_fc3_biases_limit_beta1": dataclasses.replace(GPT_OSS, fusion=0),
    "swiglu_concatenated_gpt_oss": dataclasses.replace(GPT_OSS, fusion=2),
    "swiglu_beta0_biases": dataclasses.replace(MIXTRAL, bias=True, alpha=1.5),
    "swiglu_beta_half_no_limit": dataclasses.replace(MIXTRAL, beta=0.5),
    "swiglu_alpha_no_bias_beta1": Config(alpha=1.702, beta=1.0),
    "relu": Config(activation="relu", normalize=0, bias=True),
    "gelu": Config(activation="gelu", bias=True),
    "silu": Config(activation="silu", alpha=2.0),
    "silu_fc3": Config(activation="silu", fusion=0, gated_silu=True, normalize=1),
    "identity": Config(activation="identity", bias=True),
    "relu_fp16": Config(activation="relu", bias=True, dtype=np.float16),
    "k_equals_e": dataclasses.replace(MIXTRAL, k=4),
    "k1": dataclasses.replace(QWEN2, k=1),
    "qmoe_int4_per_column": dataclasses.replace(GPT_OSS, quant=(4, 0, False)),
    "qmoe_int4_per_column_zp": dataclasses.replace(GPT_OSS, quant=(4, 0, True)),
    "qmoe_int4_block16": dataclasses.replace(GPT_OSS, quant=(4, 16, False)),
    "qmoe_int4_block16_zp": dataclasses.replace(GPT_OSS, quant=(4, 16, True)),
    "qmoe_int4_block16_acc4": dataclasses.replace(MIXTRAL, quant=(4, 16, True), accuracy_level=4),
    "qmoe_int8_per_column": dataclasses.replace(MIXTRAL, quant=(8, 0, False)),
    "qmoe_int4_per_column_acc4": dataclasses.replace(MIXTRAL, quant=(4, 0, False), accuracy_level=4),
    "qmoe_int8_per_column_acc4": dataclasses.replace(GPT_OSS, quant=(8, 0, True), accuracy_level=4),
    "qmoe_int8_per_column_zp": dataclasses.replace(MIXTRAL, quant=(8, 0, True)),
    "qmoe_int8_block16": dataclasses.replace(MIXTRAL, quant=(8, 16, False)),
    "qmoe_int8_block16_zp": dataclasses.replace(GPT_OSS, quant=(8, 16, True)),
    "qmoe_int4_fp16": dataclasses.replace(MIXTRAL, quant=(4, 16, True), dtype=np.float16),
    "qmoe_int4_no_renormalize": dataclasses.replace(QWEN2, quant=(4, 16, True)),
    "qmoe_int4_fp16_no_renormalize": dataclasses.replace(QWEN2, quant=(4, 0, False), dtype=np.float16),
    "qmoe_router_weights": dataclasses.replace(GPT_OSS, quant=(4, 16, False), router_weights=True),
    "qmoe_router_weights_no_renormalize": dataclasses.replace(QWEN2, quant=(4, 0, True), router_weights=True),
    "qmoe_int4_fc3": dataclasses.replace(MIXTRAL, fusion=0, quant=(4, 16, True)),
    "qmoe_int4_concatenated_per_column_zp": dataclasses.replace(GPT_OSS, fusion=2, quant=(4, 0, True)),
    "qmoe_int4_fc3_per_column_zp_gemm2": dataclasses.replace(GPT_OSS, fusion=0, quant=(4, 0, True)),
    "qmoe_mixed_widths": dataclasses.replace(MIXTRAL, quant=(4, 16, False), bits_override={"fc2": 8}),
    "qmoe_mixed_widths_fc3_zp": dataclasses.replace(GPT_OSS, fusion=0, quant=(4, 0, True), bits_override={"fc3": 8}),
    "qmoe_mixed_widths_fc3_no_zp": dataclasses.replace(GPT_OSS, fusion=0, quant=(4, 16, False),
                                                       bits_override={"fc1": 8}),
    "qmoe_mixed_widths_gemm3": dataclasses.replace(MIXTRAL, fusion=0, quant=(8, 16, False), bits_override={"fc3": 4}),
    "qmoe_relu": Config(activation="relu", bias=True, quant=(4, 16, False)),
    "qmoe_sparse_mixer": dataclasses.replace(PHI, quant=(8, 0, False)),
    "qmoe_fp4_gpt_oss": dataclasses.replace(GPT_OSS, quant="fp4", hidden=64, inter=32),
    "qmoe_fp4_concatenated": dataclasses.replace(MIXTRAL, fusion=2, quant="fp4", hidden=64, inter=32),
}


def truth(built: Built, x: np.ndarray) -> tuple[np.ndarray, str]:
    """What the import must give on ``x``: onnxruntime's CPU result where it computes the configuration as
    documented, else the reference; with the name of the source."""
    if ort_cpu_gap(built.config) is None:
        return ort_cpu(built.model, x), "onnxruntime"
    return built.reference(x), "reference"


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_import_numbers(name, backend):
    config = CONFIGS[name]
    built = build(config)
    model, _ = imported(built)
    for tokens in (0, 1, 7):
        x = hidden(config, tokens)
        want, _ = truth(built, x)
        got = run_ours(model, x, backend)
        assert got.shape == x.shape and got.dtype == x.dtype
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), **tolerance(config),
                                   err_msg=f"{name}, T = {tokens}")


@pytest.mark.parametrize("name", sorted(name for name, config in CONFIGS.items() if ort_cpu_gap(config) is None))
def test_reference_equals_onnxruntime_cpu(name):
    """The reference is right where the CPU kernel runs (so it may stand in where it does not)."""
    config = CONFIGS[name]
    built = build(config)
    x = hidden(config, 7)
    tol = dict(rtol=0.2, atol=0.2) if int8_activations(config) else tolerance(config)
    np.testing.assert_allclose(ort_cpu(built.model, x).astype(np.float32), built.reference(x).astype(np.float32),
                               **tol)


@pytest.mark.parametrize("name", sorted(name for name, config in CONFIGS.items() if ort_cpu_gap(config)))
def test_onnxruntime_cpu_gaps(name):
    """Each configuration listed as one the CPU kernel does not compute as documented: it refuses it, or its
    numbers are not the reference's (the gap is real, not a wrong reference)."""
    config = CONFIGS[name]
    built = build(config)
    x = hidden(config, 7)
    try:
        got = ort_cpu(built.model, x)
    except Exception:  # noqa: BLE001 (onnxruntime raises its own exception types)
        return
    assert not np.allclose(got.astype(np.float32), built.reference(x).astype(np.float32), **tolerance(config)), \
        ort_cpu_gap(config)


def test_rank3_input_and_router_bias():
    """genai's 3-D form: hidden_states [B, S, H] into the node, the router on the flattened rows, with a bias."""
    built = build(GPT_OSS, router_bias=np.linspace(-1, 1, GPT_OSS.experts).astype(np.float32), rank=3)
    model, _ = imported(built)
    x = hidden(GPT_OSS, 5, rank=3)
    np.testing.assert_allclose(run_ours(model, x, "cpp"), ort_cpu(built.model, x), **FP32_TOL)


# ----------------------------------------------------------------------------- what the import writes

def _ops(model) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _attribute(node, name):
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


@pytest.mark.parametrize("name, expert_type", [
    ("gpt_oss", "GEMM2_BIAS_SWIGLU_CLAMP"), ("mixtral", "GEMM3_SWIGLU"), ("swiglu_fc3", "GEMM3_SWIGLU"),
    ("swiglu_beta0_biases", "GEMM2_BIAS_SWIGLU_CLAMP"), ("relu", "GEMM2_ACT"), ("qmoe_int4_block16", "GEMM2_BIAS_SWIGLU_CLAMP"),
    ("qmoe_int4_fc3", "GEMM3_SWIGLU"), ("qmoe_fp4_gpt_oss", "GEMM2_BIAS_SWIGLU_CLAMP"),
])
def test_expert_types(name, expert_type):
    model, report = imported(build(CONFIGS[name]))
    node = next(n for n in model.graph.node if n.op_type in ("MOE", "QMOE"))
    assert node.op_type == ("MOE" if CONFIGS[name].quant is None else "QMOE")
    assert _attribute(node, "expert_type").decode() == expert_type


def test_gpt_oss_attributes_and_router():
    model, report = imported(build(GPT_OSS))
    assert _ops(model) == ["MatMul", "MoeGatingTopK", "MOE"]
    gating, moe = model.graph.node[1], model.graph.node[2]
    assert {a.name: helper.get_attribute_value(a) for a in gating.attribute} == \
        {"k": 2, "score_func": b"softmax", "renormalize": 1}
    assert math.isclose(_attribute(moe, "expert_alpha"), 1.702, rel_tol=1e-6)
    assert _attribute(moe, "expert_beta") == 7.0 and _attribute(moe, "gate_parity") == 0
    assert report.fused == {ort_import.RULE: 1, "RouterToMoeGatingTopK": 1}


def test_qmoe_keeps_the_stored_bytes():
    """Interleaved int4 weights go into QMOE as they are (no requantizing, no copy), fp4 scales as uint8."""
    built = build(CONFIGS["qmoe_int4_block16_zp"])
    model, _ = imported(built)
    node = next(n for n in model.graph.node if n.op_type == "QMOE")
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert node.input[3] == "fc1_experts_weights" and node.input[5] == "fc2_experts_weights"
    assert (_attribute(node, "bits"), _attribute(node, "block_size"), _attribute(node, "quant_type")) == (4, 16, b"int")
    assert inits[node.input[11]].dtype == np.uint8
    fp4, _ = imported(build(CONFIGS["qmoe_fp4_gpt_oss"]))
    node = next(n for n in fp4.graph.node if n.op_type == "QMOE")
    assert _attribute(node, "quant_type") == b"mxfp4"
    scales = next(i for i in fp4.graph.initializer if i.name == node.input[8])
    assert scales.data_type == TensorProto.UINT8


def test_router_weights_route_through_standard_ops():
    """QMoE's router_weights: the TopK over softmax(router_probs) chooses, router_weights weigh; the router
    pass keeps the chain (MoeGatingTopK weighs the scores it chose by) and says why."""
    model, report = imported(build(CONFIGS["qmoe_router_weights"]))
    assert "GatherElements" in _ops(model) and "MoeGatingTopK" not in _ops(model)
    assert any("router stays" in note for note in report.notes)


def test_sparse_mixer_stays_in_standard_ops():
    model, report = imported(build(PHI))
    assert _ops(model).count("ArgMax") == 2 and "MoeGatingTopK" not in _ops(model)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_points_on_gate_only_give_up_its_default(backend):
    """fc1 (gate) with zero points, fc3 (up) without, interleaved into one QMOE weight: up gets 8 (4 bits)."""
    built = build(CONFIGS["qmoe_int4_fc3_per_column_zp_gemm2"])
    node = built.model.graph.node[-1]
    node.input[list(node.input).index("fc3_zero_points")] = ""
    built.reference_args["fc3_zero_points"] = None
    model, _ = imported(built)
    x = hidden(built.config, 7)
    np.testing.assert_allclose(run_ours(model, x, backend), built.reference(x), **FP32_TOL)


def test_fp4_power_of_two_global_scale_moves_into_the_exponents():
    config = CONFIGS["qmoe_fp4_gpt_oss"]
    built = build(config)
    quarter = np.array([0.25, 1.0, 2.0, 0.5], np.float32)
    _replace_initializer(built.model, "fc1_global_scale", np.full(config.experts, 0.5, np.float32))
    _replace_initializer(built.model, "fc2_global_scale", quarter)
    model, _ = imported(built)
    x = hidden(config, 5)
    args = dict(built.reference_args)
    e1 = args["fc1_scales"].astype(np.int32) - 1
    e2 = args["fc2_scales"].astype(np.int32) + np.log2(quarter).astype(np.int32)[:, None, None]
    scaled = dataclasses.replace(built, reference_args=dict(args, fc1_scales=e1.astype(np.uint8),
                                                            fc2_scales=e2.astype(np.uint8)))
    np.testing.assert_allclose(run_ours(model, x, "python"), scaled.reference(x), **FP32_TOL)


def test_grouped_target_sees_the_imported_moe():
    model, report = moe_onnx.optimize(build(MIXTRAL).model, "grouped")
    assert report.fused.get(ort_import.RULE) == 1 and "MoeFinalizeRouting" in _ops(model)
    x = hidden(MIXTRAL, 6)
    np.testing.assert_allclose(run_ours(model, x, "cpp"), ort_cpu(build(MIXTRAL).model, x), **FP32_TOL)


def test_fuse_routers_off_keeps_the_routing_in_standard_ops():
    model, report = moe_onnx.optimize(build(MIXTRAL).model, fuse_routers=False)
    assert _ops(model) == ["MatMul", "Softmax", "Constant", "TopK", "Constant", "ReduceSum", "Div", "MOE"]


# ----------------------------------------------------------------------------- refused, with the reason

def _set_attribute(model: onnx.ModelProto, **attributes) -> onnx.ModelProto:
    node = model.graph.node[-1]
    for name, value in attributes.items():
        kept = [a for a in node.attribute if a.name != name]
        del node.attribute[:]
        node.attribute.extend(kept + [helper.make_attribute(name, value)])
    return model


def _as_input(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """``name`` a graph input instead of an initializer."""
    init = next(i for i in model.graph.initializer if i.name == name)
    model.graph.initializer.remove(init)
    model.graph.input.append(helper.make_tensor_value_info(name, init.data_type, list(init.dims)))
    return model


NEAR_MISSES = {
    "limit_with_beta0": (lambda: build(dataclasses.replace(MIXTRAL, limit=7.0)).model,
                         "swiglu_limit 7.0 with activation_beta 0.0"),
    "limit_zero": (lambda: build(dataclasses.replace(GPT_OSS, limit=0.0)).model, "swiglu_limit is 0.0"),
    "gated_relu": (lambda: _set_attribute(build(CONFIGS["swiglu_fc3"]).model, activation_type="relu"),
                   "activation_type 'relu' with fc3"),
    "unknown_activation": (lambda: _set_attribute(build(MIXTRAL).model, activation_type="geglu"),
                           "activation_type is 'geglu'"),
    "fused_with_fc3": (lambda: _set_attribute(build(CONFIGS["swiglu_fc3"]).model, swiglu_fusion=1),
                       "swiglu_fusion is 1 (gate and up fused in fc1) but fc3_experts_weights is given"),
    "fusion0_without_fc3": (lambda: _set_attribute(build(MIXTRAL).model, swiglu_fusion=0),
                            "swiglu_fusion is 0 (gate in fc1, up in fc3) but fc3_experts_weights is missing"),
    "k_above_e": (lambda: _set_attribute(build(MIXTRAL).model, k=5), "k is 5; expected 1..4"),
    "sparse_mixer_k3": (lambda: _set_attribute(build(PHI).model, k=3), "use_sparse_mixer with k = 3"),
    "weights_not_initializers": (lambda: _as_input(build(MIXTRAL).model, "fc1_experts_weights"),
                                 "input 'fc1_experts_weights' is not an initializer"),
    "three_bits": (lambda: _set_attribute(build(dataclasses.replace(MIXTRAL, quant=(4, 16, False))).model,
                                          expert_weight_bits=3),
                   "expert_weight_bits is 3; QMoE stores 2, 4 or 8 bits per weight of input 'fc1_experts_weights'"),
    "bits_not_fitting_the_bytes": (
        lambda: _set_attribute(build(dataclasses.replace(MIXTRAL, quant=(4, 16, False))).model, expert_weight_bits=2),
        "input 'fc1_experts_weights' has 16 bytes per row; 32 codes of 2 bits take 8"),
    "block_512": (lambda: _set_attribute(build(dataclasses.replace(MIXTRAL, quant=(4, 16, False))).model,
                                         block_size=512), "block_size is 512"),
    "nvfp4": (lambda: _set_attribute(build(dataclasses.replace(MIXTRAL, quant=(4, 16, False))).model,
                                     quant_type="nvfp4"), "quant_type is 'nvfp4'"),
    "prepacked": (lambda: _set_attribute(build(dataclasses.replace(MIXTRAL, quant=(4, 16, False))).model,
                                         weights_prepacked=1), "weights_prepacked is 1"),
    "fp4_global_scale_not_power_of_two": (
        lambda: _replace_initializer(build(CONFIGS["qmoe_fp4_gpt_oss"]).model, "fc1_global_scale",
                                     np.full(4, 0.3, np.float32)),
        "fc1_global_scale' holds a value that is not a power of two"),
    "fp4_zero_points": (
        lambda: _with_input(build(CONFIGS["qmoe_fp4_gpt_oss"]).model, "fc2_zero_points", np.zeros((4, 32), np.uint8)),
        "quant_type fp4 with input 'fc2_zero_points'"),
    "router_probs_missing": (lambda: _without_input(build(MIXTRAL).model, 1),
                             "input 'router_probs' is missing; the contrib op requires it"),
    "experts_disagree": (lambda: _replace_initializer(build(MIXTRAL).model, "fc2_experts_weights",
                                                      _initializer_array(build(MIXTRAL).model,
                                                                         "fc2_experts_weights")[:3]),
                         "the experts' weights disagree on E"),
    "block_not_dividing_hidden": (
        lambda: _set_attribute(build(dataclasses.replace(MIXTRAL, quant=(4, 16, False))).model, block_size=64),
        "block_size is 64; it does not divide hidden_size = 32"),
    "sparse_mixer_router_weights": (
        lambda: build(dataclasses.replace(PHI, quant=(4, 0, False), router_weights=True)).model,
        "use_sparse_mixer with router_weights"),
}


def _without_input(model: onnx.ModelProto, position: int) -> onnx.ModelProto:
    """The contrib node with its input at ``position`` left empty."""
    model.graph.node[-1].input[position] = ""
    return model


def _initializer_array(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == name))


def _replace_initializer(model: onnx.ModelProto, name: str, array: np.ndarray) -> onnx.ModelProto:
    init = next(i for i in model.graph.initializer if i.name == name)
    init.CopyFrom(numpy_helper.from_array(array, name))
    return model


def _with_input(model: onnx.ModelProto, name: str, array: np.ndarray) -> onnx.ModelProto:
    """The contrib node with initializer ``array`` as its input ``name``."""
    node = model.graph.node[-1]
    position = INPUTS["QMoE"].index(name)
    node.input.extend([""] * (position + 1 - len(node.input)))
    node.input[position] = name
    model.graph.initializer.append(numpy_helper.from_array(array, name))
    return model


@pytest.mark.parametrize("case", sorted(NEAR_MISSES))
def test_near_misses(case):
    make, reason = NEAR_MISSES[case]
    fused, report = moe_onnx.optimize(make())
    assert report.fused.get(ort_import.RULE, 0) == 0
    assert [(m["rule"], m["node"]) for m in report.near_misses] == [(ort_import.RULE, "layer0/moe")], report.summary()
    assert reason in report.near_misses[0]["reason"], report.near_misses[0]["reason"]
    assert [n.op_type for n in fused.graph.node if n.domain == "com.microsoft"] in (["MoE"], ["QMoE"])


# ----------------------------------------------------------------------------- the fixture families

def _family_fixture(family: str) -> str:
    return min(name for name, entry in MANIFEST.items() if entry["family"] == family and entry["size"] == "tiny")


FAMILIES = sorted({entry["family"] for entry in MANIFEST.values()})
# families whose block is exactly one genai MoE node: softmax routing, no shared expert, no output bias
# (JetMoE adds one after the experts): torch's numbers hold
PLAIN_MOE_FAMILIES = ("gpt_oss", "granitemoe", "mixtral", "olmoe", "phimoe", "qwen3_moe")


def _router(model: onnx.ModelProto, hidden_size: int, experts: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The fixture's router linear as [H, E] (and its bias)."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        weights = [inits[i] for i in node.input[1:2] if i in inits]
        if node.op_type not in ("MatMul", "Gemm") or not weights or set(weights[0].shape) != {hidden_size, experts}:
            continue
        transposed = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
        bias = inits.get(node.input[2]) if len(node.input) > 2 else None
        return (weights[0].T if transposed else weights[0]), bias
    raise AssertionError("no router linear")


def family_block(family: str) -> tuple[str, Config, Experts, np.ndarray, np.ndarray | None]:
    """The fixture family's experts and router as genai's builder would write them into one MoE node."""
    name = _family_fixture(family)
    entry = MANIFEST[name]
    e = entry["num_experts"]
    model, _ = optimized(name, "moe")
    node = moe_node(model)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}

    def initializer(i):
        return inits[node.input[i]][:e] if len(node.input) > i and node.input[i] else None
    expert_type = _attribute(node, "expert_type").decode()
    renormalize = entry["renormalize"] or "topk over logits -> softmax" in entry["router"]
    base = Config(experts=e, hidden=entry["hidden_size"], inter=entry["intermediate_size"], normalize=int(renormalize),
                  k=entry["top_k"], sparse_mixer=int(family == "phimoe"))
    if expert_type == "GEMM3_SWIGLU":
        gate, up, down = initializer(3), initializer(5), initializer(7)
        fc1 = np.empty((e, 2 * gate.shape[1], gate.shape[2]), np.float32)
        fc1[:, 0::2], fc1[:, 1::2] = gate, up
        config = dataclasses.replace(base, alpha=_attribute(node, "expert_alpha"))
        return name, config, Experts(fc1, down), *_router(model, base.hidden, e)
    if expert_type == "GEMM2_BIAS_SWIGLU_CLAMP":
        parity = _attribute(node, "gate_parity")
        fc1, bias = initializer(3).transpose(0, 2, 1), initializer(4)
        if parity:
            fc1 = fc1.reshape(e, -1, 2, base.hidden)[:, :, ::-1].reshape(fc1.shape)
            bias = bias.reshape(e, -1, 2)[:, :, ::-1].reshape(bias.shape)
        config = dataclasses.replace(base, alpha=_attribute(node, "expert_alpha"), beta=1.0,
                                     limit=_attribute(node, "expert_beta"), bias=True)
        return name, config, Experts(fc1, initializer(5).transpose(0, 2, 1), None, bias, initializer(6)), \
            *_router(model, base.hidden, e)
    # GEMM2_ACT (Nemotron-H's relu2): onnxruntime has no relu2, genai would write relu
    config = dataclasses.replace(base, activation="relu", fusion=0)
    return name, config, Experts(initializer(3), initializer(5)), *_router(model, base.hidden, e)


def family_errors(family: str, backend: str = "cpp") -> dict[str, float]:
    """Max |import - truth| on the family's block: fp32 MoE, int4 block-16 QMoE (truth: onnxruntime's CPU
    result or the reference, as test_import_numbers), and against torch for the plain-MoE families."""
    name, config, experts, router, router_bias = family_block(family)
    errors = {}
    for label, variant in (("fp32", config), ("int4", dataclasses.replace(config, quant=(4, 16, True)))):
        built = build(variant, experts, router, router_bias, rank=3)
        model, _ = imported(built)
        data = reference_data(name)
        x = data["hidden_states"]
        want, source = truth(built, x)
        errors[f"{label} vs {source}"] = float(np.abs(run_ours(model, x, backend) - want).max())
        if label == "fp32" and family in PLAIN_MOE_FAMILIES:
            errors["fp32 vs torch"] = float(np.abs(run_ours(model, x, backend) - data["expected"]).max())
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_families(family, backend):
    for label, error in family_errors(family, backend).items():
        assert error < (1e-2 if "int4" in label else 1e-4), (label, error)


# ----------------------------------------------------------------------------- the report and the CLI

def test_report_counts_qmoe_blocks_and_grouped_keeps_them():
    built = build(CONFIGS["qmoe_int4_block16"])
    _, report = moe_onnx.optimize(built.model)
    assert report.fused_blocks == 1
    model, report = moe_onnx.optimize(built.model, "grouped")
    assert report.fused_blocks == 1 and [n.op_type for n in model.graph.node if n.op_type == "QMOE"] == ["QMOE"]
    assert any("QMOE node 'layer0/moe/QMOE' stays QMOE" in note for note in report.notes)


@pytest.mark.parametrize("name", ["gpt_oss", "qmoe_int4_block16_zp"])
def test_cli_optimize_verify(name, tmp_path, capsys):
    """``moe-onnx optimize --verify`` on a genai model: the original runs on onnxruntime's CPU kernel."""
    source, out = tmp_path / "genai.onnx", tmp_path / "ours.onnx"
    onnx.save(build(CONFIGS[name]).model, source)
    status = main(["optimize", str(source), "-o", str(out), "--verify", "--backend", "python", "--sizes", "1,7"])
    printed = capsys.readouterr().out
    assert status == 0 and f"{ort_import.RULE}: 1 block fused" in printed and "OK" in printed, printed
    assert check_model(out) == []


def test_exact_ties_choose_the_lower_index_where_onnxruntime_cpu_takes_the_higher():
    """The one documented difference (ort_import's docstring): equal routing scores."""
    config = Config(activation="identity", normalize=0, k=1)
    experts = random_experts(config)
    built = build(config, experts, router=np.zeros((config.hidden, config.experts), np.float32))
    x = hidden(config, 1)
    model, _ = imported(built)

    def expert_output(e):
        return (x @ experts.fc1[e].T) @ experts.fc2[e].T / config.experts
    np.testing.assert_allclose(ort_cpu(built.model, x), expert_output(config.experts - 1), **FP32_TOL)
    np.testing.assert_allclose(run_ours(model, x, "cpp"), expert_output(0), **FP32_TOL)
