"""The batched_mm fusions (moe_onnx/rewrite/batched_mm.py) on the transformers 5 fixtures: every
family and size fuses on both targets and keeps the numbers; one-constant mutations either fuse
with the value read from the graph (parity, clamp bound, alpha, swapped halves, missing
renormalization) or stay unfused with the failed check named, and always keep the numbers."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import numpy_helper

import moe_onnx
from backends import cached_session
from fixture_models import (
    MANIFEST, SHAPES, TARGETS, TOL, attributes, fixture_names, moe_node, mutable_copy, nodes,
    op_counts, optimized, original, ort_output, producer, random_feeds, random_hidden, reference_data,
    reference_output, set_input,
    routing_producer, shared_chunks, optimize_form,
)
from moe_onnx.check import check_model
from moe_onnx.rewrite._match import shape_dims
from moe_onnx.testing import initializer

NAMES = fixture_names("batched_mm")
GPT_OSS, SWIGLU, NON_GATED = "BatchedMmGptOss", "BatchedMmSwiglu", "BatchedMmNonGated"
UNFUSED = {"GatherND", "Expand", "MatMul", "Split", "Slice", "Clip", "Squeeze", "Unsqueeze"}
# Of those, what stays outside the block: Nemotron-H's group-limited router (two Expand, an
# Unsqueeze) and its shared expert (two MatMul)
KEPT = {"nemotron_h": {"Expand": 2, "MatMul": 2, "Unsqueeze": 1}}


def rule_of(name: str) -> str:
    return {"gpt_oss": GPT_OSS, "nemotron_h": NON_GATED}.get(MANIFEST[name]["family"], SWIGLU)


def unfused_left(model: onnx.ModelProto, ops) -> dict[str, int]:
    counts = op_counts(model)
    return {op: counts[op] for op in sorted(ops) if counts[op]}


# ----------------------------------------------------------------------------- fixtures fuse

@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", NAMES)
def test_fuses(name, target):
    model, report = optimized(name, target)
    assert report.fused[rule_of(name)] == 1
    assert report.near_misses == []
    before, after = op_counts(original(name)), op_counts(model)
    # the router (with its renormalization) stays; Qwen2-MoE's shared expert folds into the MOE
    folded = shared_chunks(name) > 0
    assert report.fused.get("SharedExpertFold", 0) == folded
    assert after["Gemm"] == before["Gemm"] - 3 * folded  # its gate, up and down projections
    for op in ("TopK", "Softmax", "Div"):
        assert after[op] == before[op], op
    assert after["ReduceSum"] == before["ReduceSum"] - 1  # the sum over k went into the fused block
    kept = dict(KEPT.get(MANIFEST[name]["family"], {}))
    if folded:  # the fold extends the routing with two Expand (its weight and index columns)
        kept["Expand"] = kept.get("Expand", 0) + 2
    if target == "moe":
        assert unfused_left(model, UNFUSED) == kept, "unfused ops left"
        assert after["MOE"] == 1
    else:
        assert (after["MoeInitRouting"], after["MoeFinalizeRouting"], after["MOE"]) == (1, 1, 0)
        assert after["MoeRowParallelLinear"] == {GPT_OSS: 2, SWIGLU: 3, NON_GATED: 2}[rule_of(name)]
        # the activation is re-emitted
        checked = {"GatherND", "Expand", "MatMul", "Split"}
        assert unfused_left(model, checked) == {op: n for op, n in kept.items() if op in checked}
    assert check_model(model) == []


@pytest.mark.parametrize("name", NAMES)
def test_moe_node(name):
    entry = MANIFEST[name]
    model, _ = optimized(name, "moe")
    node = moe_node(model)
    attrs = attributes(node)
    routing = routing_producer(model, node.input[1])[0]
    assert [(n.op_type, i) for n, i in [routing_producer(model, node.input[2])]] == [("TopK", 1)]
    shapes = {i.name: list(i.dims) for i in model.graph.initializer}
    E, H, I = entry["num_experts"] + shared_chunks(name), entry["hidden_size"], entry["intermediate_size"]
    if entry["family"] == "gpt_oss":
        assert attrs == {"expert_type": b"GEMM2_BIAS_SWIGLU_CLAMP", "expert_alpha": pytest.approx(1.702),
                         "expert_beta": 7.0, "gate_parity": 0}
        assert routing.op_type == "Softmax"  # the top-k softmax the slots are multiplied by
        assert [shapes[n] for n in node.input[3:7]] == [[E, H, 2 * I], [E, 2 * I], [E, I, H], [E, H]]
    elif entry["family"] == "nemotron_h":
        assert attrs == {"expert_type": b"GEMM2_ACT", "activation": b"relu2"}
        assert routing.op_type == "Div"  # the renormalized sigmoid scores of the chosen experts
        assert list(node.input[4:]) == ["", node.input[5]]  # no biases, no weight_2
        assert [shapes[node.input[i]] for i in (3, 5)] == [[E, I, H], [E, H, I]]
    else:
        assert attrs == {"expert_type": b"GEMM3_SWIGLU", "expert_alpha": 1.0}
        # renormalized weights where the model renormalizes, else the TopK values themselves
        assert routing.op_type == ("Div" if entry["renormalize"] else "TopK")
        assert [shapes[node.input[i]] for i in (3, 5, 7)] == [[E, I, H], [E, I, H], [E, H, I]]


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", NAMES)
def test_numbers(name, target):
    assert_numbers_on(name, target, ("python",))


def assert_numbers_on(name: str, target: str, backends: tuple[str, ...]) -> None:
    """Fixture ``name`` optimized for ``target`` computes the original's outputs at every (batch, seq) of SHAPES
    on the onnx reference and on ``backends``' kernels, and torch's outputs on the reference."""
    model, _ = optimized(name, target)
    sessions = [cached_session(model, backend) for backend in backends]
    for batch, seq in SHAPES:
        inputs = random_feeds(name, batch, seq)
        expected = ort_output(original(name), inputs)
        np.testing.assert_allclose(reference_output(model, inputs), expected, **TOL)
        for session in sessions:
            np.testing.assert_allclose(session.run(["output"], inputs)[0], expected, **TOL)
    data = reference_data(name)
    for suffix in ("", "_alt"):
        got = reference_output(model, {"hidden_states": data["hidden_states" + suffix]})
        np.testing.assert_allclose(got, data["expected" + suffix], **TOL)


def test_two_blocks_in_one_model():
    """Layers in a row, as in a whole model: GPT-OSS's block feeds Qwen2-MoE's (and its shared expert)."""
    first, second = original("gpt_oss_batched_mm_tiny"), original("qwen2_moe_batched_mm_tiny")
    model = onnx.compose.merge_models(first, second, io_map=[("output", "hidden_states")], prefix1="a/", prefix2="b/")
    for target in TARGETS:
        new, report = optimize_form(model, target=target)
        assert (report.fused[GPT_OSS], report.fused[SWIGLU]) == (1, 1)
        assert check_model(new) == []
        inputs = {"a/hidden_states": random_hidden("gpt_oss_batched_mm_tiny", 2, 3)}
        expected = ort_output(model, inputs, "b/output")
        got = reference_output(new, inputs, "b/output")
        np.testing.assert_allclose(got, expected, **TOL)


# ----------------------------------------------------------------------------- mutations

def mutated(name: str, mutate: Callable[[onnx.ModelProto], None]) -> onnx.ModelProto:
    model = mutable_copy(name)
    mutate(model)
    return model


def assert_same_numbers(name: str, before: onnx.ModelProto, after: onnx.ModelProto) -> None:
    for batch, seq in SHAPES:
        inputs = random_feeds(name, batch, seq, seed=1)
        np.testing.assert_allclose(reference_output(after, inputs), ort_output(before, inputs), **TOL)


def gate_clip(m):
    return nodes(m, "Clip", lambda n: n.input[1] == "")[0]


def up_clip(m):
    return nodes(m, "Clip", lambda n: n.input[1] != "")[0]


def plus_one(m):
    """The Add of +1 to the clamped up half."""
    return nodes(m, "Add", lambda n: n.input[0] == up_clip(m).output[0])[0]


def down_gather(m):
    """The GatherND of the down weight: the weight operand of the second MatMul."""
    second = nodes(m, "MatMul")[1]
    weight_operand = next(v for v in second.input if producer(m, v).op_type == "GatherND")
    return producer(m, weight_operand)


def grow_experts(m, gather: onnx.NodeProto) -> None:
    """One more (never selected) expert in the gathered weight: E no longer agrees with the router."""
    w = initializer(m, gather.input[0])
    set_input(m, gather, 0, np.concatenate([w, np.zeros_like(w[:1])]))


def rewire_sigmoid_to_second_half(m) -> None:
    split = nodes(m, "Split")[0]
    first, second = split.output
    for node in m.graph.node:
        if node.op_type in ("Sigmoid", "Mul"):
            node.input[:] = [{first: second, second: first}.get(v, v) for v in node.input]


def drop_renormalization(m) -> None:
    (div,) = nodes(m, "Div")
    for node in m.graph.node:
        node.input[:] = [div.input[0] if v == div.output[0] else v for v in node.input]


def scale_sigmoid(m, alpha) -> None:
    """Sigmoid(gate * alpha) instead of SiLU's Sigmoid(gate)."""
    sigmoid = nodes(m, "Sigmoid")[0]
    m.graph.initializer.append(numpy_helper.from_array(np.asarray(alpha, np.float32), "alpha"))
    m.graph.node.insert(list(m.graph.node).index(sigmoid),
                        onnx.helper.make_node("Mul", [sigmoid.input[0], "alpha"], ["scaled_gate"]))
    sigmoid.input[0] = "scaled_gate"


