"""Acceptance over every bundled export: optimize on both targets, check, and run on both backends.

Each fixture's .npz holds inputs and the outputs torch computed; the optimized model must give them
(within 1e-4) on the C++ and the Python kernels. The family modules (test_rewrite_<form>.py) test
the rules themselves: near-misses, mutations, sizes the export never saw.
"""

from __future__ import annotations

import numpy as np
import pytest

import moe_onnx
from fixture_models import (MANIFEST, TARGETS, TOL, WHOLE_MANIFEST, optimized, optimized_whole, reference_data,
                            whole_feeds, whole_reference_data)
from moe_onnx.check import check_model

UNFUSED_OPS = {"Tile", "GatherND", "NonZero", "OneHot"}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_fixture_fuses_and_keeps_the_numbers(name, target):
    model, report = optimized(name, target)
    assert report.total_fused >= 1 and not report.near_misses, report.summary()
    assert check_model(model) == []
    left = {n.op_type for n in model.graph.node} & UNFUSED_OPS
    assert not left, f"unfused ops left: {left}"
    ops = {n.op_type for n in model.graph.node if n.domain == moe_onnx.DOMAIN}
    assert ops == ({"MOE"} if target == "moe" else
                   {"MoeInitRouting", "MoeRowParallelLinear", "MoeFinalizeRouting"})

    data = reference_data(name)
    input_name = model.graph.input[0].name
    for backend in ("cpp", "python"):
        sess = moe_onnx.session(model, backend=backend)
        for suffix in ("", "_alt"):
            outputs = sess.run(None, {input_name: data[f"hidden_states{suffix}"]})
            np.testing.assert_allclose(outputs[0], data[f"expected{suffix}"], **TOL,
                                       err_msg=f"{name} {target} on {backend}")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(WHOLE_MANIFEST))
def test_whole_model_fuses_as_recorded_and_keeps_the_logits(name, target):
    """Whole tiny causal LMs: the rewriter reaches exactly the recorded state (fused blocks and
    near-miss reasons; `models/export_moe_blocks.py --record-fusion` updates it), and the optimized
    model's logits equal torch's on both backends."""
    entry = WHOLE_MANIFEST[name]
    model, report = optimized_whole(name, target)
    expected = entry["expected_fusion"][target]
    moe_nodes = [n for n in model.graph.node if n.domain == moe_onnx.DOMAIN]
    assert report.fused_blocks == sum(n.op_type == ("MOE" if target == "moe" else "MoeFinalizeRouting")
                                      for n in moe_nodes)
    reasons = sorted({f"{miss['rule']}: {miss['reason']}" for miss in report.near_misses})
    assert (report.fused_blocks, reasons) == (expected["fused"], expected["near_misses"]), report.summary()
    assert report.fused_blocks <= entry["moe_layers"]
    assert check_model(model) == []

    data = whole_reference_data(name)
    for backend in ("cpp", "python"):
        sess = moe_onnx.session(model, backend=backend)
        for suffix in ("", "_alt"):
            logits = sess.run(None, whole_feeds(model, data[f"input_ids{suffix}"]))[0]
            np.testing.assert_allclose(logits, data[f"expected{suffix}"], **TOL,
                                       err_msg=f"{name} {target} on {backend}")
