"""MoeRowParallelLinear case table and an independent row-by-row oracle."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import Case, bf16_compute

OP = "MoeRowParallelLinear"
BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = {np.dtype(np.float32): (1e-5, 1e-5), np.dtype(np.float16): (2e-2, 2e-2), BF16: (5e-2, 5e-2)}
X, OFFSET, W, B = range(4)
WEIGHTS = (W, B)  # the seed's constants; expert_offset is a runtime input unless a case says otherwise
NAMES = ("X", "expert_offset", "W", "B")


def make_inputs(offsets=(0, 2, 2, 5, 7), lead=(7,), k=8, n=5, dtype=np.float32, bias=True, seed=0):
    """Random inputs X [*lead, k], expert_offset, W [E, n, k], B [E, n] (E = len(offsets) - 1)."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    experts = len(offsets) - 1
    if dtype == np.int8:
        x = rng.integers(-128, 128, (*lead, k)).astype(np.int8)
        w = rng.integers(-128, 128, (experts, n, k)).astype(np.int8)
        b = rng.integers(-1000, 1000, (experts, n)).astype(np.int32)
    else:
        x = rng.standard_normal((*lead, k)).astype(np.float32).astype(dtype)
        w = (rng.standard_normal((experts, n, k)) * 0.3).astype(np.float32).astype(dtype)
        b = rng.standard_normal((experts, n)).astype(np.float32).astype(dtype)
    return [x, np.array(offsets, dtype=np.int64), w, b if bias else None]


def oracle(X, expert_offset, W, B=None, **_):
    """Row by row: find the expert that owns the row (if any), then dot products in float64 or int64."""
    exact = X.dtype == np.int8
    wide = np.int64 if exact else np.float64
    rows = X.reshape(int(np.prod(X.shape[:-1])), X.shape[-1]).astype(wide)
    out = np.zeros((rows.shape[0], W.shape[1]), dtype=wide)
    for r in range(rows.shape[0]):
        owners = [e for e in range(W.shape[0]) if expert_offset[e] <= r < expert_offset[e + 1]]
        for e in owners:
            for j in range(W.shape[1]):
                out[r, j] = sum(rows[r, c] * wide(W[e, j, c]) for c in range(W.shape[2]))
                out[r, j] += 0 if B is None else wide(B[e, j])
    return out.astype(np.int32 if exact else np.float64).reshape(*X.shape[:-1], W.shape[1])


def _case(name, attrs=None, constant=WEIGHTS, **kw):
    inputs = make_inputs(**kw)
    rtol, atol = TOL.get(inputs[X].dtype, (0, 0))
    return Case(OP, name, inputs, dict(attrs or {}), constant=constant, rtol=rtol, atol=atol)




_base = _case("fp32")
_x, _off, _w, _b = _base.inputs
_int8 = _case("int8", dtype=np.int8)
_fp16 = _case("fp16", dtype=np.float16)
_more_rows = _case("more_rows", lead=(40,), k=16, n=12, offsets=(0, 3, 3, 10, 18, 18, 30, 37, 40), seed=3)
_SIZES = dict(num_experts=4, in_features=8, out_features=5)
_STATIC_OFFSETS = (OFFSET, W, B)

