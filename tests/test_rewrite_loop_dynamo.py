"""The dynamo loop fusion (moe_onnx/rewrite/loop_dynamo.py) on ``torch.onnx.export(dynamo=True)`` of
transformers 4.57's eager loop over range(num_experts) (OLMoE): each size fuses into one MOE on both
targets and keeps the numbers at any (batch, seq), one-constant mutations stay unfused with the failed
check named, and a MatMul layout of the same weights still fuses."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir
import pytest

from fixture_models import (
    TARGETS, assert_fuses_to_torch, assert_near_miss, assert_numbers, assert_numbers_on_both_backends,
    assert_swiglu_block_on, assert_swiglu_moe_node, fixture_names, fused_op_counts, ir_nodes, ir_set_input,
    mutated_copy, optimized, producers,
)
from moe_onnx.check import check_model

NAMES = fixture_names("loop_dynamo")
RULE = "LoopDynamoMoeFusion"
UNFUSED = {"NonZero", "ScatterND", "Equal", "GatherND"}


def test_fixtures_exist():
    assert {"olmoe_loop_dynamo_tiny", "olmoe_loop_dynamo_small"} <= set(NAMES)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", NAMES)
def test_fuses(name, target):
    model, before, after = fused_op_counts(name, target, RULE)
    assert not UNFUSED & set(after), f"unfused ops left: {UNFUSED & set(after)}"
    assert (after["TopK"], after["Softmax"]) == (before["TopK"], before["Softmax"])  # the router stays
    assert after["Gemm"] == 1  # the router's; the 3 E expert Gemms are gone
    assert_swiglu_block_on(target, after)
    assert check_model(model) == []


@pytest.mark.parametrize("name", NAMES)
def test_moe_node(name):
    model, _ = optimized(name, "moe")
    node = assert_swiglu_moe_node(name, model)
    weights, output = producers(model)[node.input[1]]
    assert (weights.op_type, output) == ("TopK", 0)  # no renormalization


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", NAMES)
def test_numbers(name, target):
    assert_numbers(name, target)


@pytest.mark.parametrize("name", NAMES)
def test_numbers_on_both_backends(name):
    assert_numbers_on_both_backends(name)


# ----------------------------------------------------------------------------- mutations

def _expert_gemms(model: ir.Model) -> list[ir.Node]:
    return [node for node in ir_nodes(model, "Gemm") if node.inputs[1].name.startswith("experts.")]


def duplicate_mask_row(model: ir.Model, entry: dict) -> None:
    """Branch 1 reads expert 0's mask row."""
    rows = [nonzero.inputs[0].producer() for nonzero in ir_nodes(model, "NonZero")]
    ir_set_input(model, rows[1], 1, np.array(0, dtype=np.int64))


def shifted_arange(model: ir.Model, entry: dict) -> None:
    """The one-hot compares the indices with arange(1, E + 1)."""
    (equal,) = ir_nodes(model, "Equal")
    ir_set_input(model, equal, 1, np.arange(1, entry["num_experts"] + 1, dtype=np.int64))


def nonzero_start(model: ir.Model, entry: dict) -> None:
    """The accumulation starts from ones."""
    first = next(node for node in ir_nodes(model, "ScatterND") if node.inputs[0].producer().op_type != "ScatterND")
    start = first.inputs[0].producer()
    ir_set_input(model, start, 0, np.array(1.0, dtype=np.float32))


def scaled_gemm(model: ir.Model, entry: dict) -> None:
    """Expert 1's up projection Gemm has alpha 2."""
    gemm = next(node for node in _expert_gemms(model) if "experts.1.up_proj" in node.inputs[1].name)
    gemm.attributes["alpha"] = ir.AttrFloat32("alpha", 2.0)


def slot_zero(model: ir.Model, entry: dict) -> None:
    """Branch 0 gathers its routing weight at (token, 0 * slot) instead of (token, slot)."""
    concat = next(node for node in ir_nodes(model, "Concat") if any(user.op_type == "GatherND"
                                                                   for user in node.outputs[0].consumers()))
    zero = ir.Value(name="mutated_zero", shape=ir.Shape([]), type=ir.TensorType(ir.DataType.INT64),
                    const_value=ir.tensor(np.array(0, dtype=np.int64)))
    model.graph.register_initializer(zero)
    times_zero = ir.Node("", "Mul", [concat.inputs[1], zero], name="mutated_slot_zero")
    model.graph.insert_before(concat, times_zero)
    concat.replace_input_with(1, times_zero.outputs[0])


def smaller_expert(model: ir.Model, entry: dict) -> None:
    """Expert 2 has half the intermediate size of the others."""
    for gemm in _expert_gemms(model):
        if "experts.2." in gemm.inputs[1].name:
            w = gemm.inputs[1].const_value.numpy()
            half = w[:, : w.shape[1] // 2] if "down_proj" in gemm.inputs[1].name else w[: w.shape[0] // 2]
            ir_set_input(model, gemm, 1, np.ascontiguousarray(half))
    for node in model.graph:  # the exporter's shapes of the intermediate values no longer hold
        for value in node.outputs:
            if not value.is_graph_output():
                value.shape = None


MUTATIONS: list[tuple[Callable[[ir.Model, dict], None], str]] = [
    (duplicate_mask_row, "two branches compute the same expert"),
    (shifted_arange, "compares the indices with something other than arange(E)"),
    (nonzero_start, "does not start from zeros"),
    (scaled_gemm, "the up projection Gemm is not x @ W"),
    (slot_zero, "the routing weight slot is not computed by Unsqueeze (found Mul)"),
    (smaller_expert, "the gate weight is [8, 32] as [out, in], expected [16, 32]"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("mutate", "reason"), MUTATIONS, ids=[m[0].__name__ for m in MUTATIONS])
def test_mutation_is_a_near_miss(mutate, reason):
    assert_near_miss("olmoe_loop_dynamo_tiny", mutate, RULE, reason)


def matmul_layout(model: ir.Model, entry: dict) -> None:
    """Every expert Gemm (transB=1) becomes a MatMul by the transposed weight."""
    for gemm in _expert_gemms(model):
        ir_set_input(model, gemm, 1, np.ascontiguousarray(gemm.inputs[1].const_value.numpy().T))
        gemm.op_type = "MatMul"
        for attribute in list(gemm.attributes):
            del gemm.attributes[attribute]


def test_matmul_layout_still_fuses():
    name = "olmoe_loop_dynamo_tiny"
    assert_fuses_to_torch(name, mutated_copy(name, matmul_layout), RULE)
