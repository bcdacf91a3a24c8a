"""Every case of every op's table on the onnxruntime backends (C++ kernels, Python kernels),
against the numpy reference; plus a property test of the MOE C++ kernel over random shapes/modes.

A valid case must give the reference's outputs (the case's rtol/atol); an invalid case must raise
an onnxruntime error whose message matches the case's regex, on both backends.
"""

from __future__ import annotations

import os
import re

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
from cases import ALL_CASES, Case
from cases.moe import BF16, GEMM2, GEMM3, TOL, make_inputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_onnx.runtime import run, session

ort.set_default_logger_severity(4)  # the errors are asserted, not logged

CPP_OPS = {"MOE"}  # ops with a C++ kernel so far
CPP_CASES = [c for c in ALL_CASES if c.op in CPP_OPS]


def as_float64(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float64) if a.dtype.kind == "f" or a.dtype == ml_dtypes.bfloat16 else a


def options(threads: int) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    return opts


def run_case(case: Case, backend: str, threads: int = 2) -> list[np.ndarray]:
    model = case.model()
    if case.error is not None:
        # Case.model() declares the outputs of an invalid node with input 0's type; leave them
        # untyped so the kernel, not onnxruntime's graph type check, reports what is wrong.
        for out in model.graph.output:
            out.ClearField("type")
    sess = session(model, backend=backend, sess_options=options(threads))
    return run(sess, case.feeds())


def check(case: Case, backend: str) -> list[np.ndarray] | None:
    if case.error is not None:
        with pytest.raises(Exception) as info:
            run_case(case, backend)
        assert not isinstance(info.value, AssertionError)
        assert re.search(case.error, str(info.value)), f"{info.value}\ndoes not match {case.error!r}"
        return None
    got = run_case(case, backend)
    expected = case.run_reference()
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, g.shape, e.dtype, e.shape)
        np.testing.assert_allclose(as_float64(g), as_float64(e), rtol=case.rtol, atol=case.atol)
    return got


@pytest.mark.parametrize("case", CPP_CASES, ids=lambda c: c.id)
def test_cpp(case):
    check(case, "cpp")


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.id)
def test_python(case):
    check(case, "python")


@pytest.mark.parametrize("case", [c for c in CPP_CASES if c.error is None], ids=lambda c: c.id)
def test_cpp_threads_identical(case):
    one, two = run_case(case, "cpp", threads=1), run_case(case, "cpp", threads=2)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# ----------------------------------------------------------------------------- MOE property test

@st.composite
def moe_cases(draw):
    expert_type = draw(st.sampled_from([GEMM2, GEMM3]))
    dtype = draw(st.sampled_from([np.float32, np.float32, np.float16, BF16]))
    experts = draw(st.integers(1, 6))
    k = draw(st.integers(1, 3))
    tokens = draw(st.integers(0, 40))
    hidden = draw(st.integers(1, 40))
    inter = draw(st.integers(1, 40))
    repeats = draw(st.booleans())  # indices may repeat an expert inside a token
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    if repeats or k > experts:
        indices = rng.integers(0, experts, size=(tokens, k))
    else:
        indices = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]) if tokens else np.zeros((0, k))
    attrs = {"expert_type": expert_type, "expert_alpha": draw(st.sampled_from([1.0, 1.702, 0.5]))}
    if expert_type == GEMM2:
        attrs["expert_beta"] = draw(st.sampled_from([7.0, 0.5, float("inf")]))
        attrs["gate_parity"] = draw(st.sampled_from([0, 1]))
    bias = draw(st.booleans())
    inputs = make_inputs(tokens=tokens, hidden=hidden, inter=inter, experts=experts, k=k, expert_type=expert_type,
                         dtype=dtype, index_dtype=draw(st.sampled_from([np.int32, np.int64])), bias=bias,
                         indices=indices, seed=seed)
    constant = draw(st.sampled_from([(3, 4, 5, 6, 7), ()]))  # initializer weights (packed once) or runtime
    rtol, atol = TOL[np.dtype(dtype)]
    return Case("MOE", "random", inputs, attrs, constant=constant, rtol=max(rtol, 1e-4), atol=max(atol, 1e-4))


EXAMPLES = int(os.environ.get("MOE_ONNX_HYPOTHESIS_EXAMPLES", "200"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_cases())
def test_moe_cpp_property(case):
    check(case, "cpp")


def test_portable_gemm_fallback():
    """The portable GEMM (no AVX2) gives the reference's results too (run in a fresh process)."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import ctypes, re, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import moe_onnx
from cases import ALL_CASES
from moe_onnx.runtime import run, session
lib = ctypes.CDLL(moe_onnx.custom_ops_library())
lib.MoeOnnxGemmIsa.restype = ctypes.c_char_p
assert lib.MoeOnnxGemmIsa() == b"portable", lib.MoeOnnxGemmIsa()
n = 0
for case in ALL_CASES:
    if case.op != "MOE" or case.error is not None:
        continue
    got = run(session(case.model()), case.feeds())[0]
    exp = case.run_reference()[0]
    np.testing.assert_allclose(got.astype(np.float64), exp.astype(np.float64), rtol=case.rtol, atol=case.atol)
    n += 1
print(n)
"""
    env = {**os.environ, "MOE_ONNX_GEMM": "portable"}
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) > 10
