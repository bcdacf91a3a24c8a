"""The ParallelExperts fusion (moe_onnx/rewrite/parallel_experts.py) on ``torch.onnx.export(dynamo=True)``
of transformers 4.57's GraniteMoe and JetMoe blocks: each fuses into one MOE on both targets (the
small fixtures with the expert weights behind ``Gather(stacked, e)``), keeps the numbers at any
(batch, seq) on both backends, one-constant mutations stay unfused with the failed check named, and
a MatMul layout of the same weights still fuses."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir
import pytest

from fixture_models import (
    MANIFEST, TARGETS, assert_fuses_to_torch, assert_near_miss, assert_numbers, assert_numbers_on_both_backends,
    assert_swiglu_block_on, assert_swiglu_moe_node, fixture_names, fused_op_counts, ir_nodes, ir_set_input, mutated_copy,
    near_misses, op_counts, optimize_form, optimized, original, producers,
)
from moe_onnx.check import check_model

NAMES = fixture_names("parallel_experts_dynamo")
RULE = "ParallelExpertsFusion"
UNFUSED = {"ScatterND", "GatherND", "Split", "Floor", "ScatterElements"}
TINY = "granitemoe_parallel_experts_dynamo_tiny"


def test_fixtures_exist():
    assert {f"{family}_parallel_experts_dynamo_{size}" for family in ("granitemoe", "jetmoe")
            for size in ("tiny", "small")} <= set(NAMES)
    # the small exports keep each expert's weight as Gather(stacked [E, out, in], e), as real-size ones do
    assert all(op_counts(original(name))["Gather"] > MANIFEST[name]["num_experts"] for name in NAMES
               if name.endswith("_small"))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", NAMES)
def test_fuses(name, target):
    model, before, after = fused_op_counts(name, target, RULE)
    assert not UNFUSED & set(after), f"unfused ops left: {UNFUSED & set(after)}"
    assert (before["TopK"], before["Gemm"]) == (2, 1 + 2 * MANIFEST[name]["num_experts"])
    assert (after["TopK"], after["Softmax"], after["Gemm"]) == (1, 1, 1)  # the router stays, the sort goes
    assert_swiglu_block_on(target, after)
    assert check_model(model) == []


@pytest.mark.parametrize("name", NAMES)
def test_moe_node(name):
    model, _ = optimized(name, "moe")
    node = assert_swiglu_moe_node(name, model)
    assert producers(model)[node.input[1]][0].op_type == "Softmax"  # softmax over the k logits


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", NAMES)
def test_numbers(name, target):
    assert_numbers(name, target)


@pytest.mark.parametrize("name", NAMES)
def test_numbers_on_both_backends(name):
    assert_numbers_on_both_backends(name)


# ----------------------------------------------------------------------------- mutations

def _sizes(model: ir.Model) -> ir.Node:
    """The Concat of the per-expert chunk sizes."""
    split = next(node for node in ir_nodes(model, "Split") if len(node.outputs) > 2)
    return split.inputs[1].producer()


def sizes_swapped(model: ir.Model, entry: dict) -> None:
    """Chunk 0 gets expert 1's count and chunk 1 expert 0's."""
    concat = _sizes(model)
    first, second = concat.inputs[0], concat.inputs[1]
    concat.replace_input_with(0, second)
    concat.replace_input_with(1, first)


def descending_sort(model: ir.Model, entry: dict) -> None:
    """The slots are sorted by descending expert index."""
    sort = next(node for node in ir_nodes(model, "TopK") if node.attributes.get_int("largest", 1) == 0)
    sort.attributes["largest"] = ir.AttrInt64("largest", 1)


def token_divisor(model: ir.Model, entry: dict) -> None:
    """Each slot's token is its position // (k + 1)."""
    div = next(node for node in ir_nodes(model, "Div") if node.outputs[0].consumers()[0].op_type == "Abs")
    ir_set_input(model, div, 1, np.array(entry["top_k"] + 1, dtype=np.float32))


