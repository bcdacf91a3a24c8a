"""MoeInitRouting case table and an independent slot-by-slot oracle."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from . import Case

OP = "MoeInitRouting"
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.float32


def make_inputs(tokens=6, hidden=8, experts=4, k=2, dtype=np.float32, index_dtype=np.int32, ids=None, seed=0,
                spread=1.0):
    """Random x [tokens, hidden] and expert_idx [tokens, k] (distinct experts per token unless ids is given)."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.int8:
        x = rng.integers(-128, 128, (tokens, hidden)).astype(np.int8)
    else:
        x = (rng.standard_normal((tokens, hidden)) * spread).astype(np.float32).astype(dtype)
    if ids is None:
        ids = [rng.permutation(experts)[:k] for _ in range(tokens)]
    expert_idx = np.asarray(ids, dtype=np.int64).reshape(tokens, k).astype(index_dtype)
    return x, expert_idx


# ----------------------------------------------------------------------------- oracle

def _quantized_row(x_row, expert, scale, offset, quant_mode, start):
    """(int8 values, scale) of one quantized row, element by element in float32 scalars."""
    hidden = len(x_row)
    if quant_mode == 0:
        out = []
        for h in range(hidden):
            v = F32(x_row[h]) * F32(scale[h if scale.size > 1 else 0])
            if offset is not None:
                v = F32(v + F32(offset[h if offset.size > 1 else 0]))
            out.append(_saturate(v))
        return out, 0.0
    smooth = [F32(1.0)] * hidden if scale is None else [F32(scale[expert - start if scale.shape[0] > 1 else 0, h])
                                                        for h in range(hidden)]
    shifted = [F32(F32(x_row[h]) * smooth[h]) for h in range(hidden)]
    if any(math.isnan(v) for v in shifted):
        return [0] * hidden, float("nan")
    biggest = F32(0.0)
    for v in shifted:
        biggest = max(biggest, F32(abs(v)))
    row_scale = F32(biggest / F32(127.0))
    if row_scale == 0:
        return [0] * hidden, 0.0
    return [_saturate(F32(v / row_scale)) for v in shifted], float(row_scale)


def _saturate(v) -> int:
    if math.isnan(v):
        return 0
    return max(-128, min(127, round(float(v))))


