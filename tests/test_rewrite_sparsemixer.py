"""PhiMoE's sparsemixer router (moe_onnx/rewrite/_router.py ``_successive_argmax``): its indices are
``Concat(ArgMax(s), ArgMax(ScatterElements(s, first pick, -inf)))``, no TopK. The batched_mm (5.x,
dynamo) and loop (4.57, TorchScript) exports fuse with the router's (weights, indices) as computed,
keep torch's numbers on both targets and backends, and a router whose picks could repeat an expert
stays unfused with that reason."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from backends import cached_session
from fixture_models import (
    MANIFEST, SHAPES, TARGETS, TOL, moe_node, op_counts, optimized, original, ort_output, random_feeds,
    reference_data, optimize_form,
)

BATCHED = ["phimoe_sparsemixer_batched_mm_tiny", "phimoe_sparsemixer_batched_mm_small"]
LOOP = ["phimoe_sparsemixer_loop_tiny", "phimoe_sparsemixer_loop_small"]
RULE = {"sparsemixer_batched_mm": "BatchedMmSwiglu", "sparsemixer_loop": "LoopMoeFusion"}


def rule_of(name: str) -> str:
    return RULE[MANIFEST[name]["style"]]


def test_fixtures_exist():
    assert set(BATCHED + LOOP) <= set(MANIFEST)
    assert all(op_counts(original(name))["TopK"] == 0 and op_counts(original(name))["ArgMax"] == 2
               for name in BATCHED + LOOP)


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", BATCHED + LOOP)
def test_fuses_with_the_routers_picks(name, target):
    model, report = optimized(name, target)
    assert report.fused[rule_of(name)] == 1 and report.near_misses == []
    producers = {out: n for n in model.graph.node for out in n.output}
    if target == "moe":
        node = moe_node(model)
        indices, weights = producers[node.input[2]], producers[node.input[1]]
        assert indices.op_type == "Concat" and [producers[i].op_type for i in indices.input] == ["ArgMax"] * 2
        assert weights.op_type == "Concat"  # each pick's masked-softmax weight
    assert op_counts(model)["ArgMax"] == 2  # the router stays


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", BATCHED + LOOP)
def test_numbers(name, target):
    model, _ = optimized(name, target)
    data = reference_data(name)
    for backend in ("cpp", "python"):
        session = cached_session(model, backend)
        for suffix in ("", "_alt"):
            got = session.run(["output"], {"hidden_states": data["hidden_states" + suffix]})[0]
            np.testing.assert_allclose(got, data["expected" + suffix], **TOL)


@pytest.mark.parametrize("name", BATCHED)
def test_numbers_at_any_shape(name):
    # the batched_mm export runs any input (a loop export only the traced routing)
    # (on onnxruntime: onnx's reference GatherElements rejects the router's axis -1 gather)
    model, _ = optimized(name, "moe")
    session = cached_session(model)
    for batch, seq in SHAPES:
        inputs = random_feeds(name, batch, seq, scale=reference_data(name)["hidden_states"].std())
        np.testing.assert_allclose(session.run(["output"], inputs)[0], ort_output(original(name), inputs), **TOL)


# ----------------------------------------------------------------------------- routers that must not fuse

def _mask(model: ir.Model) -> ir.Node:
    """The ScatterElements that sets the first pick's score to -inf."""
    second = [node for node in model.graph if node.op_type == "ArgMax"][1]
    return second.inputs[0].producer()


def unmasked_second_pick(model: ir.Model) -> None:
    """The second ArgMax reads the raw scores: both picks are the same expert."""
    mask = _mask(model)
    second = [node for node in model.graph if node.op_type == "ArgMax"][1]
    second.replace_input_with(0, mask.inputs[0])


def masked_to_zero(model: ir.Model) -> None:
    """The first pick is masked to 0 instead of -inf: the second pick may repeat it."""
    mask = _mask(model)
    zero = ir.Value(name="mutated_zero", shape=ir.Shape([]), type=ir.TensorType(ir.DataType.FLOAT),
                    const_value=ir.tensor(np.array(0.0, np.float32)))
    model.graph.register_initializer(zero)
    fill = mask.inputs[2].producer()
    if fill.op_type == "Expand":
        fill.replace_input_with(0, zero)
    else:
        fill.attributes["value"] = ir.AttrTensor("value", ir.tensor(np.array([0.0], np.float32)))


MUTATIONS: list[tuple[str, Callable[[ir.Model], None]]] = [
    (name, mutate) for name in (BATCHED[0], LOOP[0]) for mutate in (unmasked_second_pick, masked_to_zero)]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "mutate"), MUTATIONS, ids=[f"{n}-{m.__name__}" for n, m in MUTATIONS])
def test_picks_that_may_repeat_stay_unfused(name, mutate):
    model = ir.from_proto(original(name))
    mutate(model)
    mutated = ir.to_proto(model)
    new, report = optimize_form(mutated)
    assert report.fused == {} and "MOE" not in op_counts(new)
    (miss,) = [m for m in report.near_misses if m["rule"] == rule_of(name)]
    assert "sparsemixer pick 1 does not choose among the scores with pick 0 set to -inf" in miss["reason"]
    assert "two picks could name the same expert" in miss["reason"]
    inputs = {"hidden_states": reference_data(name)["hidden_states"]}
    np.testing.assert_allclose(ort_output(new, inputs), ort_output(mutated, inputs), **TOL)


def test_a_concat_of_other_indices_is_no_router():
    """Indices concatenated from something else than ArgMax picks: named as such."""
    model = ir.from_proto(original(BATCHED[0]))
    first = [node for node in model.graph if node.op_type == "ArgMax"][0]
    cast = ir.Node("", "Identity", [first.outputs[0]], name="mutated_identity")
    model.graph.insert_after(first, cast)
    concat = next(node for node in model.graph if node.op_type == "Concat" and first.outputs[0] in node.inputs)
    concat.replace_input_with(0, cast.outputs[0])
    new, report = optimize_form(ir.to_proto(model))
    assert report.fused == {}
    (miss,) = [m for m in report.near_misses if m["rule"] == "BatchedMmSwiglu"]
    assert "the expert indices are a Concat whose input 0 is not an ArgMax over the experts" in miss["reason"]


def test_sparsemixer_is_an_unfused_router_when_no_rule_matches():
    """The detector finds sparsemixer routers by their ArgMax picks: an unmatched block is reported."""
    model = onnx.ModelProto()
    model.CopyFrom(original(BATCHED[0]))
    for node in model.graph.node:
        if node.op_type == "ReduceSum" and any(i.startswith("val_") for i in node.input):
            node.op_type = "ReduceMean"  # the sum over k becomes a mean: no batched_mm pattern
    new, report = optimize_form(model)
    assert report.fused == {}
    misses = [m for m in report.near_misses if m["rule"] == "UnfusedMoe"]
    assert len(misses) == 1 and "(ArgMax" in misses[0]["reason"], report.near_misses
