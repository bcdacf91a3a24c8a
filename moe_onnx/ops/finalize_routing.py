"""MoeFinalizeRouting: un-permute the expert outputs and sum each token's k slots (the inverse of MoeInitRouting).

Meaning (docs/ops/MoeFinalizeRouting.md):
``out[t] = x1[t] + x2[t] + sum_j scales[t, j] * (expanded_x[row(t, j)] + bias[expert_idx[t, j]])``, where
``row(t, j)`` comes from MoeInitRouting's ``expanded_row_idx`` and a slot without a row adds nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import TensorProto

from . import signatures
from ._body import Config, float32, int64, ints, positions, reshape, to_rows
from ._common import (
    ArrayView,
    DimBinder,
    MoeOpError,
    NodeView,
    OpDef,
    TensorInfo,
    as_rows,
    check_choice,
    compute_dtype,
    is_known,
)

# input positions
EXPANDED_X, EXPANDED_ROW_IDX, X1, X2, BIAS, SCALES, EXPERT_IDX = range(7)
GATHER, SCATTER = 0, 1


def _validate(v: NodeView) -> list[TensorInfo | None]:
    drop_pad = check_choice(v, "drop_pad_mode", (0, 1)) == 1
    scatter = check_choice(v, "row_idx_type", (GATHER, SCATTER)) == SCATTER
    if drop_pad and scatter:
        v.fail("attribute 'row_idx_type'", "is 1 (scatter); expected 0 (gather) for drop_pad_mode 1, "
               "the only form MoeInitRouting gives in drop/pad mode")

    elem = v.expect_elem(EXPANDED_X)
    for i in (X1, X2, BIAS, SCALES):
        if v.has(i):
            v.expect_elem(i)
            v.expect_same_elem(i, EXPANDED_X)
    v.expect_elem(EXPANDED_ROW_IDX)
    if v.has(BIAS) and not v.has(EXPERT_IDX):
        v.fail(v.input_name(EXPERT_IDX),
               "is required when 'bias' is given (it says which expert's bias each slot adds)")
    if v.has(EXPERT_IDX):  # without bias it is unused (Ascend graphs always wire it), but checked all the same
        v.expect_elem(EXPERT_IDX)
    if not any(v.has(i) for i in (X1, X2, SCALES, EXPERT_IDX)):
        v.fail("inputs 'x1', 'x2', 'scales' and 'expert_idx'",
               "are all absent; expected at least one of them, to give the number of tokens N")

    dims = DimBinder(v)
    y_symbols = ("E", "C", "H") if drop_pad else ("R", "H")
    dims.shape(EXPANDED_X, y_symbols, v.expect_rank(EXPANDED_X, rank=len(y_symbols)))
    dims.shape(EXPANDED_ROW_IDX, ("L",), v.expect_rank(EXPANDED_ROW_IDX, rank=1))
    for i, symbols in ((X1, ("N", "H")), (X2, ("N", "H")), (BIAS, ("E", "H")), (SCALES, ("N", "k")),
                       (EXPERT_IDX, ("N", "k"))):
        if v.has(i):
            dims.shape(i, symbols, v.expect_rank(i, rank=2))

    tokens, k, entries = dims.get("N"), dims.get("k"), dims.get("L")
    if is_known(tokens, k, entries) and entries != tokens * k:
        v.fail(v.input_name(EXPANDED_ROW_IDX), f"has {entries} entries; expected N * k = {tokens} * {k} = {tokens * k}")
    if is_known(tokens, entries) and (entries % tokens if tokens else entries):
        v.fail(v.input_name(EXPANDED_ROW_IDX),
               f"has {entries} entries; expected a multiple of N = {tokens} (one per token and expert slot)")
    return [TensorInfo(elem, (tokens, dims.get("H")))]


def _routed_pairs(row_idx: np.ndarray, n_rows: int, scatter: bool, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(slot, row) of every routed slot, after checking the index values."""
    if scatter:
        bad = (row_idx < -1) | (row_idx >= row_idx.size)
        expected = f"[-1, {row_idx.size}) (a slot, or -1)"
    else:
        bad = (row_idx < -1) | (row_idx >= n_rows)
        expected = f"[-1, {n_rows}) (a row of expanded_x, or -1)"
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise MoeOpError(f"{where}: expanded_row_idx[{i}] = {int(row_idx[i])} is outside {expected}")
    listed = np.flatnonzero(row_idx >= 0)
    if not scatter:
        return listed, row_idx[listed]
    past = listed[listed >= n_rows]
    if past.size:
        i = int(past[0])
        raise MoeOpError(f"{where}: expanded_row_idx[{i}] = {int(row_idx[i])} names a slot for row {i}, past the "
                         f"{n_rows} rows of expanded_x; expected -1")
    slots = row_idx[listed]
    repeated = np.flatnonzero(np.bincount(slots, minlength=row_idx.size) > 1)
    if repeated.size:
        first, second = listed[slots == repeated[0]][:2]
        raise MoeOpError(f"{where}: expanded_row_idx names slot {int(repeated[0])} at rows {first} and {second}; "
                         "expected each slot at most once")
    return slots, listed


