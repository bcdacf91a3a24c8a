"""MoeGatingTopK: a router's scores, group-limited top-k selection, renormalize and scaling.

Meaning (docs/ops/MoeGatingTopK.md), per row of ``logits`` [*, E], in float32:
``s = softmax(logits) | sigmoid(logits)``, ``sel = s + bias``; with ``n_group > 1`` only the experts
of the ``topk_group`` best groups may be chosen; ``idx`` = the k best ``sel`` among them (NaN counts
as the largest value, ties: lower index first); ``w = s[idx]``, ``w / (sum(w) + eps)`` when
``renormalize``, times ``routed_scaling_factor``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import TensorProto

from . import signatures
from ._body import Config, constant, float32, ints, reshape, scalar, take_rows, to_rows
from ._common import (
    ArrayView,
    DimBinder,
    NodeView,
    OpDef,
    TensorInfo,
    as_rows,
    check_choice,
    check_float_attr,
    is_known,
)

# input positions
LOGITS, BIAS = range(2)
# output positions
WEIGHTS, INDICES, SCORES = range(3)
# the values of the string attributes, as the signature declares them
SOFTMAX, SIGMOID = signatures.MOE_GATING_TOPK.attr_spec("score_func").choices
SUM_TOP2, MAX = signatures.MOE_GATING_TOPK.attr_spec("group_select").choices


def _validate(v: NodeView) -> list[TensorInfo | None]:
    # attributes alone first (the C++ kernel checks them when it is created)
    k = v.attr("k")
    if k < 1:
        v.fail("attribute 'k'", f"is {k}; expected a value >= 1")
    check_choice(v, "score_func")
    n_group = v.attr("n_group")
    if n_group < 1:
        v.fail("attribute 'n_group'", f"is {n_group}; expected a value >= 1")
    topk_group = v.attr("topk_group")
    if not 0 <= topk_group <= n_group:
        v.fail("attribute 'topk_group'", f"is {topk_group}; expected 0 (all groups) or 1..n_group = {n_group}")
    group_select = check_choice(v, "group_select")
    check_choice(v, "renormalize", (0, 1))
    check_float_attr(v, "eps")
    check_float_attr(v, "routed_scaling_factor")

    elem = v.expect_elem(LOGITS)
    if v.has(BIAS):
        v.expect_elem(BIAS)
        v.expect_same_elem(BIAS, LOGITS)
    dims = DimBinder(v)
    shape = v.expect_rank(LOGITS, min_rank=1)
    if shape is not None:
        dims.bind("E", shape[-1], f"input 'logits' dim {len(shape) - 1}")
    if v.has(BIAS):
        dims.shape(BIAS, ("E",), v.expect_rank(BIAS, rank=1))

    experts = dims.get("E")
    if is_known(experts):
        if k > experts:
            v.fail("attribute 'k'", f"is {k}; expected at most E = {experts} (the last dim of input 'logits')")
        if experts % n_group:
            v.fail("attribute 'n_group'", f"is {n_group}; expected a divisor of E = {experts}")
        group_size = experts // n_group
        if n_group > 1 and group_select == SUM_TOP2 and group_size < 2:
            v.fail("attribute 'group_select'", f"is {SUM_TOP2!r}; expected {MAX!r} for groups of {group_size} expert "
                   f"(E / n_group = {experts} / {n_group}): {SUM_TOP2} needs at least 2 experts per group")
        allowed = (topk_group or n_group) * group_size
        if k > allowed:
            v.fail("attribute 'k'", f"is {k}; expected at most topk_group * E / n_group = {topk_group or n_group} "
                   f"* {experts} / {n_group} = {allowed}, the experts of the kept groups")

    lead = None if shape is None else tuple(shape[:-1])
    return [TensorInfo(elem, None if lead is None else (*lead, k)),
            TensorInfo(TensorProto.INT64, None if lead is None else (*lead, k)),
            TensorInfo(elem, shape)]


def _scores(rows: np.ndarray, score_func: str) -> np.ndarray:
    """softmax or sigmoid over the last axis, in float32."""
    if score_func == SIGMOID:
        return np.float32(1) / (np.float32(1) + np.exp(-rows))
    shifted = np.exp(rows - rows.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def best_first(values: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
    """Per row, the column order best first: allowed before not, NaN first, larger first, lower index first."""
    nan = np.isnan(values)
    columns = np.broadcast_to(np.arange(values.shape[1]), values.shape)
    keys = [columns, -np.where(nan, 0, values), ~nan]  # np.lexsort: the last key is the primary one
    if allowed is not None:
        keys.append(~allowed)
    return np.lexsort(keys, axis=1)


def _kept_groups(sel: np.ndarray, n_group: int, topk_group: int, group_select: str) -> np.ndarray:
    """[rows, E] bool: the experts of each row's ``topk_group`` best groups."""
    rows, experts = sel.shape
    grouped = np.sort(sel.reshape(rows, n_group, experts // n_group), axis=2)  # NaN last: it counts as the largest
    group_score = grouped[..., -1] + grouped[..., -2] if group_select == SUM_TOP2 else grouped[..., -1]
    kept = np.zeros((rows, n_group), dtype=bool)
    np.put_along_axis(kept, best_first(group_score)[:, :topk_group], True, axis=1)
    return np.repeat(kept, experts // n_group, axis=1)


def moe_gating_topk(logits, bias=None, *, k=None, score_func=None, n_group=None, topk_group=None,
                    group_select=None, renormalize=None, eps=None, routed_scaling_factor=None,
                    _node_name="", _named_outputs=None):
    """numpy reference of MoeGatingTopK; returns ``(weights, indices, scores)``.

    Raises MoeOpError for any input or attribute outside the contract.
    """
    attrs = dict(k=k, score_func=score_func, n_group=n_group, topk_group=topk_group, group_select=group_select,
                 renormalize=renormalize, eps=eps, routed_scaling_factor=routed_scaling_factor)
    view = ArrayView(MOE_GATING_TOPK, [logits, bias], attrs, node_name=_node_name, named_outputs=_named_outputs)
    MOE_GATING_TOPK.validate(view)
    k, n_group = view.attr("k"), view.attr("n_group")
    lead = logits.shape[:-1]
    rows = as_rows(logits).astype(np.float32)
    with np.errstate(all="ignore"):  # NaN and Inf go through as IEEE arithmetic has them
        s = _scores(rows, view.attr("score_func"))
        sel = s if bias is None else s + bias.astype(np.float32)
        allowed = None
        if n_group > 1:
            allowed = _kept_groups(sel, n_group, view.attr("topk_group") or n_group, view.attr("group_select"))
        idx = best_first(sel, allowed)[:, :k]
        w = np.take_along_axis(s, idx, axis=1)
        if view.attr("renormalize"):
            total = np.zeros(len(w), dtype=np.float32)
            for j in range(k):  # in slot order, as the kernels add them
                total += w[:, j]
            w = w / (total + np.float32(view.attr("eps")))[:, None]
        w = w * np.float32(view.attr("routed_scaling_factor"))
    return (w.astype(logits.dtype).reshape(*lead, k), idx.astype(np.int64).reshape(*lead, k),
            s.astype(logits.dtype).reshape(logits.shape))


# ----------------------------------------------------------------------------- as standard ONNX ops

def _function_body(op, c: Config, inputs: dict[str, Any]) -> dict[str, Any]:
    logits = inputs["logits"]
    logit_rows = to_rows(op, float32(op, logits))
    scores = op.Softmax(logit_rows, axis=-1) if c.attr("score_func") == "softmax" else op.Sigmoid(logit_rows)
    select = op.Add(scores, float32(op, inputs["bias"])) if c.has("bias") else scores
    key = _order_key(op, select)
    n_group = int(c.attr("n_group"))
    if n_group > 1:
        key = op.Where(_kept_group_experts(op, c, select, n_group), key, constant(op, -1e301, np.float64))
    k = int(c.attr("k"))
    _, idx = op.TopK(key, ints(op, k), axis=1, _outputs=2)
    weights = take_rows(op, scores, idx)
    if c.attr("renormalize"):
        total = op.Add(op.ReduceSum(weights, ints(op, 1), keepdims=1), scalar(op, float(c.attr("eps"))))
        weights = op.Div(weights, total)
    weights = op.Mul(weights, scalar(op, float(c.attr("routed_scaling_factor"))))
    out_shape = op.Concat(op.Shape(logits, end=-1), ints(op, k), axis=0)
    return {"weights": op.CastLike(op.Reshape(weights, out_shape, allowzero=1), logits),
            "indices": op.Reshape(idx, out_shape, allowzero=1),
            "scores": op.CastLike(op.Reshape(scores, op.Shape(logits), allowzero=1), logits)}


def _kept_group_experts(op, c: Config, select, n_group: int):
    """[rows, E] bool: the experts of each row's ``topk_group`` best groups (as :func:`_kept_groups`)."""
    count = op.Shape(select, end=1)
    group_size = op.Div(op.Shape(select, start=1), ints(op, n_group))
    grouped = reshape(op, select, op.Mul(count, ints(op, n_group)), group_size)  # [rows * G, E/G]
    best = 2 if c.attr("group_select") == "sum_top2" else 1
    _, top = op.TopK(_order_key(op, grouped), ints(op, best), axis=1, _outputs=2)
    group_score = op.ReduceSum(take_rows(op, grouped, top), ints(op, 1), keepdims=0)  # NaN if any NaN
    group_score = reshape(op, group_score, count, ints(op, n_group))
    topk_group = int(c.attr("topk_group")) or n_group
    _, kept = op.TopK(_order_key(op, group_score), ints(op, topk_group), axis=1, _outputs=2)
    mask = op.ScatterElements(op.ConstantOfShape(op.Concat(count, ints(op, n_group), axis=0)), kept,
                              op.Expand(scalar(op, 1.0), op.Shape(kept)), axis=1)
    per_expert = op.Expand(op.Unsqueeze(mask, ints(op, 2)), op.Concat(count, ints(op, n_group), group_size, axis=0))
    return op.Greater(reshape(op, per_expert, count, op.Shape(select, start=1)), scalar(op, 0.0))


def _order_key(op, values):
    """float32 ``values`` as float64 keys whose descending order is the reference's best-first order:
    NaN above +inf above every finite value (float32 fits float64 exactly), -inf last; TopK breaks
    ties by the lower index."""
    key = op.Cast(values, to=TensorProto.DOUBLE)
    key = op.Where(op.IsInf(values, detect_negative=0), constant(op, 1e300, np.float64), key)
    key = op.Where(op.IsInf(values, detect_positive=0), constant(op, -1e300, np.float64), key)
    return op.Where(op.IsNaN(values), constant(op, 1e301, np.float64), key)


MOE_GATING_TOPK = OpDef.of(signatures.MOE_GATING_TOPK, validate=_validate, reference=moe_gating_topk,
                           body=_function_body)
