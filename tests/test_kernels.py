"""Every case of every op's table on the onnxruntime backends (C++ kernels, Python kernels),
against the numpy reference; property tests of the C++ kernels over random shapes/modes; and the
grouped chain (MoeInitRouting -> MoeRowParallelLinear -> MoeFinalizeRouting) of optimized fixtures
on the C++ kernels against the original exported graph.

A valid case must give the reference's outputs (the case's rtol/atol); an invalid case must raise
an onnxruntime error whose message matches the case's regex and, past onnxruntime's prefix, is
exactly the reference's message, on both backends.
"""

from __future__ import annotations

import dataclasses
import os
import re

import isa_levels
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from backends import as_float64, cached_session, kernel_message, run_case
from cases import ALL_CASES, Case, bf16_compute, covering, lanes, transport_features
from cases import finalize_routing as finalize_cases
from cases import gating_topk as gating_cases
from cases import init_routing as init_cases
from cases import row_parallel_linear as linear_cases
from cases.moe import BF16, GEMM2, GEMM2_ACT, GEMM3, SCALAR_ACTIVATIONS, TOL, make_inputs
from fixture_models import FIXTURES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx.reference import ReferenceEvaluator

import moe_onnx
from moe_onnx.ops import OPS, REFERENCE_OPS, MoeOpError
from moe_onnx.runtime import kernel_report, run

CPP_OPS = {"MOE", "QMOE", "MoeInitRouting", "MoeRowParallelLinear", "MoeFinalizeRouting", "MoeGatingTopK",
           "MoeDistributeDispatch", "MoeDistributeCombine"}  # ops with a C++ kernel
CPP_CASES = [c for c in ALL_CASES if c.op in CPP_OPS]


def check(case: Case, backend: str) -> list[np.ndarray] | None:
    if case.session:  # moe_onnx.session() rejects the node before onnxruntime sees it: the reference's error
        with pytest.raises(MoeOpError, match=case.error) as info:
            run_case(case, backend)
        with pytest.raises(MoeOpError) as expected:
            case.run_reference(node_name=case.node_name)
        assert str(info.value) == str(expected.value)
        return None
    if case.error is not None:
        with pytest.raises(Exception) as info:
            run_case(case, backend)
        assert not isinstance(info.value, AssertionError)
        assert re.search(case.error, str(info.value)), f"{info.value}\ndoes not match {case.error!r}"
        with pytest.raises(MoeOpError) as expected:  # the reference's words for the same node
            case.run_reference(node_name=case.node_name)
        assert kernel_message(info.value) == str(expected.value)
        return None
    got = run_case(case, backend)
    expected = case.run_reference()
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, g.shape, e.dtype, e.shape)
        np.testing.assert_allclose(as_float64(g), as_float64(e), rtol=case.rtol, atol=case.atol)
    return got


# What test_cpp, test_cpp_larger and test_cpp_tile_paths got (at 2 intra-op threads), by case id:
# test_cpp_threads_identical compares 1 thread with it instead of building those sessions again.
TWO_THREAD_OUTPUTS: dict[str, list[np.ndarray]] = {}


def check_cpp(case: Case) -> None:
    got = check(case, "cpp")
    if got is not None:
        TWO_THREAD_OUTPUTS[case.id] = got


@pytest.mark.parametrize("case", lanes(CPP_CASES))
def test_cpp(case):
    check_cpp(case)


# The Python-kernel host runs each op's own reference, so what it can get wrong is the transport, not the
# op's rules (test_cpp checks the tables' every case against the reference, tests/test_op_cases.py the
# reference against the oracles): the cases that together have every transport feature run on it
# (cases.transport_features: every op and way a case fails, each input's element types and absence,
# every element type, each output count, each attribute given and defaulted, each input-type combination
# of valid cases, i.e. each variant the host registers that a case reaches).
PYTHON_CASES = covering(ALL_CASES, transport_features)


