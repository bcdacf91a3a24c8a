"""The shared-expert fold (moe_onnx/rewrite/shared_expert.py): Add(MOE(x), shared SwiGLU MLP(x)) becomes
one MOE over E + S/I experts; numbers equal the unfolded model's."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import moe_onnx
from backends import cached_session
from fixture_models import (
    MANIFEST, TARGETS, TOL, moe_node, optimized, reference_data, reference_output,
    shared_chunks, optimize_form,
)
from moe_onnx.check import check_model

SHARED = sorted(name for name in MANIFEST if shared_chunks(name))  # the fixtures with a SwiGLU shared expert
H, I, E, K = 16, 8, 4, 2


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", SHARED)
def test_fixtures_fold(name, target):
    model, report = optimized(name, target)
    assert report.fused["SharedExpertFold"] == 1
    assert check_model(model) == []
    if target == "moe":
        node = moe_node(model)
        shapes = {t.name: list(t.dims) for t in model.graph.initializer}
        entry = MANIFEST[name]
        assert shapes[node.input[3]][0] == entry["num_experts"] + shared_chunks(name)
    data = reference_data(name)  # torch's outputs (a loop export only runs on inputs like its traced one)
    for suffix in ("", "_alt"):
        feeds = {"hidden_states": data["hidden_states" + suffix]}
        expected = data["expected" + suffix]
        np.testing.assert_allclose(reference_output(model, feeds), expected, **TOL)
        for backend in ("cpp", "python"):
            got = cached_session(model, backend).run(["output"], feeds)[0]
            np.testing.assert_allclose(got, expected, **TOL)


# ----------------------------------------------------------------------------- a hand-made block

def block(shared_width: int = 2 * I, gated: bool = True, alpha: float = 1.0, residual: bool = False,
          seed: int = 0) -> onnx.ModelProto:
    """MOE (GEMM3_SWIGLU) + a shared SwiGLU MLP of ``shared_width`` on the same input, added; the MLP
    scaled by Sigmoid(x @ w) when ``gated``; ``residual`` adds x instead of an MLP."""
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)  # noqa: E731
    inits = {"gate": w(E, I, H), "up": w(E, I, H), "down": w(E, H, I), "sg": w(H, shared_width),
             "su": w(H, shared_width), "sd": w(shared_width, H), "gate_w": w(H, 1), "alpha": np.float32(alpha)}
    nodes = [helper.make_node("MOE", ["x", "weights", "indices", "gate", "", "up", "", "down"], ["routed"],
                              domain=moe_onnx.DOMAIN, expert_type="GEMM3_SWIGLU")]
    if residual:
        nodes.append(helper.make_node("Add", ["routed", "x"], ["y"]))
    else:
        nodes += [
            helper.make_node("MatMul", ["x", "sg"], ["g"]),
            helper.make_node("Mul", ["g", "alpha"], ["g_alpha"]),
            helper.make_node("Sigmoid", ["g_alpha"], ["g_sig"]),
            helper.make_node("Mul", ["g", "g_sig"], ["g_swish"]),
            helper.make_node("MatMul", ["x", "su"], ["u"]),
            helper.make_node("Mul", ["g_swish", "u"], ["act"]),
            helper.make_node("MatMul", ["act", "sd"], ["mlp"]),
        ]
        if gated:
            nodes += [helper.make_node("MatMul", ["x", "gate_w"], ["scale_logit"]),
                      helper.make_node("Sigmoid", ["scale_logit"], ["scale"]),
                      helper.make_node("Mul", ["scale", "mlp"], ["shared"])]
        nodes.append(helper.make_node("Add", ["routed", "shared" if gated else "mlp"], ["y"]))
    used = {i for n in nodes for i in n.input}
    graph = helper.make_graph(
        nodes, "block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", H]),
         helper.make_tensor_value_info("weights", TensorProto.FLOAT, ["T", K]),
         helper.make_tensor_value_info("indices", TensorProto.INT64, ["T", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", H])],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in inits.items() if n in used])
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18),
                                                                  helper.make_opsetid(moe_onnx.DOMAIN, 1)])


def feeds(tokens: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    indices = np.argsort(rng.random((tokens, E)), axis=1)[:, :K].astype(np.int64)
    return {"x": rng.standard_normal((tokens, H)).astype(np.float32), "indices": indices,
            "weights": rng.random((tokens, K)).astype(np.float32)}


def run(model: onnx.ModelProto, inputs: dict, backend: str = "cpp") -> np.ndarray:
    return cached_session(model, backend).run(["y"], inputs)[0]


@pytest.mark.slow
@pytest.mark.parametrize("gated", [True, False], ids=["sigmoid-scaled", "unscaled"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_block_folds(gated, chunks):
    model = block(shared_width=chunks * I, gated=gated)
    folded, report = optimize_form(model)
    assert report.fused == {"SharedExpertFold": 1} and report.notes == []
    assert [o.name for o in folded.graph.output] == ["y"]  # the Add was the graph output: its name stays
    node = moe_node(folded)
    shapes = {t.name: list(t.dims) for t in folded.graph.initializer}
    assert [shapes[node.input[i]] for i in (3, 5, 7)] == [[E + chunks, I, H], [E + chunks, I, H], [E + chunks, H, I]]
    assert [n.op_type for n in folded.graph.node].count("MatMul") == gated  # only the scale's projection
    assert check_model(folded) == []
    for tokens in (0, 1, 5):
        inputs = feeds(tokens)
        expected = run(model, inputs)
        for backend in ("cpp", "python"):
            np.testing.assert_allclose(run(folded, inputs, backend), expected, **TOL)


def test_grouped_target_takes_the_folded_experts():
    model = block(shared_width=2 * I)
    grouped, report = optimize_form(model, target="grouped")
    assert report.fused == {"SharedExpertFold": 1, "MoeToGrouped": 1}
    inputs = feeds(6)
    np.testing.assert_allclose(run(grouped, inputs), run(model, inputs), **TOL)


def test_weights_are_stacked_lazily():
    model = ir.from_proto(block())
    optimize_form(model)
    (node,) = [n for n in model.graph if n.op_type == "MOE"]
    assert all(isinstance(node.inputs[i].const_value, ir.LazyTensor) for i in (3, 5, 7))


@pytest.mark.parametrize("mutation, reason", [
    (dict(shared_width=I + 4), "width 12 is not a multiple of the experts' 8"),
    (dict(alpha=1.702), "swish alpha 1.70"),
])
def test_unfoldable_shared_expert_stays_with_a_note(mutation, reason):
    model = block(**mutation)
    unfolded, report = optimize_form(model)
    assert "SharedExpertFold" not in report.fused
    (note,) = report.notes
    assert note.startswith("SharedExpertFold: the shared expert beside MOE node") and reason in note
    inputs = feeds(4)
    np.testing.assert_allclose(run(unfolded, inputs), run(model, inputs), **TOL)


def test_a_residual_add_is_not_a_shared_expert():
    _, report = optimize_form(block(residual=True))
    assert report.fused == {} and report.notes == [] and report.near_misses == []
