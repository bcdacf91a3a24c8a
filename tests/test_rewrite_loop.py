"""The loop fusion (moe_onnx/rewrite/loop.py) on the legacy TorchScript exports of the eager per-expert
loop: every family and size fuses into one MOE on both targets and keeps the numbers, an export that
lacks an expert fuses with zero weights for it and says so, and one-constant mutations stay unfused
with the failed check named and the numbers kept.

Mixtral/Qwen loop exports run only on inputs that reach exactly the traced experts (the branches
read the i-th hit expert's mask row). To compare at any (batch, seq), the reference is the original
with each branch's row pinned to its traced expert (the manifest records the traced set)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import pytest

import moe_onnx
from fixture_models import (
    MANIFEST, SHAPES, TARGETS, TOL, assert_near_miss, assert_swiglu_block_on, assert_swiglu_moe_node, attributes,
    expert_weight_shapes, fixture_names, ir_set_input, moe_node, mutated_copy, near_misses, op_counts,
    optimize_form, optimized, original, ort_output, producers, reference_data, reference_output, routing_producer,
    scaled_random_feeds, shared_chunks,
)
from moe_onnx.check import check_model

NAMES = fixture_names("loop", "loop_missing")
RULE = "LoopMoeFusion"
UNFUSED = {"NonZero", "ScatterElements", "OneHot", "Split", "Expand", "Flatten", "ConstantOfShape"}


# ----------------------------------------------------------------------------- graph surgery

def _producer_op(value: ir.Value | None) -> str | None:
    node = None if value is None else value.producer()
    return None if node is None else node.op_type


def _hit_splits(model: ir.Model) -> list[ir.Node]:
    """The Splits of ``nonzero(mask.sum((-1, -2)) > 0)`` whose outputs the branches read as mask rows."""
    return [node for node in model.graph if node.op_type == "Split" and _producer_op(node.inputs[0]) == "Transpose"
            and _producer_op(node.inputs[0].producer().inputs[0]) == "NonZero"
            and _producer_op(node.inputs[0].producer().inputs[0].producer().inputs[0]) == "Greater"]


@functools.cache
def pinned_original(name: str) -> onnx.ModelProto:
    """The original with branch i reading the mask row of the i-th traced expert: runs on any input."""
    model = ir.from_proto(original(name))
    entry = MANIFEST[name]
    traced = sorted(set(range(entry["num_experts"])) - set(entry["missing_experts"]))
    for split in _hit_splits(model):
        for position, piece in enumerate(split.outputs):
            for squeeze in list(piece.consumers()):
                row = ir.Value(name=f"pinned_row_{position}", shape=ir.Shape([1]),
                               type=ir.TensorType(ir.DataType.INT64),
                               const_value=ir.tensor(np.array([traced[position]], dtype=np.int64)))
                model.graph.register_initializer(row)
                ir.convenience.replace_all_uses_with(squeeze.outputs[0], row)
    common_passes.RemoveUnusedNodesPass()(model)
    return ir.to_proto(model)


# ----------------------------------------------------------------------------- fixtures fuse

def test_every_loop_fixture_is_covered():
    families = {MANIFEST[name]["family"] for name in NAMES}
    assert {"mixtral", "qwen3_moe", "olmoe", "qwen2_moe"} <= families
    assert any(MANIFEST[name]["missing_experts"] for name in NAMES)


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", NAMES)
def test_fuses(name, target):
    model, report = optimized(name, target)
    assert report.fused[RULE] == 1
    assert near_misses(report, RULE) == []
    before, after = op_counts(original(name)), op_counts(model)
    folded = shared_chunks(name) > 0
    assert report.fused.get("SharedExpertFold", 0) == folded
    # the shared expert's fold extends the routing with Expand (its weight and index columns)
    left = UNFUSED & set(after)
    assert left == ({"Expand"} if folded else set()), f"unfused ops left: {left}"
    for op in ("TopK", "Softmax", "Div"):  # the router and its renormalization stay
        assert after[op] == before[op], op
    # the expert MatMuls are gone, and a folded shared expert's; the router's and the shared gate's stay
    kept = {node.name for node in original(name).graph.node
            if node.op_type == "MatMul" and "/experts." not in node.name and "/shared_expert/" not in node.name}
    assert {node.name for node in model.graph.node if node.op_type == "MatMul"} == kept
    assert_swiglu_block_on(target, after)
    assert check_model(model) == []


@pytest.mark.parametrize("name", NAMES)
def test_moe_node(name):
    entry = MANIFEST[name]
    model, _ = optimized(name, "moe")
    node = moe_node(model)
    attrs = attributes(node)
    assert attrs == {"expert_type": b"GEMM3_SWIGLU", "expert_alpha": 1.0}
    made_by = producers(model)
    indices, position = routing_producer(model, node.input[2])
    assert (indices.op_type, position) == ("TopK", 1)
    # renormalized weights where the model renormalizes (Div, then the exporter's Cast), else TopK's values
    routing = routing_producer(model, node.input[1])[0]
    assert made_by[routing.input[0]][0].op_type == ("Div" if entry["renormalize"] else "TopK")
    E, H, I = entry["num_experts"] + shared_chunks(name), entry["hidden_size"], entry["intermediate_size"]
    assert expert_weight_shapes(model, node) == [[E, I, H], [E, I, H], [E, H, I]]
    assert node.input[4] == node.input[6] == "" and len(node.input) == 8


def test_weights_are_stacked_lazily():
    model = ir.from_proto(original("mixtral_loop_small"))
    optimize_form(model)
    (node,) = [n for n in model.graph if n.op_type == "MOE"]
    assert all(isinstance(node.inputs[i].const_value, ir.LazyTensor) for i in (3, 5, 7))


def test_two_blocks_in_one_graph():
    """Two stacked blocks: each chain is matched at its own last accumulation."""
    first, second = (onnx.compose.add_prefix(original("olmoe_loop_tiny"), prefix) for prefix in ("a/", "b/"))
    model = onnx.compose.merge_models(first, second, io_map=[("a/output", "b/hidden_states")], outputs=["b/output"])
    new, report = optimize_form(model)
    assert report.fused[RULE] == 2 and near_misses(report, RULE) == []
    inputs = {"a/hidden_states": scaled_random_feeds("olmoe_loop_tiny", 2, 3)["hidden_states"]}
    expected = ort_output(model, inputs, "b/output")
    got = reference_output(new, inputs, "b/output")
    np.testing.assert_allclose(got, expected, **TOL)


@pytest.mark.parametrize("name", NAMES)
def test_missing_experts_get_zero_weights_and_a_note(name):
    missing = MANIFEST[name]["missing_experts"]
    model, report = optimized(name, "moe")
    node = moe_node(model)
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    for index in (3, 5, 7):
        stacked = weights[node.input[index]]
        absent = [e for e in range(len(stacked)) if not stacked[e].any()]
        assert absent == missing
    if missing:
        assert [note for note in report.notes if f"experts {missing}" in note and "zero weights" in note]
    else:
        assert report.notes == []


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", NAMES)
def test_numbers(name, target):
    model, _ = optimized(name, target)
    assert_torch_and_pinned_numbers(name, model)


def assert_torch_and_pinned_numbers(name: str, model: onnx.ModelProto) -> None:
    """The optimized ``model`` of fixture ``name`` computes what torch and the original compute."""
    data = reference_data(name)
    # the inputs the export runs on as it is: the torch outputs and the original in onnxruntime
    for suffix in ("", "_alt"):
        inputs = {"hidden_states": data[f"hidden_states{suffix}"]}
        got = reference_output(model, inputs)
        np.testing.assert_allclose(got, data[f"expected{suffix}"], **TOL)
        np.testing.assert_allclose(got, ort_output(original(name), inputs), **TOL)
    # any input, one token included: the original with its branches pinned to the traced experts (GPT-OSS's
    # CPU loop computes whichever expert a branch reads, so pinning changes nothing there)
    for batch, seq in SHAPES:
        inputs = scaled_random_feeds(name, batch, seq)
        expected = ort_output(pinned_original(name), inputs)
        assert expected.shape == (batch, seq, MANIFEST[name]["hidden_size"])
        np.testing.assert_allclose(reference_output(model, inputs), expected, **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_numbers_on_the_python_kernels(name):
    model, _ = optimized(name, "moe")
    assert_python_kernels_match_pinned(name, model)


def assert_python_kernels_match_pinned(name: str, model: onnx.ModelProto) -> None:
    """The optimized ``model`` of fixture ``name`` computes, on the python kernels, what the pinned original does."""
    session = moe_onnx.session(model, backend="python")
    for batch, seq in SHAPES:
        inputs = scaled_random_feeds(name, batch, seq)
        got = session.run(["output"], inputs)[0]
        np.testing.assert_allclose(got, ort_output(pinned_original(name), inputs), **TOL)


# ----------------------------------------------------------------------------- mutations that must not fuse

def _mask(model: ir.Model) -> ir.Value:
    (onehot,) = [node for node in model.graph if node.op_type == "OneHot"]
    (transpose,) = onehot.outputs[0].consumers()
    return transpose.outputs[0]


def _expert_nodes(model: ir.Model, expert: int, op_type: str) -> list[ir.Node]:
    return [node for node in model.graph if node.op_type == op_type and f"/experts.{expert}/" in node.name]


def duplicate_mask_row(model: ir.Model, entry: dict) -> None:
    """OLMoE: branch 1 reads expert 0's mask row."""
    rows = [node for node in _mask(model).consumers() if node.op_type == "Gather"]
    ir_set_input(model, rows[1], 1, np.array(0, dtype=np.int64))