@pytest.mark.parametrize("case", lanes(PYTHON_CASES))
def test_python(case):
    """A covering subset of the tables (PYTHON_CASES) on the Python kernels: the reference's outputs, or
    its error message past onnxruntime's prefix."""
    check(case, "python")


def _larger_cases() -> list[Case]:
    """Cases big enough that the kernels split the work into many tasks."""
    rng = np.random.default_rng(7)
    offsets = (0, 40, 41, 41, 200, 290)
    linear = [linear_cases._case(f"larger_{np.dtype(t).name}", lead=(300,), k=70, n=90, offsets=offsets, dtype=t)
              for t in (np.float32, BF16, np.int8)]
    wide = linear_cases._case("larger_k1024", lead=(30,), k=1024, n=20, offsets=(0, 7, 7, 30))  # a 4 KB row stride
    linear.append(dataclasses.replace(wide, rtol=1e-4, atol=1e-4))
    linear.append(bf16_compute(linear[0], "larger_float32_bf16_compute"))  # many tasks, K and N tails at level 3
    # Whole panels (N % 16 == 0: results written straight into Y), several k blocks (int8: 256 pairs
    # each, so partial sums carry over) and every row-tile remainder (1, 5, 13, 101 rows).
    direct = dict(lead=(120,), k=1101, n=48, offsets=(0, 1, 6, 19, 19, 120))
    linear += [linear_cases._case("larger_int8_whole_panels", dtype=np.int8, **direct),
               linear_cases._case("larger_int8_whole_panels_no_bias", dtype=np.int8, bias=False, **direct),
               dataclasses.replace(linear_cases._case("larger_float32_whole_panels", **direct), rtol=1e-4, atol=1e-4)]
    ids = rng.integers(-1, 8, size=(300, 3))
    init = [init_cases._case("larger_dynamic_quant", {"expert_num": 8, "quant_mode": 1, "active_expert_range": [1, 7]},
                             tokens=300, hidden=40, experts=8, k=3, ids=ids, scale=init_cases._f32(6, 40)),
            init_cases._case("larger_drop_pad", {"expert_num": 8, "drop_pad_mode": 1, "expert_capacity": 50},
                             tokens=300, hidden=40, experts=8, k=3, ids=ids, dtype=np.float16)]
    finalize = [finalize_cases.routed_case("larger_scatter", {"row_idx_type": 1, "active_expert_range": [0, 6]},
                                           tokens=300, hidden=40, experts=8, k=3, ids=ids)]
    gating = [gating_cases.gating_case("larger_deepseek_v3", shape=(300, 64), k=6, bias=True, dtype=BF16,
                                       **gating_cases.DEEPSEEK_V3),
              gating_cases.gating_case("larger_softmax", shape=(20, 15, 32), k=4, renormalize=1)]
    return linear + init + finalize + gating + _larger_distribute_cases(rng)


def _larger_distribute_cases(rng) -> list[Case]:
    """One-rank dispatches (dropless and drop/pad) of 300 tokens and the combines on their assist_info."""
    ids = np.argsort(rng.random((300, 8)), axis=1)[:, :3].astype(np.int32)  # distinct in a row
    x = rng.standard_normal((300, 40)).astype(np.float16)
    cases = []
    for capacity in (0, 50):
        dispatch = Case("MoeDistributeDispatch", f"larger_capacity{capacity}", [x, ids],
                        {"num_experts": 8, "expert_capacity": capacity})
        expand_x, _, assist = dispatch.run_reference()
        y = rng.standard_normal(expand_x.shape).astype(np.float16)
        scales = rng.random(ids.shape).astype(np.float16)
        combine = Case("MoeDistributeCombine", f"larger_capacity{capacity}", [y, assist, scales, x, x],
                       {"num_experts": 8}, rtol=2e-2, atol=2e-2)
        cases += [dispatch, combine]
    return cases


LARGER_CASES = _larger_cases()


@pytest.mark.parametrize("case", LARGER_CASES, ids=lambda c: c.id)
def test_cpp_larger(case):
    check_cpp(case)


