"""--target ort: MOE -> com.microsoft::MoE and QMOE -> com.microsoft::QMoE, run on plain onnxruntime
(no custom-op library) against our kernels and torch; every attribute written; the blocks the contrib
op cannot express stay our op with the reason in the report."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import onnx
import pytest
from backends import PLAIN, cached_session
from fixture_models import (MANIFEST, TOL, WHOLE_FIXTURES, WHOLE_MANIFEST, as_float16, fixture_lanes, optimized,
                            original, reference_data, whole_reference_data)
from moe_export.fixtures import whole_feeds
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema

import moe_onnx
from moe_onnx.check import check_model
from moe_onnx.cli import main
from moe_onnx.ops.qmoe import SCALES, quantize
from moe_onnx.rewrite._ort_contrib import ORT_DOMAIN
from moe_onnx.rewrite.ort_export import RULE

# the fixture families the contrib op cannot express: the reason the report gives
REFUSED = {
    "deepseek_v3": "the router is not one the contrib op computes",  # sigmoid + bias + groups, 0.0-masked
    "nemotron_h": "the router scores are sigmoid",
    "phimoe": "the router is not one the contrib op computes",  # the sparsemixer
}
# the whole tiny causal LMs whose MoE blocks stay ours on target ort: the reason
WHOLE_REFUSED = {"deepseek_v3": "the router scores are sigmoid", "nemotron_h": "the router scores are sigmoid",
                 "phimoe": "the router is not one the contrib op computes"}
# one float16 version per family (converted from the float32 export, see as_float16)
FP16_FIXTURES = ["aria_text_batched_mm_transposed_tiny", "gpt_oss_batched_mm_tiny",
                 "granitemoe_parallel_experts_dynamo_tiny", "jetmoe_parallel_experts_dynamo_tiny",
                 "mixtral_batched_mm_tiny", "olmoe_batched_mm_tiny", "qwen2_moe_batched_mm_tiny",
                 "qwen3_moe_batched_mm_tiny"]
FP16_NOT_RENORMALIZED = {"olmoe", "qwen2_moe"}  # float16 MoE with normalize_routing_weights=0: refused
# QMoE's per-projection bit overrides exist only in recent onnxruntime and inherit expert_weight_bits
# when omitted (no provider default involved): the export leaves them off
QMOE_OVERRIDES = {"fc1_expert_weight_bits", "fc2_expert_weight_bits", "fc3_expert_weight_bits"}
H, I, E, K = 32, 32, 8, 2


def ort_schema_attributes(op_type: str) -> set[str]:
    (schema,) = [s for s in get_all_operator_schema() if s.name == op_type and s.domain == ORT_DOMAIN]
    return set(schema.attributes)


def contrib_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == ORT_DOMAIN]


def our_nodes(model: onnx.ModelProto) -> list[str]:
    return sorted(n.op_type for n in model.graph.node if n.domain == moe_onnx.DOMAIN)


@functools.cache
def exported(name: str, fuse_routers: bool = True):
    return moe_onnx.optimize(original(name), target="ort", fuse_routers=fuse_routers)


def assert_exported_numbers(name: str, model: onnx.ModelProto) -> None:
    """Plain onnxruntime on ``model`` == torch (the fixture's .npz) == our kernels on the fused model."""
    data, ours = reference_data(name), cached_session(optimized(name, "moe")[0])
    input_name = model.graph.input[0].name
    plain = cached_session(model, PLAIN)
    for suffix in ("", "_alt"):
        feeds = {input_name: data[f"hidden_states{suffix}"]}
        got = plain.run(None, feeds)[0]
        np.testing.assert_allclose(got, data[f"expected{suffix}"], **TOL, err_msg=f"{name}: ort vs torch")
        np.testing.assert_allclose(got, ours.run(None, feeds)[0], rtol=1e-5, atol=2e-5, err_msg=f"{name}: ort vs ours")


# ----------------------------------------------------------------------------- the fixtures

@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_fixture_on_plain_onnxruntime(name):
    model, report = exported(name)
    family = MANIFEST[name]["family"]
    if family in REFUSED:
        (miss,) = report.near_misses
        assert miss["rule"] == RULE and REFUSED[family] in miss["reason"], report.summary()
        assert report.needs_our_library and "MOE" in our_nodes(model) and not contrib_nodes(model)
        return
    assert not report.near_misses and not report.needs_our_library, report.summary()
    assert our_nodes(model) == [] and [n.op_type for n in contrib_nodes(model)] == ["MoE"]
    assert report.fused[RULE] == 1 and report.fused_blocks == 1
    assert check_model(model) == []
    assert_exported_numbers(name, model)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(WHOLE_MANIFEST))
