"""MoeInitRouting: sort the (token, k) slots by expert and gather (and optionally quantize) their rows.

Meaning (docs/ops/MoeInitRouting.md): slot ``f = t * k + j`` goes to expert ``expert_idx[t, j]``; the
slots of the active experts ``[start, end)`` are ordered by expert (ties keep slot order) and
``expanded_x`` holds ``x[f // k]`` for each, dropless (one row per slot) or padded to ``[E, C, H]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from onnx import TensorProto

from . import signatures
from ._body import Config, abs_max, float32, int64, ints, positions, reshape, scalar
from ._common import (
    ArrayView,
    DimBinder,
    MoeOpError,
    NodeView,
    OpDef,
    TensorInfo,
    as_rows,
    check_choice,
    dim_product,
    is_known,
    np_dtype,
)

# input positions
X, EXPERT_IDX, SCALE, OFFSET = range(4)
# output positions
EXPANDED_X, EXPANDED_ROW_IDX, TOKEN_COUNTS, EXPANDED_SCALE = range(4)

NO_QUANT, STATIC_QUANT, DYNAMIC_QUANT = -1, 0, 1
CUMSUM, COUNT, KEY_VALUE = 0, 1, 2
GATHER, SCATTER = 0, 1

_F32 = np.float32
_INT64_MAX = 2**63 - 1  # the most elements a tensor dimension product may have


@dataclasses.dataclass(frozen=True)
class Routing:
    """The checked attributes of one node."""

    expert_num: int
    active_num: int  # <= 0: no limit
    capacity: int
    drop_pad: bool
    count_type: int
    count_flag: bool
    quant_mode: int
    start: int
    end: int
    scatter: bool

    @property
    def active_experts(self) -> int:
        return self.end - self.start


def read_attributes(v: NodeView) -> Routing:
    """The node's attributes, each and every combination checked."""
    expert_num = int(v.attr("expert_num"))
    if expert_num < 1:
        v.fail("attribute 'expert_num'", f"is {expert_num}; expected >= 1")
    drop_pad = check_choice(v, "drop_pad_mode", (0, 1)) == 1
    count_type = check_choice(v, "expert_tokens_num_type", (CUMSUM, COUNT, KEY_VALUE))
    count_flag = check_choice(v, "expert_tokens_num_flag", (0, 1)) == 1
    quant_mode = check_choice(v, "quant_mode", (NO_QUANT, STATIC_QUANT, DYNAMIC_QUANT))
    scatter = check_choice(v, "row_idx_type", (GATHER, SCATTER)) == SCATTER
    active_num = int(v.attr("active_num"))
    if active_num < -1:
        v.fail("attribute 'active_num'", f"is {active_num}; expected -1 or 0 (no limit) or a positive row limit")
    capacity = int(v.attr("expert_capacity"))
    expert_range = v.attr("active_expert_range")
    if expert_range is None:
        expert_range = [0, expert_num]
    if len(expert_range) != 2 or not 0 <= expert_range[0] < expert_range[1] <= expert_num:
        v.fail("attribute 'active_expert_range'",
               f"is {list(expert_range)}; expected 0 <= start < end <= expert_num ({expert_num})")
    start, end = (int(e) for e in expert_range)

    if drop_pad:
        why = "for drop_pad_mode 1 (drop/pad)"
        if capacity < 1:
            v.fail("attribute 'expert_capacity'", f"is {capacity}; expected >= 1 {why}")
        if scatter:
            v.fail("attribute 'row_idx_type'", f"is 1 (scatter); expected 0 (gather) {why}")
        if (start, end) != (0, expert_num):
            v.fail("attribute 'active_expert_range'", f"is [{start}, {end}]; expected [0, {expert_num}] "
                   f"(all experts: expanded_x is [expert_num, expert_capacity, H]) {why}")
        if count_type == KEY_VALUE:
            v.fail("attribute 'expert_tokens_num_type'", f"is 2 (key_value); expected 0 (cumsum) or 1 (count) {why}")
        if active_num > 0:
            v.fail("attribute 'active_num'", f"is {active_num}; expected -1 or 0 {why}: the capacity bounds the rows")
        if expert_num * capacity > _INT64_MAX:
            v.fail("attribute 'expert_capacity'", f"is {capacity}; expected expert_num * expert_capacity (the rows "
                   f"of expanded_x) <= {_INT64_MAX} (expert_num {expert_num}) {why}")
    elif capacity != 0:
        v.fail("attribute 'expert_capacity'",
               f"is {capacity}; expected 0 for drop_pad_mode 0 (dropless has no capacity)")
    return Routing(expert_num, active_num, capacity, drop_pad, count_type, count_flag, quant_mode, start, end, scatter)


