"""Acceptance over every bundled export: optimize (as users call it: routers fused too) on both
targets, check, and run on both backends.

Each fixture's .npz holds inputs and the outputs torch computed; the optimized model must give them
(within 1e-4) on the C++ and the Python kernels. The family modules (test_rewrite_<form>.py) test
the rules themselves: near-misses, mutations, sizes the export never saw.
"""

from __future__ import annotations

import numpy as np
import pytest
from backends import cached_session

import moe_onnx
from fixture_models import (MANIFEST, TARGETS, TOL, WHOLE_MANIFEST, fixture_lanes, optimized, optimized_whole,
                            reference_data, whole_reference_data)
from moe_export.fixtures import whole_feeds, whole_logits_match
from moe_onnx.check import check_model
from moe_onnx.rewrite.gating import RULE as ROUTER_RULE

UNFUSED_OPS = {"Tile", "GatherND", "NonZero", "OneHot"}
# the routers MoeGatingTopK does not express, and why (the report's note says so)
ROUTERS_KEPT = {
    "phimoe": "not the indices output of a TopK",  # the sparsemixer: weights from a masked softmax per pick
    "deepseek_v3": "filled with 0.0, not -inf",  # transformers 4.57 masks groups with 0.0 under a signed bias
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", fixture_lanes(sorted(MANIFEST)))
def test_fixture_fuses_and_keeps_the_numbers(name, target):
    model, report = optimized(name, target, fuse_routers=True)
    assert report.total_fused >= 1 and not report.near_misses, report.summary()
    assert check_model(model) == []
    left = {n.op_type for n in model.graph.node} & UNFUSED_OPS
    assert not left, f"unfused ops left: {left}"
    family = MANIFEST[name]["family"]
    kept = [note for note in report.notes if "the router stays as exported" in note]
    if family in ROUTERS_KEPT:
        assert ROUTER_RULE not in report.fused and len(kept) == 1 and ROUTERS_KEPT[family] in kept[0], report.notes
    else:
        assert report.fused[ROUTER_RULE] == 1 and kept == [], report.summary()
    ops = {n.op_type for n in model.graph.node if n.domain == moe_onnx.DOMAIN}
    router = set() if family in ROUTERS_KEPT else {"MoeGatingTopK"}
    assert ops == router | ({"MOE"} if target == "moe" else
                            {"MoeInitRouting", "MoeRowParallelLinear", "MoeFinalizeRouting"})

    data = reference_data(name)
    input_name = model.graph.input[0].name
    for backend in ("cpp", "python"):
        sess = cached_session(model, backend)
        for suffix in ("", "_alt"):
            outputs = sess.run(None, {input_name: data[f"hidden_states{suffix}"]})
            np.testing.assert_allclose(outputs[0], data[f"expected{suffix}"], **TOL,
                                       err_msg=f"{name} {target} on {backend}")


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(WHOLE_MANIFEST))
def test_whole_model_fuses_as_recorded_and_keeps_the_logits(name, target):
    """Whole tiny causal LMs: the rewriter reaches exactly the recorded state (fused blocks, near-miss
    reasons, whether the logits equal torch's; `models/export_moe_blocks.py --record-fusion` updates
    it). Where the recorded state says they match, the logits equal torch's on both backends."""
    entry = WHOLE_MANIFEST[name]
    model, report = optimized_whole(name, target)
    expected = entry["expected_fusion"][target]
    fused_op = "MOE" if target == "moe" else "MoeFinalizeRouting"
    assert report.fused_blocks == sum(n.domain == moe_onnx.DOMAIN and n.op_type == fused_op for n in model.graph.node)
    reasons = sorted({f"{miss['rule']}: {miss['reason']}" for miss in report.near_misses})
    assert (report.fused_blocks, reasons) == (expected["fused"], expected["near_misses"]), report.summary()
    assert report.fused_blocks <= entry["moe_layers"]
    assert check_model(model) == []

    data = whole_reference_data(name)
    for backend in ("cpp", "python"):
        sess = cached_session(model, backend)
        for suffix in ("", "_alt"):
            assert whole_logits_match(sess, data, suffix) == expected["matches_torch"], f"{name} {target} {backend}"
            if expected["matches_torch"]:
                feeds = whole_feeds([value.name for value in model.graph.input], data[f"input_ids{suffix}"])
                logits = sess.run(None, feeds)[0]
                np.testing.assert_allclose(logits, data[f"expected{suffix}"], **TOL,
                                           err_msg=f"{name} {target} on {backend}")
