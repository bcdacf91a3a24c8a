"""The unfused-block detector (moe_onnx/rewrite/_unfused.py): a MoE block that no rule fused and no
rule reported is still a near-miss, named at its router's selection, with the closest rule's failing
step or the form its experts resemble; fused or already reported blocks add nothing."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from fixture_models import fixture_names, mutable_copy, optimized, optimize_form

RULE = "UnfusedMoe"


def detected(report) -> list[dict]:
    return [miss for miss in report.near_misses if miss["rule"] == RULE]


def with_identity_after(model: onnx.ModelProto, op_type: str, input_index: int | None = None) -> onnx.ModelProto:
    """``model`` with an Identity between every ``op_type`` output and its consumers (all of them, or
    only input ``input_index`` of each consumer): same numbers, a pattern that no longer lines up."""
    produced = {output: node for node in model.graph.node if node.op_type == op_type for output in node.output}
    for node in list(model.graph.node):
        for index, name in enumerate(node.input):
            if name in produced and node.op_type != "Identity" and input_index in (None, index):
                bridged = f"{name}_bridged_{node.name}_{index}"
                model.graph.node.append(helper.make_node("Identity", [name], [bridged]))
                node.input[index] = bridged
    return _topologically_sorted(model)


def _topologically_sorted(model: onnx.ModelProto) -> onnx.ModelProto:
    known = {value.name for value in model.graph.input} | {init.name for init in model.graph.initializer} | {""}
    pending, ordered = list(model.graph.node), []
    while pending:
        ready = [node for node in pending if all(name in known for name in node.input)]
        assert ready, "cycle"
        for node in ready:
            ordered.append(node)
            known.update(node.output)
        pending = [node for node in pending if node not in ready]
    del model.graph.node[:]
    model.graph.node.extend(ordered)
    return model


@pytest.mark.parametrize("name", fixture_names("batched_mm", "tiled", "tiled_dynamo", "tiled3", "loop", "loop_dynamo",
                                                 "parallel_experts_dynamo", "batched_mm_transposed",
                                                 "sparsemixer_batched_mm", "sparsemixer_loop",
                                                 "batched_mm_torchscript"))
def test_fused_blocks_add_nothing(name):
    _, report = optimized(name, "moe")
    assert report.total_fused >= 1 and detected(report) == []


def test_a_rule_near_miss_is_not_reported_twice():
    model = mutable_copy("qwen3_moe_batched_mm_tiny")
    topk = next(node for node in model.graph.node if node.op_type == "TopK")
    k = next(init for init in model.graph.initializer if init.name == topk.input[1])
    k.CopyFrom(onnx.numpy_helper.from_array(np.array([3], np.int64), k.name))  # k 3 != the repeat's 2
    _, report = optimize_form(model)
    assert [miss["rule"] for miss in report.near_misses] == ["BatchedMmSwiglu"], report.near_misses


def test_a_pattern_that_stops_short_names_the_closest_rule():
    # the gate_up weight gather reaches the MatMul through an Identity: BatchedMmSwiglu's pattern
    # matches up to that MatMul and no further
    model = with_identity_after(mutable_copy("qwen3_moe_batched_mm_tiny"), "GatherND", input_index=0)
    _, report = optimize_form(model)
    assert report.total_fused == 0
    (miss,) = detected(report)
    topk = next(node for node in model.graph.node if node.op_type == "TopK")
    assert miss["node"] == topk.name
    assert "selects among 4 experts" in miss["reason"]
    assert "closest rule BatchedMmSwiglu matched" in miss["reason"]
    assert "expected GatherND, got Identity" in miss["reason"]


def test_an_unknown_form_names_what_it_resembles():
    # an Identity after each index_add_ scatter: the loop pattern matches only its root
    model = with_identity_after(mutable_copy("olmoe_loop_tiny"), "ScatterElements")
    _, report = optimize_form(model)
    assert report.total_fused == 0
    (miss,) = detected(report)
    assert "its experts look like a per-expert loop" in miss["reason"]
    assert "no fusion rule recognises the experts that TopK" in miss["reason"]


def _router_graph(selection: str, experts_read_the_tokens: bool = True,
                  router_norm: bool = False) -> onnx.ModelProto:
    """tokens [T, 8] -> MatMul(router [8, 4]) -> Softmax -> ``selection`` -> Gather of a [4, 8] table;
    the tokens also go to an output (as they go to the experts) when ``experts_read_the_tokens``; with
    ``router_norm`` the router reads them through its own scaling (two Muls, as Gemma 4's router norm)."""
    router_input = "tokens"
    nodes = []
    if router_norm:
        nodes += [helper.make_node("Mul", ["tokens", "tokens"], ["squared"]),
                  helper.make_node("Mul", ["squared", "k_float"], ["router_tokens"])]
        router_input = "router_tokens"
    nodes += [helper.make_node("MatMul", [router_input, "router"], ["logits"]),
              helper.make_node("Softmax", ["logits"], ["scores"], axis=-1)]
    outputs = [helper.make_tensor_value_info("rows", onnx.TensorProto.FLOAT, None)]
    if experts_read_the_tokens:
        nodes.append(helper.make_node("Relu", ["tokens"], ["expert_input"]))
        outputs.append(helper.make_tensor_value_info("expert_input", onnx.TensorProto.FLOAT, None))
    if selection == "TopK":
        nodes.append(helper.make_node("TopK", ["scores", "k"], ["top", "picked"], axis=-1))
    else:
        nodes.append(helper.make_node("ArgMax", ["scores"], ["picked"], axis=-1, keepdims=1))
    nodes.append(helper.make_node("Gather", ["table", "picked"], ["rows"], axis=0))
    rng = np.random.default_rng(0)
    inits = [onnx.numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "router"),
             onnx.numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "table"),
             onnx.numpy_helper.from_array(np.array([2], np.int64), "k")]
    if router_norm:
        inits.append(onnx.numpy_helper.from_array(np.array(0.5, np.float32), "k_float"))
    graph = helper.make_graph(nodes, "router", [helper.make_tensor_value_info("tokens", onnx.TensorProto.FLOAT,
                                                                              ["T", 8])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("selection", ["TopK", "ArgMax"])
def test_a_bare_router_is_reported(selection):
    _, report = optimize_form(_router_graph(selection))
    (miss,) = detected(report)
    assert miss["node"] == "" and f"({selection} '')" in miss["reason"]
    assert "no fusion rule recognises" in miss["reason"]


def test_a_router_with_its_own_normalization_is_reported():
    """Gemma 4: the router reads the tokens through single-use ops of its own; still a MoE block."""
    _, report = optimize_form(_router_graph("TopK", router_norm=True))
    (miss,) = detected(report)
    assert "no fusion rule recognises" in miss["reason"]


def test_a_sampling_topk_over_an_lm_head_is_not_a_router():
    _, report = optimize_form(_router_graph("TopK", experts_read_the_tokens=False))
    assert detected(report) == []


def test_a_topk_that_is_not_over_router_scores_is_not_a_router():
    model = _router_graph("TopK")
    del model.graph.node[0]  # the Softmax reads the tokens themselves: no router linear
    model.graph.node[0].input[0] = "tokens"
    _, report = optimize_form(model)
    assert detected(report) == []


def test_sorted_experts_that_no_rule_takes_are_named():
    # the index_add_ becomes a plain ScatterND (no reduction): no rule tries it, the detector names the form
    model = mutable_copy("granitemoe_parallel_experts_dynamo_tiny")
    scatter = next(node for node in model.graph.node if node.op_type == "ScatterND")
    del scatter.attribute[:]
    _, report = optimize_form(model)
    assert report.total_fused == 0
    (miss,) = detected(report)
    assert "its experts look like sorted expert chunks" in miss["reason"], miss
