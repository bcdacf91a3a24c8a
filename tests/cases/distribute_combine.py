"""MoeDistributeCombine case table on one rank (W = 1: the weighted sum, no MPI), built on real dispatches,
and an independent oracle."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from moe_onnx.ops.distribute_dispatch import moe_distribute_dispatch

from . import Case
from .distribute_dispatch import make_inputs

OP = "MoeDistributeCombine"
BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = {np.dtype(np.float32): (1e-5, 1e-5), np.dtype(np.float16): (2e-2, 2e-2), BF16: (5e-2, 5e-2)}


def oracle(expand_y, assist_info, scales, x1=None, x2=None, *, num_experts, gather_tokens=0, **_layout):
    """Token by token, slot by slot, in float64 (one rank: the send buffer is the arrival order)."""
    tokens, k = scales.shape
    world, tp, ep = 1, 1, 1
    start = 8 + world + tp + 2 * ep
    slot_to_send = assist_info[start:start + tokens * k]
    arrival_to_row = assist_info[start + tokens * k:]
    out = np.zeros((tokens, expand_y.shape[1]))
    for t in range(tokens):
        for j in range(k):
            position = int(slot_to_send[t * k + j])
            if position >= 0:
                out[t] += float(scales[t, j]) * expand_y[int(arrival_to_row[position])].astype(np.float64)
        for residual in (x1, x2):
            if residual is not None:
                out[t] += residual[t].astype(np.float64)
    return (out.astype(expand_y.dtype),)


def _case(name, tokens=6, hidden=4, experts=4, k=2, ids=None, dtype=np.float32, capacity=0, given=("x1", "x2"),
          seed=0, **attrs):
    """A case whose assist_info and expand_y shape come from a dispatch of the same tokens."""
    x, expert_ids = make_inputs(tokens, hidden, experts, k, ids, dtype, seed=seed)
    expand_x, _, assist = moe_distribute_dispatch(x, expert_ids, num_experts=experts, expert_capacity=capacity)
    rng = np.random.default_rng(seed + 1)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)

    residuals = {"x1": rand(tokens, hidden), "x2": rand(tokens, hidden)}
    inputs = [rand(*expand_x.shape), assist, rng.random((tokens, k)).astype(np.float32).astype(dtype),
              *(residuals[n] if n in given else None for n in ("x1", "x2"))]
    rtol, atol = TOL[np.dtype(dtype)]
    return Case(OP, name, inputs, {"num_experts": experts, **attrs}, rtol=rtol, atol=atol)


_base = _case("fp32")
_y, _assist, _scales, _x1, _x2 = _base.inputs


def _assist_with(position, value):
    changed = _assist.copy()
    changed[position] = value
    return changed


_SLOTS = 8 + 1 + 1 + 2  # where slot_to_send starts on one rank
CASES = [
    _base,
    _case("no_residuals", given=()),
    _case("x2_only", given=("x2",)),
    _case("empty", tokens=0),
    _case("one_token", tokens=1, ids=[[2, 0]]),
    _case("every_token_on_one_expert", tokens=5, k=1, ids=[[3]] * 5),
    _case("experts_without_tokens", experts=8, ids=[[1, 6]] * 3 + [[6, 1]] * 3),
    _case("k_equals_e", tokens=3, experts=3, k=3),
    _case("drop_pad_with_drops", tokens=7, ids=[[0, 1], [0, 2], [0, 1], [3, 0], [1, 0], [2, 3], [0, 3]], capacity=2),
    _case("gather_tokens", gather_tokens=1),
    _case("h_zero", hidden=0),
    _case("fp16", dtype=np.float16, seed=1),
    _case("bf16", dtype=BF16, seed=2, capacity=2),
    # errors: attributes
    _base.mutated("gather_tokens_2", r"attribute 'gather_tokens' is 2; expected one of 0, 1", gather_tokens=2),
    _base.mutated("num_experts_0", r"attribute 'num_experts' is 0; expected a multiple >= 1 of ep_world_size = 1",
                  num_experts=0),
    _base.mutated("tp_world_size_0", r"attribute 'tp_world_size' is 0; expected >= 1", tp_world_size=0),
    _base.mutated("attr_misspelled", r"attribute 'gather' is not an attribute of MoeDistributeCombine; expected one "
                  r"of 'num_experts', 'gather_tokens', 'ep_world_size', 'ep_rank_id', 'tp_world_size', "
                  r"'tp_rank_id'$", session=True, gather=1),
    # errors: shapes and types
    _base.mutated("y_rank_3", r"input 'expand_y' has rank 3 \(shape \[1, 12, 4\]\); expected rank 2",
                  expand_y=_y[None]),
    _base.mutated("assist_rank_2", r"input 'assist_info' has rank 2", assist_info=_assist[None]),
    _base.mutated("assist_int32", r"input 'assist_info' has type int32; expected int64",
                  assist_info=_assist.astype(np.int32)),
    _base.mutated("x1_wrong_h", r"input 'x1' dim 1 is 3; expected H = 4 \(from input 'expand_y' dim 1\)",
                  x1=_x1[:, :3]),
    _base.mutated("x2_wrong_tokens", r"input 'x2' dim 0 is 5; expected Bs = 6 \(from input 'scales' dim 0\)",
                  x2=_x2[:5]),
    _base.mutated("scales_fp16", r"input 'scales' has type float16; expected float32, the type of input 'expand_y'",
                  scales=_scales.astype(np.float16)),
    # errors: assist_info values (runtime: a constant-free input)
    _base.mutated("assist_short", r"input 'assist_info' has 5 entries; expected at least the 8 of its header",
                  runtime=True, assist_info=_assist[:5]),
    _base.mutated("assist_other_world", r"input 'assist_info'\[0\] \(ep_world_size\) is 2; expected 1, attribute "
                  r"'ep_world_size' \(the assist_info of the matching MoeDistributeDispatch\)", runtime=True,
                  assist_info=_assist_with(0, 2)),
    _base.mutated("assist_other_experts", r"input 'assist_info'\[2\] \(num_experts\) is 4; expected 8, attribute "
                  r"'num_experts'", runtime=True, num_experts=8),
    _base.mutated("assist_other_rows", r"input 'assist_info'\[5\] \(rows of expand_x\) is 12; expected 11, dim 0 "
                  r"of input 'expand_y'", runtime=True, expand_y=_y[:11]),
    _base.mutated("assist_truncated", r"input 'assist_info' has 35 entries with R = 12; expected 8 \+ W \+ tp \+ "
                  r"2 \* ep \+ Bs \* K \+ R = 36", runtime=True, assist_info=_assist[:-1]),
    _base.mutated("assist_slot_past_send", r"input 'assist_info' section slot_to_send is not a one-to-one map of "
                  r"slots onto the send buffer; expected each of the 12 send positions once", runtime=True,
                  assist_info=_assist_with(_SLOTS, 12)),
    _base.mutated("assist_row_past_y", r"input 'assist_info' section arrival_to_row is not a one-to-one map into "
                  r"expand_y; expected distinct rows in \[0, 12\)", runtime=True, assist_info=_assist_with(-1, 12)),
]
