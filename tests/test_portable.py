"""Portable function bodies (each op's ``body`` in moe_onnx/ops/<op>.py, written into models by
moe_onnx/rewrite/portable.py): every op's body on plain onnxruntime and on onnx's
ReferenceEvaluator equals the numpy reference, and every fixture optimized with ``portable=True`` runs
without our library with the numbers of our kernels."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from backends import PLAIN, as_float64, cached_session
from cases import ALL_CASES, VALID_CASES, lanes
import fixture_models
from fixture_models import MANIFEST, SHAPES, TARGETS, TOL, mutable_copy, original, random_feeds
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import moe_onnx
from moe_onnx.check import check_model
from moe_onnx.cli import main
from moe_onnx.ops import DOMAIN, OPS
from moe_onnx.rewrite.portable import PortableError, add_function_bodies, configurations, portable_model, summary
from moe_onnx.runtime import run


def assert_outputs_match(got, expected, rtol: float, atol: float) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_allclose(as_float64(g), as_float64(e), rtol=rtol, atol=atol)


# The valid cases of the ops that have a body; the others are refused, with their reason (below).
WITH_BODY = [c for c in VALID_CASES if OPS[c.op].body is not None]


@functools.cache
def _portable_case_model(case_id: str) -> onnx.ModelProto:
    case = next(c for c in ALL_CASES if c.id == case_id)
    return portable_model(case.model())


@pytest.mark.parametrize("case", lanes(WITH_BODY))
def test_body_on_plain_onnxruntime_matches_reference(case):
    model = _portable_case_model(case.id)
    (function,) = model.functions
    assert all(node.domain == "" for node in function.node), "standard ops only"
    got = run(cached_session(model, PLAIN), case.feeds())
    assert_outputs_match(got, case.run_reference(), rtol=max(case.rtol, 1e-5), atol=max(case.atol, 1e-5))


@pytest.mark.parametrize("case", lanes(WITH_BODY))
def test_body_on_reference_evaluator_matches_reference_and_checks(case):
    model = _portable_case_model(case.id)
    onnx.checker.check_model(model, full_check=True)
    assert check_model(model) == []
    with np.errstate(all="ignore"):  # onnx's Sigmoid and Div warn on the cases' inf and NaN
        got = ReferenceEvaluator(model).run(None, case.feeds())
    assert_outputs_match(got, case.run_reference(), rtol=max(case.rtol, 1e-5), atol=max(case.atol, 1e-5))


@pytest.mark.parametrize("op", sorted(name for name, op in OPS.items() if op.no_body))
def test_distributed_ops_are_refused_with_their_reason(op):
    """Dispatch and combine exchange data between processes: no standard op can, so no body."""
    case = next(c for c in VALID_CASES if c.op == op)
    with pytest.raises(PortableError, match=rf"^{op} node '{case.node_name}' has no portable function body: it "
                       r"sends .* \(MPI\); standard ONNX ops cannot exchange data between processes"):
        portable_model(case.model())


@pytest.mark.parametrize("op,attrs", [("MOE", {}), ("MoeRowParallelLinear", {})])
def test_a_node_of_a_tensor_parallel_group_is_refused(op, attrs):
    case = next(c for c in VALID_CASES if c.op == op)
    node_case = case.mutated("tp2", None, tp_world_size=2, tp_rank_id=1)
    with pytest.raises(PortableError, match=rf"^{op} node '{case.node_name}' has no portable function body: its "
                       r"attribute 'tp_world_size' is 2: it sums partial results over its tensor-parallel group"):
        portable_model(node_case.model())


def test_configurations_share_one_function_and_differ_by_overload():
    """Nodes with the same configuration share a function; another configuration is another overload
    of the same op, and onnxruntime runs each node's own."""
    ks = (2, 2, 3)
    nodes = [helper.make_node("MoeGatingTopK", ["logits"], [f"w{i}", f"i{i}"], domain=DOMAIN, k=k)
             for i, k in enumerate(ks)]
    outputs = [helper.make_tensor_value_info(f"{kind}{i}", elem, None)
               for i in range(len(ks)) for kind, elem in (("w", TensorProto.FLOAT), ("i", TensorProto.INT64))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [6, 8])],
                              outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)],
                              ir_version=10)
    portable = portable_model(model)
    assert [f.name for f in portable.functions] == ["MoeGatingTopK"] * 2
    first, second, third = (node.overload for node in portable.graph.node)
    assert first == second != third
    assert summary(ir.serde.deserialize_model(portable)) == (
        "portable: function bodies MoeGatingTopK x2; MoeGatingTopK with several configurations (overloads): "
        "onnxruntime runs this model, onnx.reference.ReferenceEvaluator (it ignores overload) cannot")
    logits = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)
    got = cached_session(portable, PLAIN).run(None, {"logits": logits})
    for i, k in enumerate(ks):
        weights, indices, _ = OPS["MoeGatingTopK"].reference(logits, k=k)
        np.testing.assert_allclose(got[2 * i], weights, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got[2 * i + 1], indices)