def _validate_scale_offset(v: NodeView, mode: Routing, dims: DimBinder) -> None:
    quant = mode.quant_mode
    if v.has(OFFSET) and quant != STATIC_QUANT:
        v.fail(v.input_name(OFFSET), f"is given, but quant_mode {quant} does not use it; leave it empty")
    if quant == STATIC_QUANT:
        v.require(SCALE)
    for i in (SCALE, OFFSET):
        if not v.has(i):
            continue
        v.expect_elem(i)
        if quant == NO_QUANT:  # a per-token scale carried along (x quantized earlier)
            dims.shape(i, ("N",), v.expect_rank(i, rank=1))
            continue
        if quant == STATIC_QUANT:
            shape = v.expect_rank(i, rank=1)
            hidden = dims.get("H")
            allowed, meaning = (1, hidden), f"1 (per tensor) or H = {hidden} (per channel) for static quant"
        else:
            shape = v.expect_rank(i, rank=2)
            dims.shape(i, ("", "H"), shape)
            allowed = (1, mode.active_experts)
            meaning = f"1 (one smooth scale) or end - start = {mode.active_experts} (one per active expert)"
        first = None if shape is None else shape[0]
        if is_known(first) and first != 1 and is_known(allowed[1]) and first != allowed[1]:
            v.fail(v.input_name(i), f"dim 0 is {first}; expected {meaning}")


def _validate(v: NodeView) -> list[TensorInfo | None]:
    mode = read_attributes(v)
    x_elem = v.expect_elem(X)
    v.expect_elem(EXPERT_IDX)
    if mode.quant_mode != NO_QUANT and x_elem == TensorProto.INT8:
        v.fail(v.input_name(X), f"has type int8; expected float32, float16, bfloat16 for quant_mode "
               f"{mode.quant_mode} (int8 x is already quantized: use quant_mode -1)")
    if not mode.count_flag and v.has_output(TOKEN_COUNTS):
        v.fail("output 'expert_tokens_count_or_cumsum'",
               "is named, but attribute 'expert_tokens_num_flag' is 0; drop the output or set the flag to 1")

    dims = DimBinder(v)
    dims.shape(X, ("N", "H"), v.expect_rank(X, rank=2))
    dims.shape(EXPERT_IDX, ("N", "k"), v.expect_rank(EXPERT_IDX, rank=2))
    _validate_scale_offset(v, mode, dims)

    slots = dim_product((dims.get("N"), dims.get("k")))
    if mode.drop_pad:
        rows: tuple = (mode.expert_num, mode.capacity)
    elif mode.active_num > 0:
        rows = (min(mode.active_num, slots) if slots is not None else None,)
    else:
        rows = (slots,)
    out_elem = x_elem if mode.quant_mode == NO_QUANT else TensorProto.INT8
    count_shape = (mode.active_experts,) if mode.count_type != KEY_VALUE else (mode.active_experts, 2)
    return [
        TensorInfo(out_elem, (*rows, dims.get("H"))),
        TensorInfo(TensorProto.INT32, (slots,)),
        TensorInfo(TensorProto.INT64, count_shape) if mode.count_flag else None,
        TensorInfo(TensorProto.FLOAT, rows),
    ]


def _check_expert_ids(expert_idx: np.ndarray, expert_num: int, where: str) -> None:
    bad = (expert_idx < -1) | (expert_idx >= expert_num)
    if bad.any():
        pos = tuple(int(p) for p in np.argwhere(bad)[0])
        raise MoeOpError(f"{where}: expert_idx{list(pos)} = {int(expert_idx[pos])} is outside [-1, {expert_num}) "
                         f"(expert_num {expert_num}; -1 means no expert)")


