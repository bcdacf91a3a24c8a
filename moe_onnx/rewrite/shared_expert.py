"""Folding a shared expert into the fused MOE beside it.

Qwen2-MoE, DeepSeek, GLM, dots and others add a *shared expert* to the routed output: a SwiGLU MLP
of width ``S`` that every token runs, optionally scaled by ``Sigmoid(x @ w_gate)`` (Qwen2-MoE). The
down projection is linear in its input columns, so when ``S = m * I`` the shared MLP equals ``m``
more experts of width ``I``, each taking ``I`` of its columns, that every token selects with the
shared scale (or 1) as routing weight. This pass finds ``Add(MOE(x), shared(x))`` after the fusions
and turns it into one MOE over ``E + m`` experts with ``k + m`` slots per token:
``benchmarks/bench_shared_expert.py`` measures the folded block at 0.83-0.96x the time of the MOE
with the shared MLP beside it (T = 1-512, 2 threads). Blocks that cannot fold stay as they
are (correct, unfused shared MLP) and the report says why.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from .._ir.builder import TapeBuilder, const, insert, int64s, replace
from .._ir.nodes import standard
from .._ir.passes import RewritePass, RewriteResult, rewritten
from .._ir.weights import initializer_expert, streamed_initializer
from ..ops import DOMAIN
from ._activation import read_swiglu
from ._linear import Linear, read_linear
from ._match import MatchFailure, require, static_last_dim

RULE_NAME = "SharedExpertFold"


@dataclasses.dataclass(frozen=True)
class _SharedExpert:
    """A shared SwiGLU MLP on ``x``: gate/up [S, H] and down [H, S] as nn.Linear, the optional scale."""

    x: ir.Value
    gate: Linear
    up: Linear
    down: Linear
    alpha: float
    scale: ir.Value | None  # [..., 1]: the routing weight of the shared experts (None: 1)


def _read_shared(value: ir.Value) -> _SharedExpert:
    """``down(swish(gate(x)) * up(x))``, alone or times ``Sigmoid(Linear(x) -> 1 column)``."""
    node = value.producer()
    scale = None
    if standard(node, "Mul"):
        for sigmoid, mlp in (node.inputs, reversed(node.inputs)):
            if standard(sigmoid.producer(), "Sigmoid"):
                scale, value = sigmoid, mlp
                break
        require(scale is not None, "the shared branch is a Mul without a Sigmoid gate")
    down = read_linear(value, "the shared down projection")
    act = read_swiglu(down.x)
    gate, up = read_linear(act.gate, "the shared gate projection"), read_linear(act.up, "the shared up projection")
    require(gate.x is up.x, "the shared gate and up projections read different inputs")
    require(gate.out_features == up.out_features == down.in_features and gate.in_features == up.in_features
            == down.out_features, "the shared gate, up and down projections' shapes do not fit together")
    if scale is not None:
        logit = read_linear(scale.producer().inputs[0], "the shared gate logit")
        require(logit.x is gate.x and logit.out_features == 1, "the shared expert's Sigmoid gate is not "
                "a one-column projection of the shared expert's input")
    return _SharedExpert(gate.x, gate, up, down, act.alpha, scale)


def _row_preserving(node: ir.Node, value: ir.Value) -> bool:
    """A Reshape of ``value`` or a Cast that keeps its type (exporters write both after the experts)."""
    if node.inputs[0] is not value:
        return False
    return standard(node, "Reshape") or (standard(node, "Cast") and node.attributes.get_int("to") == value.dtype)


def _unreshaped(value: ir.Value) -> ir.Value:
    """``value`` before the Reshapes that made it: the same rows of H in the same order."""
    node = value.producer()
    while standard(node, "Reshape"):
        value = node.inputs[0]
        node = value.producer()
    return value


@dataclasses.dataclass(frozen=True)
class _Fold:
    """A foldable ``Add(MOE(x), shared(x))``: the MOE, the Add, and the shared expert's m chunks of width I."""

    moe: ir.Node
    add: ir.Node
    routed: ir.Value  # the Add input from the MOE (its output, or a Reshape of it)
    shared: _SharedExpert
    chunks: int  # m = S / I