def test_size_attributes_do_not_make_another_function():
    """MoeRowParallelLinear's size attributes are checks: nodes differing only there share a body."""
    case = next(c for c in ALL_CASES if c.id == "MoeRowParallelLinear-sizes_given")
    plain = case.mutated("sizes_absent", None, num_experts=None, in_features=None, out_features=None,
                         bias_term=None)
    overloads = {portable_model(c.model()).graph.node[0].overload for c in (case, plain)}
    assert len(overloads) == 1


def test_low_opset_is_refused():
    case = next(c for c in ALL_CASES if c.id == "MOE-gemm3_fp32")
    model = case.model()
    model.opset_import[0].version = 17
    with pytest.raises(ValueError, match="need the default ONNX opset >= 18; the model imports 17"):
        portable_model(model)


# ----------------------------------------------------------------------------- fixtures

def optimized(name: str, target: str, portable: bool = True) -> onnx.ModelProto:
    """Fixture ``name`` optimized as users do (routers fused), with function bodies (``portable``)."""
    model, report = fixture_models.optimized(name, target, fuse_routers=True, portable=portable)
    assert report.total_fused >= 1
    return model


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_portable_fixture_on_plain_onnxruntime_matches_our_kernels(name, target):
    """The same portable model without and with our library (where registered, our kernels run it:
    test_portable_model_still_runs_our_kernels_where_registered)."""
    portable = optimized(name, target)
    assert check_model(portable) == []
    ours = {n.op_type for n in portable.graph.node if n.domain == DOMAIN}
    assert ours and ours == {f.name for f in portable.functions}, "every op of the fused model has its body"
    assert all(n.overload for n in portable.graph.node if n.domain == DOMAIN)
    plain, kernels = cached_session(portable, PLAIN), cached_session(portable)
    for batch, seq in SHAPES:
        feeds = random_feeds(name, batch, seq)
        for got, expected in zip(plain.run(None, feeds), kernels.run(None, feeds)):
            np.testing.assert_allclose(got, expected, **TOL, err_msg=f"{name} {target} {batch}x{seq}")


def test_portable_model_still_runs_our_kernels_where_registered():
    """A kernel wins over a function in onnxruntime: with the library registered the portable model
    runs our kernels, C++ and Python (a body made to give wrong numbers shows which ran)."""
    name = "qwen3_moe_batched_mm_tiny"
    portable = onnx.ModelProto()
    portable.CopyFrom(optimized(name, "moe"))
    for function in portable.functions:
        if function.name == "MOE":
            del function.node[:]
            function.node.append(onnx.helper.make_node("Neg", ["hidden_states"], ["y"]))
    feeds = random_feeds(name, 2, 3)
    expected = cached_session(optimized(name, "moe", False)).run(None, feeds)[0]
    for backend in moe_onnx.runtime.BACKENDS:
        got = moe_onnx.session(portable, backend=backend).run(None, feeds)[0]
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=backend)
    assert not np.allclose(cached_session(portable, PLAIN).run(None, feeds)[0], expected)


REFERENCE_EVALUATOR_FIXTURES = ["gpt_oss_tiled_tiny", "deepseek_v3_loop_grouped_tiny", "qwen3_moe_batched_mm_tiny"]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", REFERENCE_EVALUATOR_FIXTURES)
def test_portable_fixture_on_reference_evaluator(name, target):
    portable = optimized(name, target)
    assert all(count == 1 for count in configurations(ir.serde.deserialize_model(portable)).values())
    feeds = random_feeds(name, 2, 3)
    expected = cached_session(portable).run(None, feeds)
    got = ReferenceEvaluator(portable).run(None, feeds)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, **TOL)


def test_cli_optimize_portable(tmp_path, capsys):
    name = "gpt_oss_tiled_tiny"
    source, destination = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(original(name), source)
    assert main(["optimize", str(source), "-o", str(destination), "--portable"]) == 0
    assert "portable: function bodies MOE x1, MoeGatingTopK x1\n" in capsys.readouterr().out
    written = onnx.load(destination)
    assert {f.name for f in written.functions} == {"MOE", "MoeGatingTopK"}
    assert main(["check", str(destination)]) == 0
    feeds = random_feeds(name, 1, 4)
    expected = moe_onnx.session(written).run(None, feeds)
    for got, e in zip(cached_session(written, PLAIN).run(None, feeds), expected):
        np.testing.assert_allclose(got, e, **TOL)


def test_cli_optimize_portable_low_opset(tmp_path, capsys):
    """A model below opset 18: one line and exit 2, nothing written."""
    model = mutable_copy("gpt_oss_tiled_tiny")
    next(o for o in model.opset_import if o.domain in ("", "ai.onnx")).version = 17
    source, destination = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(model, source)
    assert main(["optimize", str(source), "-o", str(destination), "--portable"]) == 2
    assert "need the default ONNX opset >= 18; the model imports 17" in capsys.readouterr().err
    assert not destination.exists()


def test_add_function_bodies_on_ir_model_in_place():
    case = next(c for c in ALL_CASES if c.id == "MoeFinalizeRouting-dropless_gather")
    model = ir.serde.deserialize_model(case.model())
    assert add_function_bodies(model) is model
    assert configurations(model) == {"MoeFinalizeRouting": 1}