def transpose_weights(m) -> None:
    """The weights as a larger export may keep them: an initializer behind a Transpose node."""
    for gather in nodes(m, "GatherND"):
        w = initializer(m, gather.input[0])
        if w.ndim != 3:
            continue
        set_input(m, gather, 0, np.ascontiguousarray(w.transpose(0, 2, 1)))
        transposed = f"{gather.input[0]}_T"
        m.graph.node.insert(0, onnx.helper.make_node("Transpose", [gather.input[0]], [transposed], perm=[0, 2, 1]))
        gather.input[0] = transposed


GPT_TINY, QWEN3_TINY, OLMOE_TINY = "gpt_oss_batched_mm_tiny", "qwen3_moe_batched_mm_tiny", "olmoe_batched_mm_tiny"

# (fixture, mutation, the attributes the MOE must get from the mutated graph)
FUSED_VARIANTS = {
    "gate on the odd columns": (GPT_TINY, lambda m: (
        set_input(m, producer(m, gate_clip(m).input[0]), 1, np.array([1])),
        set_input(m, producer(m, up_clip(m).input[0]), 1, np.array([0]))), {"gate_parity": 1}),
    "clamp bound 5": (GPT_TINY, lambda m: (
        set_input(m, gate_clip(m), 2, np.float32(5)), set_input(m, up_clip(m), 1, np.float32(-5)),
        set_input(m, up_clip(m), 2, np.float32(5))), {"expert_beta": 5.0}),
    "alpha 1.5": (GPT_TINY, lambda m: set_input(m, producer(m, nodes(m, "Sigmoid")[0].input[0]), 1, np.float32(1.5)),
                  {"expert_alpha": 1.5}),
    "weights behind Transpose (gpt_oss)": (GPT_TINY, transpose_weights, {"gate_parity": 0}),
    "weights behind Transpose (qwen3)": (QWEN3_TINY, transpose_weights, {"expert_alpha": 1.0}),
    "SiLU on the second half": (QWEN3_TINY, rewire_sigmoid_to_second_half, {"expert_alpha": 1.0}),
    "no renormalization": (QWEN3_TINY, drop_renormalization, {"expert_alpha": 1.0}),
    "swish alpha 2 instead of SiLU": (QWEN3_TINY, lambda m: scale_sigmoid(m, 2.0), {"expert_alpha": 2.0}),
}