def test_whole_model_on_plain_onnxruntime(name):
    """Whole tiny causal LMs: every MoE layer becomes the contrib op and the logits equal torch's on plain
    onnxruntime (OLMoE's gave wrong logits while the contrib op could compute in place, see ort_export)."""
    entry = WHOLE_MANIFEST[name]
    model, report = moe_onnx.optimize(onnx.load(WHOLE_FIXTURES / entry["file"]), target="ort")
    family = name.split("__")[0]
    if family in WHOLE_REFUSED:
        assert report.needs_our_library and all(WHOLE_REFUSED[family] in m["reason"] for m in report.near_misses)
        return
    assert not report.near_misses and our_nodes(model) == [], report.summary()
    assert len(contrib_nodes(model)) == entry["moe_layers"]
    data, plain = whole_reference_data(name), cached_session(model, PLAIN)
    for suffix in ("", "_alt"):
        feeds = whole_feeds([value.name for value in model.graph.input], data[f"input_ids{suffix}"])
        np.testing.assert_allclose(plain.run(None, feeds)[0], data[f"expected{suffix}"], **TOL, err_msg=name)


@pytest.mark.parametrize("name", ["gpt_oss_batched_mm_tiny", "mixtral_loop_tiny", "qwen2_moe_tiled3_tiny"])
def test_router_chain_kept_as_exported(name):
    """--keep-routers: the contrib op reads the logits through the unfused softmax/top-k chain."""
    model, report = exported(name, fuse_routers=False)
    assert our_nodes(model) == [] and not report.near_misses, report.summary()
    assert_exported_numbers(name, model)


@pytest.mark.parametrize("name", fixture_lanes(sorted(n for n in MANIFEST if MANIFEST[n]["family"] not in REFUSED)))
def test_every_attribute_written(name):
    (node,) = contrib_nodes(exported(name)[0])
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert set(attributes) == ort_schema_attributes("MoE")
    assert attributes["swiglu_fusion"] == (1 if attributes["activation_type"] == b"swiglu" else 0)
    assert attributes["use_sparse_mixer"] == 0 and attributes["k"] == MANIFEST[name]["top_k"]
    entry = MANIFEST[name]
    renormalized = entry["renormalize"] or "softmax over the k values" in entry["router"]
    assert attributes["normalize_routing_weights"] == int(renormalized)
    if entry["family"] == "gpt_oss":
        assert (attributes["activation_alpha"], attributes["activation_beta"], attributes["swiglu_limit"]) == \
            pytest.approx((1.702, 1.0, 7.0))
    else:
        assert (attributes["activation_alpha"], attributes["activation_beta"], attributes["swiglu_limit"]) == \
            (1.0, 0.0, np.inf)