def tanh_activation(model: ir.Model, entry: dict) -> None:
    """The SiLU uses Tanh instead of Sigmoid."""
    (sigmoid,) = ir_nodes(model, "Sigmoid")
    sigmoid.op_type = "Tanh"


def gates_by_token(model: ir.Model, entry: dict) -> None:
    """The slot gates are gathered at the slot's token instead of its sorted position."""
    gather = next(node for node in ir_nodes(model, "GatherND") if node.inputs[0].producer().op_type == "Reshape")
    scatter = ir_nodes(model, "ScatterND")[0]
    gather.replace_input_with(1, scatter.inputs[1])


MUTATIONS: list[tuple[Callable[[ir.Model, dict], None], str]] = [
    (sizes_swapped, "chunk 0's size is not the count of expert 0"),
    (descending_sort, "the slot order is not an ascending sort"),
    (token_divisor, "the slot's token is its position // 3, expected // k = 2"),
    (tanh_activation, "swish"),
    (gates_by_token, "the slot gates are not gathered in the sorted slot order"),
]


@pytest.mark.parametrize(("mutate", "reason"), MUTATIONS, ids=[m[0].__name__ for m in MUTATIONS])
def test_mutation_is_a_near_miss(mutate, reason):
    assert_near_miss(TINY, mutate, RULE, reason)


def matmul_layout(model: ir.Model, entry: dict) -> None:
    """Every expert Gemm (transB=1) becomes a MatMul by the transposed weight."""
    for gemm in ir_nodes(model, "Gemm"):
        if gemm.inputs[1].name.startswith("select"):
            ir_set_input(model, gemm, 1, np.ascontiguousarray(gemm.inputs[1].const_value.numpy().T))
            gemm.op_type = "MatMul"
            for attribute in list(gemm.attributes):
                del gemm.attributes[attribute]


def test_matmul_layout_still_fuses():
    mutated = mutated_copy(TINY, matmul_layout)
    assert op_counts(mutated)["MatMul"] == 2 * MANIFEST[TINY]["num_experts"]
    assert_fuses_to_torch(TINY, mutated, RULE)


# JetMoe's mixture of attention heads uses ParallelExperts too, but is no expert MLP: its two steps
# are named as such (the graphs below only need to be read, not run)

def scatter_to_sorted_slots(model: ir.Model, entry: dict) -> None:
    """The weighted outputs go to their sorted slot positions (MoA's map), not to their tokens."""
    (scatter,) = ir_nodes(model, "ScatterND")
    order = next(node for node in ir_nodes(model, "TopK") if node.attributes.get_int("largest", 1) == 0).outputs[1]
    unsqueeze = scatter.inputs[1].producer()
    unsqueeze.replace_input_with(0, order)


def one_projection(model: ir.Model, entry: dict) -> None:
    """The down projection's chunks are the gathered tokens themselves (MoA's reduce: one Linear, no MLP)."""
    split = next(node for node in ir_nodes(model, "Split") if node.inputs[0].producer().op_type == "Mul")
    token_Tk1 = ir_nodes(model, "ScatterND")[0].inputs[1]
    gathered = next(node for node in ir_nodes(model, "GatherND") if node.inputs[1] is token_Tk1)
    split.replace_input_with(0, gathered.outputs[0])


@pytest.mark.parametrize(("mutate", "reason"), [
    (scatter_to_sorted_slots, "scattered to their sorted slots, not added to their tokens"),
    (one_projection, "the experts are one projection of the gathered tokens, no MLP"),
], ids=["map", "reduce"])
def test_mixture_of_attention_steps_are_named(mutate, reason):
    _, report = optimize_form(mutated_copy(TINY, mutate))
    assert report.fused.get(RULE, 0) == 0
    misses = near_misses(report, RULE)
    assert len(misses) == 1 and reason in misses[0]["reason"], report.near_misses