@pytest.mark.parametrize("variant", FUSED_VARIANTS)
def test_variant_fuses_with_the_graph_values(variant):
    name, mutate, expected_attrs = FUSED_VARIANTS[variant]
    model = mutated(name, mutate)
    new, report = optimize_form(model)
    assert report.fused.get(rule_of(name)) == 1, report.summary()
    attrs = attributes(moe_node(new))
    assert {key: attrs[key] for key in expected_attrs} == pytest.approx(expected_attrs)
    assert check_model(new) == []
    assert_same_numbers(name, model, new)


def test_swapped_halves_pick_the_other_rows():
    new, _ = optimize_form(mutated(QWEN3_TINY, rewire_sigmoid_to_second_half))
    gate_up = initializer(original(QWEN3_TINY), nodes(original(QWEN3_TINY), "GatherND")[0].input[0])
    weights = {i.name: numpy_helper.to_array(i) for i in new.graph.initializer}
    gate, up = weights[moe_node(new).input[3]], weights[moe_node(new).input[5]]
    np.testing.assert_array_equal(gate, gate_up[:, 16:])
    np.testing.assert_array_equal(up, gate_up[:, :16])


def test_missing_renormalization_feeds_the_topk_values():
    new, _ = optimize_form(mutated(QWEN3_TINY, drop_renormalization))
    routing = producer(new, moe_node(new).input[1])
    assert (routing.op_type, list(routing.output).index(moe_node(new).input[1])) == ("TopK", 0)