@pytest.mark.slow
@pytest.mark.parametrize("name", FP16_FIXTURES)
def test_float16_fixture(name):
    half = as_float16(original(name))
    model, report = moe_onnx.optimize(half, target="ort")
    if MANIFEST[name]["family"] in FP16_NOT_RENORMALIZED:
        (miss,) = report.near_misses
        assert "normalize_routing_weights=0" in miss["reason"] and our_nodes(model) == ["MOE", "MoeGatingTopK"]
        return
    assert our_nodes(model) == [] and [n.op_type for n in contrib_nodes(model)] == ["MoE"], report.summary()
    data = reference_data(name)
    ours, plain = moe_onnx.session(moe_onnx.optimize(half)[0], backend="cpp"), cached_session(model, PLAIN)
    input_name = model.graph.input[0].name
    for suffix in ("", "_alt"):
        feeds = {input_name: data[f"hidden_states{suffix}"].astype(np.float16)}
        got = plain.run(None, feeds)[0]
        assert got.dtype == np.float16
        scale = np.abs(data[f"expected{suffix}"]).max()
        np.testing.assert_allclose(got, ours.run(None, feeds)[0], atol=4e-3 * scale, err_msg=f"{name}: ort vs ours")
        np.testing.assert_allclose(got, data[f"expected{suffix}"], atol=4e-3 * scale, err_msg=f"{name}: ort vs torch")


# ----------------------------------------------------------------------------- built blocks

def _array(rng, shape, scale=0.3):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def moe_weights(expert_type: str, rng, *, with_bias: bool = True) -> dict[int, np.ndarray]:
    """MOE's weights by input position, float32, in MOE's layouts."""
    if expert_type == "GEMM2_BIAS_SWIGLU_CLAMP":
        weights = {3: _array(rng, (E, H, 2 * I)), 5: _array(rng, (E, I, H))}
        biases = {4: _array(rng, (E, 2 * I)), 6: _array(rng, (E, H))}
    elif expert_type == "GEMM3_SWIGLU":
        return {3: _array(rng, (E, I, H)), 5: _array(rng, (E, I, H)), 7: _array(rng, (E, H, I))}
    else:
        weights = {3: _array(rng, (E, I, H)), 5: _array(rng, (E, H, I))}
        biases = {4: _array(rng, (E, I)), 6: _array(rng, (E, H))}
    return weights | (biases if with_bias else {})


def qmoe_weights(expert_type: str, rng, *, bits: int, block_size: int, symmetric: bool) -> dict[int, np.ndarray]:
    """QMOE's inputs 3.. by position: its weights quantized (QMoE's [E, N, K] layout), scales, zero points."""
    floats = moe_weights(expert_type, rng)
    inputs = {}
    for position, scales_at, zero_points_at in ((3, 8, 11), (5, 9, 12), (7, 10, 13)):
        if position not in floats:
            continue
        w = floats[position]
        if expert_type == "GEMM2_BIAS_SWIGLU_CLAMP":
            w = w.transpose(0, 2, 1)
        inputs[position], inputs[scales_at], zero_points = quantize(w, bits=bits, block_size=block_size,
                                                                    symmetric=symmetric)
        if zero_points is not None:
            inputs[zero_points_at] = zero_points
    return inputs | {i: floats[i] for i in (4, 6) if i in floats}


def built_block(op_type: str = "MOE", expert_type: str = "GEMM3_SWIGLU", *, dtype=np.float32,
                router: dict | None = None, inputs: dict[int, np.ndarray] | None = None, rank: int = 2,
                **attributes) -> onnx.ModelProto:
    """hidden_states -> MatMul -> MoeGatingTopK(router) -> ``op_type`` with ``inputs`` (position ->
    array; default: random MOE weights), float inputs and weights in ``dtype``."""
    rng = np.random.default_rng(7)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inputs = moe_weights(expert_type, rng) if inputs is None else inputs
    router = {"k": K, "renormalize": 1} | (router or {})

    def init(name, array):
        if array.dtype == np.float32:
            array = array.astype(dtype)
        return helper.make_tensor(name, helper.np_dtype_to_tensor_dtype(array.dtype), array.shape, array.tobytes(),
                                  raw=True)

    initializers = [init("router_w", _array(rng, (H, E), 1.0))] + [init(f"in{i}", a) for i, a in inputs.items()]
    names = [f"in{i}" if i in inputs else "" for i in range(3, max(inputs) + 1)]
    gating_inputs = ["logits"]
    if "bias" in router:
        initializers.append(init("gating_bias", router.pop("bias")))
        gating_inputs.append("gating_bias")
    nodes = [helper.make_node("MatMul", ["hidden_states", "router_w"], ["logits"]),
             helper.make_node("MoeGatingTopK", gating_inputs, ["w", "idx"], domain=moe_onnx.DOMAIN, **router),
             helper.make_node(op_type, ["hidden_states", "w", "idx", *names], ["y"], domain=moe_onnx.DOMAIN,
                              name="block", expert_type=expert_type, **attributes)]
    dims = ["T", H] if rank == 2 else ["B", "S", H]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("hidden_states", elem, dims)],
                              [helper.make_tensor_value_info("y", elem, dims)], initializers)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18),
                                                                  helper.make_opsetid(moe_onnx.DOMAIN, 1)])