def _tile_path_cases() -> list[Case]:
    """Float cases (fp32, fp16, bf16) whose GEMMs take every tile path of every ISA level: experts
    with 1 and 2 rows (the decode kernels: 4, 2 and 1 panels at once), 3, 12, 13, 25, 27 and 30 rows (one
    to three row tiles of equal height), panel counts that leave every remainder, and K over 256 and
    512 (several K blocks, the partial sums carried through C, the next block prefetched)."""
    from cases import moe as moe_module

    cases = []
    for dtype in (np.float32, np.float16, BF16):
        name = np.dtype(dtype).name
        # 15 panels (3 x 4 + 2 + 1); rows per expert 1, 2, 3, 12, 13, 25
        linear = linear_cases._case(f"tile_paths_{name}", lead=(56,), k=600, n=240, offsets=(0, 1, 3, 6, 18, 31, 56),
                                    dtype=dtype, seed=5)
        # token 0 on experts 0 and 3, tokens 1-2 on 1 and 3, the rest on 2 and 3: 1, 2, 27 and 30
        # rows; gate/up 33 panels over K = 300, down 19 panels over K = 264
        indices = np.array([[0, 3], [1, 3], [1, 3]] + [[2, 3]] * 27)
        moe = moe_module._case(f"tile_paths_{name}", G3_ATTRS, tokens=30, hidden=300, inter=264, experts=4, k=2,
                               indices=indices, dtype=dtype, scale=0.2)
        cases += [linear, moe]
    # fp32 sums of a few hundred products of values up to ~10: rounding allows ~1e-4 absolute
    return [dataclasses.replace(c, rtol=max(c.rtol, 1e-4), atol=max(c.atol, 1e-4)) for c in cases]


G3_ATTRS = {"expert_type": GEMM3}
TILE_PATH_CASES = _tile_path_cases()


def _qmoe_tile_path_cases() -> list[Case]:
    """QMOE cases whose quantized GEMMs take every path of every ISA level: experts with 1 to 4 rows
    (the fused kernels: 4, 2 and 1 panels at once) and 5, 12 and 27 rows (blocks decoded for the fp32
    GEMM); int4, int8 and mxfp4; per column with K % 8 != 0 (a partial code group) and block-wise with
    zero points; int8 activations (accuracy_level 4) on the same shapes."""
    from cases import qmoe as qmoe_cases

    # token 0 on experts 0 and 6, ...: 1, 2, 3, 4, 5, 12 and 27 rows
    rows = [1, 2, 3, 4, 5, 12]
    indices = [[e, 6] for e, n in enumerate(rows) for _ in range(n)]
    indices += [[6, 5]] * (27 - len(indices))
    common = dict(tokens=len(indices), experts=7, k=2, indices=np.array(indices), scale=0.3)
    g2 = {"expert_type": GEMM2, "expert_alpha": 1.702, "expert_beta": 7.0}
    cases = [
        qmoe_cases._case("tile_paths_int4_columns", G3_ATTRS, hidden=100, inter=84, **common),  # 100 % 8 = 4
        qmoe_cases._case("tile_paths_int8_columns_zero_points", G3_ATTRS, bits=8, hidden=102, inter=90,
                         zero_points=True, **common),  # 102 % 4 = 2
        qmoe_cases._case("tile_paths_int4_block32_zero_points", g2, block_size=32, hidden=160, inter=96,
                         zero_points=True, **common),
        qmoe_cases._case("tile_paths_int8_block16", g2, bits=8, block_size=16, hidden=96, inter=80, **common),
        qmoe_cases._case("tile_paths_mxfp4", g2, quant_type="mxfp4", block_size=32, hidden=160, inter=96, **common),
    ]
    cases += [qmoe_cases._case(c.name + "_int8_activations", G3_ATTRS, bits=c.attrs["bits"],
                               block_size=c.attrs.get("block_size", 0), accuracy_level=4, hidden=96, inter=64,
                               zero_points=True, **common)
              for c in cases[:2]]
    return [dataclasses.replace(c, rtol=max(c.rtol, 1e-4), atol=max(c.atol, 1e-4)) for c in cases]