def to_int8(values: np.ndarray) -> np.ndarray:
    """Round half to even and saturate to int8; NaN becomes 0."""
    return np.nan_to_num(np.clip(np.rint(values), -128, 127), nan=0.0).astype(np.int8)


def _expand_rows(x, tokens, relative_experts, mode: Routing, scale, offset):
    """The rows of the given tokens (quantized as the mode says) and their scales (None: no scale)."""
    if mode.quant_mode == NO_QUANT:
        return x[tokens], None if scale is None else scale[tokens]
    values = x[tokens].astype(_F32)
    if mode.quant_mode == STATIC_QUANT:
        shifted = values * scale if offset is None else values * scale + offset
        return to_int8(shifted), None
    if scale is not None:
        values = values * (scale[relative_experts] if scale.shape[0] > 1 else scale)
    row_scale = np.abs(values).max(axis=1, initial=0.0) / _F32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        return to_int8(values / row_scale[:, None]), row_scale


def _check_output_sizes(view: ArrayView, infos: list[TensorInfo | None]) -> None:
    """Outputs whose size (set by the attributes) is past any allocation: the kernel's words."""
    for i, info in enumerate(infos):
        if info is None or not view.has_output(i):
            continue
        size = int(np.prod([int(d) for d in info.shape], dtype=object)) * np_dtype(info.elem_type).itemsize
        if size > np.iinfo(np.int64).max:
            raise MoeOpError(f"{view.where()}: cannot allocate {size} bytes for output "
                             f"'{MOE_INIT_ROUTING.outputs[i].name}'")


