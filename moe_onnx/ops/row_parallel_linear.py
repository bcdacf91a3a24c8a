"""MoeRowParallelLinear: one linear layer per expert over contiguous row ranges, split along K.

Meaning (docs/ops/MoeRowParallelLinear.md): expert i owns the rows
``[expert_offset[i], expert_offset[i+1])`` of X (flattened to [rows, K]);
``Y[rows of i] = X[rows of i] @ W[i]^T + B[i]`` and rows no expert owns are 0. Under tensor
parallelism each rank holds a K-slice of W (and of X), computes its partial product without bias,
the partials are all-reduce summed and B is added once: :func:`row_parallel_linear_tensor_parallel`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from onnx import TensorProto

from . import signatures
from ._body import INT64_MAX, Config, ints, positions, reshape, scalar, take_rows, to_rows
from ._common import (
    EXACT,
    FLOAT_ACCURACY_LEVELS,
    ArrayView,
    Dim,
    DimBinder,
    MoeOpError,
    NodeView,
    OpDef,
    TensorInfo,
    as_rows,
    check_choice,
    check_group_attrs,
    compute_dtype,
    dim_product,
    drop_group_attrs,
    elem_name,
    is_known,
    refuse_without_group,
)
from .layout import Layout

OP_NAME = signatures.ROW_PARALLEL_LINEAR.name

# input positions
X, OFFSET, W, B = range(4)

_SIZE_ATTRS = (("E", "num_experts"), ("K", "in_features"), ("N", "out_features"))


def output_elem(x_elem: int) -> int:
    """Element type of Y (and B): int8 accumulates into int32, floats keep their type."""
    return TensorProto.INT32 if x_elem == TensorProto.INT8 else x_elem


def accumulation_dtype(dtype: np.dtype) -> np.dtype:
    """int8 products are summed in int32; float16 and bfloat16 in float32."""
    return np.dtype(np.int32) if dtype == np.int8 else compute_dtype(dtype)


def _validate(v: NodeView) -> list[TensorInfo | None]:
    parallel = check_choice(v, "input_is_parallel", (0, 1)) == 1
    tp_size, _ = check_group_attrs(v, "tp_world_size", "tp_rank_id")
    accuracy_level = check_choice(v, "accuracy_level", FLOAT_ACCURACY_LEVELS)
    # K is the full input width (in_features); with tp_world_size > 1, W holds this rank's K_q, and so does X
    # when input_is_parallel is 1
    w_k = "K" if tp_size == 1 else "K_q"
    x_k = w_k if parallel else "K"
    bias_term = v.attr("bias_term")
    if bias_term is not None:
        check_choice(v, "bias_term", (0, 1))
        if bias_term and not v.has(B):
            v.fail("attribute 'bias_term'", "is 1, but input 'B' is absent; expected B [E, N], or bias_term = 0")
        if not bias_term and v.has(B):
            v.fail(v.input_name(B), "is given, but attribute 'bias_term' is 0; expected no B, or bias_term = 1")

    x_elem = v.expect_elem(X)
    if x_elem == TensorProto.INT8 and accuracy_level != EXACT:
        v.fail("attribute 'accuracy_level'", f"is {accuracy_level}; int8 X expects {EXACT} (the int8 product is "
               "exact int32)")
    v.expect_elem(W)
    v.expect_same_elem(W, X)
    v.expect_elem(OFFSET)
    y_elem = output_elem(x_elem)
    if v.has(B):
        b_elem = v.input(B).elem_type
        if TensorProto.UNDEFINED not in (b_elem, y_elem) and b_elem != y_elem:
            reason = "int8 X and W accumulate in int32" if x_elem == TensorProto.INT8 else "the type of input 'X'"
            v.fail(v.input_name(B), f"has type {elem_name(b_elem)}; expected {elem_name(y_elem)} ({reason})")

    dims = DimBinder(v)
    for symbol, name in _SIZE_ATTRS:
        value = v.attr(name)
        if value is not None:
            if value < 0:
                v.fail(f"attribute '{name}'", f"is {value}; expected a size >= 0")
            dims.bind(symbol, value, f"attribute '{name}'")
    x_shape = v.expect_rank(X, min_rank=1)
    if x_shape is not None:
        dims.bind(x_k, x_shape[-1], "input 'X' dim -1")
    dims.shape(W, ("E", "N", w_k), v.expect_rank(W, rank=3))
    if v.has(B):
        dims.shape(B, ("E", "N"), v.expect_rank(B, rank=2))
    offset_shape = v.expect_rank(OFFSET, rank=1)
    if offset_shape is not None:
        _bind_offset_length(v, dims, offset_shape[0])
        offsets = v.const(OFFSET)
        if offsets is not None:
            _check_offsets(v, offsets, None if x_shape is None else dim_product(x_shape[:-1]))

    out_shape = None if x_shape is None else (*x_shape[:-1], dims.get("N"))
    return [TensorInfo(y_elem, out_shape)]


def _bind_offset_length(v: NodeView, dims: DimBinder, length: Dim) -> None:
    """expert_offset has E + 1 entries."""
    if not is_known(length):
        return
    experts = dims.get("E")
    if not is_known(experts):
        dims.bind("E", length - 1, "input 'expert_offset' dim 0 (minus 1)")
    elif length != experts + 1:
        source = dims.values["E"][1]
        v.fail(v.input_name(OFFSET), f"dim 0 is {length}; expected E + 1 = {experts + 1} (E from {source})")


def _check_offsets(v: NodeView, offsets: np.ndarray, rows: int | None) -> None:
    """0 <= offset[0] <= offset[1] <= ... <= offset[E] <= rows."""
    if offsets.size == 0:
        return
    if offsets[0] < 0:
        v.fail("input 'expert_offset'[0]", f"= {offsets[0]} is negative; expected 0 <= expert_offset[0]")
    drops = np.flatnonzero(offsets[1:] < offsets[:-1])  # neighbours compared: a difference could wrap
    if drops.size:
        i = int(drops[0]) + 1
        v.fail(f"input 'expert_offset'[{i}]", f"= {offsets[i]} is less than expert_offset[{i - 1}] = "
               f"{offsets[i - 1]}; expected expert_offset[i] <= expert_offset[i+1]")
    last = len(offsets) - 1
    if rows is not None and offsets[last] > rows:
        v.fail(f"input 'expert_offset'[{last}]", f"= {offsets[last]} is greater than the {rows} rows of input 'X' "
               f"(the product of its leading dims); expected expert_offset[E] <= {rows}")


def partial_product(x_d: np.ndarray, expert_offset: np.ndarray, w_d: np.ndarray) -> np.ndarray:
    """One rank's bias-free partial result [rows, N] from its K-slices X_d [*, K_d] and W_d [E, N, K_d].

    One matmul per expert, in the accumulation type (float32, or int32 for int8). Inputs are trusted:
    validate the node first.
    """
    acc = accumulation_dtype(x_d.dtype)
    x_rows = as_rows(x_d)
    partial = np.zeros((x_rows.shape[0], w_d.shape[1]), dtype=acc)
    for expert, (start, stop) in enumerate(zip(expert_offset[:-1], expert_offset[1:])):
        if stop > start:
            partial[start:stop] = x_rows[start:stop].astype(acc, copy=False) @ w_d[expert].astype(acc, copy=False).T
    return partial


def finish_reduced(reduced: np.ndarray, expert_offset: np.ndarray, bias: np.ndarray | None,
                   x: np.ndarray) -> np.ndarray:
    """Y from the all-reduced partials (updated in place): B[i] added once to expert i's rows, then
    X's leading dims and Y's type (X's, int32 for int8)."""
    if bias is not None:
        for expert, (start, stop) in enumerate(zip(expert_offset[:-1], expert_offset[1:])):
            reduced[start:stop] += bias[expert].astype(reduced.dtype)
    out_dtype = np.dtype(np.int32) if x.dtype == np.int8 else x.dtype
    return reduced.astype(out_dtype).reshape(*x.shape[:-1], reduced.shape[-1])


def row_parallel_linear(X, expert_offset, W, B=None, *, num_experts=None, in_features=None, out_features=None,
                        bias_term=None, input_is_parallel=None, tp_world_size=None, tp_rank_id=None,
                        accuracy_level=None, _node_name="", _named_outputs=None):
    """numpy reference of MoeRowParallelLinear on one process; returns ``(Y,)``, Y [*, N].

    Y has X's type, int32 for int8 X; exact at every ``accuracy_level``. Raises MoeOpError for any input or
    attribute outside the contract, and for a node of a tensor-parallel group of more than one rank
    (:func:`row_parallel_linear_tensor_parallel` simulates every rank).
    """
    attrs = dict(num_experts=num_experts, in_features=in_features, out_features=out_features,
                 bias_term=bias_term, input_is_parallel=input_is_parallel, tp_world_size=tp_world_size,
                 tp_rank_id=tp_rank_id, accuracy_level=accuracy_level)
    view = validated([X, expert_offset, W, B], attrs, _node_name, _named_outputs)
    refuse_without_group(view, Layout(tp_size=int(view.attr("tp_world_size"))), tp_only=True)
    return (finish_reduced(partial_product(X, expert_offset, W), expert_offset, B, X),)


def validated(inputs: Sequence[np.ndarray | None], attrs: dict, node_name: str = "",
              named_outputs: Sequence[bool] | None = None) -> ArrayView:
    """One rank's node checked on its arrays; its view."""
    view = ArrayView(ROW_PARALLEL_LINEAR, inputs, attrs, node_name=node_name, named_outputs=named_outputs)
    ROW_PARALLEL_LINEAR.validate(view)
    return view


def rank_input(view: NodeView, X: np.ndarray, widths: Sequence[int]) -> np.ndarray:
    """TP rank q's X_q from its node's X and the K_q of every rank of the group (``widths``, in TP rank order):
    X itself with input_is_parallel 1, else ``X[..., k_q : k_q + K_q]`` with k_q the sum of the widths
    before q. MoeOpError when the widths do not add up to the full K (X's width, or in_features)."""
    parallel = view.attr("input_is_parallel") == 1
    full = view.attr("in_features") if parallel else X.shape[-1]
    if full is not None and sum(widths) != full:
        source = "attribute 'in_features'" if parallel else "input 'X' dim -1"
        view.fail("input 'W' dim 2", f"adds up to {sum(widths)} over the {len(widths)} TP ranks ({list(widths)}); "
                  f"expected K = {full} (from {source})")
    if parallel:
        return X
    q = int(view.attr("tp_rank_id"))
    start = sum(widths[:q])
    return X[..., start:start + widths[q]]


def row_parallel_linear_tensor_parallel(X, expert_offset, W_shards, B=None, **attrs):
    """The tensor-parallel meaning: rank d holds ``W_shards[d] = W[:, :, k_d:k_d + K_d]``.

    ``X`` is the full [*, K] when ``input_is_parallel`` is 0 (rank d takes ``X[..., k_d:k_d + K_d]``),
    else the list of every rank's X_d [*, K_d]. Each rank's node (``tp_world_size`` the number of shards,
    ``tp_rank_id`` d) is checked, its partial computed without bias, the partials summed (the all-reduce)
    and B added once. Returns ``(Y,)`` like :func:`row_parallel_linear`; raises MoeOpError when the shards
    do not form a valid node.
    """
    parallel = attrs.get("input_is_parallel") == 1
    if parallel and isinstance(X, np.ndarray):
        raise MoeOpError(f"{OP_NAME}: X is one array; expected the list of every rank's X_d when input_is_parallel = 1")
    x_shards = list(X) if parallel else None
    _check_shards(W_shards, x_shards)
    ranks = len(W_shards)
    drop_group_attrs(OP_NAME, attrs, ranks, "W shards")
    widths = [w.shape[2] for w in W_shards]
    full_x = np.concatenate(x_shards, axis=-1) if parallel else X
    validated([full_x, expert_offset, np.concatenate(W_shards, axis=2), B], attrs)  # as one process would see it
    partials = []
    for d, w_d in enumerate(W_shards):
        given_x = x_shards[d] if parallel else X
        view = validated([given_x, expert_offset, w_d, B], {**attrs, "tp_world_size": ranks, "tp_rank_id": d},
                         f"tp rank {d}")
        partials.append(partial_product(rank_input(view, given_x, widths), expert_offset, w_d))
    return (finish_reduced(sum(partials[1:], partials[0]), expert_offset, B, full_x),)


def _check_shards(w_shards: Sequence[np.ndarray], x_shards: Sequence[np.ndarray] | None) -> None:
    """The shards must concatenate along K: the same E and N, and X_d as wide as W_d."""
    if not w_shards:
        raise MoeOpError(f"{OP_NAME}: W_shards is empty; expected one W_d [E, N, K_d] per rank")
    first = w_shards[0]
    for d, w_d in enumerate(w_shards):
        if w_d.ndim != 3 or w_d.shape[:2] != first.shape[:2]:
            raise MoeOpError(f"{OP_NAME}: W shard {d} has shape {list(w_d.shape)}; expected "
                             f"[{first.shape[0]}, {first.shape[1]}, K_d] (E and N of W shard 0)")
    if x_shards is None:
        return
    if len(x_shards) != len(w_shards):
        raise MoeOpError(f"{OP_NAME}: {len(x_shards)} X shards for {len(w_shards)} W shards; "
                         "expected one X_d per rank when input_is_parallel = 1")
    lead = x_shards[0].shape[:-1]
    for d, (x_d, w_d) in enumerate(zip(x_shards, w_shards)):
        if x_d.ndim < 1 or x_d.shape != (*lead, w_d.shape[2]):
            raise MoeOpError(f"{OP_NAME}: X shard {d} has shape {list(x_d.shape)}; expected "
                             f"{[*lead, w_d.shape[2]]} (leading dims of X shard 0, K_d of W shard {d})")


# ----------------------------------------------------------------------------- as standard ONNX ops

def _function_body(op, c: Config, inputs: dict[str, Any]) -> dict[str, Any]:
    """Exact at every accuracy_level (not part of the configuration: ``checked_only``)."""
    accumulate = TensorProto.INT32 if c.int8 else TensorProto.FLOAT
    x = to_rows(op, op.Cast(inputs["X"], to=accumulate))
    every_expert = op.MatMul(x, op.Transpose(op.Cast(inputs["W"], to=accumulate), perm=[0, 2, 1]))  # [E, rows, N]
    offsets = inputs["expert_offset"]
    position = positions(op, op.Shape(x, end=1))
    ends = op.Slice(offsets, ints(op, 1), ints(op, INT64_MAX))
    # row r belongs to the expert whose range holds it: the number of range ends <= r
    ended = op.LessOrEqual(op.Unsqueeze(ends, ints(op, 0)), op.Unsqueeze(position, ints(op, 1)))
    expert = op.ReduceSum(op.Cast(ended, to=TensorProto.INT64), ints(op, 1), keepdims=0)
    expert = op.Min(expert, op.Sub(op.Shape(ends), ints(op, 1)))
    covered = op.And(op.GreaterOrEqual(position, op.Slice(offsets, ints(op, 0), ints(op, 1))),
                     op.Less(position, op.Slice(offsets, ints(op, -1), ints(op, INT64_MAX))))
    per_row = take_rows(op, op.Transpose(every_expert, perm=[1, 0, 2]), op.Unsqueeze(expert, ints(op, 1)))
    y = op.Squeeze(per_row, ints(op, 1))
    if c.has("B"):
        y = op.Add(y, op.Gather(op.Cast(inputs["B"], to=accumulate), expert, axis=0))
    y = op.Where(op.Unsqueeze(covered, ints(op, 1)), y, op.CastLike(scalar(op, 0.0), y))
    y = reshape(op, y, op.Shape(inputs["X"], end=-1), op.Shape(inputs["W"], start=1, end=2))
    return {"Y": y if c.int8 else op.CastLike(y, inputs["X"])}


ROW_PARALLEL_LINEAR = OpDef.of(
    signatures.ROW_PARALLEL_LINEAR, validate=_validate, reference=row_parallel_linear, body=_function_body,
    checked_only=(*(name for _, name in _SIZE_ATTRS), "bias_term", "input_is_parallel", "accuracy_level"))