QMOE_TILE_PATH_CASES = _qmoe_tile_path_cases()


@pytest.mark.parametrize("case", TILE_PATH_CASES + QMOE_TILE_PATH_CASES, ids=lambda c: c.id)
def test_cpp_tile_paths(case):
    check_cpp(case)


def _dequantized_moe_case(case: Case) -> Case:
    """The MOE case on ``case``'s (QMOE) weights dequantized: GEMM2 takes them as [E, K, N]."""
    from moe_onnx.ops.qmoe import dequantize

    x, weights, indices, w0, b0, w1, b1, w2, *scales_and_zero_points = case.inputs
    attrs = case.attrs
    hidden, inter = x.shape[-1], w0.shape[1] // (2 if attrs["expert_type"] == GEMM2 else 1)
    k_dims = {GEMM2: (hidden, inter), GEMM3: (hidden, hidden, inter), GEMM2_ACT: (hidden, inter)}[attrs["expert_type"]]
    quant = dict(bits=attrs["bits"], block_size=attrs.get("block_size", 0), quant_type=attrs.get("quant_type", "int"))
    dense = [dequantize(w, scales_and_zero_points[j], scales_and_zero_points[3 + j], k_dim=k, **quant)
             for j, (w, k) in enumerate(zip((w0, w1, w2), k_dims))]
    if attrs["expert_type"] == GEMM2:
        dense = [d.transpose(0, 2, 1) for d in dense]
    dense += [None] * (3 - len(dense))
    moe_attrs = {key: value for key, value in attrs.items() if key not in ("bits", "block_size", "quant_type")}
    return Case("MOE", case.name, [x, weights, indices, dense[0], b0, dense[1], b1, dense[2]], moe_attrs,
                constant=(3, 4, 5, 6, 7))


@pytest.mark.parametrize("case", [c for c in QMOE_TILE_PATH_CASES if c.attrs.get("accuracy_level", 0) == 0],
                         ids=lambda c: c.id)
def test_qmoe_prefill_rows_are_moe_on_the_dequantized_weights(case):
    """Experts with more than 4 rows dequantize their weights exactly for the fp32 GEMM: a token whose
    experts all have more has the bits of the C++ MOE on the dequantized weights. QMOE's weights give
    the same bits packed once at kernel creation or per run."""
    got = run_case(case, "cpp", threads=2)[0]
    per_run = run_case(dataclasses.replace(case, constant=()), "cpp", threads=2)[0]
    np.testing.assert_array_equal(got.view(np.uint8), per_run.view(np.uint8))
    moe = run_case(_dequantized_moe_case(case), "cpp", threads=2)[0]
    indices = case.inputs[2]
    rows = np.bincount(indices.ravel(), minlength=7)
    prefill = np.all(rows[indices] > 4, axis=1)
    assert prefill.sum() >= 10
    np.testing.assert_array_equal(got[prefill].view(np.uint8), moe[prefill].view(np.uint8))


@pytest.mark.parametrize("backend", ["cpp", "python", "reference_evaluator"])
def test_init_routing_unnamed_count_output_between_named_ones(backend):
    """expert_tokens_num_flag 0 with output 2 left unnamed ("") and expanded_scale named: a valid node,
    whose named outputs are the reference's on every backend."""
    case = next(c for c in init_cases.CASES if c.name == "float_token_scale")
    case = case.mutated("unnamed_count_output", None, expert_tokens_num_flag=0)
    model = case.model()  # names every output (shape inference rejects it): leave output 2 unnamed
    model.graph.node[0].output[2] = ""
    del model.graph.output[2]
    for out in model.graph.output:
        out.ClearField("type")
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    if backend == "reference_evaluator":
        got = ReferenceEvaluator(model, new_ops=REFERENCE_OPS).run(None, case.feeds())
    else:
        got = run(cached_session(model, backend, threads=2), case.feeds())
    expected = OPS[case.op].reference(*case.inputs, _named_outputs=[True, True, False, True], **case.attrs)
    assert len(got) == 3 and expected[2] is None
    for g, e in zip(got, (expected[0], expected[1], expected[3])):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("case", lanes([c for c in CPP_CASES if c.error is None] + LARGER_CASES + QMOE_TILE_PATH_CASES))