def _read_fold(moe: ir.Node) -> _Fold | None:
    """The MOE's ``Add`` with a shared expert; None when its output is not added to a SwiGLU MLP
    (a residual, say). Raises MatchFailure when there is a shared expert that cannot fold."""
    routed = moe.outputs[0]
    consumers = routed.consumers()
    while len(consumers) == 1 and _row_preserving(consumers[0], routed):
        routed = consumers[0].outputs[0]
        consumers = routed.consumers()
    if len(consumers) != 1 or not standard(consumers[0], "Add") or routed.is_graph_output():
        return None
    add = consumers[0]
    try:
        shared = _read_shared(add.inputs[1] if add.inputs[0] is routed else add.inputs[0])
    except MatchFailure:
        return None
    hidden = moe.inputs[0]
    require(_unreshaped(shared.x) is _unreshaped(hidden), "the shared expert does not read the MOE's hidden_states")
    attrs = moe.attributes
    expert_type = attrs.get_string("expert_type")
    require(expert_type == "GEMM3_SWIGLU", f"the MOE is {expert_type}; only GEMM3_SWIGLU takes a SwiGLU shared expert")
    require(shared.alpha == attrs.get_float("expert_alpha", 1.0),
            f"the shared expert's swish alpha {shared.alpha} differs from the MOE's")
    require(all(moe.inputs[i] is not None and moe.inputs[i].const_value is not None for i in (3, 5, 7)),
            "the MOE's weights are not initializers")
    width, hidden_size = moe.inputs[3].shape[1], moe.inputs[3].shape[2]
    require(shared.gate.in_features == hidden_size,
            f"the shared expert's hidden size {shared.gate.in_features} is not the MOE's {hidden_size}")
    require(shared.gate.out_features % width == 0,
            f"the shared expert's width {shared.gate.out_features} is not a multiple of the experts' {width}")
    k = static_last_dim(moe.inputs[1])
    require(k is not None and k == static_last_dim(moe.inputs[2]), "the MOE's k is not static")
    dtypes = {moe.inputs[3].dtype, moe.inputs[1].dtype, shared.gate.weight.dtype, shared.up.weight.dtype,
              shared.down.weight.dtype} | ({shared.scale.dtype} if shared.scale is not None else set())
    require(len(dtypes) == 1, "the shared expert's weights or scale have another type than the MOE's")
    return _Fold(moe, add, routed, shared, shared.gate.out_features // width)


def _stacked(graph: ir.Graph, routed: ir.Value, extra: list[np.ndarray]) -> ir.Value:
    """An initializer holding the experts of ``routed`` and then ``extra``, written one expert at a time."""
    count = routed.shape[0]
    shape = (count + len(extra), *routed.shape[1:])
    return streamed_initializer(graph, routed.name, lambda e: initializer_expert(routed, e) if e < count
                                else extra[e - count], routed.dtype, shape, sources=[routed])


def _fold(fold: _Fold) -> None:
    """Makes the MOE take the shared expert's chunks as m more experts that every token selects (with the
    shared scale, or 1, as weight) and its Add's readers the MOE's output."""
    moe, shared, m = fold.moe, fold.shared, fold.chunks
    graph = moe.graph
    experts, width = moe.inputs[3].shape[0], moe.inputs[3].shape[1]
    columns = [slice(c * width, (c + 1) * width) for c in range(m)]
    gate, up, down = shared.gate.out_in(), shared.up.out_in(), shared.down.out_in()
    weights = {3: _stacked(graph, moe.inputs[3], [gate[c] for c in columns]),
               5: _stacked(graph, moe.inputs[5], [up[c] for c in columns]),
               7: _stacked(graph, moe.inputs[7], [np.ascontiguousarray(down[:, c]) for c in columns])}

    k = static_last_dim(moe.inputs[1])
    op = TapeBuilder()
    rows_by_k = int64s(op, [-1, k])
    weights_2d, indices_2d = op.Reshape(moe.inputs[1], rows_by_k), op.Reshape(moe.inputs[2], rows_by_k)
    extra_shape = op.Concat(op.Shape(indices_2d, end=1), int64s(op, [m]), axis=0)
    ids = const(op, np.arange(experts, experts + m)[None, :], moe.inputs[2].dtype)
    extra_indices = op.Expand(ids, extra_shape)
    if shared.scale is not None:
        scale = op.Reshape(shared.scale, int64s(op, [-1, 1]))
    else:
        scale = const(op, np.ones((1, 1)), moe.inputs[1].dtype)
    extra_weights = op.Expand(scale, extra_shape)
    all_weights = op.Concat(weights_2d, extra_weights, axis=1)
    all_indices = op.Concat(indices_2d, extra_indices, axis=1)
    insert(moe, op)
    moe.replace_input_with(1, all_weights)
    moe.replace_input_with(2, all_indices)
    for index, value in weights.items():
        moe.replace_input_with(index, value)
    replace(fold.add, fold.routed)  # the Add's readers (and its name, maybe a graph output's) take the MOE's output


class FoldSharedExperts(RewritePass):
    """Fold every foldable shared expert beside an MOE node into it; the notes name the shared experts left
    beside their MOE, with the reason."""

    stage = "folding shared experts"

    def call(self, model: ir.Model) -> RewriteResult:
        count, notes = 0, []
        moes = [node for node in ir.traversal.RecursiveGraphIterator(model.graph)
                if node.domain == DOMAIN and node.op_type == "MOE"]
        for moe in moes:
            try:
                fold = _read_fold(moe)
            except MatchFailure as failure:
                notes.append(f"{RULE_NAME}: the shared expert beside MOE node '{moe.name}' stays unfused: {failure}")
                continue
            if fold is not None:
                _fold(fold)
                moe.graph.sort()  # the shared scale is computed after the MOE in the export's order
                count += 1
        return rewritten(model, {RULE_NAME: count}, notes=notes)