def duplicate_hit_expert(model: ir.Model, entry: dict) -> None:
    """Mixtral: branch 1 reads the mask row of the first hit expert, like branch 0."""
    (split,) = _hit_splits(model)
    (squeeze,) = split.outputs[1].consumers()
    squeeze.replace_input_with(0, split.outputs[0])


def onehot_depth(model: ir.Model, entry: dict) -> None:
    """The expert mask has one more expert than the router."""
    (onehot,) = [node for node in model.graph if node.op_type == "OneHot"]
    ir_set_input(model, onehot, 1, np.array(entry["num_experts"] + 1, dtype=np.int64))


def tanh_activation(model: ir.Model, entry: dict) -> None:
    """Expert 1's SiLU uses Tanh instead of Sigmoid."""
    (sigmoid,) = _expert_nodes(model, 1, "Sigmoid")
    sigmoid.op_type = "Tanh"


def _scale_swish(model: ir.Model, expert: int, alpha: float) -> None:
    """Expert ``expert``'s SiLU becomes g * Sigmoid(alpha * g)."""
    (sigmoid,) = _expert_nodes(model, expert, "Sigmoid")
    scale = ir.Value(name=f"mutated_alpha_{expert}", shape=ir.Shape([]), type=ir.TensorType(ir.DataType.FLOAT),
                     const_value=ir.tensor(np.array(alpha, dtype=np.float32)))
    model.graph.register_initializer(scale)
    scaled = ir.Node("", "Mul", [scale, sigmoid.inputs[0]], name=f"mutated_alpha_mul_{expert}")
    model.graph.insert_before(sigmoid, scaled)
    sigmoid.replace_input_with(0, scaled.outputs[0])


