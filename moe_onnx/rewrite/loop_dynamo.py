"""Fusions of the loop export form as the dynamo exporter writes it.

``torch.onnx.export(dynamo=True)`` of transformers 4.x's eager ``for expert_idx in range(num_experts)``
loop (OLMoE, FlexOlmo) unrolls it into one branch per expert, like the TorchScript exporter
(``loop``), but writes each step differently: the one-hot mask is an ``Equal`` with ``arange(E)``,
rows are picked by ``GatherND`` and ``index_add_`` is a ``ScatterND`` with reduction add into the
running sum::

    mask_EKT = Transpose(Cast(Equal(Unsqueeze(topk_indices_TK, -1), arange(E))), perm=[2, 1, 0])
    branch of expert e (row_KT = Gather(mask_EKT, e)):
        where_N2 = Transpose(NonZero(row_KT), [1, 0])
        slot_N = Squeeze(Slice(where_N2, 0:1 on axis 1), 1);  token_N = Squeeze(Slice(where_N2, 1:2 on axis 1), 1)
        token_N1 = Unsqueeze(token_N, -1)
        x_NH = Reshape(Transpose(GatherND(Transpose(Unsqueeze(tokens_TH, 0), [1, 0, 2]), token_N1), [1, 0, 2]),
                       [-1, H])
        y_NH = Gemm(swish(Gemm(x_NH, gate_IH)) * Gemm(x_NH, up_IH), down_HI)       (transB=1: nn.Linear weights)
        w_N1 = GatherND(Unsqueeze(routing_TK, -1), Concat(token_N1, Unsqueeze(slot_N, -1), axis=-1))
        acc_TH = ScatterND(acc_TH, token_N1, Mul(y_NH, w_N1), reduction="add")
    with acc_TH = zeros [T, H] before the first branch.

The chain becomes the same MOE GEMM3_SWIGLU node as the TorchScript loop (``_unrolled.UnrolledLoopFusion.emit``).

Shapes in names: T tokens, H hidden size, I expert intermediate size, E experts, K experts per
token, N tokens routed to one expert.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir
from onnxscript.rewriter import MatchResult
from onnxscript.rewriter.pattern import SimplePatternMatcher

from .._ir.nodes import standard
from .._ir.weights import Weight
from ._activation import read_swiglu
from ._linear import Linear, read_linear
from ._match import (
    MatchFailure, axes, constant_ints, failing_in, is_zeros, nonzero_of, producer, require, static_shape,
    unsqueezed_last,
)
from ._router import one_hot_route
from ._unrolled import LinearExpert, LoopBlock, UnrolledLoopFusion, mask_row


def _is_accumulation(node: ir.Node | None) -> bool:
    return standard(node, "ScatterND") and node.attributes.get_string("reduction", "none") == "add"


def _indexes_by_nonzero(scatter: ir.Node) -> bool:
    """Whether the ScatterND's row index is a column of a NonZero (through Unsqueeze/Squeeze/Slice/Transpose)."""
    node = scatter.inputs[1].producer()
    while node is not None and node.op_type in ("Unsqueeze", "Squeeze", "Slice", "Transpose"):
        node = node.inputs[0].producer()
    return standard(node, "NonZero")


class AccumulatingScatterMatcher(SimplePatternMatcher):
    """Tries only the last ScatterND with reduction add of a chain (index_add_), so each block is matched
    (and reported) once and other ScatterNDs (cache updates) are no near-misses; and only those whose
    row index comes from a NonZero (the loop's routed tokens) when ``loop_index``, else only the others
    (sorted experts). A block that neither form takes is still reported, by its router (``_unfused``)."""

    loop_index = True

    def match(self, model, graph_or_function, node, **kwargs):
        if not _is_accumulation(node):
            return MatchResult().fail("not an accumulating ScatterND")
        if node.outputs and any(_is_accumulation(user) and user.inputs[0] is node.outputs[0]
                                for user in node.outputs[0].consumers()):
            return MatchResult().fail("not the last accumulation of its chain")
        if _indexes_by_nonzero(node) != self.loop_index:
            return MatchResult().fail("the scatter index belongs to another form")
        return super().match(model, graph_or_function, node, **kwargs)


# ----------------------------------------------------------------------------- one branch

@dataclasses.dataclass(frozen=True)
class _Branch:
    """One unrolled expert: its mask row, inputs and weights (``in_out``: stored [in, out], per projection)."""

    mask_EKT: ir.Value
    expert: int
    tokens_TH: ir.Value
    routing_TK: ir.Value
    gate: Weight
    up: Weight
    down: Weight
    in_out: tuple[bool, bool, bool]
    alpha: float