# (fixture, mutation, words the near-miss reason must contain)
NEAR_MISSES = {
    "gate and up on the same columns": (GPT_TINY,
                                        lambda m: set_input(m, producer(m, up_clip(m).input[0]), 1, np.array([0])),
                                        "start at [0] and [0]"),
    "gate clamp bound differs from up's": (GPT_TINY, lambda m: set_input(m, gate_clip(m), 2, np.float32(5)),
                                           "up is clamped to [-7.0, 7.0], expected [-5.0, 5.0]"),
    "asymmetric up clamp": (GPT_TINY, lambda m: set_input(m, up_clip(m), 1, np.float32(-6)),
                            "up is clamped to [-6.0, 7.0]"),
    "gate clamp with a lower bound": (GPT_TINY, lambda m: set_input(m, gate_clip(m), 1, np.float32(-7)),
                                      "gate clamp has a lower bound"),
    "negative clamp bound": (GPT_TINY, lambda m: (set_input(m, gate_clip(m), 2, np.float32(-1)),
                                                  set_input(m, up_clip(m), 1, np.float32(1)),
                                                  set_input(m, up_clip(m), 2, np.float32(-1))),
                             "gate clamp bound is -1.0"),
    "per-channel alpha": (GPT_TINY, lambda m: set_input(m, producer(m, nodes(m, "Sigmoid")[0].input[0]), 1,
                                                        np.full(16, 1.702, np.float32)), "swish alpha"),
    "infinite alpha": (GPT_TINY, lambda m: set_input(m, producer(m, nodes(m, "Sigmoid")[0].input[0]), 1,
                                                     np.float32(np.inf)), "swish alpha (the Mul before Sigmoid) is inf"),
    "up offset 2": (GPT_TINY, lambda m: set_input(m, plus_one(m), 1, np.float32(2)), "up is offset by 2.0"),
    "expert count (gpt_oss down)": (GPT_TINY, lambda m: grow_experts(m, down_gather(m)), "down has shape [5, 16, 32]"),
    "expert count (olmoe down)": (OLMOE_TINY, lambda m: grow_experts(m, down_gather(m)), "down has shape [5, 32, 16]"),
    "per-channel alpha in a SiLU": (QWEN3_TINY, lambda m: scale_sigmoid(m, np.full(16, 2.0)), "swish alpha"),
}


@pytest.mark.parametrize("case", NEAR_MISSES)
def test_near_miss_stays_unfused(case):
    name, mutate, reason = NEAR_MISSES[case]
    model = mutated(name, mutate)
    new, report = optimize_form(model)
    assert report.fused == {}
    assert "MOE" not in op_counts(new)
    reasons = [miss["reason"] for miss in report.near_misses if miss["rule"] == rule_of(name)]
    assert any(reason in r for r in reasons), reasons
    assert_same_numbers(name, model, new)


# ----------------------------------------------------------------------------- non-gated experts (Nemotron-H)

NEMOTRON_TINY = "nemotron_h_batched_mm_tiny"


def expert_activation(m) -> tuple[str, onnx.NodeProto]:
    """The experts' relu² (the shared expert has its own): the up bmm's Squeeze output and the Pow
    whose output the down bmm reads."""
    (relu,) = nodes(m, "Relu", lambda n: producer(m, n.input[0]).op_type == "Squeeze")
    (power,) = nodes(m, "Pow", lambda n: n.input[0] == relu.output[0])
    return relu.input[0], power


def set_activation(m, make: Callable[[Callable, str], str]) -> None:
    """Replace the experts' relu² by ``make(node, z)``'s nodes (``node(op, inputs, **attrs)`` adds one
    and returns its output; a float input is a new scalar constant), ``make`` returning the result."""
    z, power = expert_activation(m)
    relu = producer(m, power.input[0])
    added = []

    def node(op_type, *inputs, **attrs):
        names = []
        for value in inputs:
            if isinstance(value, float):
                names.append(f"act_const_{len(m.graph.initializer)}")
                m.graph.initializer.append(numpy_helper.from_array(np.array(value, np.float32), names[-1]))
            else:
                names.append(value)
        added.append(onnx.helper.make_node(op_type, names, [f"act_{len(added)}"], **attrs))
        return added[-1].output[0]

    result = make(node, z)
    at = list(m.graph.node).index(relu)
    m.graph.node.remove(power)
    m.graph.node.remove(relu)
    for i, new in enumerate(added):
        m.graph.node.insert(at + i, new)
    for consumer in m.graph.node:
        consumer.input[:] = [result if v == power.output[0] else v for v in consumer.input]


def with_opset(version: int, make):
    """``make`` on a model that imports the default domain at ``version`` (Gelu is opset 20)."""
    def mutate(m):
        for opset in m.opset_import:
            if opset.domain == "":
                opset.version = version
        set_activation(m, make)
    return mutate


def gelu_erf(node, z):
    return node("Mul", z, node("Mul", 0.5, node("Add", node("Erf", node("Div", z, float(np.sqrt(2)))), 1.0)))


def gelu_tanh(node, z):
    cubic = node("Add", z, node("Mul", 0.044715, node("Pow", z, 3.0)))
    return node("Mul", z, node("Mul", 0.5, node("Add", node("Tanh", node("Mul", float(np.sqrt(2 / np.pi)), cubic)), 1.0)))


def gelu_new(node, z):  # transformers' gelu_new as torch's exporter writes it
    cubic = node("Add", z, node("Mul", node("Pow", z, 3.0), 0.044715))
    return node("Mul", node("Mul", z, 0.5), node("Add", node("Tanh", node("Mul", cubic, float(np.sqrt(2 / np.pi)))), 1.0))