def hidden(shape, dtype=np.float32, seed=3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(dtype)


def assert_block_exports(block: onnx.ModelProto, backend: str = "cpp", shapes=((9, H),), **tolerance) -> onnx.NodeProto:
    """``block`` exports to one contrib node; plain onnxruntime on it == ``backend`` on ``block``."""
    model, report = moe_onnx.optimize(block, target="ort")
    assert our_nodes(model) == [] and not report.near_misses, report.summary()
    (node,) = contrib_nodes(model)
    plain, ours = cached_session(model, PLAIN), cached_session(block, backend)
    for shape in shapes:
        feeds = {"hidden_states": hidden(shape, block_dtype(block))}
        got, expected = plain.run(None, feeds)[0], ours.run(None, feeds)[0]
        assert got.shape == expected.shape == shape
        np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32),
                                   **(tolerance or {"rtol": 1e-5, "atol": 1e-5}))
    return node


def block_dtype(block: onnx.ModelProto):
    return helper.tensor_dtype_to_np_dtype(block.graph.input[0].type.tensor_type.elem_type)


def assert_refused(block: onnx.ModelProto, reason: str) -> None:
    model, report = moe_onnx.optimize(block, target="ort")
    misses = [m for m in report.near_misses if m["rule"] == RULE]
    assert len(misses) == 1 and reason in misses[0]["reason"] and misses[0]["node"] == "block", report.summary()
    assert report.needs_our_library and not contrib_nodes(model)


@pytest.mark.parametrize("activation", ["relu", "silu", "identity", "gelu_tanh"])
@pytest.mark.parametrize("renormalize", [0, 1])
def test_activation_experts(activation, renormalize):
    node = assert_block_exports(built_block(expert_type="GEMM2_ACT", activation=activation,
                                            router={"renormalize": renormalize}))
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attributes["activation_type"] == {"gelu_tanh": b"gelu"}.get(activation, activation.encode())
    assert attributes["normalize_routing_weights"] == renormalize and attributes["swiglu_fusion"] == 0


@pytest.mark.parametrize("gate_parity", [0, 1])
@pytest.mark.parametrize("limit", [7.0, 0.5, np.inf])
def test_clamped_swiglu_experts(gate_parity, limit):
    assert_block_exports(built_block(expert_type="GEMM2_BIAS_SWIGLU_CLAMP", expert_alpha=1.702, expert_beta=limit,
                                     gate_parity=gate_parity))


@pytest.mark.parametrize("shape", [(1, 1, H), (1, 0, H), (0, 4, H), (2, 3, H)], ids=["T1", "T0", "B0", "T6"])
def test_token_counts_and_3d_input(shape):
    assert_block_exports(built_block(rank=3, expert_alpha=1.5), shapes=[shape])


def test_float16_block():
    node = assert_block_exports(built_block(dtype=np.float16), rtol=2e-2, atol=2e-2)
    assert node.op_type == "MoE"


