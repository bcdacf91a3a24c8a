"""MoeFinalizeRouting case table, built on real MoeInitRouting layouts, and an independent per-token oracle."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from moe_onnx.ops.init_routing import moe_init_routing

from . import Case
from .init_routing import make_inputs

OP = "MoeFinalizeRouting"
BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = {np.dtype(np.float32): (1e-5, 1e-5), np.dtype(np.float16): (2e-2, 2e-2), BF16: (5e-2, 5e-2)}
INPUTS = ["expanded_x", "expanded_row_idx", "x1", "x2", "bias", "scales", "expert_idx"]


def oracle(expanded_x, expanded_row_idx, x1=None, x2=None, bias=None, scales=None, expert_idx=None, *,
           drop_pad_mode=0, row_idx_type=0):
    """Token by token, slot by slot, in float64: written apart from the reference on purpose."""
    hidden = expanded_x.shape[-1]
    rows = expanded_x.reshape(int(np.prod(expanded_x.shape[:-1])), hidden).astype(np.float64)  # H may be 0
    tokens = next(a.shape[0] for a in (x1, x2, scales, expert_idx) if a is not None)
    k = len(expanded_row_idx) // tokens if tokens else 0
    index = [int(v) for v in expanded_row_idx]
    out = np.zeros((tokens, hidden))
    for t in range(tokens):
        for residual in (x1, x2):
            if residual is not None:
                out[t] += residual[t].astype(np.float64)
        for j in range(k):
            slot = t * k + j
            if row_idx_type == 0:
                rows_of_slot = [index[slot]] if index[slot] >= 0 else []
            else:
                rows_of_slot = [r for r, f in enumerate(index) if f == slot]
            weight = 1.0 if scales is None else float(scales[t, j])
            for r in rows_of_slot:
                y = rows[r] + (0.0 if bias is None else bias[int(expert_idx[t, j])].astype(np.float64))
                out[t] += weight * y
    return (out.astype(expanded_x.dtype),)


def routed_case(name, init_attrs, *, tokens=6, hidden=8, experts=4, k=2, ids=None, dtype=np.float32,
                index_dtype=np.int32, given=("x1", "x2", "bias", "scales", "expert_idx"), seed=3):
    """A case whose expanded_row_idx and expanded_x shape come from MoeInitRouting with ``init_attrs``."""
    x, expert_idx = make_inputs(tokens, hidden, experts, k, ids=ids, seed=seed)
    init_attrs = {"expert_num": experts, **init_attrs}
    expanded, row_idx, *_ = moe_init_routing(x, expert_idx, **init_attrs)
    rng = np.random.default_rng(seed + 1)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)

    scales = rng.random((tokens, k)).astype(np.float32).astype(dtype)
    available = dict(x1=rand(tokens, hidden), x2=rand(tokens, hidden), bias=rand(experts, hidden), scales=scales,
                     expert_idx=expert_idx.astype(index_dtype))
    inputs = [rand(*expanded.shape), row_idx.astype(index_dtype)] + [available[n] if n in given else None
                                                                     for n in INPUTS[2:]]
    attrs = {a: init_attrs[a] for a in ("drop_pad_mode", "row_idx_type") if a in init_attrs}
    rtol, atol = TOL[np.dtype(dtype)]
    return Case(OP, name, inputs, attrs, rtol=rtol, atol=atol)




def zero_hidden(case, name, error=None, runtime=False, **changes):
    """``case`` with H = 0: expanded_x, x1, x2 and bias keep their other dims and lose every column."""
    hidden_inputs = ("expanded_x", "x1", "x2", "bias")
    given = {n: a[..., :0] for n, a in zip(INPUTS, case.padded_inputs()) if n in hidden_inputs and a is not None}
    return case.mutated(name, error, runtime=runtime, **{**given, **changes})


SCATTER = {"row_idx_type": 1}
DROP = {"drop_pad_mode": 1, "expert_capacity": 2}
SKEWED = [[0, 1], [0, 2], [0, 1], [3, 0], [1, 0], [2, 3]]
UNROUTED = [[0, -1], [-1, -1], [2, 1], [3, -1], [1, 0], [-1, 2]]
_base = routed_case("dropless_gather", {})
_scatter = routed_case("dropless_scatter", SCATTER)
_drop = routed_case("drop_pad_drops", DROP, ids=SKEWED)
_y, _rows, _x1, _x2, _bias, _scales, _ids = _base.inputs
_nan_tail = routed_case("nan_in_unused_row", {"active_expert_range": [0, 2]}, experts=4)
_nan_tail.inputs[0][-1] = np.nan  # the tail rows of a range subset are never referenced

CASES = [
    _base,
    _scatter,
    _drop,
    routed_case("drop_pad_no_drop", {**DROP, "expert_capacity": 6}, ids=SKEWED),
    routed_case("drop_pad_unrouted_ids", DROP, ids=UNROUTED),
    routed_case("range_gather", {"active_expert_range": [2, 5]}, experts=8, tokens=9),
    routed_case("range_scatter", {"active_expert_range": [2, 5], **SCATTER}, experts=8, tokens=9),
    routed_case("range_nothing_routed", {"active_expert_range": [3, 4]}, ids=[[0, 1]] * 6),
    routed_case("active_num_gather", {"active_num": 5}),
    routed_case("active_num_scatter", {"active_num": 5, **SCATTER}),
    routed_case("unrouted_ids_gather", {}, ids=UNROUTED),
    routed_case("unrouted_ids_scatter", SCATTER, ids=UNROUTED),
    routed_case("fp16", {}, dtype=np.float16),
    routed_case("bf16_scatter", SCATTER, dtype=BF16),
    routed_case("bf16_drop_pad", DROP, ids=SKEWED, dtype=BF16),
    routed_case("int64_indices", SCATTER, index_dtype=np.int64),
    routed_case("only_scales", {}, given=("scales",)),
    routed_case("only_x1", SCATTER, given=("x1",)),
    routed_case("only_x2", DROP, ids=SKEWED, given=("x2",)),
    routed_case("bias_no_scales", {}, given=("bias", "expert_idx")),
    routed_case("bias_with_unrouted_ids", {"active_expert_range": [1, 3]}, ids=UNROUTED),
    routed_case("one_token", {}, tokens=1),
    routed_case("empty", {}, tokens=0),
    routed_case("empty_scatter_x1_only", SCATTER, tokens=0, given=("x1",)),
    routed_case("empty_drop_pad", DROP, tokens=0),
    routed_case("all_on_one_expert", {}, k=1, ids=[[2]] * 6),
    routed_case("all_on_one_expert_drop_pad", DROP, k=1, ids=[[2]] * 6),
    routed_case("experts_without_tokens", SCATTER, experts=8, ids=[[1, 5]] * 6),
    routed_case("k_equals_e", {}, k=4),
    routed_case("k1_scatter", SCATTER, k=1),
    _nan_tail,
    _base.mutated("nan_propagates", None, expanded_x=np.where(np.arange(12)[:, None] == 3, np.nan, _y)
            .astype(np.float32)),
    zero_hidden(_base, "zero_hidden"),
    zero_hidden(_scatter, "zero_hidden_scatter"),
    zero_hidden(_drop, "zero_hidden_drop_pad"),
    _base.mutated("expert_idx_without_bias", None, bias=None),
    _base.mutated("expert_idx_without_bias_values_unused", None, bias=None,
            expert_idx=np.where(np.arange(12).reshape(6, 2) == 3, 99, -7).astype(np.int32)),
    _base.mutated("only_expert_idx", None, x1=None, x2=None, bias=None, scales=None),
    # errors: values
    _base.mutated("gather_row_too_large", runtime=True, error=r"expanded_row_idx\[4\] = 12 is outside \[-1, 12\) \(a row of expanded_x",
            expanded_row_idx=np.where(np.arange(12) == 4, 12, _rows).astype(np.int32)),
    _base.mutated("gather_row_below_minus_one", runtime=True, error=r"expanded_row_idx\[0\] = -2 is outside \[-1, 12\)",
            expanded_row_idx=np.where(np.arange(12) == 0, -2, _rows).astype(np.int32)),
    _scatter.mutated("scatter_slot_too_large", runtime=True, error=r"expanded_row_idx\[7\] = 12 is outside \[-1, 12\) \(a slot, or -1\)",
            expanded_row_idx=np.where(np.arange(12) == 7, 12, _scatter.inputs[1]).astype(np.int32)),
    _scatter.mutated("scatter_past_rows", runtime=True, error=r"expanded_row_idx\[11\] = \d+ names a slot for row 11, past the 11 rows "
            r"of expanded_x; expected -1", expanded_x=_scatter.inputs[0][:11]),
    _base.mutated("bias_expert_too_large", runtime=True, error=r"expert_idx\[1, 0\] = 4 is outside \[0, 4\) \(the experts of bias\) for "
            r"a slot routed to row \d+", expert_idx=np.where(np.arange(12).reshape(6, 2) == 2, 4, _ids)
            .astype(np.int32)),
    _base.mutated("bias_expert_minus_one_routed", runtime=True, error=r"expert_idx\[0, 0\] = -1 is outside \[0, 4\)",
            expert_idx=np.where(np.arange(12).reshape(6, 2) == 0, -1, _ids).astype(np.int32)),
    zero_hidden(_base, "zero_hidden_row_too_large", runtime=True, error=r"expanded_row_idx\[4\] = 12 is outside "
            r"\[-1, 12\) \(a row of expanded_x", expanded_row_idx=np.where(np.arange(12) == 4, 12, _rows)
            .astype(np.int32)),
    zero_hidden(_scatter, "zero_hidden_scatter_slot_twice", runtime=True, error=r"expanded_row_idx names slot \d+ "
            r"at rows 0 and 1; expected each slot at most once",
            expanded_row_idx=np.where(np.arange(12) == 1, _scatter.inputs[1][0], _scatter.inputs[1]).astype(np.int32)),
    zero_hidden(_base, "zero_hidden_bias_expert_too_large", runtime=True, error=r"expert_idx\[1, 0\] = 4 is outside "
            r"\[0, 4\) \(the experts of bias\)", expert_idx=np.where(np.arange(12).reshape(6, 2) == 2, 4, _ids)
            .astype(np.int32)),
    # errors: attributes
    _drop.mutated("drop_pad_scatter", r"attribute 'row_idx_type' is 1 \(scatter\); expected 0 \(gather\) for "
            r"drop_pad_mode 1", row_idx_type=1),
    _base.mutated("drop_pad_mode_2", r"attribute 'drop_pad_mode' is 2; expected one of 0, 1", drop_pad_mode=2),
    _base.mutated("row_idx_type_2", r"attribute 'row_idx_type' is 2; expected one of 0, 1", row_idx_type=2),
    _base.mutated("attr_drop_pad_float", r"attribute 'drop_pad_mode' has type FLOAT; expected INT", drop_pad_mode=0.0),
    _base.mutated("attr_misspelled", r"attribute 'row_index_type' is not an attribute of MoeFinalizeRouting; "
            r"expected one of 'drop_pad_mode', 'row_idx_type'$", session=True, row_index_type=1),
    # errors: types and shapes
    _base.mutated("drop_pad_rank2", r"input 'expanded_x' has rank 2 .*expected rank 3", drop_pad_mode=1),
    _drop.mutated("dropless_rank3", r"input 'expanded_x' has rank 3 .*expected rank 2", drop_pad_mode=0),
    _base.mutated("expanded_x_int8", r"input 'expanded_x' has type int8; expected float32, float16, bfloat16",
            expanded_x=_y.astype(np.int8)),
    _base.mutated("x1_fp16", r"input 'x1' has type float16; expected float32, the type of input 'expanded_x'",
            x1=_x1.astype(np.float16)),
    _base.mutated("scales_fp16", r"input 'scales' has type float16; expected float32", scales=_scales
            .astype(np.float16)),
    _base.mutated("row_idx_float", r"input 'expanded_row_idx' has type float32; expected int32, int64",
            expanded_row_idx=_rows.astype(np.float32)),
    _base.mutated("expert_idx_float", r"input 'expert_idx' has type float32; expected int32, int64",
            expert_idx=_ids.astype(np.float32)),
    _base.mutated("bias_without_expert_idx", r"input 'expert_idx' is required when 'bias' is given", expert_idx=None),
    _base.mutated("expert_idx_without_bias_wrong_k", r"input 'expert_idx' dim 1 is 1; expected k = 2 \(from "
            r"input 'scales' dim 1\)", bias=None, expert_idx=_ids[:, :1]),
    _base.mutated("expert_idx_without_bias_float", r"input 'expert_idx' has type float32; expected int32, int64",
            bias=None, expert_idx=_ids.astype(np.float32)),
    _base.mutated("expanded_x_uint16", r"input 'expanded_x' has type uint16; expected float32, float16, bfloat16",
            expanded_x=_y.astype(np.uint16)),
    _base.mutated("row_idx_int16", r"input 'expanded_row_idx' has type int16; expected int32, int64",
            expanded_row_idx=_rows.astype(np.int16)),
    _base.mutated("expert_idx_uint64", r"input 'expert_idx' has type uint64; expected int32, int64",
            expert_idx=_ids.astype(np.uint64)),
    _base.mutated("no_token_count", r"inputs 'x1', 'x2', 'scales' and 'expert_idx' are all absent; expected at least "
            r"one", x1=None, x2=None, bias=None, scales=None, expert_idx=None),
    _base.mutated("row_idx_wrong_length", r"input 'expanded_row_idx' has 10 entries; expected N \* k = 6 \* 2 = 12",
            expanded_row_idx=_rows[:10]),
    _base.mutated("row_idx_not_multiple", r"input 'expanded_row_idx' has 10 entries; expected a multiple of N = 6",
            expanded_row_idx=_rows[:10], x2=None, bias=None, scales=None, expert_idx=None),
    _base.mutated("row_idx_rank2", r"input 'expanded_row_idx' has rank 2 .*expected rank 1",
            expanded_row_idx=_rows.reshape(6, 2)),
    _base.mutated("x1_wrong_hidden", r"input 'x1' dim 1 is 7; expected H = 8", x1=_x1[:, :7]),
    _base.mutated("x2_wrong_tokens", r"input 'x2' dim 0 is 5; expected N = 6", x2=_x2[:5]),
    _base.mutated("bias_wrong_hidden", r"input 'bias' dim 1 is 4; expected H = 8", bias=_bias[:, :4]),
    _base.mutated("scales_wrong_k", r"input 'expert_idx' dim 1 is 1; expected k = 2", expert_idx=_ids[:, :1]),
    _drop.mutated("drop_pad_bias_wrong_experts", r"input 'bias' dim 0 is 3; expected E = 4", bias=_drop.inputs[4][:3]),
]
