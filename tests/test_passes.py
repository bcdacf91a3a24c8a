"""The one pass protocol (moe_onnx/_ir/passes.py): every pass of ``optimize`` and ``quantize`` is onnx_ir's
in-place pass returning a RewriteResult; the optimize path runs onnx shape inference once, the portable bodies
included; the report is the sum of the passes' results."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

from fixture_models import TARGETS, original
from moe_onnx.rewrite.quantize import Quantize, QuantizeSettings
from moe_onnx.rewrite import _driver
from moe_onnx._ir.passes import RewritePass, RewriteResult

FIXTURE = "qwen3_moe_batched_mm_tiny"


@pytest.mark.parametrize("target", [*TARGETS, "ort"])
def test_every_optimize_pass_speaks_the_protocol(target):
    """One shape inference first, the target's own pass, the bodies last; each result a RewriteResult."""
    passes = _driver.optimize_passes(target, fuse_routers=True, portable=target != "ort", compute="bf16")
    names = [type(graph_pass).__name__ for graph_pass in passes]
    assert all(isinstance(graph_pass, RewritePass) and graph_pass.in_place for graph_pass in passes)
    assert names.count("InferShapes") == 1 and names.index("InferShapes") < names.index("ImportOrtNodes")
    assert ("ExpandToGrouped" in names) == (target == "grouped") and ("ExportToOrt" in names) == (target == "ort")
    assert ("FoldSharedExperts" in names) == (target != "ort")
    assert names[-1] == ("Tidy" if target == "ort" else "AddFunctionBodies")
    model = ir.serde.deserialize_model(original(FIXTURE))
    fused = {}
    for graph_pass in passes:
        result = graph_pass(model)
        assert isinstance(result, RewriteResult) and result.model is model
        assert all(count > 0 for count in result.fused.values())
        fused.update(result.fused)
    assert fused.get("RouterToMoeGatingTopK") == 1


@pytest.mark.parametrize("target", TARGETS)
def test_shape_inference_runs_once_on_the_optimize_path(target, monkeypatch):
    """A ModelProto optimized with its routers and bodies: one onnx shape inference over the model, and the
    grouped chain's rows keep the block's type for the portable MoeRowParallelLinear body."""
    calls = []
    infer = onnx.shape_inference.infer_shapes
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", lambda *a, **k: calls.append(1) or infer(*a, **k))
    model, report = _driver.optimize(original(FIXTURE), target, portable=True)
    assert len(calls) == 1
    assert report.fused_blocks == 1 and report.notes[-1].startswith("portable: function bodies")
    assert {f.name for f in model.functions} == {n.op_type for n in model.graph.node if n.domain == "moe_onnx"}


def test_quantize_is_a_pass():
    """Quantize's result counts the MOE nodes made QMOE; its QuantizeReport stays on the pass."""
    model, _ = _driver.optimize(ir.serde.deserialize_model(original(FIXTURE)))
    quantize = Quantize(QuantizeSettings(bits=4))
    result = quantize(model)
    assert isinstance(result, RewriteResult) and result.modified and result.fused == {"QMOE": 1}
    assert [layer.node for layer in quantize.report.layers] == [n.name for n in model.graph if n.op_type == "QMOE"]