def test_cpp_threads_identical(case):
    """One and two intra-op threads give the same bits (two: what test_cpp and the others got, where they ran)."""
    two = TWO_THREAD_OUTPUTS.pop(case.id, None) or run_case(case, "cpp", threads=2)
    one = run_case(case, "cpp", threads=1)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# ----------------------------------------------------------------------------- MOE property test

@st.composite
def moe_cases(draw):
    expert_type = draw(st.sampled_from([GEMM2, GEMM3, GEMM2_ACT]))
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
    if expert_type == GEMM2_ACT:
        attrs = {"expert_type": expert_type, "activation": draw(st.sampled_from(sorted(SCALAR_ACTIVATIONS)))}
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


# Random examples, new ones on each run (the suite's runs add up); MOE_ONNX_HYPOTHESIS_EXAMPLES for a deeper run
EXAMPLES = int(os.environ.get("MOE_ONNX_HYPOTHESIS_EXAMPLES", "100"))


@pytest.mark.slow
@pytest.mark.fuzz
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_cases())
def test_moe_cpp_property(case):
    check(case, "cpp")


# ----------------------------------------------------------------------------- routing ops property tests

def _random_ids(rng, tokens: int, k: int, experts: int, dtype) -> np.ndarray:
    """Expert ids in [-1, experts): -1 and ids outside an active range are not routed."""
    return rng.integers(-1, experts, size=(tokens, k)).astype(dtype)


@st.composite
def init_routing_cases(draw):
    dtype = draw(st.sampled_from([np.float32, np.float16, BF16, np.int8]))
    experts, k, tokens, hidden = draw(st.integers(1, 6)), draw(st.integers(1, 3)), draw(st.integers(0, 12)), \
        draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    quant = -1 if dtype == np.int8 else draw(st.sampled_from([-1, 0, 1]))
    attrs = {"expert_num": experts, "quant_mode": quant, "expert_tokens_num_type": draw(st.sampled_from([0, 1, 2])),
             "expert_tokens_num_flag": draw(st.sampled_from([0, 1]))}
    start, end = 0, experts
    if draw(st.booleans()):  # drop/pad
        attrs.update(drop_pad_mode=1, expert_capacity=draw(st.integers(1, 4)),
                     expert_tokens_num_type=draw(st.sampled_from([0, 1])))
    else:
        start = draw(st.integers(0, experts - 1))
        end = draw(st.integers(start + 1, experts))
        attrs.update(active_expert_range=[start, end], row_idx_type=draw(st.sampled_from([0, 1])),
                     active_num=draw(st.sampled_from([-1, 0, 1, 3, tokens * k, tokens * k + 2])))
    scale = offset = None
    if quant == -1 and draw(st.booleans()):
        scale = rng.uniform(0.5, 2.0, tokens).astype(np.float32)
    elif quant == 0:
        scale = rng.uniform(5, 60, draw(st.sampled_from([1, hidden]))).astype(np.float32)
        if draw(st.booleans()):
            offset = rng.uniform(-3, 3, draw(st.sampled_from([1, hidden]))).astype(np.float32)
    elif quant == 1 and draw(st.booleans()):
        scale = rng.uniform(0.5, 2.0, (draw(st.sampled_from([1, end - start])), hidden)).astype(np.float32)
    x, _ = init_cases.make_inputs(tokens, hidden, experts, k, dtype=dtype, ids=np.zeros((tokens, k)), seed=seed,
                                  spread=draw(st.sampled_from([1.0, 4.0])))
    if dtype != np.int8 and tokens and draw(st.integers(0, 4)) == 0:  # NaN/inf in one row
        x[rng.integers(tokens), rng.integers(hidden)] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    ids = _random_ids(rng, tokens, k, experts, draw(st.sampled_from([np.int32, np.int64])))
    outputs = 2 if attrs["expert_tokens_num_flag"] == 0 else None
    return Case("MoeInitRouting", "random", [x, ids, scale, offset], attrs, outputs=outputs, rtol=0, atol=0)


