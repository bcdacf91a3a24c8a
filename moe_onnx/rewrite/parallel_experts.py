"""Fusions of transformers 4.x ``ParallelExperts`` blocks (GraniteMoe, GraniteMoeShared, JetMoe) as
``torch.onnx.export(dynamo=True)`` writes them.

The router sorts the (token, slot) pairs by expert, the experts run on consecutive chunks of the
sorted tokens (``Split`` by the per-expert counts, one ``Gemm`` per expert, ``Concat``), and the
weighted results are index_add_ed back to their tokens::

    topk_values_TK, topk_indices_TK = TopK(router logits, k)
    gates_TK = Softmax(topk_values_TK)
    counts_E = ReduceSum(Cast(ScatterElements(zeros [T, E], topk_indices_TK, ones, axis=1)), 0)
    sizes_E = Concat(counts_E[0], ..., counts_E[E - 1])
    order_Tk = TopK(Reshape(topk_indices_TK, [-1]), Tk, largest=0)[1]          (argsort)
    token_Tk1 = Unsqueeze(order_Tk // k, -1)                                   (Cast, Div, Abs, Floor, Sign, Mul, Cast)
    x_TkH = GatherND(tokens_TH, token_Tk1)
    h_Tk2I = Concat(Gemm(Split(x_TkH, sizes_E)[e], in_e [2I, H]) for e)       (transB=1)
    first, second = Split(h_Tk2I, 2, axis=1);  act_TkI = swish(first) * second
    y_TkH = Concat(Gemm(Split(act_TkI, sizes_E)[e], out_e [H, I]) for e)
    gate_Tk1 = Unsqueeze(GatherND(Reshape(gates_TK, [-1]), Unsqueeze(order_Tk, -1)), 1)
    out_TH = ScatterND(zeros [T, H], token_Tk1, Expand(Mul(y_TkH, gate_Tk1)), reduction="add")

Chunk e is expert e because the sort is by expert index and the chunk sizes are the per-expert
counts in expert order; :func:`_chunk_sizes` checks exactly that. The block, from the sort to the
ScatterND, becomes one MOE GEMM3_SWIGLU node fed by the router's TopK indices and ``gates_TK``; the
reshape back to [B, S, H], JetMoe's output bias and GraniteMoeShared's shared MLP stay as they are.

Shapes in names: T tokens, k experts per token, Tk = T * k slots, H hidden size, I expert
intermediate size, E experts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from .._ir.nodes import skip_reshapes, standard
from .._ir.weights import Weight, lazy_initializer
from ..ops.moe import GEMM3_SWIGLU
from ._activation import read_swiglu
from ._linear import read_linear
from ._match import (
    MoeFusion, axes, constant_ints, constant_scalar, emit_moe, failing_in, fill_value, is_zeros, producer, require,
    static_shape, unsqueezed_last,
)
from ._router import Route, route
from .loop_dynamo import AccumulatingScatterMatcher


def _floor_div(value: ir.Value, what: str) -> tuple[ir.Value, float]:
    """``(n, d)`` of ``value = n // d`` as the exporter writes it for non-negative integers:
    ``Cast(Mul(Floor(Abs(q)), Sign(q)), int64)`` with ``q = Div(Cast(n, float), d)``."""
    cast_back = producer(value, "Cast", what)
    product = producer(cast_back.inputs[0], "Mul", what)
    ops = {factor.producer().op_type: factor.producer() for factor in product.inputs if factor.producer()}
    require(set(ops) == {"Floor", "Sign"}, f"{what} is not a floor division (Floor(Abs(q)) * Sign(q))")
    quotient = ops["Sign"].inputs[0]
    require(producer(ops["Floor"].inputs[0], "Abs", what).inputs[0] is quotient,
            f"{what}: Floor and Sign take different quotients")
    div = producer(quotient, "Div", what)
    divisor = constant_scalar(div.inputs[1])
    require(divisor is not None, f"{what}: the divisor is not a constant")
    return producer(div.inputs[0], "Cast", what).inputs[0], divisor


def _argsort(order_Tk: ir.Value) -> ir.Value:
    """topk_indices_TK of ``order_Tk = TopK(Reshape(topk_indices_TK, [-1]), all, axis 0, ascending)[1]``."""
    sort = producer(order_Tk, "TopK", "the slot order")
    require(order_Tk.index() == 1, "the slot order is not the indices output of a TopK")
    require(sort.attributes.get_int("largest", 1) == 0 and sort.attributes.get_int("axis", -1) in (0, -1),
            "the slot order is not an ascending sort (TopK largest=0 over the flattened slots)")
    flat = producer(sort.inputs[0], "Reshape", "the sorted expert indices")
    require(constant_ints(flat.inputs[1]) == [-1], "the sorted expert indices are not the flattened top-k indices")
    return flat.inputs[0]


def _chunk_sizes(sizes_E: ir.Value, topk_indices_TK: ir.Value, experts: int) -> None:
    """``sizes_E`` lists counts_E[0], ..., counts_E[E - 1], the number of slots routed to each expert."""
    concat = producer(sizes_E, "Concat", "the chunk sizes")
    require(len(concat.inputs) == experts,
            f"the tokens are split into {len(concat.inputs)} chunks for {experts} experts")
    counts = set()
    for e, size in enumerate(concat.inputs):
        value = skip_reshapes(size)
        pick = value.producer()
        if standard(pick, "Gather"):  # [n][0]
            require(constant_ints(pick.inputs[1]) == [0], "a chunk size is not one element of the expert counts")
            value = skip_reshapes(pick.inputs[0])
        piece = producer(value, "Slice", "a chunk size")
        starts, ends = constant_ints(piece.inputs[1]), constant_ints(piece.inputs[2])
        slice_axes = constant_ints(piece.inputs[3]) if len(piece.inputs) > 3 and piece.inputs[3] is not None else [0]
        require(starts == [e] and ends == [e + 1] and slice_axes in ([0], [-1]),
                f"chunk {e}'s size is not the count of expert {e}")
        counts.add(piece.inputs[0])
    require(len(counts) == 1, "the chunk sizes come from different expert counts")
    reduce = producer(counts.pop(), "ReduceSum", "the expert counts")
    require(axes(reduce, 2) == [0] and reduce.attributes.get_int("keepdims", 1) == 0,
            "the expert counts are not summed over the tokens")
    one_hot = reduce.inputs[0]
    if standard(one_hot.producer(), "Cast"):
        one_hot = one_hot.producer().inputs[0]
    scatter = producer(one_hot, "ScatterElements", "the expert counts")
    require(scatter.attributes.get_int("axis", 0) in (1, -1) and is_zeros(scatter.inputs[0])
            and scatter.inputs[1] is topk_indices_TK and fill_value(scatter.inputs[2]) == 1.0,
            "the expert counts do not count the top-k indices (ScatterElements of ones into zeros [T, E], axis 1)")


def _experts(joined: ir.Value, what: str, sizes_E: ir.Value | None) -> tuple[ir.Value, list[Weight], bool, ir.Value]:
    """``(x, weights, in_out, sizes)`` of ``joined = Concat(x @ W_e on Split(x, sizes)[e] for each e)``."""
    concat = producer(joined, "Concat", what)
    require(concat.attributes.get_int("axis", 0) == 0, f"{what}: the expert outputs are not concatenated on axis 0")
    split, weights, layouts = None, [], set()
    for e, part in enumerate(concat.inputs):
        with failing_in(f"{what} of expert {e}"):
            linear = read_linear(part, "the projection")
            node = producer(linear.x, "Split", "the expert's tokens")
            require(split in (None, node) and list(node.outputs).index(linear.x) == e,
                    f"the tokens are not chunk {e} of one Split")
            split = node
            weights.append(linear.weight)
            layouts.add(linear.in_out)
    require(split.attributes.get_int("axis", 0) == 0 and len(split.inputs) > 1,
            f"{what}: the Split is not by sizes on axis 0")
    require(sizes_E in (None, split.inputs[1]), f"{what}: the chunks are split by other sizes than the input's")
    require(len(layouts) == 1, f"{what}: the experts store their weights in different layouts")
    return split.inputs[0], weights, layouts.pop(), split.inputs[1]


class _SortedScatterMatcher(AccumulatingScatterMatcher):
    """The index_add_ ScatterNDs whose row index does not come from a NonZero."""

    loop_index = False


@dataclasses.dataclass(frozen=True)
class _Block:
    tokens_TH: ir.Value
    route: Route
    gate_up: list[Weight]  # [2I, H] as [out, in] unless in_out
    down: list[Weight]  # [H, I] as [out, in] unless in_out
    in_out: tuple[bool, bool]
    gate_half: int
    alpha: float
    hidden: int
    intermediate: int


def _gates(gate_Tk1: ir.Value, order_Tk: ir.Value) -> ir.Value:
    """gates_TK of ``gate_Tk1 = Unsqueeze(GatherND(Reshape(gates_TK, [-1]), Unsqueeze(order_Tk, -1)), 1)``."""
    gather = producer(unsqueezed_last(gate_Tk1, 2, "the slot gate"), "GatherND", "the slot gate")
    require(gather.attributes.get_int("batch_dims", 0) == 0
            and unsqueezed_last(gather.inputs[1], 2, "the slot gate index") is order_Tk,
            "the slot gates are not gathered in the sorted slot order")
    flat = producer(gather.inputs[0], "Reshape", "the slot gates")
    require(constant_ints(flat.inputs[1]) == [-1], "the slot gates are not the flattened [T, k] gates")
    return flat.inputs[0]


def _block(scatter: ir.Node) -> _Block:
    zeros_TH, token_Tk1, updates = scatter.inputs
    shape = static_shape(zeros_TH)
    require(is_zeros(zeros_TH) and shape is not None and len(shape) == 2 and shape[1] is not None,
            "the scatter target is not zeros [T, H] with a static H")
    hidden = shape[1]
    token_Tk = unsqueezed_last(token_Tk1, 2, "the scatter index")
    require(not standard(token_Tk.producer(), "TopK"),
            "the expert outputs are scattered to their sorted slots, not added to their tokens (as JetMoe's "
            "mixture of attention heads maps tokens to k heads): MOE fuses expert MLPs summed per token")
    order_Tk, k = _floor_div(token_Tk, "the slot's token")
    topk_indices_TK = _argsort(order_Tk)

    expand = updates.producer()
    weighted = expand.inputs[0] if standard(expand, "Expand") else updates
    mul = producer(weighted, "Mul", "the weighted expert outputs")
    y_TkH, gate_Tk1 = mul.inputs if standard(mul.inputs[0].producer(), "Concat") else reversed(mul.inputs)
    gates_TK = _gates(gate_Tk1, order_Tk)
    found = route(topk_indices_TK, gates_TK)
    require(k == found.k, f"the slot's token is its position // {k:g}, expected // k = {found.k}")

    act_TkI, down, down_in_out, sizes_E = _experts(y_TkH, "the down projection", None)
    _chunk_sizes(sizes_E, topk_indices_TK, found.experts)
    require(len(down) == found.experts, f"{len(down)} experts for a router over {found.experts}")
    require(not standard(act_TkI.producer(), "GatherND"),
            "the experts are one projection of the gathered tokens, no MLP (as JetMoe's mixture of attention "
            "heads): MOE fuses expert MLPs (gate_up, activation, down)")
    activation = read_swiglu(act_TkI)
    halves = producer(activation.gate, "Split", "the gate")
    require(activation.up in halves.outputs and len(halves.outputs) == 2
            and halves.attributes.get_int("axis", 0) in (1, -1), "gate and up are not the two halves of one Split")
    x_TkH, gate_up, gate_up_in_out, _ = _experts(halves.inputs[0], "the gate_up projection", sizes_E)
    tokens = producer(x_TkH, "GatherND", "the sorted tokens")
    require(tokens.inputs[1] is token_Tk1 and tokens.attributes.get_int("batch_dims", 0) == 0,
            "the sorted tokens are not gathered at the slots' tokens")

    def out_in(w: Weight, in_out: bool) -> tuple[int, ...]:
        return tuple(reversed(w.shape)) if in_out else w.shape

    two_i = out_in(gate_up[0], gate_up_in_out)[0]
    require(two_i % 2 == 0, f"gate_up has {two_i} outputs, not two halves")
    dtype = tokens.inputs[0].dtype
    for e, (w_in, w_out) in enumerate(zip(gate_up, down, strict=True)):
        for w, in_out, expected, what in ((w_in, gate_up_in_out, (two_i, hidden), "gate_up"),
                                          (w_out, down_in_out, (hidden, two_i // 2), "down")):
            require(out_in(w, in_out) == expected,
                    f"expert {e}'s {what} weight is {list(out_in(w, in_out))} as [out, in], expected {list(expected)}")
            require(w.dtype == dtype, f"expert {e}'s {what} weight is {w.dtype}, the tokens are {dtype}")
    gate_half = list(halves.outputs).index(activation.gate)
    return _Block(tokens.inputs[0], found, gate_up, down, (gate_up_in_out, down_in_out), gate_half,
                  activation.alpha, hidden, two_i // 2)


def _stacked(op, name: str, weights: list[Weight], in_out: bool, rows: slice, shape: tuple[int, int, int],
             dtype: ir.DataType) -> ir.Value:
    """A lazy [E, rows, cols] initializer: ``rows`` of each expert's [out, in] matrix."""

    def expert_slice(e: int) -> np.ndarray:
        w = weights[e].array()
        return (w.T if in_out else w)[rows]

    return lazy_initializer(op, name, expert_slice, dtype, shape, sources=[w.source for w in weights])