def _column(value: ir.Value, what: str) -> tuple[ir.Value, int]:
    """``(where_N2, c)`` of ``value = Squeeze(Slice(where_N2, c:c+1 on axis 1), 1)``."""
    squeeze = producer(value, "Squeeze", what)
    require(axes(squeeze, 2) == [1], f"{what}: Squeeze axes are not [1]")
    piece = producer(squeeze.inputs[0], "Slice", what)
    inputs = list(piece.inputs) + [None] * (5 - len(piece.inputs))
    starts, ends = constant_ints(inputs[1]), constant_ints(inputs[2])
    slice_axes = constant_ints(inputs[3]) if inputs[3] is not None else None
    steps = constant_ints(inputs[4]) if inputs[4] is not None else [1]
    require(starts is not None and len(starts) == 1 and ends == [starts[0] + 1] and slice_axes in ([1], [-1])
            and steps == [1], f"{what} is not one column of NonZero's [N, 2] indices")
    return piece.inputs[0], starts[0]


def _routing(w_N1: ir.Value, token_N1: ir.Value, where_N2: ir.Value) -> ir.Value:
    """The [T, K] routing weights of ``w_N1 = GatherND(Unsqueeze(routing_TK, -1), Concat(token_N1, slot_N1))``."""
    gather = producer(w_N1, "GatherND", "the routing weight")
    require(gather.attributes.get_int("batch_dims", 0) == 0, "the routing weight GatherND has batch_dims != 0")
    routing_TK = unsqueezed_last(gather.inputs[0], 3, "the gathered routing weights")
    shape = static_shape(routing_TK)
    require(shape is not None and len(shape) == 2 and shape[1] is not None, "the routing weights are not [T, K]")
    concat = producer(gather.inputs[1], "Concat", "the routing weight index")
    require(concat.attributes.get_int("axis", 0) in (1, -1) and len(concat.inputs) == 2
            and concat.inputs[0] is token_N1, "the routing weight index is not (routed token, slot)")
    slot_N = unsqueezed_last(concat.inputs[1], 2, "the routing weight slot")
    require(_column(slot_N, "the slots") == (where_N2, 0), "the slots are not column 0 of NonZero(mask row)")
    return routing_TK


def _expert_tokens(x_NH: ir.Value, token_N1: ir.Value, hidden: int) -> ir.Value:
    """tokens_TH of ``x_NH = Reshape(Transpose(GatherND(Transpose(Unsqueeze(tokens_TH, 0)), token_N1)), [-1, H])``."""
    reshape = producer(x_NH, "Reshape", "the expert input")
    require(constant_ints(reshape.inputs[1]) == [-1, hidden], f"the expert input is not reshaped to [-1, {hidden}]")
    back = producer(reshape.inputs[0], "Transpose", "the gathered tokens")
    gather = producer(back.inputs[0], "GatherND", "the expert input")
    front = producer(gather.inputs[0], "Transpose", "the tokens")
    for transpose, what in ((back, "the gathered tokens"), (front, "the tokens")):
        require(list(transpose.attributes.get_ints("perm", [])) == [1, 0, 2],
                f"{what}: Transpose perm is not [1, 0, 2]")
    require(gather.inputs[1] is token_N1 and gather.attributes.get_int("batch_dims", 0) == 0,
            "the expert input does not gather the routed tokens")
    lifted = producer(front.inputs[0], "Unsqueeze", "the tokens")
    require(axes(lifted, 3) == [0], "the tokens are not unsqueezed on axis 0")
    return lifted.inputs[0]


def _expert(y_NH: ir.Value) -> tuple[ir.Value, tuple[Linear, Linear, Linear], float]:
    """``(x, (gate, up, down), alpha)`` of ``y = swish(x @ gate, alpha) * (x @ up) @ down``."""
    down = read_linear(y_NH, "the down projection")
    activation = read_swiglu(down.x)
    gate = read_linear(activation.gate, "the gate projection")
    up = read_linear(activation.up, "the up projection")
    require(up.x is gate.x, "the gate and up projections read different inputs")
    return gate.x, (gate, up, down), activation.alpha