@st.composite
def row_parallel_linear_cases(draw):
    dtype = draw(st.sampled_from([np.float32, np.float16, BF16, np.int8]))
    experts, k, n = draw(st.integers(1, 5)), draw(st.integers(0, 37)), draw(st.integers(0, 37))
    lead = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
    rows = int(np.prod(lead))
    offsets = sorted(draw(st.lists(st.integers(0, rows), min_size=experts + 1, max_size=experts + 1)))
    bias = draw(st.booleans())
    inputs = linear_cases.make_inputs(offsets=offsets, lead=lead, k=k, n=n, dtype=dtype, bias=bias,
                                      seed=draw(st.integers(0, 2**31 - 1)))
    if dtype == np.int8 and bias and draw(st.booleans()):  # the bias add wraps like numpy's int32
        inputs[3] = inputs[3] + np.int32(2**31 - 1000)
    attrs = {"bias_term": int(bias)} if draw(st.booleans()) else {}
    constant = draw(st.sampled_from([(2, 3), (1, 2, 3), ()]))  # W (and B, offsets) initializers or runtime
    rtol, atol = linear_cases.TOL.get(np.dtype(dtype), (0, 0))
    return Case("MoeRowParallelLinear", "random", inputs, attrs, constant=constant, rtol=max(rtol, 1e-5 if rtol else 0),
                atol=max(atol, 1e-4 if atol else 0))