def swish_alpha(model: ir.Model, entry: dict) -> None:
    """Expert 2's swish is g * Sigmoid(1.702 * g), the others' plain SiLU."""
    _scale_swish(model, 2, 1.702)


def infinite_swish_alpha(model: ir.Model, entry: dict) -> None:
    """Every expert's swish is g * Sigmoid(inf * g): MOE's expert_alpha must be finite."""
    for expert in range(entry["num_experts"]):
        _scale_swish(model, expert, np.inf)


def smaller_expert(model: ir.Model, entry: dict) -> None:
    """Expert 2 has half the intermediate size of the others (a consistent graph that MOE cannot hold)."""
    for matmul in _expert_nodes(model, 2, "MatMul"):
        w = matmul.inputs[1].const_value.numpy()
        half = w[:, : w.shape[1] // 2] if w.shape[0] == entry["hidden_size"] else w[: w.shape[0] // 2]
        ir_set_input(model, matmul, 1, np.ascontiguousarray(half))


def routing_step(model: ir.Model, entry: dict) -> None:
    """Branch 0 gathers its routing weight at token * 1 + slot instead of token * K + slot."""
    flatten = next(node for node in model.graph if node.op_type == "Flatten")
    unsqueeze = flatten.inputs[0]
    width = next(node for node in model.graph if node.op_type == "Gather" and _producer_op(node.inputs[0]) == "Shape"
                 and node.inputs[0].producer().inputs[0] is unsqueeze
                 and node.outputs[0].consumers()[0].op_type == "Mul")
    ir_set_input(model, width, 1, np.array([2], dtype=np.int64))


def scatter_reduction(model: ir.Model, entry: dict) -> None:
    """The first branch scatters with reduction 'mul' (into zeros: its contribution vanishes)."""
    scatter = next(node for node in model.graph if node.op_type == "ScatterElements")
    scatter.attributes["reduction"] = ir.AttrString("reduction", "mul")


def nonzero_start(model: ir.Model, entry: dict) -> None:
    """The accumulation starts from ones."""
    start = next(node for node in model.graph if node.op_type == "ConstantOfShape"
                 and _producer_op(node.inputs[0]) == "Concat")
    start.attributes["value"] = ir.AttrTensor("value", ir.tensor(np.array([1.0], dtype=np.float32)))


MUTATIONS: list[tuple[str, Callable[[ir.Model, dict], None], str]] = [
    ("olmoe_loop_tiny", duplicate_mask_row, "two branches compute the same expert"),
    ("mixtral_loop_tiny", duplicate_hit_expert, "the branches read hit experts [0, 0, 2, 3] of 4"),
    ("mixtral_loop_tiny", onehot_depth, "OneHot depth 5 differs from the router's width 4"),
    ("mixtral_loop_tiny", tanh_activation, "swish"),
    ("qwen3_moe_loop_tiny", swish_alpha, "swish alpha"),
    ("olmoe_loop_tiny", infinite_swish_alpha, "swish alpha (the Mul before Sigmoid) is inf"),
    ("olmoe_loop_tiny", smaller_expert, "the gate weight is [32, 8], expected [32, 16]"),
    ("qwen2_moe_loop_tiny", routing_step, "does not step by K = 2"),
    ("mixtral_loop_tiny", scatter_reduction, "reduction is 'mul'"),
    ("olmoe_loop_tiny", nonzero_start, "does not start from zeros"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "mutate", "reason"), MUTATIONS, ids=[m[1].__name__ for m in MUTATIONS])
def test_mutation_is_a_near_miss(name, mutate, reason):
    assert_near_miss(name, mutate, RULE, reason)


# ----------------------------------------------------------------------------- mutations that still fuse

def swish_everywhere(model: ir.Model, entry: dict) -> None:
    """Every expert's swish is g * Sigmoid(1.702 * g): fused with expert_alpha 1.702."""
    for expert in range(entry["num_experts"]):
        _scale_swish(model, expert, 1.702)


def gate_up_swapped(model: ir.Model, entry: dict) -> None:
    """Expert 1's gate and up weights trade places and expert 2's gated product lists up first:
    the fusion must take the roles from the dataflow."""
    product = next(node for node in _expert_nodes(model, 1, "Mul") if node.inputs[1].producer().op_type == "MatMul")
    gate = product.inputs[0].producer().inputs[0].producer()
    up = product.inputs[1].producer()
    gate_w, up_w = gate.inputs[1], up.inputs[1]
    gate.replace_input_with(1, up_w)
    up.replace_input_with(1, gate_w)
    product = next(node for node in _expert_nodes(model, 2, "Mul") if node.inputs[1].producer().op_type == "MatMul")
    first, second = product.inputs
    product.replace_input_with(0, second)
    product.replace_input_with(1, first)


STILL_FUSE: list[tuple[str, Callable[[ir.Model, dict], None], float]] = [
    ("qwen3_moe_loop_tiny", swish_everywhere, 1.702),
    ("mixtral_loop_tiny", gate_up_swapped, 1.0),
]


@pytest.mark.parametrize(("name", "mutate", "alpha"), STILL_FUSE, ids=[m[1].__name__ for m in STILL_FUSE])
def test_mutation_still_fuses(name, mutate, alpha):
    mutated = mutated_copy(name, mutate)
    new, report = optimize_form(mutated)
    assert report.fused[RULE] == 1 and near_misses(report, RULE) == []
    node = moe_node(new)
    assert {a.name: a.f for a in node.attribute if a.name == "expert_alpha"} == {"expert_alpha": pytest.approx(alpha)}
    for suffix in ("", "_alt"):
        inputs = {"hidden_states": reference_data(name)[f"hidden_states{suffix}"]}
        np.testing.assert_allclose(reference_output(new, inputs), ort_output(mutated, inputs), **TOL)


# ----------------------------------------------------------------------------- GPT-OSS's CPU loop, DeepSeek-V3's loop
# GPT-OSS (transformers 4.57, exported on CPU): the branches gather the stacked weights and biases at the
# hit expert's index and read their routing weight from the dense [T, E] router scores; DeepSeek-V3: an
# [E, T, K] mask (tokens in column 0 of its NonZero), the tokens gathered directly, a sigmoid + bias +
# group-limited router, a shared expert beside.

GPT_OSS_CPU = fixture_names("loop_cpu")
DEEPSEEK = fixture_names("loop_grouped")


def test_new_loop_forms_are_covered():
    assert {MANIFEST[name]["family"] for name in GPT_OSS_CPU} == {"gpt_oss"}
    assert {MANIFEST[name]["family"] for name in DEEPSEEK} == {"deepseek_v3"}


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", GPT_OSS_CPU + DEEPSEEK)
def test_new_forms_fuse(name, target):
    model, report = optimized(name, target)
    assert report.fused[RULE] == 1 and report.near_misses == [], report.summary()
    after = op_counts(model)
    assert not {"NonZero", "OneHot", "Flatten", "Split"} & set(after)
    assert after["ScatterElements"] == 1  # the router's: GPT-OSS's dense scores, DeepSeek-V3's group mask
    # the expert MatMuls are gone, and DeepSeek-V3's shared expert's (folded into the MOE); the router's stay
    assert report.fused.get("SharedExpertFold", 0) == (shared_chunks(name) > 0)
    kept = {n.name for n in original(name).graph.node if n.op_type == "MatMul" and "/experts" not in n.name
            and "/shared_experts/" not in n.name}
    assert {n.name for n in model.graph.node if n.op_type == "MatMul"} == kept
    if target == "moe":
        assert after["MOE"] == 1
    else:
        assert (after["MoeInitRouting"], after["MoeFinalizeRouting"]) == (1, 1)
    assert check_model(model) == []


@pytest.mark.parametrize("name", GPT_OSS_CPU)
def test_gpt_oss_cpu_moe_node(name):
    """GEMM2_BIAS_SWIGLU_CLAMP on the block's own stacked weights, routed by the TopK and the softmax that the
    dense router scores scatter."""
    model, _ = optimized(name, "moe")
    node = moe_node(model)
    assert attributes(node) == {"expert_type": b"GEMM2_BIAS_SWIGLU_CLAMP", "expert_alpha": pytest.approx(1.702),
                                "expert_beta": 7.0, "gate_parity": 0}
    assert list(node.input[3:]) == ["experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj",
                                    "experts.down_proj_bias"]
    made_by = producers(model)
    indices, position = made_by[node.input[2]]
    assert (indices.op_type, position) == ("TopK", 1)
    weights = made_by[node.input[1]][0]  # the exporter's Cast of the softmax over the top-k logits
    assert (weights.op_type, made_by[weights.input[0]][0].op_type) == ("Cast", "Softmax")


@pytest.mark.parametrize("name", DEEPSEEK)
def test_deepseek_moe_node(name):
    """GEMM3_SWIGLU routed by the last TopK of the group-limited router (its indices) and the renormalized,
    scaled sigmoid scores gathered there (its weights)."""
    entry = MANIFEST[name]
    model, _ = optimized(name, "moe")
    node = moe_node(model)
    assert attributes(node) == {"expert_type": b"GEMM3_SWIGLU", "expert_alpha": 1.0}
    made_by = producers(model)
    indices, position = routing_producer(model, node.input[2])
    assert (indices.op_type, position) == ("TopK", 1)
    assert sum(n.op_type == "TopK" for n in model.graph.node) == 3  # group scores, groups, experts
    scaled = routing_producer(model, node.input[1])[0]
    assert scaled.op_type == "Mul" and made_by[scaled.input[0]][0].op_type == "Div"
    assert made_by[made_by[scaled.input[0]][0].input[0]][0].op_type == "GatherElements"
    E, H, I = entry["num_experts"] + shared_chunks(name), entry["hidden_size"], entry["intermediate_size"]
    assert expert_weight_shapes(model, node) == [[E, I, H], [E, I, H], [E, H, I]]


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", GPT_OSS_CPU + DEEPSEEK)
def test_new_forms_numbers(name, target):
    model, _ = optimized(name, target)
    assert_torch_and_pinned_numbers(name, model)
    assert_python_kernels_match_pinned(name, model)


def _first(model: ir.Model, op_type: str, where: Callable[[ir.Node], bool]) -> ir.Node:
    return next(node for node in model.graph if node.op_type == op_type and where(node))


def _reads(node: ir.Node, initializer_name: str) -> bool:
    return any(value is not None and value.name == initializer_name for value in node.inputs)


def gathers_expert_0_down(model: ir.Model, entry: dict) -> None:
    """GPT-OSS: branch 1 takes expert 0's down weight, whichever expert it computes."""
    gathers = [node for node in model.graph if node.op_type == "Gather" and _reads(node, "experts.down_proj")]
    ir_set_input(model, gathers[1], 1, np.array(0, dtype=np.int64))


def routing_column_0(model: ir.Model, entry: dict) -> None:
    """GPT-OSS: branch 1 multiplies by expert 0's column of the router scores."""
    columns = [node for node in model.graph if node.op_type == "Gather" and _reads(node, "router_scores")
               and node.attributes.get_int("axis", 0) == 1]
    ir_set_input(model, columns[1], 1, np.array(0, dtype=np.int64))


def gpt_oss_onehot_depth(model: ir.Model, entry: dict) -> None:
    """GPT-OSS: the expert mask has two classes beyond the experts (GPT-OSS has one)."""
    onehot = _first(model, "OneHot", lambda node: True)
    ir_set_input(model, onehot, 1, np.array(entry["num_experts"] + 2, dtype=np.int64))


def unclamped_up(model: ir.Model, entry: dict) -> None:
    """GPT-OSS: branch 0 clamps up to [-7, 8]."""
    clip = _first(model, "Clip", lambda node: node.inputs[1] is not None)
    ir_set_input(model, clip, 2, np.array(8.0, dtype=np.float32))


def deepseek_routing_step(model: ir.Model, entry: dict) -> None:
    """DeepSeek-V3: branch 0 gathers its routing weight at token * 1 + slot instead of token * K + slot."""
    flatten = _first(model, "Flatten", lambda node: True)
    index = flatten.outputs[0].consumers()[0].inputs[1].producer()  # Add(slot, Mul(token, K))
    mul = next(term.producer() for term in index.inputs if _producer_op(term) == "Mul")
    ir_set_input(model, mul, 1, np.array(1, dtype=np.int64))


NEW_FORM_MUTATIONS: list[tuple[str, Callable[[ir.Model, dict], None], str]] = [
    ("gpt_oss_loop_cpu_tiny", gathers_expert_0_down,
     "the down projection weight is not gathered on axis 0 at the branch's expert index"),
    ("gpt_oss_loop_cpu_tiny", routing_column_0, "the routing weights column is not the branch's expert's"),
    ("gpt_oss_loop_cpu_tiny", gpt_oss_onehot_depth, "OneHot depth 6 differs from the router's width 4 (or 5"),
    ("gpt_oss_loop_cpu_tiny", unclamped_up, "up is clamped to [-7.0, 8.0], expected [-7.0, 7.0]"),
    ("deepseek_v3_loop_grouped_tiny", deepseek_routing_step, "does not step by K = 2"),
    ("deepseek_v3_loop_grouped_tiny", duplicate_mask_row, "two branches compute the same expert"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "mutate", "reason"), NEW_FORM_MUTATIONS,
                         ids=[m[1].__name__ for m in NEW_FORM_MUTATIONS])
def test_new_form_mutation_is_a_near_miss(name, mutate, reason):
    test_mutation_is_a_near_miss(name, mutate, reason)


# ----------------------------------------------------------------------------- GraniteMoe / JetMoe's sorted dispatch
# One index_add_ of the T * K routed rows sorted by expert; each expert's row block (Split by the traced
# counts) through its own weights. The export is right only on inputs with the trace's counts, and even
# there onnxruntime differs from torch: its ScatterElements has duplicate indices and no reduction. The
# fused model is compared with torch and with the block computed in numpy from the export's weights.

SORTED = fixture_names("sorted")


def test_sorted_fixtures_are_covered():
    assert {MANIFEST[name]["family"] for name in SORTED} == {"granitemoe", "jetmoe"}


def sorted_reference(name: str, hidden_states: np.ndarray) -> np.ndarray:
    """The block in numpy from the export's weights: each token through its top-k experts (SiLU of the first
    half of input_linear times the second, then output_linear), weighted by the softmax over the k logits and
    summed as torch's index_add_ does; plus JetMoe's output bias."""
    model, entry = original(name), MANIFEST[name]
    k, inter = entry["top_k"], entry["intermediate_size"]
    made_by = {out: node for node in model.graph.node for out in node.output}
    constants = {tensor.name: onnx.numpy_helper.to_array(tensor) for tensor in model.graph.initializer}

    def per_expert(layer: str) -> list[np.ndarray]:
        (concat,) = [node for node in model.graph.node if node.name == f"/{layer}/Concat"]
        return [constants[made_by[part].input[1]] for part in concat.input]

    gate_up, down = per_expert("input_linear"), per_expert("output_linear")
    (router,) = [node for node in model.graph.node if node.name == "/router/layer/MatMul"]
    tokens = hidden_states.reshape(-1, entry["hidden_size"]).astype(np.float64)
    logits = tokens @ constants[router.input[1]]
    chosen = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, chosen, axis=1)
    weights = np.exp(top - top.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    out = np.zeros_like(tokens)
    for t, (experts, scales) in enumerate(zip(chosen, weights, strict=True)):
        for e, scale in zip(experts, scales, strict=True):
            h = tokens[t] @ gate_up[e]
            out[t] += scale * ((h[:inter] / (1 + np.exp(-h[:inter])) * h[inter:]) @ down[e])
    last = made_by["output"]
    bias = [constants[value] for value in last.input if value in constants] if last.op_type == "Add" else []
    return (out.reshape(hidden_states.shape) + sum(bias)).astype(np.float32)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", SORTED)
def test_sorted_fuses(name, target):
    model, report = optimized(name, target)
    assert report.fused[RULE] == 1 and report.near_misses == [], report.summary()
    (note,) = report.notes
    assert "expert counts" in note and "without reduction" in note and "follows torch" in note
    after = op_counts(model)
    assert after["Split"] == after["ScatterElements"] == 0
    assert [n.name for n in model.graph.node if n.op_type == "MatMul"] == ["/router/layer/MatMul"]
    assert (after["TopK"], after["Softmax"]) == (1, 1)  # the router's; the sort is gone
    if target == "moe":
        node = assert_swiglu_moe_node(name, model)
        assert producers(model)[node.input[1]][0].op_type == "Softmax"
    assert check_model(model) == []


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", SORTED)
def test_sorted_numbers(name, target):
    model, _ = optimized(name, target)
    data = reference_data(name)
    for suffix in ("", "_alt"):
        inputs = {"hidden_states": data[f"hidden_states{suffix}"]}
        np.testing.assert_allclose(reference_output(model, inputs), data[f"expected{suffix}"], **TOL)
    # the export itself differs from torch (duplicate scatter indices): what the fusion repairs
    original_output = ort_output(original(name), {"hidden_states": data["hidden_states"]})
    assert not np.allclose(original_output, data["expected"], **TOL)
    session = moe_onnx.session(model, backend="python")
    for batch, seq in SHAPES:
        inputs = scaled_random_feeds(name, batch, seq)
        expected = sorted_reference(name, inputs["hidden_states"])
        np.testing.assert_allclose(reference_output(model, inputs), expected, **TOL)
        np.testing.assert_allclose(session.run(["output"], inputs)[0], expected, **TOL)


def test_sorted_reference_is_torch():
    """The numpy block above is the block: it gives torch's outputs."""
    for name in SORTED:
        data = reference_data(name)
        for suffix in ("", "_alt"):
            np.testing.assert_allclose(sorted_reference(name, data[f"hidden_states{suffix}"]),
                                       data[f"expected{suffix}"], **TOL)


def _named(model: ir.Model, name: str) -> ir.Node:
    return next(node for node in model.graph if node.name == name)


def down_blocks_differ(model: ir.Model, entry: dict) -> None:
    """The down projection splits its rows with expert 0's and 1's counts swapped."""
    split = _named(model, "/output_linear/Split")
    sizes = split.inputs[1].producer().attributes["value"].as_tensor().numpy().copy()
    sizes[[0, 1]] = sizes[[1, 0]]
    ir_set_input(model, split, 1, sizes)


def down_blocks_reordered(model: ir.Model, entry: dict) -> None:
    """The down projection concatenates expert 1's block first."""
    concat = _named(model, "/output_linear/Concat")
    first, second = concat.inputs[0], concat.inputs[1]
    concat.replace_input_with(0, second)
    concat.replace_input_with(1, first)


def descending_sort(model: ir.Model, entry: dict) -> None:
    """The routed rows are sorted by descending expert."""
    _named(model, "/router/TopK_1").attributes["largest"] = ir.AttrInt64("largest", 1)


SORTED_MUTATIONS: list[tuple[str, Callable[[ir.Model, dict], None], str]] = [
    ("granitemoe_sorted_tiny", down_blocks_differ, "the row blocks differ"),
    ("jetmoe_sorted_tiny", down_blocks_reordered, "the rows of expert 0 are not output 0 of one Split"),
    ("granitemoe_sorted_tiny", descending_sort, "the sorted slots are not the indices of an ascending TopK"),
]


@pytest.mark.parametrize(("name", "mutate", "reason"), SORTED_MUTATIONS, ids=[m[1].__name__ for m in SORTED_MUTATIONS])
def test_sorted_mutation_is_a_near_miss(name, mutate, reason):
    test_mutation_is_a_near_miss(name, mutate, reason)


def deepseek_mask_kt(model: ir.Model, entry: dict) -> None:
    """DeepSeek-V3: the mask is permuted [2, 1, 0] ([E, K, T]) while the branches still take column 0 of each
    row's NonZero as the tokens (now the slots)."""
    transpose = _first(model, "Transpose", lambda node: _producer_op(node.inputs[0]) == "OneHot")
    transpose.attributes["perm"] = ir.AttrInt64s("perm", [2, 1, 0])
    for value in [transpose.outputs[0]] + [user.outputs[0] for user in transpose.outputs[0].consumers()]:
        value.shape = None  # stale [E, T, K] / [T, K] annotations; shape inference sets them again


@pytest.mark.slow
def test_deepseek_token_column_is_checked():
    test_mutation_is_a_near_miss("deepseek_v3_loop_grouped_tiny", deepseek_mask_kt,
                                 "the routed tokens are not column 1 of NonZero(mask row), the mask row's token axis")
