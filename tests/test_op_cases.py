"""Every op's case table against its numpy reference, its oracle, the onnx checker and shape inference; and
ReferenceEvaluator (the reference wrapped as an onnx.reference op) on the cases that cover its wrapping."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from backends import as_float64
from cases import ALL_CASES, ORACLES, VALID_CASES, covering, transport_features
from onnx.reference import ReferenceEvaluator

from moe_onnx.ops import REFERENCE_OPS, MoeOpError

INVALID = [c for c in ALL_CASES if c.error is not None]


@pytest.mark.parametrize("case", VALID_CASES, ids=lambda c: c.id)
def test_reference_matches_oracle(case):
    got = case.run_reference()
    expected = ORACLES[case.op](*case.padded_inputs(), **case.attrs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        np.testing.assert_allclose(as_float64(g), as_float64(e), rtol=max(case.rtol, 1e-4), atol=max(case.atol, 1e-4))


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.id)
def test_reference_rejects(case):
    with pytest.raises(MoeOpError, match=case.error) as info:
        case.run_reference()
    assert str(info.value).startswith(case.op)


@pytest.mark.parametrize("case", VALID_CASES, ids=lambda c: c.id)
def test_model_checks(case):
    """The case's model passes the onnx checker, and shape inference with symbolic dims names its outputs."""
    onnx.checker.check_model(case.model(), full_check=True)
    symbolic = onnx.shape_inference.infer_shapes(case.model(symbolic=True), strict_mode=True)
    assert len(symbolic.graph.output) == case.n_outputs


# ReferenceEvaluator runs the op's own reference (moe_onnx.ops.REFERENCE_OPS wraps it), so what it can get
# wrong is the wrapping: the inputs, attributes and named outputs it hands over. The valid cases that together
# have every transport feature (cases.transport_features: each input's element types and absence, each output
# count, each attribute given and defaulted, each input-type combination) run on it; its errors are
# test_reference_evaluator_rejects_attributes' and test_reference_rejects_types_onnxruntime_cannot_feed's.
REFERENCE_EVALUATOR_CASES = covering(VALID_CASES, transport_features)


@pytest.mark.parametrize("case", REFERENCE_EVALUATOR_CASES, ids=lambda c: c.id)
def test_reference_evaluator_runs(case):
    """ReferenceEvaluator gives the reference's outputs exactly."""
    got = ReferenceEvaluator(case.model(), new_ops=REFERENCE_OPS).run(None, case.feeds())
    for g, e in zip(got, case.run_reference()):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_array_equal(g, e)


STATIC_ERRORS = [c for c in INVALID if not c.runtime and not c.session]


@pytest.mark.parametrize("case", STATIC_ERRORS, ids=lambda c: c.id)
def test_shape_inference_rejects(case):
    """Errors visible from types, shapes and attributes fail ONNX shape inference, with the same message."""
    with pytest.raises(Exception, match=case.error):
        onnx.shape_inference.infer_shapes(case.model(), strict_mode=True)



@pytest.mark.parametrize("dtype", [np.complex64, np.dtype("datetime64[s]")], ids=lambda d: np.dtype(d).name)
def test_reference_rejects_types_onnxruntime_cannot_feed(dtype):
    """Element types no kernel is registered for (onnxruntime refuses the model) fail the references'
    own type check, directly and inside ReferenceEvaluator."""
    base = next(c for c in ALL_CASES if c.id == "MoeRowParallelLinear-fp32")
    case = base.mutated("x_other_type", None, X=base.inputs[0].astype(dtype))
    expected = f"input 'X' has type {np.dtype(dtype)}; expected float32, float16, bfloat16, int8"
    with pytest.raises(MoeOpError, match=re.escape(f"MoeRowParallelLinear: {expected}")):
        case.run_reference()
    if dtype == np.complex64:  # ONNX has a complex64 tensor type, so a model can carry it
        with pytest.raises(MoeOpError, match=re.escape(f"MoeRowParallelLinear node '{case.node_name}': {expected}")):
            ReferenceEvaluator(case.model(), new_ops=REFERENCE_OPS).run(None, case.feeds())


ATTRIBUTE_ERRORS = [c for c in INVALID if c.name.startswith("attr_")]  # the tables' attribute type and name cases


@pytest.mark.parametrize("case", ATTRIBUTE_ERRORS, ids=lambda c: c.id)
def test_reference_evaluator_rejects_attributes(case):
    """ReferenceEvaluator checks a node's attributes as ONNX types them, in the reference's words."""
    with pytest.raises(MoeOpError) as expected:
        case.run_reference(node_name=case.node_name)
    with pytest.raises(MoeOpError) as info:
        ReferenceEvaluator(case.model(), new_ops=REFERENCE_OPS).run(None, case.feeds())
    assert str(info.value) == str(expected.value)