def moe_init_routing(x, expert_idx, scale=None, offset=None, *, expert_num=None, active_num=None,
                     expert_capacity=None, drop_pad_mode=None, expert_tokens_num_type=None,
                     expert_tokens_num_flag=None, quant_mode=None, active_expert_range=None, row_idx_type=None,
                     _node_name="", _named_outputs=None):
    """numpy reference of MoeInitRouting.

    Returns ``(expanded_x, expanded_row_idx, expert_tokens_count_or_cumsum, expanded_scale)``; the third
    is None when ``expert_tokens_num_flag`` is 0. ``_named_outputs`` says which outputs the node names
    (None: the count output exactly when the flag is 1, every other output). Raises MoeOpError for any
    input or attribute outside the contract.
    """
    attrs = dict(expert_num=expert_num, active_num=active_num, expert_capacity=expert_capacity,
                 drop_pad_mode=drop_pad_mode, expert_tokens_num_type=expert_tokens_num_type,
                 expert_tokens_num_flag=expert_tokens_num_flag, quant_mode=quant_mode,
                 active_expert_range=active_expert_range, row_idx_type=row_idx_type)
    if _named_outputs is None:
        _named_outputs = [i != TOKEN_COUNTS or expert_tokens_num_flag != 0 for i in range(EXPANDED_SCALE + 1)]
    view = ArrayView(MOE_INIT_ROUTING, [x, expert_idx, scale, offset], attrs, node_name=_node_name,
                     named_outputs=_named_outputs)
    infos = MOE_INIT_ROUTING.validate(view)
    mode = read_attributes(view)
    _check_expert_ids(expert_idx, mode.expert_num, view.where())
    _check_output_sizes(view, infos)

    k = expert_idx.shape[1]
    flat = expert_idx.reshape(-1).astype(np.int64)
    active = (flat >= mode.start) & (flat < mode.end)
    order = np.argsort(np.where(active, flat, mode.end), kind="stable")[: np.count_nonzero(active)]
    sorted_experts = flat[order] - mode.start  # relative to start
    counts = np.bincount(sorted_experts, minlength=mode.active_experts)
    if mode.drop_pad:  # rank inside the expert's run; kept below the capacity; counts stay before the drop
        first = np.cumsum(counts) - counts
        rank = np.arange(order.size) - first[sorted_experts]
        kept = rank < mode.capacity
        slots, rows = order[kept], sorted_experts[kept] * mode.capacity + rank[kept]
    else:  # the first rows of the sorted order, up to expanded_x's row count; counts describe those rows
        slots = order[: infos[EXPANDED_X].shape[0]]
        rows = np.arange(slots.size)
        counts = np.bincount(sorted_experts[: slots.size], minlength=mode.active_experts)

    row_idx = np.full(flat.size, -1, dtype=np.int32)
    if mode.scatter:
        row_idx[rows] = slots
    else:
        row_idx[slots] = rows

    values, row_scale = _expand_rows(x, slots // k, flat[slots] - mode.start, mode, scale, offset)
    expanded_x = np.zeros(infos[EXPANDED_X].shape, dtype=values.dtype)
    as_rows(expanded_x)[rows] = values
    expanded_scale = np.zeros(infos[EXPANDED_SCALE].shape, dtype=_F32)
    if row_scale is not None:
        expanded_scale.reshape(-1)[rows] = row_scale
    return expanded_x, row_idx, _token_counts(counts, mode), expanded_scale


def _token_counts(counts: np.ndarray, mode: Routing) -> np.ndarray | None:
    if not mode.count_flag:
        return None
    if mode.count_type == CUMSUM:
        return np.cumsum(counts).astype(np.int64)
    if mode.count_type == COUNT:
        return counts.astype(np.int64)
    used = np.flatnonzero(counts)
    pairs = np.tile(np.array([-1, 0], dtype=np.int64), (mode.active_experts, 1))
    pairs[: used.size, 0] = used + mode.start
    pairs[: used.size, 1] = counts[used]
    return pairs


# ----------------------------------------------------------------------------- as standard ONNX ops

def _function_body(op, c: Config, inputs: dict[str, Any]) -> dict[str, Any]:
    expert_num = int(c.attr("expert_num"))
    start, end = c.attr("active_expert_range") or (0, expert_num)
    active_experts = end - start
    ids = op.Cast(inputs["expert_idx"], to=TensorProto.INT64)
    k = op.Shape(ids, start=1)
    flat = op.Reshape(ids, ints(op, -1))
    slots = op.Shape(flat)
    active = op.And(op.GreaterOrEqual(flat, int64(op, start)), op.Less(flat, int64(op, end)))
    # stable sort by expert, inactive slots (key `end`) last: TopK keeps the lower index first on ties
    sorted_key, order = op.TopK(op.Where(active, flat, int64(op, end)), slots, axis=0, largest=0, _outputs=2)
    n_valid = op.ReduceSum(op.Cast(active, to=TensorProto.INT64), keepdims=1)
    position = positions(op, slots)
    relative = op.Sub(sorted_key, int64(op, start))  # active_experts for the inactive slots
    experts = op.Range(int64(op, start), int64(op, end), int64(op, 1))
    routed_to = op.Equal(op.Unsqueeze(sorted_key, ints(op, 0)), op.Unsqueeze(experts, ints(op, 1)))  # [A, slots]

    def count(where):
        hits = routed_to if where is None else op.And(routed_to, op.Unsqueeze(where, ints(op, 0)))
        return op.ReduceSum(op.Cast(hits, to=TensorProto.INT64), ints(op, 1), keepdims=0)

    x = inputs["x"]
    hidden = op.Shape(x, start=1)
    if c.attr("drop_pad_mode"):  # rank inside the expert's run, kept below the capacity
        capacity = int(c.attr("expert_capacity"))
        counts = count(None)  # before the drop
        first = op.CumSum(counts, int64(op, 0), exclusive=1)
        rank = op.Sub(position, op.Gather(first, op.Min(relative, int64(op, active_experts - 1))))
        kept = op.And(op.Less(position, n_valid), op.Less(rank, int64(op, capacity)))
        dest = op.Add(op.Mul(relative, int64(op, capacity)), rank)
        out_rows = ints(op, expert_num * capacity)
        rows_shape = ints(op, expert_num, capacity)
    else:  # the first rows of the sorted order, up to expanded_x's row count
        active_num = int(c.attr("active_num"))
        out_rows = slots if active_num <= 0 else op.Min(slots, ints(op, active_num))
        kept = op.Less(position, op.Min(n_valid, out_rows))
        dest = position
        counts = count(kept)
        rows_shape = out_rows

    if c.attr("row_idx_type") == SCATTER:  # dropless only: row -> slot
        row_idx = op.Where(kept, order, int64(op, -1))
    else:  # GATHER: slot -> row
        row_idx = op.ScatterElements(op.CastLike(op.ConstantOfShape(slots), order), order,
                                     op.Where(kept, dest, int64(op, -1)), axis=0)

    tokens = op.Compress(op.Div(order, k), kept)
    targets = op.Unsqueeze(op.Compress(dest, kept), ints(op, 1))
    values, row_scale = _expanded_values(op, c, inputs, op.Gather(x, tokens, axis=0), tokens,
                                         op.Compress(relative, kept))
    zeros = op.CastLike(op.ConstantOfShape(op.Concat(out_rows, hidden, axis=0)), values)
    expanded_x = op.ScatterND(zeros, targets, values)
    expanded_scale = op.ConstantOfShape(out_rows)
    if row_scale is not None:
        expanded_scale = op.ScatterND(expanded_scale, targets, row_scale)
    return {"expanded_x": reshape(op, expanded_x, rows_shape, hidden),
            "expanded_row_idx": op.Cast(row_idx, to=TensorProto.INT32),
            "expert_tokens_count_or_cumsum": _count_output(op, c, counts, experts),
            "expanded_scale": op.Reshape(expanded_scale, rows_shape, allowzero=1)}


def _expanded_values(op, c: Config, inputs: dict[str, Any], gathered, tokens, relative):
    """The gathered rows as the quant mode makes them, and their scales (None: none) (:func:`_expand_rows`)."""
    quant_mode = int(c.attr("quant_mode"))
    scale = inputs.get("scale")
    if quant_mode == NO_QUANT:
        return gathered, None if scale is None else op.Gather(scale, tokens, axis=0)
    values = float32(op, gathered)
    if quant_mode == STATIC_QUANT:
        shifted = op.Mul(values, scale)
        return _int8_of(op, op.Add(shifted, inputs["offset"]) if c.has("offset") else shifted), None
    if scale is not None:  # one smooth row per active expert, or one for all: index min(relative, rows - 1)
        last = op.Sub(op.Shape(scale, end=1), ints(op, 1))
        values = op.Mul(values, op.Gather(scale, op.Min(relative, last), axis=0))
    largest = op.Squeeze(abs_max(op, values, 1), ints(op, 1))
    is_nan = op.Cast(op.IsNaN(values), to=TensorProto.FLOAT)
    has_nan = op.Greater(op.ReduceMax(is_nan, ints(op, 1), keepdims=0), scalar(op, 0.0))
    row_scale = op.Div(op.Where(has_nan, scalar(op, float("nan")), largest), scalar(op, 127.0))
    return _int8_of(op, op.Div(values, op.Unsqueeze(row_scale, ints(op, 1)))), row_scale


def _int8_of(op, values):
    """Round half to even, saturate to int8, NaN to 0 (:func:`to_int8`)."""
    rounded = op.Round(values)
    clipped = op.Clip(rounded, scalar(op, -128.0), scalar(op, 127.0))
    return op.Cast(op.Where(op.IsNaN(rounded), scalar(op, 0.0), clipped), to=TensorProto.INT8)


def _count_output(op, c: Config, counts, experts):
    """The count output from the per-expert ``counts`` of the active ``experts`` (:func:`_token_counts`)."""
    count_type = int(c.attr("expert_tokens_num_type"))
    if count_type == CUMSUM:
        return op.CumSum(counts, int64(op, 0))
    if count_type == COUNT:
        return counts
    used = op.Greater(counts, int64(op, 0))
    used_experts = op.Compress(experts, used)
    padding = op.Concat(ints(op, 0), op.Sub(op.Shape(experts), op.Shape(used_experts)), axis=0)
    keys = op.Pad(used_experts, padding, int64(op, -1))
    values = op.Pad(op.Compress(counts, used), padding, int64(op, 0))
    return op.Concat(op.Unsqueeze(keys, ints(op, 1)), op.Unsqueeze(values, ints(op, 1)), axis=1)


MOE_INIT_ROUTING = OpDef.of(signatures.MOE_INIT_ROUTING, validate=_validate, reference=moe_init_routing,
                            body=_function_body)