def _branch(scatter: ir.Node, hidden: int) -> _Branch:
    """Reads and verifies the branch whose result ``scatter`` adds into the sum."""
    token_N1, updates_NH = scatter.inputs[1], scatter.inputs[2]
    where_N2, column = _column(unsqueezed_last(token_N1, 2, "the scatter index"), "the routed tokens")
    require(column == 1, "the routed tokens are not column 1 of NonZero(mask row)")
    mask_EKT, row_index = mask_row(nonzero_of(where_N2, "the routed tokens"))
    expert = constant_ints(row_index)
    require(expert is not None and len(expert) == 1, "the mask row index is not one constant")
    weighted = producer(updates_NH, "Mul", "the scattered rows")
    for y_NH, w_N1 in (weighted.inputs, reversed(weighted.inputs)):
        if standard(y_NH.producer(), "Gemm") or standard(y_NH.producer(), "MatMul"):
            break
    else:
        raise MatchFailure("no expert Gemm/MatMul among the factors of the weighted output")
    routing_TK = _routing(w_N1, token_N1, where_N2)
    x_NH, (gate, up, down), alpha = _expert(y_NH)
    tokens_TH = _expert_tokens(x_NH, token_N1, hidden)
    return _Branch(mask_EKT, expert[0], tokens_TH, routing_TK, gate.weight, up.weight, down.weight,
                   (gate.in_out, up.in_out, down.in_out), alpha)


# ----------------------------------------------------------------------------- the block

def _chain(last: ir.Node) -> list[ir.Node]:
    """The ScatterND of each index_add_ from the zeros to ``last``, in order."""
    scatters = []
    node: ir.Node | None = last
    while _is_accumulation(node):
        scatters.append(node)
        node = node.inputs[0].producer()
    require(is_zeros(scatters[-1].inputs[0]), "the accumulation does not start from zeros")
    return scatters[::-1]


def _moe_layout(w: Weight, in_out: bool) -> tuple[int, ...]:
    """The [out, in] shape of a projection weight."""
    return tuple(reversed(w.shape)) if in_out else w.shape


def _block(last: ir.Node) -> LoopBlock:
    """Walks the ScatterND chain back from ``last`` and verifies every branch."""
    shape = static_shape(last.outputs[0])
    require(shape is not None and len(shape) == 2 and shape[1] is not None, "the sum is not [T, H] with a static H")
    hidden = shape[1]
    scatters = _chain(last)
    labels = [f"branch {i} ('{scatter.name}')" for i, scatter in enumerate(scatters)]
    branches = []
    for scatter, label in zip(scatters, labels, strict=True):
        with failing_in(label):
            branches.append(_branch(scatter, hidden))
    first = branches[0]
    for name in ("mask_EKT", "tokens_TH", "routing_TK"):
        require(all(getattr(b, name) is getattr(first, name) for b in branches), f"the branches differ in {name}")
    intermediate = _moe_layout(first.gate, first.in_out[0])[0]
    dtype = first.tokens_TH.dtype
    for b, label in zip(branches, labels, strict=True):
        with failing_in(label):
            for w, in_out, expected, what in ((b.gate, b.in_out[0], (intermediate, hidden), "gate"),
                                              (b.up, b.in_out[1], (intermediate, hidden), "up"),
                                              (b.down, b.in_out[2], (hidden, intermediate), "down")):
                require(_moe_layout(w, in_out) == expected,
                        f"the {what} weight is {list(_moe_layout(w, in_out))} as [out, in], expected {list(expected)}")
                require(w.dtype == dtype, f"the {what} weight is {w.dtype}, the tokens are {dtype}")
            require(b.in_out == first.in_out, "the branches store their weights in different layouts")
            require(b.alpha == first.alpha, f"swish alpha {b.alpha:g} differs from {first.alpha:g}")
    route = one_hot_route(first.mask_EKT, first.routing_TK)
    experts = [b.expert for b in branches]
    require(all(0 <= e < route.experts for e in experts), f"expert rows {experts} are outside [0, {route.experts})")
    require(len(set(experts)) == len(experts), f"two branches compute the same expert ({sorted(experts)})")

    experts_by_row: list[LinearExpert | None] = [None] * route.experts
    for b in branches:
        experts_by_row[b.expert] = LinearExpert(b.gate, b.up, b.down, b.alpha, in_out=b.in_out)
    return LoopBlock(last.outputs[0].name, first.tokens_TH, route, experts_by_row, hidden, intermediate)


class LoopDynamoMoeFusion(UnrolledLoopFusion):
    """The dynamo exporter's unrolled per-expert loop (see the module docstring), matched at its last
    ``acc_TH = ScatterND(acc_TH, token_N1, updates_NH, reduction="add")``; ``read`` walks the chain back
    to its zeros; ``emit`` is :class:`UnrolledLoopFusion`'s, as for the TorchScript loop (one MOE GEMM3_SWIGLU)."""

    matcher = AccumulatingScatterMatcher
    removes_matched_nodes = False

    def pattern(self, op, acc_TH, token_N1, updates_NH):
        return op.ScatterND(acc_TH, token_N1, updates_NH)


    def read(self, context, **_) -> LoopBlock:
        return _block(context.root)


FUSIONS = [LoopDynamoMoeFusion]