@st.composite
def finalize_routing_cases(draw):
    experts, k, tokens = draw(st.integers(1, 6)), draw(st.integers(1, 3)), draw(st.integers(0, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    init = {}
    if draw(st.booleans()):
        init.update(drop_pad_mode=1, expert_capacity=draw(st.integers(1, 4)))
    else:
        start = draw(st.integers(0, experts - 1))
        init.update(active_expert_range=[start, draw(st.integers(start + 1, experts))],
                    row_idx_type=draw(st.sampled_from([0, 1])),
                    active_num=draw(st.sampled_from([-1, 1, 3, tokens * k + 1])))
    residuals = draw(st.lists(st.sampled_from(["x1", "x2", "scales"]), unique=True))
    given_ = tuple(residuals) + (("bias", "expert_idx") if draw(st.booleans()) or not residuals else ())
    ids = _random_ids(np.random.default_rng(seed), tokens, k, experts, np.int64)
    return finalize_cases.routed_case("random", init, tokens=tokens, hidden=draw(st.integers(1, 12)), experts=experts,
                                      k=k, ids=ids, dtype=draw(st.sampled_from([np.float32, np.float16, BF16])),
                                      index_dtype=draw(st.sampled_from([np.int32, np.int64])), given=given_, seed=seed)


@pytest.mark.slow
@pytest.mark.fuzz
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(init_routing_cases())
def test_init_routing_cpp_property(case):
    check(case, "cpp")


@pytest.mark.slow
@pytest.mark.fuzz
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(row_parallel_linear_cases())
def test_row_parallel_linear_cpp_property(case):
    check(case, "cpp")


@pytest.mark.slow
@pytest.mark.fuzz
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(finalize_routing_cases())
def test_finalize_routing_cpp_property(case):
    check(case, "cpp")


# ----------------------------------------------------------------------------- grouped chain end to end

@pytest.mark.parametrize("name", ["qwen3_moe_batched_mm_tiny", "gpt_oss_tiled_tiny", "mixtral_tiled3_tiny"])
def test_grouped_target_cpp_matches_original(name):
    """optimize(target="grouped") run on the C++ kernels equals the exported graph on onnxruntime."""
    path = str(FIXTURES / f"{name}.onnx")  # optimize() from a path (the other tests pass models)
    grouped, _ = moe_onnx.optimize(path, target="grouped")
    ours = {n.op_type for n in grouped.graph.node if n.domain == moe_onnx.DOMAIN}
    assert ours == {"MoeGatingTopK", "MoeInitRouting", "MoeRowParallelLinear", "MoeFinalizeRouting"}
    original = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    hidden = original.get_inputs()[0].shape[-1]
    fast = cached_session(grouped, threads=2)
    for shape in [(2, 5, hidden), (1, 1, hidden), (3, 17, hidden)]:
        feeds = {original.get_inputs()[0].name: np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
        expected = original.run(None, feeds)
        got = fast.run(None, feeds)
        assert np.abs(expected[0]).max() > 1e-3  # the block contributes
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)


GEMM2_ACT_CASES = [c for c in CPP_CASES if c.op == "MOE" and c.error is None
                   and c.attrs.get("expert_type") == GEMM2_ACT and c.inputs[0].dtype == np.float32]


@pytest.mark.slow
@pytest.mark.parametrize("case", GEMM2_ACT_CASES, ids=lambda c: c.id)
def test_grouped_target_gemm2_act_matches_reference(case):
    """A GEMM2_ACT node (each activation, with and without biases) expanded to the grouped chain and
    run on the C++ kernels gives the reference's output."""
    grouped, report = moe_onnx.optimize(case.model(), target="grouped")
    assert report.fused == {"MoeToGrouped": 1}
    assert "MOE" not in {n.op_type for n in grouped.graph.node}
    got = run(cached_session(grouped, threads=2), case.feeds())
    expected = case.run_reference(case.node_name)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=case.atol)


ISA_LEVELS = isa_levels.LEVELS  # this architecture's

# What test_isa_level runs at each other level: the cases of test_cpp, test_cpp_larger and test_cpp_tile_paths that
# are valid MOE, QMOE and MoeRowParallelLinear cases (float and int8), the ops whose GEMMs and activations each level
# implements. Their invalid cases are refused by checks that run before any kernel and are the same code at
# every level (a coverage build ran them at portable, avx2 and avx512: they reached no line the valid cases
# did not, beyond those checks and their messages); test_cpp runs them at this process's level.
ISA_LEVEL_CASES = [case for case in CPP_CASES + LARGER_CASES + TILE_PATH_CASES + QMOE_TILE_PATH_CASES
                   if case.op in ("MOE", "QMOE", "MoeRowParallelLinear") and case.error is None]

# Run in a fresh process under the MOE_ONNX_GEMM of the environment: registers the C++ library and prints the
# registration's error (a level this CPU or build lacks), or the float GEMM's kernels in use; then, unless told
# to probe only, runs ISA_LEVEL_CASES through check_cpp and prints how many passed (a failure raises).
ISA_LEVEL_RUN = """
import sys
import onnxruntime as ort
import moe_onnx
from moe_onnx.runtime import kernel_report
try:
    ort.SessionOptions().register_custom_ops_library(moe_onnx.custom_ops_library())
except Exception as error:
    print("unsupported:", error)
    sys.exit(0)
print("gemm:", kernel_report()["gemm_panels"], flush=True)
if sys.argv[1] == "run":
    ort.set_default_logger_severity(4)
    import backends
    backends.sessions_do_not_spin()
    import test_kernels
    for case in test_kernels.ISA_LEVEL_CASES:
        test_kernels.check_cpp(case)
    print("passed:", len(test_kernels.ISA_LEVEL_CASES))
"""


def in_process_level() -> str:
    """The ISA level this process's kernels run (test_cpp, test_cpp_larger, test_cpp_tile_paths ran at it):
    MOE_ONNX_GEMM, else the highest the CPU and the build support."""
    return kernel_report()["level"]


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("level", ISA_LEVELS)
def test_isa_level(level):
    """Every ISA level this machine supports (MOE_ONNX_GEMM=level, in a fresh process) runs the C++
    kernels of ISA_LEVEL_CASES to the reference's results; a level the CPU or the build lacks is skipped.
    The level this process runs has run them here already: for it only the level the library reports is
    checked."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    env = {**os.environ, "MOE_ONNX_GEMM": level,
           "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent / "models"), os.environ.get("PYTHONPATH", "")])}
    mode = "probe" if level == in_process_level() else "run"
    out = subprocess.run([sys.executable, "-c", ISA_LEVEL_RUN, mode], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    if out.stdout.startswith("unsupported:"):
        assert f"MOE_ONNX_GEMM={level}: this CPU (or this build of the library) supports up to" in out.stdout
        pytest.skip(f"ISA level '{level}' is not supported here: {out.stdout.strip()}")
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["gemm:", isa_levels.gemm_kernel(level)]
    assert lines[1:] == ([] if mode == "probe" else [f"passed: {len(ISA_LEVEL_CASES)}"]), out.stdout[-3000:]


# ----------------------------------------------------------------------------- memory in proportion to the data

@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("shape", ["hidden_zero", "inter_zero"])
def test_zero_size_weights_of_many_experts_allocate_nothing(shape):
    """A model of a few hundred bytes whose weights have millions of experts and no elements: the
    session takes no memory for them (was +1 GiB, +70 MiB) and gives the reference's output (run in a
    fresh process, whose peak resident size is measured)."""
    import subprocess
    import sys
    from pathlib import Path

    code = f"""