class ParallelExpertsFusion(MoeFusion):
    """The sorted ParallelExperts block (see the module docstring), matched at its ScatterND::

        out_TH = ScatterND(zeros_TH, token_Tk1, updates_TkH)     (reduction add)

    ``read`` checks the sort, the chunking by expert counts, the per-expert Gemms, the activation and
    the gates; ``emit`` replaces ``out_TH`` by ``MOE(tokens_TH, gates_TK, topk_indices_TK, gate_EIH, -,
    up_EIH, -, down_EHI)``.
    """

    matcher = _SortedScatterMatcher

    def pattern(self, op, zeros_TH, token_Tk1, updates_TkH):
        return op.ScatterND(zeros_TH, token_Tk1, updates_TkH)


    def read(self, context, **_) -> _Block:
        return _block(context.root)

    def emit(self, op, block: _Block) -> ir.Value:
        experts, i, hidden = block.route.experts, block.intermediate, block.hidden
        halves = (slice(0, i), slice(i, 2 * i))
        gate_rows, up_rows = halves if block.gate_half == 0 else halves[::-1]
        gate_up_in_out, down_in_out = block.in_out
        dtype = block.tokens_TH.dtype
        return emit_moe(op, block.tokens_TH, block.route.weights, block.route.indices, expert_type=GEMM3_SWIGLU,
                        weight_0=_stacked(op, "parallel_gate_EIH", block.gate_up, gate_up_in_out, gate_rows,
                                          (experts, i, hidden), dtype),
                        weight_1=_stacked(op, "parallel_up_EIH", block.gate_up, gate_up_in_out, up_rows,
                                          (experts, i, hidden), dtype),
                        weight_2=_stacked(op, "parallel_down_EHI", block.down, down_in_out, slice(None),
                                          (experts, hidden, i), dtype),
                        expert_alpha=block.alpha)


FUSIONS = [ParallelExpertsFusion]