# (mutation, the activation the MOE must name)
NON_GATED_VARIANTS = {
    "relu": (lambda node, z: node("Relu", z), "relu"),
    "relu² as Mul": (lambda node, z: (lambda r: node("Mul", r, r))(node("Relu", z)), "relu2"),
    "SiLU": (lambda node, z: node("Mul", node("Sigmoid", z), z), "silu"),
    "GELU erf": (gelu_erf, "gelu"),
    "GELU tanh": (gelu_tanh, "gelu_tanh"),
    "gelu_new": (gelu_new, "gelu_tanh"),
    "identity": (lambda node, z: z, "identity"),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", NON_GATED_VARIANTS)
def test_non_gated_activation_is_read_from_the_graph(variant):
    make, activation = NON_GATED_VARIANTS[variant]
    model = mutated(NEMOTRON_TINY, lambda m: set_activation(m, make))
    for target in TARGETS:
        new, report = optimize_form(model, target=target)
        assert report.fused.get(NON_GATED) == 1 and report.near_misses == [], report.summary()
        assert check_model(new) == []
        if target == "moe":
            assert attributes(moe_node(new)) == {"expert_type": b"GEMM2_ACT", "activation": activation.encode()}
        assert_same_numbers(NEMOTRON_TINY, model, new)
        python = moe_onnx.session(new, backend="python")
        cpp = moe_onnx.session(new, backend="cpp")
        inputs = random_feeds(NEMOTRON_TINY, 2, 3, seed=2, scale=3.0)
        expected = ort_output(model, inputs)
        for session in (python, cpp):
            np.testing.assert_allclose(session.run(["output"], inputs)[0], expected, **TOL)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_non_gated_gelu_op(approximate):
    """The Gelu op of opset 20 (what torch writes at that opset) is read with its approximation."""
    model = mutated(NEMOTRON_TINY, with_opset(20, lambda node, z: node("Gelu", z, approximate=approximate)))
    new, report = optimize_form(model)
    assert report.fused.get(NON_GATED) == 1, report.summary()
    assert attributes(moe_node(new))["activation"] == (b"gelu" if approximate == "none" else b"gelu_tanh")
    inputs = random_feeds(NEMOTRON_TINY, 3, 7, seed=1)
    np.testing.assert_allclose(moe_onnx.session(new, backend="cpp").run(["output"], inputs)[0],
                               ort_output(model, inputs), **TOL)


def test_non_gated_weights_behind_transpose():
    model = mutated(NEMOTRON_TINY, transpose_weights)
    new, report = optimize_form(model)
    assert report.fused.get(NON_GATED) == 1, report.summary()
    assert_same_numbers(NEMOTRON_TINY, model, new)


def test_non_gated_block_beside_a_gated_one():
    """Layers in a row: Nemotron-H's non-gated block feeds Qwen3-MoE's SwiGLU block."""
    first, second = original(NEMOTRON_TINY), original(QWEN3_TINY)
    model = onnx.compose.merge_models(first, second, io_map=[("output", "hidden_states")], prefix1="a/", prefix2="b/")
    new, report = optimize_form(model)
    assert (report.fused[NON_GATED], report.fused[SWIGLU]) == (1, 1)
    inputs = {"a/hidden_states": random_hidden(NEMOTRON_TINY, 2, 3)}
    np.testing.assert_allclose(reference_output(new, inputs, "b/output"), ort_output(model, inputs, "b/output"), **TOL)


def set_exponent(m, value) -> None:
    set_input(m, expert_activation(m)[1], 1, value)


# (mutation, words the near-miss reason must contain)
NON_GATED_NEAR_MISSES = {
    "relu cubed": (lambda m: set_exponent(m, np.float32(3)),
                   "the activation of the up projection is none of relu, relu2, gelu, gelu_tanh, silu, identity "
                   "(f(-2.0) = 0, f(-0.5) = 0, f(0.5) = 0.125, f(2.0) = 8)"),
    "per-channel exponent": (lambda m: set_exponent(m, np.full(16, 2.0, np.float32)),
                             "the activation uses a constant of shape [16]; expected scalars"),
    "LeakyRelu": (lambda m: set_activation(m, lambda node, z: node("LeakyRelu", z, alpha=0.1)),
                  "the activation uses LeakyRelu; expected a pointwise function of the up projection"),
    "LeakyRelu squared": (lambda m: set_activation(m, lambda node, z: node("Pow", node("LeakyRelu", z), 2.0)),
                          "the activation uses LeakyRelu"),
    "tanh": (lambda m: set_activation(m, lambda node, z: node("Tanh", z)),
             "the activation of the up projection is none of"),
    "expert count (nemotron_h down)": (lambda m: grow_experts(m, down_gather(m)), "down has shape [5, 32, 16]"),
}


@pytest.mark.parametrize("case", NON_GATED_NEAR_MISSES)
def test_non_gated_near_miss_stays_unfused(case):
    mutate, reason = NON_GATED_NEAR_MISSES[case]
    model = mutated(NEMOTRON_TINY, mutate)
    new, report = optimize_form(model)
    assert report.fused == {}
    assert "MOE" not in op_counts(new)
    reasons = [miss["reason"] for miss in report.near_misses if miss["rule"] == NON_GATED]
    assert any(reason in r for r in reasons), reasons
    assert_same_numbers(NEMOTRON_TINY, model, new)


# ----------------------------------------------------------------------------- weights stored [E, in, out]
# transformers' batched_mm with is_transposed=True (AriaText): MatMul(Unsqueeze(tokens, 1), GatherND(W))

TRANSPOSED = fixture_names("batched_mm_transposed")
TRANSPOSED_RULE, ARIA_TINY = "BatchedMmSwigluTransposed", "aria_text_batched_mm_transposed_tiny"


def test_transposed_fixtures_exist():
    assert {"aria_text_batched_mm_transposed_tiny", "aria_text_batched_mm_transposed_small"} <= set(TRANSPOSED)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", TRANSPOSED)
def test_transposed_fuses(name, target):
    model, report = optimized(name, target)
    assert report.fused[TRANSPOSED_RULE] == 1 and report.near_misses == []
    before, after = op_counts(original(name)), op_counts(model)
    for op in ("Gemm", "TopK", "Softmax"):  # the router stays
        assert after[op] == before[op], op
    assert not {"GatherND", "Split", "ReduceSum"} & set(after)
    assert report.fused["SharedExpertFold"] == 1 and after["MatMul"] == 0  # the shared expert, folded in
    assert after["MOE" if target == "moe" else "MoeInitRouting"] == 1
    assert check_model(model) == []


@pytest.mark.parametrize("name", TRANSPOSED)
def test_transposed_moe_node(name):
    entry = MANIFEST[name]
    model, _ = optimized(name, "moe")
    node = moe_node(model)
    assert attributes(node) == {"expert_type": b"GEMM3_SWIGLU", "expert_alpha": 1.0}
    E, H, I = entry["num_experts"], entry["hidden_size"], entry["intermediate_size"]
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    gate_up = initializer(original(name), nodes(original(name), "GatherND")[0].input[0])  # [E, H, 2I]
    down = initializer(original(name), down_gather(original(name)).input[0])  # [E, I, H]
    assert (gate_up.shape, down.shape) == ((E, H, 2 * I), (E, I, H))
    # the routed experts first; the folded shared expert (one of width I) after them
    assert [weights[node.input[i]].shape[0] for i in (3, 5, 7)] == [E + shared_chunks(name)] * 3
    np.testing.assert_array_equal(weights[node.input[3]][:E], gate_up[:, :, :I].transpose(0, 2, 1))
    np.testing.assert_array_equal(weights[node.input[5]][:E], gate_up[:, :, I:].transpose(0, 2, 1))
    np.testing.assert_array_equal(weights[node.input[7]][:E], down.transpose(0, 2, 1))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", TRANSPOSED)
def test_transposed_numbers(name, target):
    assert_numbers_on(name, target, ("cpp", "python"))


def test_transposed_swapped_halves_pick_the_other_columns():
    model = mutated(ARIA_TINY, rewire_sigmoid_to_second_half)
    new, report = optimize_form(model)
    assert report.fused == {TRANSPOSED_RULE: 1, "SharedExpertFold": 1}
    gate_up = initializer(model, nodes(model, "GatherND")[0].input[0])
    weights = {i.name: numpy_helper.to_array(i) for i in new.graph.initializer}
    routed = weights[moe_node(new).input[3]][:len(gate_up)]  # the folded shared expert follows
    np.testing.assert_array_equal(routed, gate_up[:, :, 16:].transpose(0, 2, 1))
    assert_same_numbers(ARIA_TINY, model, new)


@pytest.mark.parametrize(("mutate", "reason"), [
    (lambda m: grow_experts(m, down_gather(m)), "down has shape [5, 16, 32], expected [4, 16, 32] = [E, I, H]"),
    (lambda m: scale_sigmoid(m, np.full(16, 2.0)), "swish alpha"),
], ids=["expert count", "per-channel alpha"])
def test_transposed_near_miss_stays_unfused(mutate, reason):
    model = mutated(ARIA_TINY, mutate)
    new, report = optimize_form(model)
    assert report.fused == {} and "MOE" not in op_counts(new)
    reasons = [miss["reason"] for miss in report.near_misses if miss["rule"] == TRANSPOSED_RULE]
    assert any(reason in r for r in reasons), report.near_misses
    assert_same_numbers(ARIA_TINY, model, new)


# ----------------------------------------------------------------------------- the TorchScript exports
# torch.onnx.export(dynamo=False) of the same blocks: Flatten(Tile(Unsqueeze(tokens, 1), [1, k, 1]), 2),
# Gather(W, Reshape(indices, [-1])) per slot, torch.chunk's two Slices, shapes computed from Shape nodes

TORCHSCRIPT = fixture_names("batched_mm_torchscript")
QWEN3_TS, GPT_TS = "qwen3_moe_batched_mm_torchscript_tiny", "gpt_oss_batched_mm_torchscript_tiny"


def torchscript_rule(name: str) -> str:
    transposed = MANIFEST[name]["family"] == "aria_text"  # experts stored [E, in, out]
    return (TRANSPOSED_RULE if transposed else rule_of(name)) + "TorchScript"


def weight_gathers(m) -> list[onnx.NodeProto]:
    """The per-slot Gathers of expert weights (and biases), in graph order."""
    weights = {i.name for i in m.graph.initializer}
    return nodes(m, "Gather", lambda n: n.input[0] in weights)


def chunk_halves(m) -> list[onnx.NodeProto]:
    """torch.chunk's two Slices of the gate_up projection (first half, second half)."""
    return nodes(m, "Slice", lambda n: producer(m, n.input[0]).op_type == "Squeeze")


def set_axis(node: onnx.NodeProto, axis: int) -> None:
    del node.attribute[:]
    node.attribute.append(onnx.helper.make_attribute("axis", axis))


def test_torchscript_fixtures_exist():
    assert {f"{family}_batched_mm_torchscript_{size}" for family in ("qwen3_moe", "gpt_oss")
            for size in ("tiny", "small")} <= set(TORCHSCRIPT)


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", TORCHSCRIPT)
def test_torchscript_fuses(name, target):
    model, report = optimized(name, target)
    assert report.fused[torchscript_rule(name)] == 1 and report.near_misses == []
    before, after = op_counts(original(name)), op_counts(model)
    for op in ("TopK", "Softmax", "Gemm"):  # the router stays (optimize_form)
        assert after[op] == before[op], op
    assert after["MOE" if target == "moe" else "MoeInitRouting"] == 1
    assert weight_gathers(model) == [] and unfused_left(model, {"Tile", "OneHot", "Flatten"}) == {}
    # the two per-slot bmm and the sum over k went into the fused block; Qwen2-MoE's shared expert
    # (gate, up and down MatMul) folds into it
    folded = shared_chunks(name) > 0
    assert report.fused.get("SharedExpertFold", 0) == folded
    assert after["MatMul"] == before["MatMul"] - 2 - 3 * folded
    assert after["ReduceSum"] == before["ReduceSum"] - 1
    assert check_model(model) == []


@pytest.mark.parametrize("name", TORCHSCRIPT)
def test_torchscript_moe_node_has_the_exported_weights(name):
    entry = MANIFEST[name]
    model, _ = optimized(name, "moe")
    node = moe_node(model)
    attrs = attributes(node)
    E, H, I = entry["num_experts"], entry["hidden_size"], entry["intermediate_size"]
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    exported = [initializer(original(name), g.input[0]) for g in weight_gathers(original(name))]
    assert [(n.op_type, i) for n, i in [routing_producer(model, node.input[2])]] == [("TopK", 1)]
    if entry["family"] == "gpt_oss":
        assert attrs == {"expert_type": b"GEMM2_BIAS_SWIGLU_CLAMP", "expert_alpha": pytest.approx(1.702),
                         "expert_beta": 7.0, "gate_parity": 0}
        gate_up, gate_up_bias, down, down_bias = exported
        expected = {3: gate_up, 4: gate_up_bias, 5: down, 6: down_bias}
        assert gate_up.shape == (E, H, 2 * I)
    elif entry["family"] == "nemotron_h":
        assert attrs == {"expert_type": b"GEMM2_ACT", "activation": b"relu2"}
        up, down = exported
        expected = {3: up, 5: down}
        assert up.shape == (E, I, H)
    elif entry["family"] == "aria_text":  # [E, in, out]: MOE takes each expert's [out, in]
        assert attrs == {"expert_type": b"GEMM3_SWIGLU", "expert_alpha": 1.0}
        gate_up, down = exported
        expected = {3: gate_up[:, :, :I].transpose(0, 2, 1), 5: gate_up[:, :, I:].transpose(0, 2, 1),
                    7: down.transpose(0, 2, 1)}
        assert gate_up.shape == (E, H, 2 * I)
    else:
        assert attrs == {"expert_type": b"GEMM3_SWIGLU", "expert_alpha": 1.0}
        gate_up, down = exported
        expected = {3: gate_up[:, :I], 5: gate_up[:, I:], 7: down}
        assert gate_up.shape == (E, 2 * I, H)
    for index, array in expected.items():  # the routed experts first (a folded shared expert follows)
        assert weights[node.input[index]].shape[0] == E + shared_chunks(name)
        np.testing.assert_array_equal(weights[node.input[index]][:E], array, err_msg=f"MOE input {index}")


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", TORCHSCRIPT)
def test_torchscript_numbers(name, target):
    assert_numbers_on(name, target, ("cpp", "python"))


def test_torchscript_chunk_end_past_the_width_still_fuses():
    """torch.chunk's second Slice ending past 2I (clamped) still takes the second half."""
    model = mutated(QWEN3_TS, lambda m: set_input(m, producer(m, chunk_halves(m)[1].input[2]), 1, np.array([3])))
    new, report = optimize_form(model)
    assert report.fused == {"BatchedMmSwigluTorchScript": 1}, report.summary()
    assert check_model(new) == []
    assert_same_numbers(QWEN3_TS, model, new)


# (fixture, mutation, words the near-miss reason must contain, whether the mutated model still runs)
TORCHSCRIPT_NEAR_MISSES = {
    "tokens tiled along T": (QWEN3_TS, lambda m: set_input(m, nodes(m, "OneHot")[0], 0, np.array([0])),
                             "repeat_interleave tiles to [2, 1, 1], expected [1, 2, 1]", True),
    "expert count (qwen3 down)": (QWEN3_TS, lambda m: grow_experts(m, weight_gathers(m)[1]),
                                  "down has shape [5, 32, 16], expected [4, 32, 16] = [E, H, I]", True),
    "expert count (gpt_oss down)": (GPT_TS, lambda m: grow_experts(m, weight_gathers(m)[2]),
                                    "down has shape [5, 16, 32], expected [4, 16, 32] = [E, I, H]", True),
    "gate_up not cut in halves": (QWEN3_TS, lambda m: set_input(m, chunk_halves(m)[0], 1, np.array([1])),
                                  "gate_up is sliced into columns [(1, 16), (16, 32)], expected the halves "
                                  "[(0, 16), (16, 32)]", False),
    "tiled tokens flattened at axis 1": (QWEN3_TS, lambda m: set_axis(nodes(m, "Flatten")[0], 1),
                                         "are not flattened at axis 2", False),
    "weights gathered along axis 1": (QWEN3_TS, lambda m: set_axis(weight_gathers(m)[0], 1),
                                      "Gather of gate_up_per_slot is not along axis 0", False),
}


@pytest.mark.parametrize("case", TORCHSCRIPT_NEAR_MISSES)
def test_torchscript_near_miss_stays_unfused(case):
    name, mutate, reason, runs = TORCHSCRIPT_NEAR_MISSES[case]
    model = mutated(name, mutate)
    new, report = optimize_form(model)
    assert report.fused == {} and "MOE" not in op_counts(new)
    reasons = [miss["reason"] for miss in report.near_misses if miss["rule"] == torchscript_rule(name)]
    assert any(reason in r for r in reasons), report.near_misses
    if runs:
        assert_same_numbers(name, model, new)


def folded(nodes_: list[onnx.NodeProto], output: str, shape=("T", 2)) -> list:
    """shape_dims of ``output`` in a graph of ``nodes_`` over an input ``x`` of ``shape``."""
    graph = onnx.helper.make_graph(nodes_, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.INT64,
                                                                                      list(shape))],
                                   [onnx.helper.make_tensor_value_info(output, onnx.TensorProto.INT64, None)])
    model = ir.from_proto(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)]))
    values = {v.name: v for node in model.graph for v in node.outputs}
    return shape_dims(values[output])