CASES = [
    _base,
    _case("fp32_no_bias", bias=False),
    _fp16,
    _case("fp16_no_bias", dtype=np.float16, bias=False),
    _case("bf16", dtype=BF16),
    _case("bf16_no_bias", dtype=BF16, bias=False),
    _int8,
    _case("int8_no_bias", dtype=np.int8, bias=False),
    _case("int8_rank3", dtype=np.int8, lead=(2, 4), offsets=(1, 1, 6, 8)),
    _case("sizes_given", dict(_SIZES, bias_term=1)),
    _case("bias_term_0_without_bias", dict(bias_term=0), bias=False),
    _case("input_is_parallel_one_process", dict(_SIZES, input_is_parallel=1)),
    _case("constant_offsets", constant=_STATIC_OFFSETS),
    _case("constant_offsets_int8", constant=_STATIC_OFFSETS, dtype=np.int8),
    _case("empty_experts", offsets=(0, 0, 7, 7, 7)),
    _case("first_and_last_experts_empty", offsets=(0, 0, 3, 7, 7), constant=_STATIC_OFFSETS),
    _case("all_rows_on_last_expert", offsets=(0, 0, 0, 0, 7)),
    _case("leading_and_trailing_rows_uncovered", offsets=(2, 3, 3, 4, 5)),
    _case("no_row_covered", offsets=(3, 3, 3, 3, 3)),
    _case("no_row_covered_at_end", offsets=(7, 7, 7, 7, 7), constant=_STATIC_OFFSETS),
    _case("one_expert", offsets=(0, 7)),
    _case("one_expert_partial", offsets=(1, 5), dtype=np.int8),
    _case("x_rank1", lead=(), offsets=(0, 0, 1, 1, 1)),
    _case("x_rank1_uncovered", lead=(), offsets=(0, 0, 0, 0, 0), constant=_STATIC_OFFSETS),
    _case("x_rank3", lead=(2, 3), offsets=(0, 1, 4, 4, 6)),
    _case("x_rank4", lead=(2, 2, 3), offsets=(1, 4, 5, 9, 11), dtype=np.float16),
    _case("zero_rows", lead=(0,), offsets=(0, 0, 0, 0, 0)),
    _case("zero_rows_rank3", lead=(2, 0), offsets=(0, 0, 0), constant=_STATIC_OFFSETS),
    _case("one_row", lead=(1,), offsets=(0, 0, 1, 1, 1)),
    _more_rows,
    # accuracy_level 3: bfloat16 GEMM operands allowed
    bf16_compute(_more_rows, "bf16_compute"),
    bf16_compute(_case("fp16", dtype=np.float16, offsets=(1, 1, 6, 7)), "fp16_bf16_compute"),
    bf16_compute(_case("bf16", dtype=BF16), "bf16_bf16_compute"),
    _base.mutated("nan_in_uncovered_row_stays_out", None,
            X=np.where(np.arange(7)[:, None] == 6, np.nan, _x).astype(np.float32),
            expert_offset=np.array([0, 2, 2, 5, 6])),
    _base.mutated("nan_in_covered_row_propagates", None,
            X=np.where(np.arange(7)[:, None] == 3, np.nan, _x).astype(np.float32)),
    # errors: offset values (offsets are constants here, so shape inference sees them too)
    _base.mutated("offsets_decreasing", r"input 'expert_offset'\[3\] = 1 is less than expert_offset\[2\] = 2; "
            r"expected expert_offset\[i\] <= expert_offset\[i\+1\]",
            expert_offset=np.array([0, 2, 2, 1, 7]), constant=_STATIC_OFFSETS),
    _base.mutated("offset_beyond_rows", r"input 'expert_offset'\[4\] = 8 is greater than the 7 rows of input 'X' "
            r".*expected expert_offset\[E\] <= 7", expert_offset=np.array([0, 2, 2, 5, 8]), constant=_STATIC_OFFSETS),
    _base.mutated("offset_negative", r"input 'expert_offset'\[0\] = -1 is negative; expected 0 <= expert_offset\[0\]",
            expert_offset=np.array([-1, 2, 2, 5, 7]), constant=_STATIC_OFFSETS),
    _base.mutated("offsets_decreasing_past_int64_max", r"input 'expert_offset'\[2\] = -2 is less than "
            r"expert_offset\[1\] = 9223372036854775807; expected expert_offset\[i\] <= expert_offset\[i\+1\]",
            expert_offset=np.array([0, 2**63 - 1, -2, 5]), W=_w[:3], B=_b[:3], constant=_STATIC_OFFSETS),
    _base.mutated("runtime_offsets_decreasing_past_int64_max", runtime=True, error=r"input 'expert_offset'\[2\] = -2 "
            r"is less than expert_offset\[1\] = 9223372036854775807", expert_offset=np.array([0, 2**63 - 1, -2, 5]),
            W=_w[:3], B=_b[:3]),
    _base.mutated("offset_beyond_zero_rows", r"input 'expert_offset'\[4\] = 1 is greater than the "
            r"0 rows of input 'X'", X=_x[:0], expert_offset=np.array([0, 0, 0, 0, 1]), constant=_STATIC_OFFSETS),
    # errors: offset shape and type
    _base.mutated("offset_length_e", r"input 'expert_offset' dim 0 is 4; expected E \+ 1 = 5 \(E from input 'W' "
            r"dim 0\)", expert_offset=_off[:4]),
    _base.mutated("offset_length_vs_num_experts", r"input 'expert_offset' dim 0 is 5; expected E \+ 1 = 4 "
            r"\(E from attribute 'num_experts'\)", W=_w[:3], B=_b[:3], num_experts=3),
    _base.mutated("offset_rank2", r"input 'expert_offset' has rank 2 .*expected rank 1", expert_offset=_off[None]),
    _base.mutated("offset_int32", r"input 'expert_offset' has type int32; expected int64",
            expert_offset=_off.astype(np.int32)),
    _base.mutated("offset_float", r"input 'expert_offset' has type float32; expected int64",
            expert_offset=_off.astype(np.float32)),
    # errors: sizes
    _base.mutated("k_mismatch", r"input 'W' dim 2 is 6; expected K = 8 \(from input 'X' dim -1\)", W=_w[:, :, :6]),
    _base.mutated("in_features_mismatch", r"input 'X' dim -1 is 8; expected K = 16 \(from attribute 'in_features'\)",
            in_features=16),
    _base.mutated("out_features_mismatch", r"input 'W' dim 1 is 5; expected N = 6 \(from attribute 'out_features'\)",
            out_features=6),
    _base.mutated("num_experts_mismatch", r"input 'W' dim 0 is 4; expected E = 3 \(from attribute 'num_experts'\)",
            num_experts=3),
    _base.mutated("num_experts_negative", r"attribute 'num_experts' is -1; expected a size >= 0", num_experts=-1),
    _base.mutated("attr_num_experts_float", r"attribute 'num_experts' has type FLOAT; expected INT", num_experts=4.0),
    _base.mutated("attr_bias_term_string", r"attribute 'bias_term' has type STRING; expected INT", bias_term="1"),
    _base.mutated("tp_world_size_negative", r"attribute 'tp_world_size' is -2; expected >= 1", tp_world_size=-2),
    _base.mutated("tp_rank_outside", r"attribute 'tp_rank_id' is 4; expected 0 <= tp_rank_id < tp_world_size = 4",
                  tp_world_size=4, tp_rank_id=4),
    _base.mutated("attr_misspelled", r"attribute 'bias_terms' is not an attribute of MoeRowParallelLinear; "
            r"expected one of 'num_experts', 'in_features', 'out_features', 'bias_term', 'input_is_parallel', "
            r"'tp_world_size', 'tp_rank_id', 'accuracy_level'$",
            session=True, bias_terms=1),
    _base.mutated("accuracy_level_4", r"attribute 'accuracy_level' is 4; expected one of 0, 3$", accuracy_level=4),
    _int8.mutated("int8_accuracy_level_3", r"attribute 'accuracy_level' is 3; int8 X expects 0 \(the int8 product "
                  r"is exact int32\)$", accuracy_level=3),
    _int8.mutated("int8_accuracy_level_1", r"attribute 'accuracy_level' is 1; expected one of 0, 3$",
                  accuracy_level=1),
    _base.mutated("attr_accuracy_level_string", r"attribute 'accuracy_level' has type STRING; expected INT$",
                  accuracy_level="3"),
    _base.mutated("bias_wrong_n", r"input 'B' dim 1 is 3; expected N = 5 \(from input 'W' dim 1\)", B=_b[:, :3]),
    _base.mutated("bias_wrong_e", r"input 'B' dim 0 is 3; expected E = 4 \(from input 'W' dim 0\)", B=_b[:3]),
    _base.mutated("bias_rank1", r"input 'B' has rank 1 .*expected rank 2", B=_b[0]),
    _base.mutated("w_rank2", r"input 'W' has rank 2 .*expected rank 3", W=_w[0]),
    _base.mutated("x_scalar", r"input 'X' has rank 0 .*expected rank >= 1", X=np.array(1.0, dtype=np.float32)),
    _base.mutated("w_missing", r"input 'W' is required", W=None),
    # errors: bias_term and input_is_parallel
    _base.mutated("bias_with_bias_term_0", r"input 'B' is given, but attribute 'bias_term' is 0; expected no B, "
            r"or bias_term = 1", bias_term=0),
    _base.mutated("bias_term_1_without_bias", r"attribute 'bias_term' is 1, but input 'B' is absent; expected B "
            r"\[E, N\], or bias_term = 0", B=None, bias_term=1),
    _base.mutated("bias_term_2", r"attribute 'bias_term' is 2; expected one of 0, 1", bias_term=2),
    _base.mutated("input_is_parallel_2", r"attribute 'input_is_parallel' is 2; expected one of 0, 1",
            input_is_parallel=2),
    # errors: types
    _int8.mutated("int8_x_float_w", r"input 'W' has type float32; expected int8, the type of input 'X'",
            W=_w),
    _int8.mutated("int8_float_bias", r"input 'B' has type float32; expected int32 \(int8 X and W accumulate in "
            r"int32\)", B=_b),
    _int8.mutated("int8_int8_bias", r"input 'B' has type int8; expected int32", B=_int8.inputs[B].astype(np.int8)),
    _fp16.mutated("fp16_fp32_bias", r"input 'B' has type float32; expected float16 \(the type of input 'X'\)",
            B=_b),
    _base.mutated("fp32_x_fp16_w", r"input 'W' has type float16; expected float32, the type of input 'X'",
            W=_w.astype(np.float16)),
    _base.mutated("x_float64", r"input 'X' has type float64; expected float32, float16, bfloat16, int8",
            X=_x.astype(np.float64), W=_w.astype(np.float64), B=_b.astype(np.float64)),
    _base.mutated("x_int32", r"input 'X' has type int32; expected float32, float16, bfloat16, int8",
            X=_x.astype(np.int32)),
    _base.mutated("x_uint16", r"input 'X' has type uint16; expected float32, float16, bfloat16, int8",
            X=_x.astype(np.uint16), W=_w.astype(np.uint16), B=_b.astype(np.uint16)),
    _base.mutated("offset_uint64", r"input 'expert_offset' has type uint64; expected int64",
            expert_offset=_off.astype(np.uint64)),
    _base.mutated("w_uint8", r"input 'W' has type uint8; expected float32, float16, bfloat16, int8",
            W=_w.astype(np.uint8)),
]