import resource, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from cases import Case
from cases.moe import GEMM2
from moe_onnx.runtime import run, session

E, H, I = {{"hidden_zero": (2**20, 0, 128), "inter_zero": (2**22, 8, 0)}}[{shape!r}]
inputs = [np.zeros((3, H), np.float32), np.ones((3, 1), np.float32), np.zeros((3, 1), np.int64),
          np.zeros((E, H, 2 * I), np.float32), None, np.zeros((E, I, H), np.float32)]
case = Case("MOE", "zero_size_weights", inputs, {{"expert_type": GEMM2, "expert_beta": 7.0}}, constant=(3, 5))
model = case.model()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sess = session(model)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
got = run(sess, case.feeds())[0]
expected = case.run_reference()[0]
assert got.shape == expected.shape == (3, H), got.shape
np.testing.assert_array_equal(got, expected)
print(len(model.SerializeToString()), grown)
"""
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    model_bytes, grown_kib = map(int, out.stdout.split()[-2:])
    assert model_bytes < 1000 and grown_kib < 32 * 1024, (model_bytes, grown_kib)


def _init_routing_case(expert_num: int, hidden: int, **attrs) -> Case:
    ids = np.array([[0], [min(1, expert_num - 1)], [0]], np.int64)
    return Case("MoeInitRouting", "huge", [np.zeros((3, hidden), np.float32), ids],
                {"expert_num": expert_num, "expert_tokens_num_flag": 0, **attrs}, outputs=2)


@pytest.mark.parametrize("case, message", [
    (_init_routing_case(2**60, 0), "cannot allocate 9223372036854775816 bytes for the expert offsets of the slot sort"),
    (_init_routing_case(1, 0, drop_pad_mode=1, expert_capacity=2**61 + 1),
     "cannot allocate 18446744073709551624 bytes for the source slot of each row of expanded_x"),
    (_init_routing_case(1, 8, drop_pad_mode=1, expert_capacity=2**61 + 1),
     "cannot allocate 73786976294838206460 bytes for output 'expanded_x'"),
], ids=["experts", "rows", "output"])
def test_allocation_failure_names_node_and_size(case, message):
    """Memory the attributes ask for and no machine has: an error naming the node, the bytes and
    what they were for (was a bare std::bad_alloc or onnxruntime's 'Integer overflow')."""
    with pytest.raises(Exception) as info:
        run_case(case, "cpp")
    assert kernel_message(info.value) == f"MoeInitRouting node 'MoeInitRouting_node': {message}"
