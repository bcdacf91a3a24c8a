"""The committed export fixtures (models/fixtures) as the rewrite tests load, run, compare and mutate them.

Shared by the test_rewrite_*.py modules and test_cli_optimize.py: loading, running, reading and
mutating the fixtures, and the checks several export forms' tests make; what only one export form
needs stays in its own test module.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import numpy_helper
from backends import PLAIN, cached_session
from onnx.reference import ReferenceEvaluator

import moe_onnx
from moe_onnx.ops import REFERENCE_OPS
from moe_onnx.testing import random_hidden_states
from moe_onnx.testing import attributes, moe_node

# The targets our ops run on: the rewrite tests optimize each fixture for every one.
TARGETS = moe_onnx.OUR_OPS_TARGETS
FIXTURES = Path(__file__).resolve().parents[1] / "models" / "fixtures"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]
# whole tiny causal LMs (input_ids -> logits), with the fusion state the rewriter is expected to reach
WHOLE_FIXTURES = FIXTURES / "whole"
WHOLE_MANIFEST = json.loads((WHOLE_FIXTURES / "manifest.json").read_text())["fixtures"]
# (batch, seq): one token, a small shape, and one unlike the exports' traced (2, 5) or (2, 8)
SHAPES = [(1, 1), (2, 3), (3, 7)]
TOL = dict(rtol=1e-4, atol=1e-4)


# Where a test takes every fixture, the fast lane (`pytest -m "not slow"`) runs these: a tiny export of each
# router chain's kind (softmax -> top-k renormalized; top-k -> softmax); the others are marked slow.
FAST_FIXTURES = ("qwen3_moe_batched_mm_tiny", "gpt_oss_tiled_tiny")


def fixture_lanes(names: Sequence[str]) -> list:
    """``names`` as pytest parameters, those not in FAST_FIXTURES marked slow."""
    return [pytest.param(name, marks=() if name in FAST_FIXTURES else pytest.mark.slow) for name in names]


def fixture_names(*styles: str) -> list[str]:
    """The fixtures exported in one of these styles (the manifest's "style"), sorted."""
    return sorted(name for name, entry in MANIFEST.items() if entry["style"] in styles)


def shared_chunks(name: str) -> int:
    """The experts of width I that the fixture's shared expert folds into (0: it has none, or it is not a
    SwiGLU MLP like the routed experts)."""
    entry = MANIFEST[name]
    foldable = entry["shared_expert"] and entry["activation"] == "silu"
    return entry["shared_intermediate_size"] // entry["intermediate_size"] if foldable else 0


def routing_producer(model: onnx.ModelProto, value: str) -> tuple[onnx.NodeProto, int]:
    """The node (and its output index) making an MOE routing input, seen through the shared-expert
    fold's ``Concat(Reshape(routed, [-1, k]), shared columns)``."""
    producers = {out: (n, i) for n in model.graph.node for i, out in enumerate(n.output)}
    node, index = producers[value]
    if node.op_type == "Concat":
        reshape, _ = producers[node.input[0]]
        assert reshape.op_type == "Reshape"
        node, index = producers[reshape.input[0]]
    return node, index


# ----------------------------------------------------------------------------- loading

@functools.cache
def original(name: str) -> onnx.ModelProto:
    """The fixture as committed; shared between tests, so never mutate it (see ``mutable_copy``)."""
    return onnx.load(FIXTURES / MANIFEST[name]["file"])


def mutable_copy(name: str) -> onnx.ModelProto:
    """A private copy of the fixture, for a test to mutate."""
    model = onnx.ModelProto()
    model.CopyFrom(original(name))
    return model


def optimize_form(model, target: str = "moe"):
    """``optimize`` with the routers left as exported: what the export-form tests check (the fusions,
    the shared-expert fold); tests/test_rewrite_gating.py checks the router pass."""
    return moe_onnx.optimize(model, target=target, fuse_routers=False)


# The one cache of optimized fixtures: every test module takes them from here, so each (fixture, target,
# options) is optimized once per run. The models are shared: copy one before changing it.

@functools.cache
def optimized(name: str, target: str, *, fuse_routers: bool = False, portable: bool = False):
    """``moe_onnx.optimize`` of fixture ``name``: the optimized model and its report. By default the routers
    stay as exported (``optimize_form``: what the export-form tests check); ``fuse_routers=True`` is what
    users get (``optimize``'s default)."""
    return moe_onnx.optimize(original(name), target=target, fuse_routers=fuse_routers, portable=portable)


@functools.cache
def optimized_whole(name: str, target: str):
    """``optimize`` of the whole-model fixture ``name`` (routers fused): the optimized model and its report."""
    return moe_onnx.optimize(onnx.load(WHOLE_FIXTURES / WHOLE_MANIFEST[name]["file"]), target=target)


def whole_reference_data(name: str) -> dict[str, np.ndarray]:
    """The whole-model fixture's .npz: ``input_ids[_alt]`` and torch's logits ``expected[_alt]``."""
    return dict(np.load(WHOLE_FIXTURES / WHOLE_MANIFEST[name]["reference"]))


@functools.cache
def reference_data(name: str) -> dict[str, np.ndarray]:
    """The fixture's .npz: inputs ``hidden_states[_alt]`` and torch's outputs ``expected[_<output>][_alt]``."""
    return dict(np.load(FIXTURES / MANIFEST[name]["reference"]))


def random_hidden(name: str, batch: int, seq: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """Standard normal (times ``scale``) float32 hidden states [batch, seq, H] for fixture ``name``."""
    return random_hidden_states(MANIFEST[name]["hidden_size"], batch, seq, seed, scale)


def random_feeds(name: str, batch: int, seq: int, seed: int = 0, scale: float = 1.0) -> dict[str, np.ndarray]:
    """``random_hidden`` as the fixture's input ``hidden_states``."""
    return {"hidden_states": random_hidden(name, batch, seq, seed, scale)}


# ----------------------------------------------------------------------------- running

def run_ort(model: onnx.ModelProto, feeds: dict, outputs: Sequence[str] | None = None) -> list[np.ndarray]:
    """The outputs (all, or those named) of onnxruntime on the CPU (without our library)."""
    return cached_session(model, PLAIN).run(None if outputs is None else list(outputs), feeds)


def run_reference(model: onnx.ModelProto, feeds: dict, outputs: Sequence[str] | None = None) -> list[np.ndarray]:
    """The outputs (all, or those named) of onnx's ReferenceEvaluator with the moe_onnx reference ops."""
    return ReferenceEvaluator(model, new_ops=REFERENCE_OPS).run(None if outputs is None else list(outputs), feeds)


def ort_output(model: onnx.ModelProto, feeds: dict, name: str = "output") -> np.ndarray:
    return run_ort(model, feeds, [name])[0]


def reference_output(model: onnx.ModelProto, feeds: dict, name: str = "output") -> np.ndarray:
    return run_reference(model, feeds, [name])[0]


# ----------------------------------------------------------------------------- reading graphs

def op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(node.op_type for node in model.graph.node)


def nodes(model: onnx.ModelProto, op_type: str,
          where: Callable[[onnx.NodeProto], bool] = lambda n: True) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op_type and where(n)]


def producer(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    """The one node that computes ``name``."""
    (node,) = [n for n in model.graph.node if name in n.output]
    return node


# ----------------------------------------------------------------------------- mutating graphs

def set_input(model: onnx.ModelProto, node: onnx.NodeProto, index: int, array) -> None:
    """Give input ``index`` of ``node`` a new initializer of its own (shared constants stay as they are)."""
    name = f"mutated_{len(model.graph.initializer)}"
    model.graph.initializer.append(numpy_helper.from_array(np.asarray(array), name))
    while len(node.input) <= index:
        node.input.append("")
    node.input[index] = name


# ----------------------------------------------------------------------------- mutating graphs in onnx_ir

def ir_nodes(model: ir.Model, op_type: str) -> list[ir.Node]:
    return [node for node in model.graph if node.op_type == op_type]


def ir_set_input(model: ir.Model, node: ir.Node, index: int, array: np.ndarray) -> None:
    """Give input ``index`` of ``node`` a new initializer of its own holding ``array``."""
    value = ir.Value(name=f"mutated_{node.name}_{index}", shape=ir.Shape(array.shape),
                     type=ir.TensorType(ir.DataType.from_numpy(array.dtype)), const_value=ir.tensor(array))
    model.graph.register_initializer(value)
    node.replace_input_with(index, value)


def mutated_copy(name: str, mutate: Callable[[ir.Model, dict], None]) -> onnx.ModelProto:
    """The fixture after ``mutate(model, its manifest entry)`` on an IR copy."""
    model = ir.from_proto(original(name))
    mutate(model, MANIFEST[name])
    return ir.to_proto(model)


# ----------------------------------------------------------------------------- checks the form tests share

def scaled_random_feeds(name: str, batch: int, seq: int) -> dict[str, np.ndarray]:
    """Random hidden states on the scale of the fixture's own."""
    return random_feeds(name, batch, seq, scale=reference_data(name)["hidden_states"].std())


def near_misses(report, rule: str) -> list[dict]:
    """The report's near-misses of ``rule``."""
    return [miss for miss in report.near_misses if miss["rule"] == rule]


def producers(model: onnx.ModelProto) -> dict[str, tuple[onnx.NodeProto, int]]:
    """Each value's producing node and output index."""
    return {out: (n, i) for n in model.graph.node for i, out in enumerate(n.output)}


def expert_weight_shapes(model: onnx.ModelProto, node: onnx.NodeProto) -> list[list[int]]:
    """The shapes of a GEMM3_SWIGLU MOE node's gate, up and down weights (inputs 3, 5, 7)."""
    shapes = {i.name: list(i.dims) for i in model.graph.initializer}
    return [shapes[node.input[i]] for i in (3, 5, 7)]


def fused_op_counts(name: str, target: str, rule: str) -> tuple[onnx.ModelProto, Counter, Counter]:
    """Fixture ``name`` optimized for ``target``, asserted fused once by ``rule`` without near-misses; returned
    with the op counts before and after, for the form's own checks."""
    model, report = optimized(name, target)
    assert report.fused[rule] == 1 and report.near_misses == []
    return model, op_counts(original(name)), op_counts(model)


def assert_swiglu_block_on(target: str, after: Counter) -> None:
    """The op counts ``after`` hold one GEMM3_SWIGLU block on ``target``: one MOE, or the routed chain
    (MoeInitRouting, three MoeRowParallelLinear, MoeFinalizeRouting) and no MOE."""
    if target == "moe":
        assert after["MOE"] == 1
    else:
        assert (after["MoeInitRouting"], after["MoeRowParallelLinear"], after["MoeFinalizeRouting"]) == (1, 3, 1)
        assert after["MOE"] == 0


def assert_swiglu_moe_node(name: str, model: onnx.ModelProto) -> onnx.NodeProto:
    """The MOE node of fixture ``name``'s optimized ``model``: GEMM3_SWIGLU (alpha 1) on a TopK's indices,
    with [E, I, H], [E, I, H] and [E, H, I] weights; returned for the form's own checks of its weights."""
    node = moe_node(model)
    assert attributes(node) == {"expert_type": b"GEMM3_SWIGLU", "expert_alpha": 1.0}
    made_by = producers(model)
    assert (made_by[node.input[2]][0].op_type, made_by[node.input[2]][1]) == ("TopK", 1)
    E, H, I = (MANIFEST[name][key] for key in ("num_experts", "hidden_size", "intermediate_size"))
    assert expert_weight_shapes(model, node) == [[E, I, H], [E, I, H], [E, H, I]]
    return node


def assert_near_miss(name: str, mutate: Callable[[ir.Model, dict], None], rule: str, reason: str) -> None:
    """Fixture ``name`` mutated by ``mutate`` stays unfused, with one near-miss of ``rule`` naming ``reason``,
    and computes what the mutated export does."""
    mutated = mutated_copy(name, mutate)
    new, report = optimize_form(mutated)
    assert report.fused.get(rule, 0) == 0
    misses = near_misses(report, rule)
    assert len(misses) == 1 and reason in misses[0]["reason"], report.near_misses
    assert op_counts(new)["MOE"] == 0
    for suffix in ("", "_alt"):
        inputs = {"hidden_states": reference_data(name)[f"hidden_states{suffix}"]}
        np.testing.assert_allclose(ort_output(new, inputs), ort_output(mutated, inputs), **TOL)


def assert_fuses_to_torch(name: str, mutated: onnx.ModelProto, rule: str) -> None:
    """The mutated copy of fixture ``name`` fuses by ``rule`` without near-misses and computes torch's outputs."""
    new, report = optimize_form(mutated)
    assert report.fused[rule] == 1 and report.near_misses == []
    for suffix in ("", "_alt"):
        inputs = {"hidden_states": reference_data(name)[f"hidden_states{suffix}"]}
        np.testing.assert_allclose(reference_output(new, inputs), reference_data(name)[f"expected{suffix}"], **TOL)


def assert_numbers(name: str, target: str) -> None:
    """The optimized fixture computes torch's outputs, and the original's at any (batch, seq) of SHAPES."""
    model, _ = optimized(name, target)
    data = reference_data(name)
    for suffix in ("", "_alt"):
        inputs = {"hidden_states": data[f"hidden_states{suffix}"]}
        np.testing.assert_allclose(reference_output(model, inputs), data[f"expected{suffix}"], **TOL)
    for batch, seq in SHAPES:
        inputs = scaled_random_feeds(name, batch, seq)
        np.testing.assert_allclose(reference_output(model, inputs), ort_output(original(name), inputs), **TOL)


def assert_numbers_on_both_backends(name: str) -> None:
    """The fixture optimized for MOE computes the original's outputs on the cpp and the python kernels."""
    model, _ = optimized(name, "moe")
    for backend in ("cpp", "python"):
        session = cached_session(model, backend)
        for batch, seq in SHAPES:
            inputs = scaled_random_feeds(name, batch, seq)
            np.testing.assert_allclose(session.run(["output"], inputs)[0], ort_output(original(name), inputs),
                                       **TOL)


def as_float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """The float32 export with every float tensor, Cast and graph input/output in float16."""
    half = onnx.ModelProto()
    half.CopyFrom(model)
    graph = half.graph

    def to_half(tensor: onnx.TensorProto) -> None:
        if tensor.data_type == onnx.TensorProto.FLOAT:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), tensor.name))

    for tensor in graph.initializer:
        to_half(tensor)
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR:
                to_half(attribute.t)
            elif node.op_type == "Cast" and attribute.name == "to" and attribute.i == onnx.TensorProto.FLOAT:
                attribute.i = onnx.TensorProto.FLOAT16
    for value in [*graph.input, *graph.output]:
        if value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    del graph.value_info[:]
    return half