REFUSALS = {
    "relu2 experts": (dict(expert_type="GEMM2_ACT", activation="relu2"), "activation is relu2"),
    "erf gelu experts": (dict(expert_type="GEMM2_ACT", activation="gelu"), "activation is gelu;"),
    "sigmoid router": (dict(router={"score_func": "sigmoid"}), "the router scores are sigmoid"),
    "group-limited router": (dict(router={"n_group": 2, "topk_group": 1}), "from 2 groups"),
    "biased router": (dict(router={"bias": np.linspace(-0.1, 0.1, E, dtype=np.float32)}), "adds a bias"),
    "scaled weights": (dict(router={"routed_scaling_factor": 2.5}), "scaled by 2.5"),
    "eps in the renormalization": (dict(router={"eps": 1e-6}), "eps = 1e-06"),
    "bfloat16": (dict(dtype=ml_dtypes.bfloat16), "float32 and float16"),
    "float16 not renormalized": (dict(dtype=np.float16, router={"renormalize": 0}), "normalize_routing_weights=0"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refused_blocks_keep_our_op(case):
    arguments, reason = REFUSALS[case]
    assert_refused(built_block(**arguments), reason)


@pytest.mark.parametrize("name", ["qwen2_moe_batched_mm_tiny", "aria_text_batched_mm_transposed_tiny"])
def test_folded_shared_expert_refused(name):
    """A fused model whose shared expert is folded into the MOE: the contrib op has no always-selected
    experts, so the MOE stays ours, with the reason (the model as exported exports, test above)."""
    fused, _ = optimized(name, "moe")
    model, report = moe_onnx.optimize(fused, target="ort")
    misses = [m for m in report.near_misses if m["rule"] == RULE]
    assert len(misses) == 1 and "a shared expert is folded into the MOE" in misses[0]["reason"], report.summary()
    assert report.needs_our_library and our_nodes(model) == ["MOE"] and not contrib_nodes(model)


def test_cli_target_ort(tmp_path, capsys):
    out = tmp_path / "out.onnx"
    fixtures = original("qwen3_moe_batched_mm_tiny")
    source = tmp_path / "in.onnx"
    onnx.save(fixtures, source)
    assert main(["optimize", str(source), "-o", str(out), "--target", "ort", "--verify", "--backend", "python",
                 "--sizes", "1x1,2x3"]) == 0
    printed = capsys.readouterr().out
    assert "MoeToOrtMoE: 1 block fused" in printed and "com.microsoft::MoE" in printed and "OK" in printed
    assert [n.op_type for n in contrib_nodes(onnx.load(out))] == ["MoE"]
    refused = tmp_path / "refused.onnx"
    onnx.save(original("phimoe_sparsemixer_batched_mm_tiny"), refused)
    assert main(["optimize", str(refused), "-o", str(out), "--target", "ort"]) == 1
    printed = capsys.readouterr().out
    assert "near-miss MoeToOrtMoE" in printed and "still needs our library" in printed


def test_cli_target_ort_on_grouped_model(tmp_path, capsys):
    """Our ops without a contrib form (the grouped chain) stay: the model needs our library, exit 1."""
    grouped, _ = optimized("mixtral_batched_mm_tiny", "grouped")
    source, out = tmp_path / "grouped.onnx", tmp_path / "out.onnx"
    onnx.save(grouped, source)
    assert main(["optimize", str(source), "-o", str(out), "--target", "ort"]) == 1
    printed = capsys.readouterr().out
    assert "moe_onnx ops stay (MoeFinalizeRouting, MoeInitRouting, MoeRowParallelLinear;" in printed
    assert "still needs our library" in printed


# ----------------------------------------------------------------------------- QMOE -> QMoE

EXPERT_ATTRIBUTES = {"GEMM3_SWIGLU": {"expert_alpha": 1.5},
                     "GEMM2_BIAS_SWIGLU_CLAMP": {"expert_alpha": 1.702, "expert_beta": 7.0, "gate_parity": 1},
                     "GEMM2_ACT": {"activation": "silu"}}
# (bits, block_size, accuracy_level) QMoE's CPU kernel computes as QMOE does
QUANTIZATIONS = [(4, 0, 0), (8, 0, 0), (4, 16, 0), (4, 32, 0), (4, 16, 4), (4, 32, 4), (8, 16, 4), (8, 32, 4)]


def quantized_block(expert_type: str, bits: int, block_size: int, accuracy_level: int, *, symmetric: bool = True,
                    renormalize: int = 1, **options) -> onnx.ModelProto:
    inputs = qmoe_weights(expert_type, np.random.default_rng(1), bits=bits, block_size=block_size, symmetric=symmetric)
    return built_block("QMOE", expert_type, inputs=inputs, router={"renormalize": renormalize}, bits=bits,
                       block_size=block_size, accuracy_level=accuracy_level, **EXPERT_ATTRIBUTES[expert_type],
                       **options)


@pytest.mark.slow
@pytest.mark.parametrize("renormalize", [0, 1])
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero_points"])
@pytest.mark.parametrize("bits, block_size, accuracy_level", QUANTIZATIONS)
@pytest.mark.parametrize("expert_type", sorted(EXPERT_ATTRIBUTES))
def test_quantized_block(expert_type, bits, block_size, accuracy_level, symmetric, renormalize):
    """QMOE -> QMoE == our QMOE reference; with int8 activations onnxruntime's rounding of an activation code
    may differ by one step in a rare element (measured: up to 1e-3 of the output's scale)."""
    block = quantized_block(expert_type, bits, block_size, accuracy_level, symmetric=symmetric,
                            renormalize=renormalize)
    tolerance = {"rtol": 1e-5, "atol": 2e-5} if accuracy_level == 0 else {"rtol": 0, "atol": 2e-2}
    node = assert_block_exports(block, backend="python", shapes=[(9, H), (1, H), (0, H)], **tolerance)
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert node.op_type == "QMoE" and set(attributes) == ort_schema_attributes("QMoE") - QMOE_OVERRIDES
    assert (attributes["expert_weight_bits"], attributes["block_size"], attributes["accuracy_level"]) == \
        (bits, block_size, accuracy_level)
    assert attributes["weights_prepacked"] == 0 and attributes["quant_type"] == b"int"
    # QMoE renormalizes unless router_weights are given: the softmax over all experts, gathered as they are
    assert attributes["normalize_routing_weights"] == renormalize
    assert (node.input[14:] != [] and node.input[14] != "") == (not renormalize)


QUANTIZED_REFUSALS = {
    "per-column int8 activations": ((4, 0, 4), "accuracy_level 4 with per-column scales"),
    "block-wise 8 bits, float activations": ((8, 32, 0), "bits 8 with block_size 32 at accuracy_level 0"),
}


@pytest.mark.parametrize("case", sorted(QUANTIZED_REFUSALS))
def test_quantized_refusals(case):
    (bits, block_size, accuracy_level), reason = QUANTIZED_REFUSALS[case]
    assert_refused(quantized_block("GEMM3_SWIGLU", bits, block_size, accuracy_level), reason)


@pytest.mark.parametrize("float32_scales", [False, True], ids=["float16_scales", "float32_scales"])
def test_quantized_float16_block(float32_scales):
    """float16 tokens; scales of their type or float32 (what `moe-onnx quantize` writes)."""
    block = quantized_block("GEMM3_SWIGLU", 4, 32, 0, renormalize=0)
    scales = {block.graph.node[-1].input[i] for i in SCALES.values() if i < len(block.graph.node[-1].input)}
    half = onnx.ModelProto()
    half.CopyFrom(block)
    for tensor in half.graph.initializer:
        if tensor.data_type == TensorProto.FLOAT and not (float32_scales and tensor.name in scales):
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), tensor.name))
    for value in [*half.graph.input, *half.graph.output]:
        value.type.tensor_type.elem_type = TensorProto.FLOAT16
    assert assert_block_exports(half, backend="python", rtol=2e-2, atol=3e-2).op_type == "QMoE"