def oracle(x, expert_idx, scale=None, offset=None, *, expert_num, active_num=-1, expert_capacity=0, drop_pad_mode=0,
           expert_tokens_num_type=0, expert_tokens_num_flag=1, quant_mode=-1, active_expert_range=None,
           row_idx_type=0):
    """Expert by expert, slot by slot: written apart from the reference on purpose."""
    tokens, k = expert_idx.shape
    hidden = x.shape[1]
    start, end = active_expert_range or (0, expert_num)
    ids = [int(v) for v in expert_idx.reshape(-1)]
    slots_of = {e: [f for f in range(tokens * k) if ids[f] == e] for e in range(start, end)}

    placement = []  # (slot, row)
    if drop_pad_mode:
        for e in range(start, end):
            placement += [(f, e * expert_capacity + r) for r, f in enumerate(slots_of[e][:expert_capacity])]
        n_rows = expert_num * expert_capacity
        counts = [len(slots_of[e]) for e in range(start, end)]
    else:
        n_rows = tokens * k if active_num <= 0 else min(active_num, tokens * k)
        in_order = [f for e in range(start, end) for f in slots_of[e]]
        placement = [(f, r) for r, f in enumerate(in_order[:n_rows])]
        counts = [sum(1 for f, _ in placement if ids[f] == e) for e in range(start, end)]

    row_idx = [-1] * (tokens * k)
    out_dtype = x.dtype if quant_mode == -1 else np.int8
    expanded = np.zeros((n_rows, hidden), dtype=out_dtype)
    scales = np.zeros(n_rows, dtype=np.float32)
    for f, r in placement:
        if row_idx_type == 0:
            row_idx[f] = r
        else:
            row_idx[r] = f
        if quant_mode == -1:
            expanded[r] = x[f // k]
            scales[r] = 0.0 if scale is None else scale[f // k]
        else:
            expanded[r], scales[r] = _quantized_row(x[f // k], ids[f], scale, offset, quant_mode, start)

    if drop_pad_mode:
        expanded = expanded.reshape(expert_num, expert_capacity, hidden)
        scales = scales.reshape(expert_num, expert_capacity)
    if not expert_tokens_num_flag:
        token_counts = None
    elif expert_tokens_num_type == 0:
        token_counts = np.array([sum(counts[: i + 1]) for i in range(len(counts))], dtype=np.int64)
    elif expert_tokens_num_type == 1:
        token_counts = np.array(counts, dtype=np.int64)
    else:
        pairs = [[start + i, c] for i, c in enumerate(counts) if c > 0]
        pairs += [[-1, 0]] * (len(counts) - len(pairs))
        token_counts = np.array(pairs, dtype=np.int64).reshape(len(counts), 2)
    return expanded, np.array(row_idx, dtype=np.int32), token_counts, scales


# ----------------------------------------------------------------------------- cases

def _case(name, attrs, scale=None, offset=None, outputs=None, **kw):
    x, expert_idx = make_inputs(**kw)
    return Case(OP, name, [x, expert_idx, scale, offset], dict(attrs), outputs=outputs)




def _f32(*shape, seed=1, low=0.5, high=2.0):
    return np.random.default_rng(seed).uniform(low, high, shape).astype(np.float32)


E4 = dict(expert_num=4)
E8 = dict(expert_num=8)
DROP = dict(expert_num=4, drop_pad_mode=1, expert_capacity=2)
SKEWED = [[0, 1], [0, 2], [0, 1], [3, 0], [1, 0], [2, 3]]  # expert 0 has 5 slots, 1 has 3
_base = _case("dropless_gather", E4)
_x, _idx = _base.inputs[:2]
_dyn = _case("dynamic_quant_expert_smooth", {**E8, "quant_mode": 1, "active_expert_range": [2, 6]}, experts=8,
             scale=_f32(4, 8))
_static = _case("static_quant_per_tensor", {**E4, "quant_mode": 0}, scale=np.array([20.0], F32), spread=3.0)

CASES = [
    # dropless, every index form and count type
    _base,
    _case("dropless_scatter", {**E4, "row_idx_type": 1}),
    _case("dropless_count", {**E4, "expert_tokens_num_type": 1}),
    _case("dropless_key_value", {**E8, "expert_tokens_num_type": 2}, experts=8),
    _case("dropless_scatter_key_value", {**E8, "expert_tokens_num_type": 2, "row_idx_type": 1}, experts=8),
    _case("no_count_output", {**E4, "expert_tokens_num_flag": 0}, outputs=2),
    _case("fp16", E4, dtype=np.float16),
    _case("bf16", {**E4, "row_idx_type": 1}, dtype=BF16),
    _case("int64_ids", E4, index_dtype=np.int64),
    _case("int8_passthrough", E4, dtype=np.int8),
    _case("int8_passthrough_token_scale", {**E4, "row_idx_type": 1}, dtype=np.int8, scale=_f32(6)),
    _case("float_token_scale", E4, scale=_f32(6)),
    # active expert range, ids not routed
    _case("range_gather", {**E8, "active_expert_range": [2, 5]}, experts=8, tokens=9),
    _case("range_scatter", {**E8, "active_expert_range": [2, 5], "row_idx_type": 1}, experts=8, tokens=9),
    _case("range_key_value", {**E8, "active_expert_range": [5, 8], "expert_tokens_num_type": 2}, experts=8,
          tokens=9),
    _case("range_count", {**E8, "active_expert_range": [0, 1], "expert_tokens_num_type": 1}, experts=8),
    _case("range_nothing_routed", {**E8, "active_expert_range": [6, 8]}, ids=[[0, 1]] * 6),
    _case("minus_one_ids", E4, ids=[[0, -1], [-1, -1], [2, 1], [3, -1], [1, 0], [-1, 2]]),
    _case("minus_one_ids_scatter", {**E4, "row_idx_type": 1}, ids=[[0, -1], [-1, -1], [2, 1], [3, -1], [1, 0],
                                                                    [-1, 2]]),
    # active_num
    _case("active_num_truncates", {**E4, "active_num": 5}),
    _case("active_num_truncates_scatter", {**E4, "active_num": 5, "row_idx_type": 1, "expert_tokens_num_type": 1}),
    _case("active_num_above_valid", {**E8, "active_num": 9, "active_expert_range": [0, 4]}, experts=8),
    _case("active_num_above_slots", {**E4, "active_num": 100}),
    _case("active_num_zero_is_all", {**E4, "active_num": 0}),
    # drop/pad
    _case("drop_pad_drops", DROP, ids=SKEWED),
    _case("drop_pad_count", {**DROP, "expert_tokens_num_type": 1}, ids=SKEWED),
    _case("drop_pad_no_drop", {**DROP, "expert_capacity": 6}, ids=SKEWED),
    _case("drop_pad_capacity_1", {**DROP, "expert_capacity": 1}, ids=SKEWED),
    _case("drop_pad_minus_one", DROP, ids=[[0, -1], [-1, -1], [2, 1], [3, -1], [1, 0], [-1, 2]]),
    _case("drop_pad_bf16", DROP, ids=SKEWED, dtype=BF16),
    _case("drop_pad_int8", DROP, ids=SKEWED, dtype=np.int8, scale=_f32(6)),
    _case("drop_pad_dynamic_quant", {**DROP, "quant_mode": 1}, ids=SKEWED, scale=_f32(4, 8)),
    _case("drop_pad_static_quant", {**DROP, "quant_mode": 0}, ids=SKEWED, scale=np.array([30.0], F32)),
    # shapes at the edges
    _case("one_token", E4, tokens=1),
    _case("one_token_drop_pad", DROP, tokens=1),
    _case("empty", E4, tokens=0),
    _case("empty_key_value", {**E4, "expert_tokens_num_type": 2, "row_idx_type": 1}, tokens=0),
    _case("empty_drop_pad", DROP, tokens=0),
    _case("empty_dynamic_quant", {**E4, "quant_mode": 1}, tokens=0),
    _case("all_on_one_expert", {**E4, "expert_tokens_num_type": 2}, k=1, ids=[[2]] * 6),
    _case("all_on_one_expert_drop_pad", DROP, k=1, ids=[[2]] * 6),
    _case("experts_without_tokens", {**E8, "expert_tokens_num_type": 1}, experts=8, ids=[[1, 5]] * 6),
    _case("k_equals_e", {**E4, "row_idx_type": 1}, k=4),
    _case("k_equals_e_drop_pad", {**DROP, "expert_capacity": 3}, k=4),
    _case("k1", E4, k=1),
    _case("one_expert", {"expert_num": 1}, k=1, experts=1),
    # H = 0: rows without elements, every index and count still given
    _case("zero_hidden", E4, hidden=0),
    _case("zero_hidden_scatter_key_value", {**E8, "row_idx_type": 1, "expert_tokens_num_type": 2}, experts=8,
          hidden=0, scale=_f32(6)),
    _case("zero_hidden_drop_pad", DROP, ids=SKEWED, hidden=0),
    _case("zero_hidden_dynamic_quant", {**E4, "quant_mode": 1, "active_num": 7}, hidden=0, scale=_f32(4, 0)),
    _case("zero_hidden_static_quant", {**DROP, "quant_mode": 0}, ids=SKEWED, hidden=0, scale=np.array([2.0], F32)),
    # dynamic quant
    _case("dynamic_quant_no_scale", {**E4, "quant_mode": 1}),
    _case("dynamic_quant_shared_smooth", {**E4, "quant_mode": 1}, scale=_f32(1, 8)),
    _dyn,
    _dyn.mutated("dynamic_quant_expert_smooth_scatter", None, row_idx_type=1),
    _case("dynamic_quant_fp16", {**E4, "quant_mode": 1}, dtype=np.float16, scale=_f32(4, 8)),
    _case("dynamic_quant_bf16", {**E4, "quant_mode": 1, "active_num": 7}, dtype=BF16),
    _case("dynamic_quant_one_active_expert", {**E4, "quant_mode": 1, "active_expert_range": [1, 2]},
          scale=_f32(1, 8)),
    _base.mutated("dynamic_quant_zero_row", None, quant_mode=1, x=np.where(np.arange(6)[:, None] == 2, 0, _x)
            .astype(np.float32)),
    _base.mutated("dynamic_quant_nan_row", None, quant_mode=1, x=np.where(np.arange(6)[:, None] == 4, np.nan, _x)
            .astype(np.float32)),
    # static quant
    _static,
    _case("static_quant_per_channel_offset", {**E4, "quant_mode": 0, "row_idx_type": 1}, scale=_f32(8, low=5, high=40),
          offset=np.linspace(-3, 3, 8).astype(F32)),
    _case("static_quant_tensor_offset", {**E4, "quant_mode": 0}, scale=np.array([10.0], F32),
          offset=np.array([0.5], F32)),
    _case("static_quant_saturates", {**E4, "quant_mode": 0}, scale=np.array([1000.0], F32), spread=2.0),
    _case("static_quant_fp16", {**E4, "quant_mode": 0}, dtype=np.float16, scale=np.array([25.0], F32)),
    _case("static_quant_bf16_range", {**E8, "quant_mode": 0, "active_expert_range": [3, 7]}, experts=8, dtype=BF16,
          scale=np.array([25.0], F32)),
    # errors: values
    _base.mutated("id_too_large", runtime=True, error=r"expert_idx\[2, 1\] = 4 is outside \[-1, 4\) \(expert_num 4; -1 means no expert\)",
            expert_idx=np.where(np.arange(12).reshape(6, 2) == 5, 4, _idx).astype(np.int32)),
    _base.mutated("id_below_minus_one", runtime=True, error=r"expert_idx\[0, 0\] = -2 is outside \[-1, 4\)",
            expert_idx=np.where(np.arange(12).reshape(6, 2) == 0, -2, _idx).astype(np.int32)),
    # errors: attributes
    _base.mutated("missing_expert_num", r"attribute 'expert_num' is required", expert_num=None),
    _base.mutated("expert_num_zero", r"attribute 'expert_num' is 0; expected >= 1", expert_num=0),
    _base.mutated("attr_expert_num_float", r"attribute 'expert_num' has type FLOAT; expected INT", expert_num=4.0),
    _base.mutated("attr_range_int", r"attribute 'active_expert_range' has type INT; expected INTS",
            active_expert_range=3),
    _base.mutated("attr_range_floats", r"attribute 'active_expert_range' has type FLOATS; expected INTS",
            active_expert_range=[0.0, 2.0]),
    _base.mutated("attr_misspelled", r"attribute 'expert_capacities' is not an attribute of MoeInitRouting; "
            r"expected one of 'expert_num', 'active_num', 'expert_capacity', ", session=True, expert_capacities=2),
    _base.mutated("range_reversed", r"attribute 'active_expert_range' is \[3, 2\]; expected 0 <= start < end <= "
            r"expert_num \(4\)", active_expert_range=[3, 2]),
    _base.mutated("range_past_experts", r"attribute 'active_expert_range' is \[0, 5\]; expected 0 <= start",
            active_expert_range=[0, 5]),
    _base.mutated("range_three_values", r"attribute 'active_expert_range' is \[0, 1, 2\]; expected",
            active_expert_range=[0, 1, 2]),
    _base.mutated("range_negative", r"attribute 'active_expert_range' is \[-1, 2\]", active_expert_range=[-1, 2]),
    _base.mutated("active_num_negative", r"attribute 'active_num' is -2; expected -1 or 0 \(no limit\) or a positive",
            active_num=-2),
    _base.mutated("dropless_capacity", r"attribute 'expert_capacity' is 3; expected 0 for drop_pad_mode 0",
            expert_capacity=3),
    _base.mutated("drop_pad_mode_2", r"attribute 'drop_pad_mode' is 2; expected one of 0, 1", drop_pad_mode=2),
    _base.mutated("count_output_named_without_flag", r"output 'expert_tokens_count_or_cumsum' is named, but attribute "
            r"'expert_tokens_num_flag' is 0; drop the output or set the flag to 1", expert_tokens_num_flag=0),
    _base.mutated("count_type_3", r"attribute 'expert_tokens_num_type' is 3; expected one of 0, 1, 2",
            expert_tokens_num_type=3),
    _base.mutated("count_flag_2", r"attribute 'expert_tokens_num_flag' is 2; expected one of 0, 1",
            expert_tokens_num_flag=2),
    _base.mutated("quant_mode_2", r"attribute 'quant_mode' is 2; expected one of -1, 0, 1", quant_mode=2),
    _base.mutated("row_idx_type_2", r"attribute 'row_idx_type' is 2; expected one of 0, 1", row_idx_type=2),
    _base.mutated("drop_pad_no_capacity", r"attribute 'expert_capacity' is 0; expected >= 1 for drop_pad_mode 1",
            drop_pad_mode=1),
    _base.mutated("drop_pad_scatter", r"attribute 'row_idx_type' is 1 \(scatter\); expected 0 \(gather\) for "
            r"drop_pad_mode 1", **DROP, row_idx_type=1),
    _base.mutated("drop_pad_range", r"attribute 'active_expert_range' is \[1, 4\]; expected \[0, 4\] \(all experts",
            **DROP, active_expert_range=[1, 4]),
    _base.mutated("drop_pad_key_value", r"attribute 'expert_tokens_num_type' is 2 \(key_value\); expected 0 "
            r"\(cumsum\) or 1 \(count\) for drop_pad_mode 1", **DROP, expert_tokens_num_type=2),
    _base.mutated("drop_pad_active_num", r"attribute 'active_num' is 5; expected -1 or 0 for drop_pad_mode 1",
            **DROP, active_num=5),
    _base.mutated("drop_pad_rows_overflow", r"attribute 'expert_capacity' is 4611686018427387905; expected expert_num "
            r"\* expert_capacity \(the rows of expanded_x\) <= 9223372036854775807 \(expert_num 4\) for drop_pad_mode 1",
            **{**DROP, "expert_capacity": 2**62 + 1}),
    _base.mutated("count_output_overflow", r"cannot allocate 36893488147419103240 bytes for output "
            r"'expert_tokens_count_or_cumsum'", runtime=True, expert_num=2**62 + 1),
    # errors: types and shapes
    _base.mutated("x_float64", r"input 'x' has type float64; expected float32, float16, bfloat16, int8",
            x=_x.astype(np.float64)),
    _base.mutated("x_uint16", r"input 'x' has type uint16; expected float32, float16, bfloat16, int8",
            x=_x.astype(np.uint16)),
    _base.mutated("ids_int16", r"input 'expert_idx' has type int16; expected int32, int64",
            expert_idx=_idx.astype(np.int16)),
    _base.mutated("ids_uint64", r"input 'expert_idx' has type uint64; expected int32, int64",
            expert_idx=_idx.astype(np.uint64)),
    _base.mutated("ids_float", r"input 'expert_idx' has type float32; expected int32, int64",
            expert_idx=_idx.astype(np.float32)),
    _base.mutated("x_rank3", r"input 'x' has rank 3 .*expected rank 2", x=_x.reshape(6, 2, 4)),
    _base.mutated("ids_rank1", r"input 'expert_idx' has rank 1 .*expected rank 2", expert_idx=_idx.reshape(-1)),
    _base.mutated("tokens_mismatch", r"input 'expert_idx' dim 0 is 5; expected N = 6", expert_idx=_idx[:5]),
    _base.mutated("int8_x_dynamic", r"input 'x' has type int8; expected float32, float16, bfloat16 for quant_mode 1 "
            r"\(int8 x is already quantized: use quant_mode -1\)", x=_x.astype(np.int8), quant_mode=1),
    _static.mutated("int8_x_static", r"input 'x' has type int8; expected .* for quant_mode 0", x=_x.astype(np.int8)),
    _static.mutated("static_without_scale", r"input 'scale' is required", scale=None),
    _static.mutated("static_scale_wrong_size", r"input 'scale' dim 0 is 3; expected 1 \(per tensor\) or H = 8 "
            r"\(per channel\) for static quant", scale=_f32(3)),
    _static.mutated("static_scale_rank2", r"input 'scale' has rank 2 .*expected rank 1", scale=_f32(1, 8)),
    _static.mutated("static_offset_wrong_size", r"input 'offset' dim 0 is 5; expected 1 \(per tensor\) or H = 8",
            offset=_f32(5)),
    _static.mutated("static_scale_float16", r"input 'scale' has type float16; expected float32",
            scale=np.array([20.0], np.float16)),
    _dyn.mutated("dynamic_scale_wrong_experts", r"input 'scale' dim 0 is 3; expected 1 \(one smooth scale\) or "
            r"end - start = 4 \(one per active expert\)", scale=_f32(3, 8)),
    _dyn.mutated("dynamic_scale_full_experts", r"input 'scale' dim 0 is 8; expected 1 .* or end - start = 4",
            scale=_f32(8, 8)),
    _dyn.mutated("dynamic_scale_wrong_hidden", r"input 'scale' dim 1 is 7; expected H = 8", scale=_f32(4, 7)),
    _dyn.mutated("dynamic_scale_rank1", r"input 'scale' has rank 1 .*expected rank 2", scale=_f32(8)),
    _dyn.mutated("dynamic_offset", r"input 'offset' is given, but quant_mode 1 does not use it; leave it empty",
            offset=_f32(1)),
    _base.mutated("no_quant_offset", r"input 'offset' is given, but quant_mode -1 does not use it", offset=_f32(1)),
    _base.mutated("token_scale_wrong_tokens", r"input 'scale' dim 0 is 5; expected N = 6", scale=_f32(5)),
    _base.mutated("token_scale_rank2", r"input 'scale' has rank 2 .*expected rank 1", scale=_f32(6, 1)),
]
