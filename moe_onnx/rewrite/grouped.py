"""target="grouped": each MOE node becomes the routed chain

    MoeInitRouting -> MoeRowParallelLinear (gate/up; GEMM2_ACT: up) -> activation (standard ops)
    -> MoeRowParallelLinear (down) -> MoeFinalizeRouting

which computes the same block for any activation and is the form tensor parallelism shards
(MoeRowParallelLinear's K dimension). MoeRowParallelLinear takes its weights as [E, N, K]: the
GEMM3 ones are that already, the GEMM2 ones are transposed offline, lazily (see
``moe_onnx._ir.weights.lazy_initializer``). Every linear takes the MOE's ``accuracy_level`` (bf16 compute).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .._ir.builder import TapeBuilder, const, int64s, replace
from .._ir.nodes import attribute_value
from .._ir.passes import RewritePass, RewriteResult, rewritten
from .._ir.weights import Weight, weight, weight_value
from ..ops import DOMAIN, IN_OUR_DOMAIN
from ..ops.moe import B0, B1, GEMM2_BIAS_SWIGLU_CLAMP, MOE, W0, W1, W2, expert_layer

def _grouped_linear(op, rows: ir.Value, offsets: ir.Value, w: Weight, name: str, transposed: bool,
                    bias: ir.Value | None = None, accuracy: dict[str, int] | None = None) -> ir.Value:
    """MoeRowParallelLinear with W in [E, N, K]; ``transposed`` says the source is [E, K, N]; ``accuracy``:
    the MOE's accuracy_level, where it sets one."""
    if transposed:
        experts, k, n = w.shape
        w_enk = weight_value(op, w, name, np.transpose, (experts, n, k))
    else:
        w_enk = weight_value(op, w, name)
    inputs = [rows, offsets, w_enk] + ([bias] if bias is not None else [])
    return op.MoeRowParallelLinear(*inputs, **IN_OUR_DOMAIN, **(accuracy or {}))


def _expand(node: ir.Node) -> tuple[TapeBuilder, ir.Value] | None:
    """The grouped chain for one MOE node: the builder that made it and its output (None: keep the node)."""
    hidden, routing, indices, w0, b0, w1, b1, w2 = (list(node.inputs) + [None] * 8)[:8]
    weights = [weight(w) for w in (w0, w1, w2)]
    if weights[0] is None or weights[1] is None or (w2 is not None and weights[2] is None):
        return None  # weights computed at run time: keep the MOE node
    expert_type = attribute_value(node, "expert_type", "")
    dtype = hidden.dtype
    experts = weights[0].shape[0]

    op = TapeBuilder()

    def scalar(value: float) -> ir.Value:
        return const(op, value, dtype)

    hidden_size = weights[1].shape[2] if expert_type == GEMM2_BIAS_SWIGLU_CLAMP else weights[0].shape[2]
    rows_in = op.Reshape(hidden, int64s(op, [-1, hidden_size]))
    minus_one = int64s(op, [-1])
    k = op.Slice(op.Shape(indices), minus_one, int64s(op, [np.iinfo(np.int64).max]))  # [k]: the last dim
    shape_tk = op.Concat(minus_one, k, axis=0)
    idx_tk = op.Reshape(indices, shape_tk)
    scales_tk = op.Reshape(routing, shape_tk)
    rows, row_idx, cumsum = op.MoeInitRouting(rows_in, idx_tk, expert_num=experts, _outputs=3, **IN_OUR_DOMAIN)
    offsets = op.Concat(int64s(op, [0]), cumsum, axis=0)

    transposed = expert_type == GEMM2_BIAS_SWIGLU_CLAMP  # MOE's GEMM2 stores [E, K, N]
    weight_of, bias_of = {W0: weights[0], W1: weights[1], W2: weights[2]}, {B0: b0, B1: b1}
    accuracy = {name: attr.value for name, attr in node.attributes.items() if name == "accuracy_level"}

    def linear(weight_input: int, bias_input: int | None, a: ir.Value) -> ir.Value:
        if a.dtype is None and dtype is not None:  # the chain's rows have the block's type (portable bodies read it)
            a.dtype = dtype
        name = f"moe_{MOE.inputs[weight_input].name}" + ("_enk" if transposed else "")
        return _grouped_linear(op, a, offsets, weight_of[weight_input], name, transposed, bias_of.get(bias_input),
                               accuracy)

    def attr(name: str):
        return attribute_value(node, name, MOE.attr_spec(name).default)

    down = expert_layer(op, rows, linear, attr, scalar)

    out = op.MoeFinalizeRouting(down, row_idx, None, None, None, scales_tk, **IN_OUR_DOMAIN)
    y = op.Reshape(out, op.Shape(hidden), allowzero=1)  # a 0 in the shape is a 0 (no tokens), not a copy
    return op, y


class ExpandToGrouped(RewritePass):
    """Replace every MOE node whose weights are constants by the grouped chain; a note for each QMOE node (the
    grouped chain has no quantized linear)."""

    stage = "expanding MOE nodes into the grouped chain"

    def call(self, model: ir.Model) -> RewriteResult:
        count = 0
        graph = model.graph
        for node in list(graph):
            if node.domain != DOMAIN or node.op_type != "MOE":
                continue
            expansion = _expand(node)
            if expansion is None:
                continue
            op, y = expansion
            replace(node, y, op)
            count += 1
        notes = [f"QMOE node '{node.name}' stays QMOE: the grouped chain has no quantized linear"
                 for node in graph if node.domain == DOMAIN and node.op_type == "QMOE"]
        return rewritten(model, {"MoeToGrouped": count}, notes=notes)
