"""Routers into MoeGatingTopK: a pass over the fused graph (``optimize(..., fuse_routers=True)``, the default).

Every export form leaves the router in the graph and hands MOE the router's result (see _router.py).
This pass reads each MOE (and QMOE) node's routing weights and indices back to the router logits and, when
the chain is one MoeGatingTopK computes, replaces it by one node (the old chain goes when nothing
else reads it). Recognized chains, T tokens, E experts:

- softmax -> top-k: ``TopK(Softmax(L), k)``, the weights its values (Qwen2-MoE, OLMoE), optionally
  renormalized ``w / ReduceSum(w)`` (Mixtral, Qwen3-MoE), optionally ``+ eps`` in the denominator;
  DeepSeek-V2's group-limited form ranks the scores under the group mask below and takes the values;
- top-k -> softmax: ``Softmax(TopK(L, k).values)`` (GPT-OSS, Mixtral's v5 router): softmax with
  renormalize, the same numbers up to rounding;
- the DeepSeek-V3 router (GLM-4-MoE, dots1): ``sel = Sigmoid(L) + bias``; group scores
  ``ReduceSum(TopK(Reshape(sel, [-1, G, E/G]), 2).values)`` (or ``ReduceMax``, DeepSeek-V2); the
  group mask ``ScatterElements(zeros, TopK(groups, topk_group).indices, 1)`` spread over the experts;
  ``Where(Not(mask), fill, sel)``; ``TopK(.., k)``; ``GatherElements(scores, indices)``, renormalized
  (``+ 1e-20``) and times ``routed_scaling_factor``.

Each may end in ``Mul`` by a scalar (routed_scaling_factor); float Casts that widen (or keep) to
float32 may sit between the steps. A masked fill must rank the masked experts below every allowed
one: -inf always does; transformers 4.57 fills 0.0, which does only where no allowed ``s + bias``
is negative (a constant bias >= 0). A chain that is not recognized stays as it is (MOE works with
it) and the report says why in a note. PhiMoE's sparsemixer does not fit: its weights are a softmax
over the experts within a relative threshold (jitter_eps) of each round's maximum, a set the logits
decide, not the chosen experts' scores.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper
from onnx.reference import ReferenceEvaluator

from .._ir.builder import TapeBuilder, const, insert, typed
from .._ir.nodes import standard
from .._ir.passes import RewritePass, RewriteResult, rewritten
from ..ops import DOMAIN, IN_OUR_DOMAIN
from ._match import (
    MatchFailure, constant, constant_ints, constant_scalar, constant_text, fill_value, ints_input_or_attr, is_zeros,
    require,
)

RULE = "RouterToMoeGatingTopK"
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_UNWRITTEN = {"eps": 0.0, "routed_scaling_factor": 1.0}  # defaults left off the node


@dataclasses.dataclass
class Router:
    """What one MoeGatingTopK node needs: the logits [T, E], the selection bias and the attributes."""

    logits: ir.Value
    bias: np.ndarray | None
    attributes: dict


# ----------------------------------------------------------------------------- small readers

def _producer_if(value: ir.Value | None, op_type: str) -> ir.Node | None:
    """The node computing ``value`` if it is a standard ``op_type``, else None."""
    node = None if value is None else value.producer()
    return node if standard(node, op_type) else None


def _widened(value: ir.Value) -> ir.Value:
    """``value`` before Casts to float32 from a float type (exact: they widen or keep every value)."""
    while (cast := _producer_if(value, "Cast")) is not None:
        source = cast.inputs[0]
        if cast.attributes.get_int("to", 0) != ir.DataType.FLOAT or source.dtype not in _FLOATS:
            break
        value = source
    return value


def uncast(value: ir.Value) -> ir.Value:
    """``value`` before Casts between float types (the routing weights' last steps: MoeGatingTopK
    gives its weights in the logits' type, and a Cast to the MOE's type follows where they differ)."""
    while (cast := _producer_if(value, "Cast")) is not None and value.dtype in _FLOATS \
            and cast.inputs[0].dtype in _FLOATS:
        value = cast.inputs[0]
    return value


def _rows(value: ir.Value, experts: int) -> ir.Value:
    """``value`` before float32 Casts and Reshapes to [rows, E] (views of the same [T, E] scores)."""
    while True:
        value = _widened(value)
        reshape = _producer_if(value, "Reshape")
        if reshape is None or not _is_rows_shape(constant_ints(reshape.inputs[1]), experts):
            return value
        value = reshape.inputs[0]


def _is_rows_shape(shape: list[int] | None, experts: int) -> bool:
    """A Reshape target that views a tensor as [rows, E] (rows -1 or static)."""
    return shape is not None and len(shape) == 2 and shape[1] == experts and shape[0] != 0


def _folded_ints(value: ir.Value, limit: int = 12) -> list[int] | None:
    """An integer tensor computed from constants only (an exporter's shape arithmetic, such as
    torch's ``expand(-1, G, n)`` lowering), evaluated; None when it depends on a graph input or takes
    more than ``limit`` nodes."""
    found = constant_ints(value)
    if found is not None or value.producer() is None:
        return found
    nodes, constants, pending = [], {}, [value.producer()]
    while pending:
        node = pending.pop()
        if node in nodes:
            continue
        nodes.append(node)
        if len(nodes) > limit or node.domain not in ("", "ai.onnx"):
            return None
        for source in node.inputs:
            if source is None:
                continue
            if source.producer() is not None:
                pending.append(source.producer())
            elif (array := constant(source)) is not None:
                constants[source.name] = array
            else:
                return None  # a graph input
    position = {node: i for i, node in enumerate(value.producer().graph)}
    protos = [ir.serde.serialize_node(node) for node in sorted(nodes, key=position.__getitem__)]
    model = helper.make_model(helper.make_graph(
        protos, "folded", [], [helper.make_tensor_value_info(value.name, onnx.TensorProto.UNDEFINED, None)],
        [onnx.numpy_helper.from_array(array, name) for name, array in constants.items()]))
    (result,) = ReferenceEvaluator(model).run([value.name], {})
    return [int(v) for v in np.asarray(result).reshape(-1)] if np.asarray(result).dtype.kind in "iu" else None


def _float32_text(value: ir.Value | None) -> str:
    """A scalar constant as float32 prints it (1e-12, not 9.999999960041972e-13), or what constant_text says."""
    scalar = constant_scalar(value)
    return str(np.float32(scalar)) if scalar is not None else constant_text(value)


def _is_last_axis(axis: int | None, rank: int) -> bool:
    return axis is not None and axis in (-1, rank - 1)


def _top_k(value: ir.Value, output: int, what: str) -> tuple[ir.Node, int]:
    """The TopK (largest, last axis) whose output ``output`` is ``value``, and its k."""
    topk = _producer_if(value, "TopK")
    require(topk is not None and value.index() == output, f"{what} is not {'the indices' if output else 'the values'} "
            "output of a TopK")
    rank = len(topk.inputs[0].shape) if topk.inputs[0].shape is not None else None
    require(topk.attributes.get_int("largest", 1) == 1 and rank is not None
            and _is_last_axis(topk.attributes.get_int("axis", -1), rank),
            f"{what}: the TopK does not take the largest values over the last axis")
    k = constant_ints(topk.inputs[1])
    require(k is not None and len(k) == 1, f"{what}: the TopK's k is not a constant")
    return topk, k[0]


def _experts(value: ir.Value) -> int:
    """E of the [T, E] scores ``value`` (static)."""
    shape = value.shape
    require(shape is not None and len(shape) == 2 and isinstance(shape[1], int),
            f"the router scores have shape {shape}; expected [T, E] with a static E")
    return shape[1]


def _scores(value: ir.Value) -> tuple[str, ir.Value]:
    """(score_func, logits) of ``value`` = Softmax(logits) over the last axis or Sigmoid(logits)."""
    node = value.producer()
    if standard(node, "Sigmoid"):
        return "sigmoid", node.inputs[0]
    require(standard(node, "Softmax"), f"the router scores come from {node.op_type if node else 'a graph input'}; "
            "expected Softmax or Sigmoid")
    rank = len(value.shape) if value.shape is not None else 0
    require(_is_last_axis(node.attributes.get_int("axis", -1), rank), "the router Softmax is not over the experts")
    return "softmax", node.inputs[0]


# ----------------------------------------------------------------------------- the weights chain

def _scaled(weights: ir.Value) -> tuple[ir.Value, float]:
    """(w, routed_scaling_factor) of ``weights`` = w * scalar constant (1.0 when there is no Mul)."""
    mul = _producer_if(weights, "Mul")
    if mul is None:
        return weights, 1.0
    for w, factor in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        scale = constant_scalar(factor)
        if scale is not None:
            require(math.isfinite(scale), f"the routing weights are scaled by {scale}; expected a finite factor")
            return _widened(w), scale
    raise MatchFailure("the routing weights are a Mul by a tensor that is not a scalar constant")


def _renormalized(weights: ir.Value) -> tuple[ir.Value, bool, float]:
    """(w, renormalize, eps) of ``weights`` = w / (ReduceSum(w, last axis, keepdims) + eps), or w as it is."""
    div = _producer_if(weights, "Div")
    if div is None:
        return weights, False, 0.0
    w, denominator, eps = div.inputs[0], div.inputs[1], 0.0
    add = _producer_if(denominator, "Add")
    if add is not None:
        sums = [v for v in add.inputs if _producer_if(v, "ReduceSum") is not None]
        others = [constant_scalar(v) for v in add.inputs if _producer_if(v, "ReduceSum") is None]
        require(len(sums) == 1 and len(others) == 1 and others[0] is not None and math.isfinite(others[0]),
                "the routing weights are divided by a sum plus something that is not a scalar constant")
        denominator, eps = sums[0], others[0]
    clip = _producer_if(denominator, "Clip")
    require(clip is None or _producer_if(clip.inputs[0], "ReduceSum") is None,
            f"the routing weights are divided by max(their sum, {_float32_text(clip.inputs[1]) if clip else ''}) "
            "(Ernie 4.5's norm_min): MoeGatingTopK adds eps to the sum instead, which differs where the sum "
            "is below that minimum")
    total = _producer_if(denominator, "ReduceSum")
    require(total is not None, "the routing weights are divided by something other than their sum")
    rank = len(w.shape) if w.shape is not None else 0
    axes = ints_input_or_attr(total, 1, "axes")
    require(total.inputs[0] is w and axes is not None and len(axes) == 1 and _is_last_axis(axes[0], rank)
            and total.attributes.get_int("keepdims", 1) == 1,
            "the routing weights are divided by a sum that is not theirs over k (keepdims)")
    return w, True, eps


# ----------------------------------------------------------------------------- the selection chain

def _group_scores(groups: ir.Value, sel: ir.Value, experts: int) -> tuple[int, str]:
    """(n_group, group_select) of ``groups`` [T, G] = ReduceSum(TopK(view, 2).values) or ReduceMax(view)
    over the last axis, ``view`` = Reshape(sel, [-1, G, E / G])."""
    node = groups.producer()
    require(standard(node, "ReduceSum") or standard(node, "ReduceMax"),
            f"the group scores come from {node.op_type if node else 'a graph input'}; expected ReduceSum of a "
            "TopK(2) or ReduceMax")
    axes = ints_input_or_attr(node, 1, "axes")
    require(axes in ([-1], [2]) and node.attributes.get_int("keepdims", 1) == 0,
            "the group scores are not reduced over the experts of a group")
    view = node.inputs[0]
    if node.op_type == "ReduceSum":
        topk, two = _top_k(view, 0, "the group scores' top values")
        require(two == 2, f"the group scores sum the top {two} of a group; expected the top 2")
        view, group_select = topk.inputs[0], "sum_top2"
    else:
        group_select = "max"
    reshape = _producer_if(view, "Reshape")
    shape = None if reshape is None else constant_ints(reshape.inputs[1])
    require(shape is not None and len(shape) == 3 and shape[1] > 0 and shape[1] * shape[2] == experts,
            f"the groups are not a Reshape of the selection scores to [-1, G, E / G] with E = {experts}")
    require(_rows(reshape.inputs[0], experts) is _rows(sel, experts), "the groups are not made of the selection scores")
    return shape[1], group_select


def _group_mask(where: ir.Node, sel: ir.Value, experts: int, k: int) -> dict:
    """The group-limited routing of ``Where(Not(mask of the kept groups), fill, sel)``: its attributes
    and the fill value."""
    cond, negations = where.inputs[0], 0
    while True:
        node = cond.producer()
        if standard(node, "Not"):
            negations += 1
        elif not (standard(node, "Cast") and node.attributes.get_int("to", 0) == ir.DataType.BOOL):
            break
        cond = node.inputs[0]
    require(negations % 2 == 1, "the Where does not keep the selection scores where the group mask is set")
    reshape = _producer_if(cond, "Reshape")
    require(reshape is not None and _is_rows_shape(constant_ints(reshape.inputs[1]), experts),
            "the group mask is not a Reshape to [rows, E]")
    expand = _producer_if(reshape.inputs[0], "Expand")
    unsqueeze = _producer_if(expand.inputs[0], "Unsqueeze") if expand is not None else None
    require(unsqueeze is not None and constant_ints(unsqueeze.inputs[1]) in ([-1], [2]),
            "the group mask is not spread over the experts by Unsqueeze(-1) and Expand")
    scatter = _producer_if(unsqueeze.inputs[0], "ScatterElements")
    require(scatter is not None and scatter.attributes.get_int("axis", 0) in (1, -1) and is_zeros(scatter.inputs[0])
            and fill_value(scatter.inputs[2]) == 1 and scatter.attributes.get_string("reduction", "none") == "none",
            "the group mask is not ScatterElements of ones into zeros [T, G] along the groups")
    topk, topk_group = _top_k(scatter.inputs[1], 1, "the kept groups")
    n_group, group_select = _group_scores(topk.inputs[0], sel, experts)
    size = experts // n_group
    shape = _folded_ints(expand.inputs[1])
    require(shape is not None and len(shape) == 3 and shape[1:] in ([n_group, size], [1, size]),
            f"the group mask is expanded to {shape if shape is not None else 'a shape that is not a constant'}; "
            f"expected [T, {n_group}, {size}]")
    require(1 <= topk_group <= n_group and k <= topk_group * size,
            f"k = {k} experts from {topk_group} of {n_group} groups of {size}: more than the kept groups hold")
    if group_select == "sum_top2":
        require(size >= 2, "the groups sum their top 2 experts but hold one")
    return {"n_group": n_group, "topk_group": topk_group, "group_select": group_select}


def _selection(sel: ir.Value, experts: int, k: int) -> tuple[ir.Value, np.ndarray | None, dict]:
    """(scores, bias, group attributes) of the values the expert TopK ranks: the scores, + a bias,
    under a group mask."""
    groups, fill = {}, None
    where = _producer_if(sel, "Where")
    if where is not None:
        fill = constant_scalar(where.inputs[1])
        require(fill is not None, "the masked selection scores are not filled with a constant")
        sel = where.inputs[2]
        groups = _group_mask(where, sel, experts, k)
    bias = None
    add = _producer_if(sel, "Add")
    if add is not None:
        for scores, other in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            bias = constant(other)
            if bias is not None:
                break
        require(bias is not None and bias.size == experts and bias.shape[-1] == experts,
                f"the selection scores add something other than a constant bias of E = {experts} values")
        require(ir.DataType.from_numpy(bias.dtype) == _rows(scores, experts).dtype,
                "the selection bias has another type than the router scores")
        sel = scores
    if fill is not None and fill != -math.inf:
        smallest = 0.0 if bias is None else float(bias.min())
        require(fill <= 0 and smallest >= 0,
                f"the masked experts' selection scores are filled with {fill}, not -inf, and the expert bias "
                f"has values down to {smallest}: an allowed expert scoring below {fill} would lose to a masked "
                "one, which MoeGatingTopK never chooses")
    return _rows(sel, experts), None if bias is None else bias.reshape(experts), groups


# ----------------------------------------------------------------------------- the router

def read_router(weights: ir.Value, indices: ir.Value) -> Router:
    """The router whose result a MOE node takes as ``weights`` and ``indices``, or MatchFailure."""
    topk, k = _top_k(indices, 1, "the expert indices")
    experts = _experts(topk.inputs[0])
    require(1 <= k <= experts, f"TopK k = {k} over E = {experts} experts")
    w, scale = _scaled(uncast(weights))
    w, renormalize, eps = _renormalized(w)
    w = _widened(w)
    softmax = _producer_if(w, "Softmax")
    if softmax is not None and _producer_if(softmax.inputs[0], "TopK") is topk:  # top-k -> softmax
        require(softmax.inputs[0].index() == 0, "the router's Softmax takes TopK's indices")
        require(not renormalize, "the top-k softmax is renormalized again")
        require(_is_last_axis(softmax.attributes.get_int("axis", -1), len(softmax.inputs[0].shape or ())),
                "the top-k Softmax is not over k")
        attributes = {"k": k, "score_func": "softmax", "renormalize": 1, "routed_scaling_factor": scale}
        return Router(topk.inputs[0], None, attributes)
    if _producer_if(w, "TopK") is topk:  # the TopK's own values: the scores it ranks (DeepSeek-V2: masked by group)
        require(w.index() == 0, "the routing weights are the TopK's indices")
        scores, bias, groups = _selection(topk.inputs[0], experts, k)
        require(bias is None, "the routing weights are the top values of the scores plus a bias; expected the "
                "scores alone")
    else:
        gather = _producer_if(w, "GatherElements")
        require(gather is not None, "the routing weights are not TopK's values, a Softmax of them or the scores "
                "gathered at the indices")
        require(gather.inputs[1] is indices and gather.attributes.get_int("axis", 0) in (1, -1),
                "the routing weights gather the scores at other indices than the expert TopK's")
        scores = _rows(gather.inputs[0], experts)
        selected, bias, groups = _selection(topk.inputs[0], experts, k)
        require(selected is scores, "the expert TopK ranks other scores than the weights are gathered from")
    score_func, logits = _scores(scores)
    require(logits.dtype in _FLOATS, f"the router logits have type {logits.dtype}; expected a float type")
    attributes = {"k": k, "score_func": score_func, **groups, "renormalize": int(renormalize), "eps": eps,
                  "routed_scaling_factor": scale}
    return Router(logits, bias, attributes)


def _emit(moe: ir.Node, router: Router) -> None:
    """Insert MoeGatingTopK before ``moe`` and make ``moe`` take its weights and indices."""
    op = TapeBuilder()
    bias = None if router.bias is None else const(op, router.bias)
    attributes = {name: value for name, value in router.attributes.items() if value != _UNWRITTEN.get(name)}
    weights, indices = op.MoeGatingTopK(router.logits, bias, _outputs=2, **IN_OUR_DOMAIN,
                                        _name=f"{moe.name or 'MOE'}/router", **attributes)
    # the shapes the routed values had, for the passes after this one (the shared-expert fold reads k)
    typed(weights, router.logits.dtype, moe.inputs[1].shape)
    typed(indices, ir.DataType.INT64, moe.inputs[2].shape)
    wanted = moe.inputs[1].dtype
    if wanted is not None and wanted != router.logits.dtype:
        weights = typed(op.Cast(weights, to=wanted), wanted, indices.shape)
    insert(moe, op)
    moe.replace_input_with(1, weights)
    moe.replace_input_with(2, indices)


class FuseRouters(RewritePass):
    """Replace the router of every MOE (and QMOE) node that has a recognized one; the notes name the nodes
    whose router stays, with the reason."""

    stage = "routers"

    def call(self, model: ir.Model) -> RewriteResult:
        count, notes = 0, []
        for node in list(model.graph):
            if node.domain != DOMAIN or node.op_type not in ("MOE", "QMOE"):
                continue
            try:
                router = read_router(node.inputs[1], node.inputs[2])
            except MatchFailure as failure:
                notes.append(f"{node.op_type} node '{node.name or ''}': the router stays as exported ({failure})")
                continue
            _emit(node, router)
            count += 1
        return rewritten(model, {RULE: count}, notes=notes)