def ints(name: str, values) -> onnx.NodeProto:
    return onnx.helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64)))


def test_shape_dims_fold_torchscripts_size_and_repeats():
    """Shape(x)[-1:] (torch's size(-1)) and OneHot([1], 3, [1, k]) (repeat_interleave's Tile repeats)."""
    size = [onnx.helper.make_node("Shape", ["x"], ["shape"]), ints("start", [-1]), ints("end", [2 ** 63 - 1]),
            ints("axes", [0]), onnx.helper.make_node("Slice", ["shape", "start", "end", "axes"], ["k"])]
    assert folded(size, "k") == [2]
    repeats = size + [ints("index", [1]), ints("depth", 3), ints("one", [1]),
                      onnx.helper.make_node("Concat", ["one", "k"], ["values"], axis=0),
                      onnx.helper.make_node("OneHot", ["index", "depth", "values"], ["repeats"])]
    assert folded(repeats, "repeats") == [1, 2, 1]
    at_zero = repeats + [ints("zero", [0]), onnx.helper.make_node("OneHot", ["zero", "depth", "values"], ["r0"])]
    assert folded(at_zero, "r0") == [2, 1, 1]
    two_picks = repeats + [ints("both", [0, 1]), onnx.helper.make_node("OneHot", ["both", "depth", "values"], ["r2"])]
    assert folded(two_picks, "r2") is None  # more than one index: a 2-D one-hot, not a shape
    stepped = size[:-1] + [ints("steps", [2]), onnx.helper.make_node("Slice", ["shape", "start", "end", "axes",
                                                                               "steps"], ["k"])]
    assert folded(stepped, "k") is None