def moe_finalize_routing(expanded_x, expanded_row_idx, x1=None, x2=None, bias=None, scales=None, expert_idx=None, *,
                         drop_pad_mode=None, row_idx_type=None, _node_name="", _named_outputs=None):
    """numpy reference of MoeFinalizeRouting; returns ``(out,)``, [N, H] in the type of ``expanded_x``.

    Raises MoeOpError for any input or attribute outside the contract.
    """
    attrs = dict(drop_pad_mode=drop_pad_mode, row_idx_type=row_idx_type)
    arrays = [expanded_x, expanded_row_idx, x1, x2, bias, scales, expert_idx]
    view = ArrayView(MOE_FINALIZE_ROUTING, arrays, attrs, node_name=_node_name, named_outputs=_named_outputs)
    (out_info,) = MOE_FINALIZE_ROUTING.validate(view)
    tokens, hidden = out_info.shape
    k = expanded_row_idx.size // tokens if tokens else 1
    rows = as_rows(expanded_x)
    scatter = view.attr("row_idx_type") == SCATTER
    slots, row_of_slot = _routed_pairs(expanded_row_idx.astype(np.int64), rows.shape[0], scatter, view.where())

    acc = compute_dtype(expanded_x.dtype)
    routed = rows[row_of_slot].astype(acc)
    if bias is not None:
        experts = expert_idx.reshape(-1)[slots].astype(np.int64)
        bad = (experts < 0) | (experts >= bias.shape[0])
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            f = int(slots[first])
            raise MoeOpError(f"{view.where()}: expert_idx[{f // k}, {f % k}] = {int(experts[first])} is outside "
                             f"[0, {bias.shape[0]}) (the experts of bias) for a slot routed to row "
                             f"{int(row_of_slot[first])}")
        routed += bias[experts].astype(acc)
    if scales is not None:
        routed *= scales.reshape(-1)[slots].astype(acc)[:, None]

    out = np.zeros((tokens, hidden), dtype=acc)
    for residual in (x1, x2):
        if residual is not None:
            out += residual.astype(acc)
    per_slot = np.zeros((tokens * k, hidden), dtype=acc)  # each slot at most once: a dense sum over k
    per_slot[slots] = routed
    out += per_slot.reshape(tokens, k, hidden).sum(axis=1)
    return (out.astype(expanded_x.dtype),)


# ----------------------------------------------------------------------------- as standard ONNX ops

def _function_body(op, c: Config, inputs: dict[str, Any]) -> dict[str, Any]:
    expanded = to_rows(op, float32(op, inputs["expanded_x"]))
    hidden = op.Shape(expanded, start=1)
    row_idx = op.Cast(inputs["expanded_row_idx"], to=TensorProto.INT64)
    slots = op.Shape(row_idx)
    listed = op.GreaterOrEqual(row_idx, int64(op, 0))
    listed_at, listed_value = op.Compress(positions(op, slots), listed), op.Compress(row_idx, listed)
    slot, row = (listed_value, listed_at) if c.attr("row_idx_type") == SCATTER else (listed_at, listed_value)
    routed = op.Gather(expanded, row, axis=0)
    if c.has("bias"):
        expert = op.Gather(op.Reshape(op.Cast(inputs["expert_idx"], to=TensorProto.INT64), ints(op, -1)), slot)
        routed = op.Add(routed, op.Gather(float32(op, inputs["bias"]), expert, axis=0))
    if c.has("scales"):
        slot_scale = op.Gather(op.Reshape(float32(op, inputs["scales"]), ints(op, -1)), slot)
        routed = op.Mul(routed, op.Unsqueeze(slot_scale, ints(op, 1)))
    zeros = op.ConstantOfShape(op.Concat(slots, hidden, axis=0))
    per_slot = op.ScatterND(zeros, op.Unsqueeze(slot, ints(op, 1)), routed)
    token_source = next(name for name in ("x1", "x2", "scales", "expert_idx") if c.has(name))
    tokens = op.Shape(inputs[token_source], end=1)
    k = op.Div(slots, op.Max(tokens, ints(op, 1)))
    out = op.ReduceSum(reshape(op, per_slot, tokens, k, hidden), ints(op, 1), keepdims=0)
    for residual in ("x1", "x2"):
        if c.has(residual):
            out = op.Add(out, float32(op, inputs[residual]))
    return {"out": op.CastLike(out, inputs["expanded_x"])}


MOE_FINALIZE_ROUTING = OpDef.of(signatures.MOE_FINALIZE_ROUTING, validate=_validate, reference=moe_finalize_routing,
                                body=_function_body)
