"""Fusions of the loop export form: the legacy TorchScript exporter's unrolled per-expert loop.

``torch.onnx.export(dynamo=False)`` of transformers 4.x's eager MoE block (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE) unrolls the loop over experts into one branch per expert the trace reached.
Every branch takes its tokens from a one-hot expert mask, runs the expert's three Linear layers and
index_add_s the weighted result into the block output, starting from zeros::

    mask_EKT = Transpose(OneHot(topk_indices_TK, E, [0, 1]), perm=[2, 1, 0])
    branch of expert e (row_KT = mask_EKT[e]):
        slot_N, token_N = Squeeze(Split(Transpose(NonZero(Cast(row_KT, bool)))))
        x_NH = Reshape(Gather(Unsqueeze(tokens_TH, 0), token_N, axis=1))
        y_NH = MatMul(Mul(SiLU(MatMul(x_NH, gate_HI)), MatMul(x_NH, up_HI)), down_IH)
        w_N1 = Reshape(Gather(Flatten(Unsqueeze(routing_TK, 2)), slot_N + token_N * K))
        acc_TH = Add(acc_TH, ScatterElements(zeros_like(acc_TH), Expand(token_N), Expand(Mul(y_NH, w_N1))))
    with acc_TH = ConstantOfShape(0) before the first branch.

The mask row e is a constant (OLMoE loops over range(E)) or the i-th expert the trace hit (Mixtral
and Qwen loop over ``expert_hit = nonzero(mask.sum((-1, -2)) > 0)``, exported as the i-th output of a
Split of that NonZero; such a graph runs only on inputs that reach exactly the traced experts).
The whole chain of branches becomes one MOE GEMM3_SWIGLU node fed by the router's TopK indices and
the routing weights the branches multiply by; experts without a branch get zero weights.

Shapes in names: T tokens, H hidden size, I expert intermediate size, E experts, K experts per
token, N tokens routed to one expert.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRule
from onnxscript.rewriter.pattern import SimplePatternMatcher

from ..ops.moe import GEMM3_SWIGLU
from ._activation import read_swiglu
from ._match import MatchFailure, MoeFusion, constant_ints, constant_scalar, emit_moe, failing_in, is_zeros, \
    require, standard
from ._router import Route, one_hot_route
from ._weights import Weight, lazy_initializer, weight

_SCOPE_EXPERT = re.compile(r"(?:^|/)experts\.(\d+)/")


# ----------------------------------------------------------------------------- graph helpers

def _producer(value: ir.Value | None, op_type: str, what: str) -> ir.Node:
    """The node computing ``value``, which must be a standard ``op_type``."""
    node = None if value is None else value.producer()
    require(standard(node, op_type),
            f"{what} is not computed by {op_type} (found {'no node' if node is None else node.op_type})")
    return node


def _ints_input_or_attr(node: ir.Node, index: int, name: str) -> list[int] | None:
    """An int-list operand given as input ``index`` (recent opsets) or attribute ``name`` (older)."""
    if len(node.inputs) > index and node.inputs[index] is not None:
        return constant_ints(node.inputs[index])
    attr = node.attributes.get(name)
    return None if attr is None else list(attr.as_ints())


def _axes(node: ir.Node, rank: int) -> list[int] | None:
    """The (non-negative) axes of a Squeeze, Unsqueeze or ReduceSum; ``rank`` normalizes negatives."""
    axes = _ints_input_or_attr(node, 1, "axes")
    return None if axes is None else sorted(a % rank for a in axes)


def _static_shape(value: ir.Value) -> tuple[int | None, ...] | None:
    if value.shape is None:
        return None
    return tuple(d if isinstance(d, int) else None for d in value.shape)


def _skip_identity_casts(value: ir.Value) -> ir.Value:
    """Follows Casts to the type their input already has (the exporter's ``.to(dtype)``)."""
    node = value.producer()
    while standard(node, "Cast") and node.inputs[0].dtype == ir.DataType(node.attributes.get_int("to", 0)):
        value = node.inputs[0]
        node = value.producer()
    return value


def _split_of(value: ir.Value, axis: int, what: str) -> tuple[ir.Node, int]:
    """The Split into rows/columns of one element that ``Squeeze(value, axis)`` takes; and which output."""
    squeeze = _producer(value, "Squeeze", what)
    split = _producer(squeeze.inputs[0], "Split", what)
    require(_axes(squeeze, 2) == [axis], f"{what}: Squeeze axes are not [{axis}]")
    require(split.attributes.get_int("axis", 0) == axis, f"{what}: Split axis is not {axis}")
    sizes = _ints_input_or_attr(split, 1, "split")
    require(sizes is None or sizes == [1] * len(split.outputs), f"{what}: Split sizes {sizes} are not all 1")
    return split, list(split.outputs).index(squeeze.inputs[0])


def _nonzero_of(value: ir.Value, what: str) -> ir.Value:
    """The input of ``Transpose(NonZero(x), perm=[1, 0])`` (the exporter's torch.where/nonzero)."""
    transpose = _producer(value, "Transpose", what)
    require(list(transpose.attributes.get_ints("perm", [])) == [1, 0], f"{what}: Transpose perm is not [1, 0]")
    return _producer(transpose.inputs[0], "NonZero", what).inputs[0]


def _first_row(value: ir.Value, hidden: int) -> bool:
    """Whether ``value`` is ``x[0:1, :]`` of an [*, hidden] matrix x (a Slice with constant operands)."""
    node = value.producer()
    if not standard(node, "Slice"):
        return False
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    starts, ends = constant_ints(inputs[1]), constant_ints(inputs[2])
    if starts is None or ends is None:
        return False
    axes = constant_ints(inputs[3]) if inputs[3] is not None else list(range(len(starts)))
    steps = constant_ints(inputs[4]) if inputs[4] is not None else [1] * len(starts)
    if axes is None or steps is None:
        return False
    ranges = {axis % 2: (start, end, step) for axis, start, end, step in zip(axes, starts, ends, steps)}
    start, end, step = ranges.get(1, (0, hidden, 1))
    return ranges.get(0) == (0, 1, 1) and (start, step) == (0, 1) and end >= hidden


def _accumulation(node: ir.Node | None) -> tuple[ir.Value, ir.Node] | None:
    """``(acc_TH, scatter)`` when ``node`` is one index_add_:
    ``Add(acc_TH, ScatterElements(ConstantOfShape(Shape(acc_TH)), index, updates))``."""
    if not standard(node, "Add") or len(node.inputs) != 2:
        return None
    acc_TH, scattered = node.inputs
    scatter = None if scattered is None else scattered.producer()
    if not standard(scatter, "ScatterElements"):
        return None
    zeros = scatter.inputs[0].producer()
    shape = zeros.inputs[0].producer() if standard(zeros, "ConstantOfShape") else None
    return (acc_TH, scatter) if standard(shape, "Shape") and shape.inputs[0] is acc_TH else None


def _accumulates_further(value: ir.Value) -> bool:
    return any((step := _accumulation(user)) is not None and step[0] is value for user in value.consumers())


class _LastAccumulationMatcher(SimplePatternMatcher):
    """Tries only the last index_add_ of a chain, so each block is matched (and reported) once."""

    def match(self, model, graph_or_function, node, **kwargs):
        if node.outputs and _accumulates_further(node.outputs[0]):
            return MatchResult().fail("not the last accumulation of its chain")
        return super().match(model, graph_or_function, node, **kwargs)


# ----------------------------------------------------------------------------- one branch
# Each reader below checks one part of a branch; _block prefixes the branch to their failures.

@dataclasses.dataclass(frozen=True)
class _Branch:
    """One unrolled expert: which mask row it reads, its inputs and its weights (MatMul layout)."""

    mask_EKT: ir.Value
    row: int | tuple[ir.Node, int]  # a constant row, or (Split of the hit experts, output position)
    tokens_TH: ir.Value
    routing_TK: ir.Value
    gate_HI: Weight
    up_HI: Weight
    down_IH: Weight
    alpha: float
    scope_expert: int | None  # the e of the ".../experts.<e>/..." node names, when they all agree


def _linear(value: ir.Value, what: str) -> tuple[ir.Value, Weight, ir.Node]:
    """``(x, W, node)`` of ``value = MatMul(x, W)`` with a constant matrix W."""
    matmul = _producer(value, "MatMul", what)
    w = weight(matmul.inputs[1])
    require(w is not None and len(w.shape) == 2, f"{what} weight is not a constant matrix")
    return matmul.inputs[0], w, matmul


def _expert(y_NH: ir.Value) -> tuple[ir.Value, Weight, Weight, Weight, float, list[ir.Node]]:
    """``(x, gate, up, down, alpha, MatMuls)`` of ``y = MatMul(swish(x @ gate, alpha) * (x @ up), down)``;
    which weight is which follows from the dataflow."""
    act_NI, down, down_mm = _linear(y_NH, "the down projection")
    activation = read_swiglu(act_NI)
    x_NH, gate, gate_mm = _linear(activation.gate, "the gate projection")
    x_up, up, up_mm = _linear(activation.up, "the up projection")
    require(x_up is x_NH, "the gate and up projections read different inputs")
    return x_NH, gate, up, down, activation.alpha, [gate_mm, up_mm, down_mm]


def _routing(w_N1: ir.Value, token_N: ir.Value, slot_N: ir.Value) -> ir.Value:
    """The [T, K] routing weights that ``w_N1 = routing_TK[token_N, slot_N, None]`` gathers."""
    shape = _static_shape(w_N1)
    require(shape is not None and len(shape) == 2 and shape[1] == 1, "the routing weight is not [N, 1]")
    value = w_N1
    while standard(value.producer(), "Reshape"):  # reshapes to [N, 1] keep the element order
        value = value.producer().inputs[0]
    gather = _producer(value, "Gather", "the routing weight")
    require(gather.attributes.get_int("axis", 0) == 0, "the routing weight Gather axis is not 0")
    flatten = _producer(gather.inputs[0], "Flatten", "the gathered routing weights")
    require(flatten.attributes.get_int("axis", 1) == 2, "the routing weights Flatten axis is not 2")
    unsqueeze = _producer(flatten.inputs[0], "Unsqueeze", "the flattened routing weights")
    routing_TK = unsqueeze.inputs[0]
    shape = _static_shape(routing_TK)
    require(shape is not None and len(shape) == 2 and shape[1] is not None, "the routing weights are not [T, K]")
    require(_axes(unsqueeze, 3) == [2], "the routing weights are not unsqueezed on axis 2")
    # the flat index into [T * K, 1] must be slot + token * K
    add = _producer(gather.inputs[1], "Add", "the routing weight index")
    require(slot_N in add.inputs, "the routing weight index does not add the slot")
    scaled_token = add.inputs[1] if add.inputs[0] is slot_N else add.inputs[0]
    mul = _producer(scaled_token, "Mul", "the routing weight index")
    require(token_N in mul.inputs, "the routing weight index does not scale the token")
    k = mul.inputs[1] if mul.inputs[0] is token_N else mul.inputs[0]
    k_value = constant_ints(k)
    if k_value is None:  # Gather(Shape(routing_TK1), 1)
        dim = _producer(k, "Gather", "the routing weight row length")
        of_shape = _producer(dim.inputs[0], "Shape", "the routing weight row length")
        axis = constant_ints(dim.inputs[1])
        k_value = [shape[1]] if of_shape.inputs[0] is unsqueeze.outputs[0] and axis == [1] else None
    require(k_value == [shape[1]], f"the routing weight index does not step by K = {shape[1]} per token")
    return routing_TK


def _mask_row(row_KT: ir.Value) -> tuple[ir.Value, ir.Value]:
    """``(mask_EKT, row index)`` of ``row_KT = mask_EKT[index]`` (Gather, Squeeze of a 1-element index)."""
    node = row_KT.producer()
    if standard(node, "Squeeze"):
        require(_axes(node, 3) == [0], "the mask row Squeeze axes are not [0]")
        row_KT = node.inputs[0]
    gather = _producer(row_KT, "Gather", "the mask row")
    require(gather.attributes.get_int("axis", 0) == 0, "the mask row Gather axis is not 0")
    return gather.inputs[0], gather.inputs[1]


def _hit_position(index: ir.Value, mask_EKT: ir.Value) -> tuple[ir.Node, int]:
    """The Split output position of ``index = Squeeze(Split(nonzero(ReduceSum(mask, (1, 2)) > 0))[i])``."""
    split, position = _split_of(index, 0, "the hit expert index")
    hit = _nonzero_of(split.inputs[0], "the hit experts")
    greater = _producer(hit, "Greater", "the hit experts")
    require(constant_scalar(greater.inputs[1]) == 0, "the hit experts are not those with a count > 0")
    reduce = _producer(greater.inputs[0], "ReduceSum", "the expert counts")
    require(reduce.inputs[0] is mask_EKT, "the expert counts are not summed over the expert mask")
    require(_axes(reduce, 3) == [1, 2] and reduce.attributes.get_int("keepdims", 1) == 0,
            "the expert counts are not summed over (slot, token) to [E]")
    return split, position


def _row_ref(row_index: ir.Value, mask_EKT: ir.Value) -> int | tuple[ir.Node, int]:
    """The mask row a branch reads: a constant, or its position among the hit experts."""
    constant_row = constant_ints(row_index)
    if constant_row is None:
        return _hit_position(row_index, mask_EKT)
    require(len(constant_row) == 1, f"the mask row index {constant_row} is not one row")
    return constant_row[0]


def _scatter_target(scatter: ir.Node) -> int:
    """H of the zeros [T, H] that the branch's ScatterElements (axis 0, no reduction or add) writes into."""
    require(scatter.attributes.get_int("axis", 0) == 0, "ScatterElements axis is not 0")
    reduction = scatter.attributes.get_string("reduction", "none")
    require(reduction in ("none", "add"), f"ScatterElements reduction is {reduction!r}")
    require(is_zeros(scatter.inputs[0]), "the scatter target is not zeros")
    zeros_shape = _static_shape(scatter.inputs[0])
    require(zeros_shape is not None and len(zeros_shape) == 2 and zeros_shape[1] is not None,
            "the accumulator is not [T, H] with a static H")
    return zeros_shape[1]


def _weighted_rows(updates: ir.Value, hidden: int) -> ir.Node:
    """The Mul(y_NH, w_N1) that ``updates = Expand(Mul(...), Shape(acc[:1]))`` broadcasts to [N, H] unchanged."""
    expand = _producer(updates, "Expand", "the scattered rows")
    target = _producer(expand.inputs[1], "Shape", "the scattered rows' shape").inputs[0]
    require(_static_shape(target) == (1, hidden) or _first_row(target, hidden),
            "the scattered rows are not expanded to the shape of one accumulator row")
    return _producer(_skip_identity_casts(expand.inputs[0]), "Mul", "the weighted expert output")


def _routed_tokens(index: ir.Value, updates: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """``(token_N, slot_N, row_KT)``: ``index = Expand(Unsqueeze(token_N, 1), Shape(updates))`` (row r of the
    updates goes to token_N[r]) with token_N and slot_N the columns of NonZero(mask row row_KT)."""
    expand = _producer(index, "Expand", "the scatter index")
    require(_producer(expand.inputs[1], "Shape", "the scatter index shape").inputs[0] is updates,
            "the scatter index is not expanded to the updates' shape")
    unsqueeze = _producer(expand.inputs[0], "Unsqueeze", "the scatter index")
    require(_axes(unsqueeze, 2) == [1], "the scatter index is not unsqueezed on axis 1")
    token_N = unsqueeze.inputs[0]
    split, column = _split_of(token_N, 1, "the routed tokens")
    require(column == 1 and len(split.outputs) == 2, "the routed tokens are not column 1 of NonZero(mask row)")
    slot_N = next((user.outputs[0] for user in split.outputs[0].consumers() if standard(user, "Squeeze")), None)
    require(slot_N is not None and _split_of(slot_N, 1, "the slots") == (split, 0),
            "the slots are not column 0 of NonZero(mask row)")
    row = _nonzero_of(split.inputs[0], "the routed tokens")
    cast = row.producer()
    if standard(cast, "Cast"):
        require(cast.attributes.get_int("to", 0) == ir.DataType.BOOL, "the mask row is cast to a non-bool type")
        row = cast.inputs[0]
    require(_static_shape(row) is not None and len(row.shape) == 2, "the mask row is not [K, T]")
    return token_N, slot_N, row


def _expert_tokens(x_NH: ir.Value, token_N: ir.Value, hidden: int) -> ir.Value:
    """tokens_TH of ``x_NH = Reshape(Gather(Unsqueeze(tokens_TH, 0), token_N, axis=1))`` to [N, H]."""
    reshape = _producer(x_NH, "Reshape", "the expert input")
    require(_static_shape(x_NH) is not None and len(x_NH.shape) == 2 and x_NH.shape[1] == hidden,
            f"the expert input is not [N, {hidden}]")
    picked = _producer(reshape.inputs[0], "Gather", "the expert input")
    require(picked.inputs[1] is token_N and picked.attributes.get_int("axis", 0) == 1,
            "the expert input does not gather the routed tokens on axis 1")
    lifted = _producer(picked.inputs[0], "Unsqueeze", "the gathered tokens")
    require(_axes(lifted, 3) == [0], "the tokens are not unsqueezed on axis 0")
    return lifted.inputs[0]


def _branch(scatter: ir.Node) -> _Branch:
    """Reads and verifies the branch whose result ``scatter`` writes."""
    hidden = _scatter_target(scatter)
    weighted = _weighted_rows(scatter.inputs[2], hidden)
    token_N, slot_N, row_KT = _routed_tokens(scatter.inputs[1], scatter.inputs[2])
    mask_EKT, row_index = _mask_row(row_KT)
    for y_NH, w_N1 in (weighted.inputs, reversed(weighted.inputs)):
        if standard(y_NH.producer(), "MatMul"):
            break
    else:
        raise MatchFailure("no expert MatMul among the factors of the weighted output")
    routing_TK = _routing(w_N1, token_N, slot_N)
    x_NH, gate, up, down, alpha, matmuls = _expert(y_NH)
    tokens_TH = _expert_tokens(x_NH, token_N, hidden)
    scopes = {match.group(1) for node in matmuls if (match := _SCOPE_EXPERT.search(node.name or ""))}
    scope_expert = int(scopes.pop()) if len(scopes) == 1 and len(matmuls) == 3 else None
    return _Branch(mask_EKT, _row_ref(row_index, mask_EKT), tokens_TH, routing_TK, gate, up, down, alpha,
                   scope_expert)


# ----------------------------------------------------------------------------- the block

@dataclasses.dataclass(frozen=True)
class _Block:
    """A verified chain of branches: the MOE inputs and each expert's weights (None: no branch)."""

    name: str  # the chain's result, for the report
    tokens_TH: ir.Value
    route: Route
    gate_HI: list[Weight | None]
    up_HI: list[Weight | None]
    down_IH: list[Weight | None]
    alpha: float
    hidden: int
    intermediate: int
    # per projection (gate, up, down): stored [in, out] as named above (MatMul), or [out, in] (nn.Linear
    # weights of a Gemm with transB=1, the layout MOE takes)
    in_out: tuple[bool, bool, bool] = (True, True, True)


def _chain(last: ir.Node) -> list[ir.Node]:
    """The ScatterElements of each index_add_ from the zeros to ``last``, in order."""
    scatters = []
    node: ir.Node | None = last
    while (step := _accumulation(node)) is not None:
        acc_TH, scatter = step
        scatters.append(scatter)
        node = acc_TH.producer()
    require(standard(node, "ConstantOfShape") and is_zeros(node.outputs[0]),
            "the accumulation does not start from zeros")
    return scatters[::-1]


def _check_alike(branches: list[_Branch], labels: list[str]) -> tuple[int, int]:
    """(H, I): every branch reads the same mask, tokens and routing weights, with weights of one shape,
    type and swish alpha."""
    first = branches[0]
    for name in ("mask_EKT", "tokens_TH", "routing_TK"):
        require(all(getattr(b, name) is getattr(first, name) for b in branches), f"the branches differ in {name}")
    dtype = first.tokens_TH.dtype
    tokens_shape = _static_shape(first.tokens_TH)
    require(tokens_shape is not None and len(tokens_shape) == 2 and tokens_shape[1] is not None,
            "the tokens are not [T, H] with a static H")
    hidden = tokens_shape[1]
    intermediate = first.gate_HI.shape[1]
    for b, label in zip(branches, labels, strict=True):
        with failing_in(label):
            for w, shape, what in ((b.gate_HI, (hidden, intermediate), "gate"),
                                   (b.up_HI, (hidden, intermediate), "up"), (b.down_IH, (intermediate, hidden), "down")):
                require(w.shape == shape, f"the {what} weight is {list(w.shape)}, expected {list(shape)}")
                require(w.dtype == dtype, f"the {what} weight is {w.dtype}, the tokens are {dtype}")
            require(b.alpha == first.alpha, f"swish alpha {b.alpha:g} differs from {first.alpha:g}")
    return hidden, intermediate


def _expert_numbers(branches: list[_Branch], experts: int) -> list[int]:
    """The expert of each branch: its constant mask row, or its hit position mapped to the traced experts."""
    if all(isinstance(b.row, int) for b in branches):
        numbers = [b.row for b in branches]
    else:
        require(all(not isinstance(b.row, int) for b in branches),
                "the branches mix constant and hit-expert mask rows")
        splits = {b.row[0] for b in branches}
        require(len(splits) == 1, "the branches read the hit experts of different Splits")
        positions = [b.row[1] for b in branches]
        hits = len(next(iter(splits)).outputs)
        require(sorted(positions) == list(range(hits)), f"the branches read hit experts {positions} of {hits}")
        if hits == experts:  # the i-th of all E experts in increasing order is expert i
            numbers = positions
        else:  # the trace missed some experts; only the branches' scope names tell which ones it hit
            numbers = [b.scope_expert for b in branches]
            by_position = [n for _, n in sorted(zip(positions, numbers, strict=True))]
            require(None not in numbers and by_position == sorted(set(by_position)),
                    f"the loop has {hits} of {experts} experts and its node names do not say which")
    require(all(0 <= n < experts for n in numbers), f"expert rows {numbers} are outside [0, {experts})")
    require(len(set(numbers)) == len(numbers), f"two branches compute the same expert ({sorted(numbers)})")
    return numbers


def _block(last: ir.Node) -> _Block:
    """Walks the accumulation chain back from ``last`` and verifies every branch."""
    scatters = _chain(last)
    labels = [f"branch {i} ('{scatter.name}')" for i, scatter in enumerate(scatters)]
    branches = []
    for scatter, label in zip(scatters, labels, strict=True):
        with failing_in(label):
            branches.append(_branch(scatter))
    hidden, intermediate = _check_alike(branches, labels)
    first = branches[0]
    route = one_hot_route(first.mask_EKT, first.routing_TK)
    numbers = _expert_numbers(branches, route.experts)

    def by_expert(field: str) -> list[Weight | None]:
        weights: list[Weight | None] = [None] * route.experts
        for n, b in zip(numbers, branches, strict=True):
            weights[n] = getattr(b, field)
        return weights

    return _Block(last.outputs[0].name, first.tokens_TH, route, by_expert("gate_HI"), by_expert("up_HI"),
                  by_expert("down_IH"), first.alpha, hidden, intermediate)


def _stacked(op, name: str, weights: list[Weight | None], dtype: ir.DataType, shape: tuple[int, int, int],
             transpose: bool = True) -> ir.Value:
    """A lazy [E, rows, cols] initializer of the per-expert matrices (transposed unless ``transpose`` is
    False: already [out, in]); zeros for absent experts."""

    def expert_slice(e: int) -> np.ndarray:
        w = weights[e]
        if w is None:
            return np.zeros(shape[1:], dtype=dtype.numpy())
        return w.array().T if transpose else w.array()

    return lazy_initializer(op, name, expert_slice, dtype, shape, sources=[w.source for w in weights if w])


class LoopMoeFusion(MoeFusion):
    """The unrolled per-expert loop (see the module docstring), matched at its last accumulation::

        acc_TH = Add(acc_TH, ScatterElements(ConstantOfShape(Shape(acc_TH)), token_NH, updates_NH))

    ``read`` walks the chain of such index_add_s back to its zeros and verifies each branch;
    ``emit`` replaces the chain's result by
    ``MOE(tokens_TH, routing_TK, topk_indices_TK, gate_EIH, -, up_EIH, -, down_EHI)``.
    """

    def pattern(self, op, acc_TH, token_NH, updates_NH):
        return op.Add(acc_TH, op.ScatterElements(op.ConstantOfShape(op.Shape(acc_TH)), token_NH, updates_NH))

    def as_rule(self) -> RewriteRule:
        # remove_nodes=False: the rule set then drops the whole dead chain at once, so the earlier
        # accumulations do not become "last" ones for a later matching pass
        return RewriteRule(self.pattern, self.rewrite, self.check, matcher=_LastAccumulationMatcher,
                           name=self.name, remove_nodes=False)

    def read(self, context, **_) -> _Block:
        return _block(context.root)

    def emit(self, op, block: _Block) -> ir.Value:
        missing = [e for e, w in enumerate(block.gate_HI) if w is None]
        note = (f"block '{block.name}': experts {missing} have no branch in the export (the trace routed no token "
                "to them); fused with zero weights, so they contribute nothing")
        if missing and note not in self.notes:
            self.notes.append(note)
        experts, dtype = block.route.experts, block.tokens_TH.dtype
        shape_EIH, shape_EHI = (experts, block.intermediate, block.hidden), (experts, block.hidden, block.intermediate)
        gate_in_out, up_in_out, down_in_out = block.in_out
        return emit_moe(op, block.tokens_TH, block.route.weights, block.route.indices, expert_type=GEMM3_SWIGLU,
                        weight_0=_stacked(op, "loop_gate_EIH", block.gate_HI, dtype, shape_EIH, gate_in_out),
                        weight_1=_stacked(op, "loop_up_EIH", block.up_HI, dtype, shape_EIH, up_in_out),
                        weight_2=_stacked(op, "loop_down_EHI", block.down_IH, dtype, shape_EHI, down_in_out),
                        expert_alpha=block.alpha)


FUSIONS = [LoopMoeFusion]
