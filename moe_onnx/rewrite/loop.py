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

Three more exports of the same loop, read by the same readers:

- DeepSeek-V3 (and GLM-4-MoE, dots1) permutes the mask to [E, T, K] (perm [2, 0, 1]): a row's NonZero has
  the tokens in column 0; the tokens are gathered straight from tokens_TH, and the routing weights are
  flattened without the Unsqueeze. Its router (sigmoid, expert bias, group-limited TopK, renormalized and
  scaled) stays; MOE takes its last TopK's indices and the weights it computes.
- GPT-OSS on CPU (transformers 4.57) computes the hit expert ``e = Squeeze(Split(...)[i])[0]`` and gathers the
  stacked weights and biases at it (``x @ gate_up[e] + gate_up_bias[e]``, the clamped SwiGLU, ``@ down[e] +
  down_bias[e]``); its mask has E + 1 rows (a "masking" class) and its weight is ``router_scores[token_N, e]``,
  the dense [T, E] matrix that the router scatters from its TopK. It becomes one MOE GEMM2_BIAS_SWIGLU_CLAMP on
  the stacked weights as they are; since every branch computes whichever expert it reads at run time, the
  export is right on any input that hits as many experts as the trace, and so is MOE, on any input.
- GraniteMoe / JetMoe (ParallelExperts) have one index_add_ of all T * K routed rows, sorted by expert:
  ``token_R = Div(TopK(Reshape(topk_indices_TK, [-1]), ascending).indices, K)``, the rows ``Gather(tokens_TH,
  token_R)`` split into per-expert blocks by the trace's expert counts (a constant), each block's
  ``MatMul`` with that expert's gate_up matrix, ``Concat``, SwiGLU of its two halves (``Slice``), the same for
  down, weighted by ``Gather(Reshape(routing_TK, [-1]), order)``. It becomes one MOE GEMM3_SWIGLU; the export
  itself runs only on inputs with the traced counts and scatters duplicate indices without reduction
  (onnxruntime keeps one of a token's K rows, torch sums them): the report notes that MOE computes torch's sum.

Shapes in names: T tokens, H hidden size, I expert intermediate size, E experts, K experts per
token, N tokens routed to one expert.
"""

from __future__ import annotations

import dataclasses
import re

import onnx_ir as ir
from onnxscript.rewriter import MatchResult
from onnxscript.rewriter.pattern import SimplePatternMatcher

from .._ir.nodes import skip_reshapes, standard
from .._ir.weights import Weight, weight
from ._activation import read_clamped_swiglu, read_swiglu
from ._match import (
    MatchFailure, axes, constant_ints, constant_scalar, failing_in, ints_input_or_attr, is_zeros, nonzero_of, producer,
    require, shape_dims, static_shape,
)
from ._router import one_hot_dense_route, one_hot_route, route as _route
from ._unrolled import GatheredExpert, LinearExpert, LoopBlock, UnrolledLoopFusion, mask_row

_SCOPE_EXPERT = re.compile(r"(?:^|/)experts\.(\d+)/")


# ----------------------------------------------------------------------------- graph helpers

def _skip_identity_casts(value: ir.Value) -> ir.Value:
    """Follows Casts to the type their input already has (the exporter's ``.to(dtype)``)."""
    node = value.producer()
    while standard(node, "Cast") and node.inputs[0].dtype == ir.DataType(node.attributes.get_int("to", 0)):
        value = node.inputs[0]
        node = value.producer()
    return value


def _split_of(value: ir.Value, axis: int, what: str) -> tuple[ir.Node, int]:
    """The Split into rows/columns of one element that ``Squeeze(value, axis)`` takes; and which output."""
    squeeze = producer(value, "Squeeze", what)
    split = producer(squeeze.inputs[0], "Split", what)
    require(axes(squeeze, 2) == [axis], f"{what}: Squeeze axes are not [{axis}]")
    require(split.attributes.get_int("axis", 0) == axis, f"{what}: Split axis is not {axis}")
    sizes = ints_input_or_attr(split, 1, "split")
    require(sizes is None or sizes == [1] * len(split.outputs), f"{what}: Split sizes {sizes} are not all 1")
    return split, list(split.outputs).index(squeeze.inputs[0])


def _first_row(value: ir.Value, hidden: int) -> bool:
    """Whether ``value`` is ``x[0:1, :]`` of an [*, hidden] matrix x (a Slice with constant operands)."""
    node = value.producer()
    if not standard(node, "Slice"):
        return False
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    starts, ends = constant_ints(inputs[1]), constant_ints(inputs[2])
    if starts is None or ends is None:
        return False
    slice_axes = constant_ints(inputs[3]) if inputs[3] is not None else list(range(len(starts)))
    steps = constant_ints(inputs[4]) if inputs[4] is not None else [1] * len(starts)
    if slice_axes is None or steps is None:
        return False
    ranges = {axis % 2: (start, end, step) for axis, start, end, step in zip(slice_axes, starts, ends, steps)}
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
    """One unrolled expert: which mask row it reads, its inputs, routing weights and expert."""

    expert_mask: ir.Value
    row: int | tuple[ir.Node, int]  # a constant row, or (Split of the hit experts, output position)
    token_column: int  # which column of NonZero(mask row) holds the routed tokens
    tokens_TH: ir.Value
    routing: ir.Value  # the top-k weights [T, K], or the dense [T, E] matrix (``dense``)
    dense: bool
    expert: LinearExpert | GatheredExpert
    scope_expert: int | None  # the e of the ".../experts.<e>/..." node names, when they all agree


def _linear(value: ir.Value, what: str) -> tuple[ir.Value, Weight, ir.Node]:
    """``(x, W, node)`` of ``value = MatMul(x, W)`` with a constant matrix W."""
    matmul = producer(value, "MatMul", what)
    w = weight(matmul.inputs[1])
    require(w is not None and len(w.shape) == 2, f"{what} weight is not a constant matrix")
    return matmul.inputs[0], w, matmul


def _linears(y_NH: ir.Value) -> tuple[ir.Value, LinearExpert, list[ir.Node]]:
    """``(x, expert, MatMuls)`` of ``y = MatMul(swish(x @ gate, alpha) * (x @ up), down)``; which weight is
    which follows from the dataflow."""
    act_NI, down, down_mm = _linear(y_NH, "the down projection")
    activation = read_swiglu(act_NI)
    x_NH, gate, gate_mm = _linear(activation.gate, "the gate projection")
    x_up, up, up_mm = _linear(activation.up, "the up projection")
    require(x_up is x_NH, "the gate and up projections read different inputs")
    return x_NH, LinearExpert(gate, up, down, activation.alpha), [gate_mm, up_mm, down_mm]


def _gathered_weight(value: ir.Value, index: ir.Value, what: str) -> Weight:
    """The constant stacked tensor W of ``value = Gather(W, index, axis=0)`` (one expert's slice)."""
    gather = producer(value, "Gather", what)
    require(gather.attributes.get_int("axis", 0) == 0 and gather.inputs[1] is index,
            f"{what} is not gathered on axis 0 at the branch's expert index")
    w = weight(gather.inputs[0])
    require(w is not None, f"{what} is not gathered from a constant")
    return w


def _biased_linear(value: ir.Value, index: ir.Value, what: str) -> tuple[ir.Value, Weight, Weight]:
    """``(x, W, b)`` of ``value = Add(MatMul(x, Gather(W, index)), Gather(b, index))`` (Add in either order)."""
    add = producer(value, "Add", what)
    product, bias = add.inputs if standard(add.inputs[0].producer(), "MatMul") else reversed(add.inputs)
    matmul = producer(product, "MatMul", f"{what} (with its bias)")
    return (matmul.inputs[0], _gathered_weight(matmul.inputs[1], index, f"{what} weight"),
            _gathered_weight(bias, index, f"{what} bias"))


def _gathered(y_NH: ir.Value, index: ir.Value) -> tuple[ir.Value, GatheredExpert]:
    """``(x, expert)`` of GPT-OSS's ``y = clamped_swiglu(x @ gate_up[e] + gate_up_bias[e]) @ down[e] + down_bias[e]``
    with e the branch's expert ``index``."""
    act_NI, down, down_bias = _biased_linear(y_NH, index, "the down projection")
    require(len(down.shape) == 3, f"the down projection weight {list(down.shape)} is not [E, I, H]")
    activation = read_clamped_swiglu(act_NI, 2 * down.shape[1])
    x_NH, gate_up, gate_up_bias = _biased_linear(activation.gate_up, index, "the gate_up projection")
    return x_NH, GatheredExpert(gate_up, gate_up_bias, down, down_bias, activation.gate_parity, activation.limit,
                           activation.alpha)


def _top_k_weights(gather: ir.Node, token_N: ir.Value, slot_N: ir.Value | None) -> ir.Value:
    """routing_TK of ``gather = Gather(Flatten(routing_TK (unsqueezed on axis 2)), slot_N + token_N * K)``."""
    require(gather.attributes.get_int("axis", 0) == 0, "the routing weight Gather axis is not 0")
    flatten = producer(gather.inputs[0], "Flatten", "the gathered routing weights")
    require(flatten.attributes.get_int("axis", 1) == 2, "the routing weights Flatten axis is not 2")
    routing_TK = flatten.inputs[0]
    unsqueeze = routing_TK.producer()
    if standard(unsqueeze, "Unsqueeze"):
        require(axes(unsqueeze, 3) == [2], "the routing weights are not unsqueezed on axis 2")
        routing_TK = unsqueeze.inputs[0]
    shape = static_shape(routing_TK)
    require(shape is not None and len(shape) == 2 and shape[1] is not None, "the routing weights are not [T, K]")
    # the flat index into [T * K, 1] must be slot + token * K
    add = producer(gather.inputs[1], "Add", "the routing weight index")
    require(slot_N is not None and slot_N in add.inputs, "the routing weight index does not add the slot")
    scaled_token = add.inputs[1] if add.inputs[0] is slot_N else add.inputs[0]
    mul = producer(scaled_token, "Mul", "the routing weight index")
    require(token_N in mul.inputs, "the routing weight index does not scale the token")
    k = shape_dims(mul.inputs[1] if mul.inputs[0] is token_N else mul.inputs[0])
    require(k == [shape[1]], f"the routing weight index does not step by K = {shape[1]} per token")
    return routing_TK


def _dense_column(gather: ir.Node, expert_index: ir.Value) -> ir.Value:
    """dense_TE of ``gather = Gather(Unsqueeze(Gather(dense_TE, expert_index, axis=1), 1), token_N)``: the
    branch's expert's column of a dense [T, E] matrix at the routed tokens (GPT-OSS)."""
    require(gather.attributes.get_int("axis", 0) == 0, "the routing weight Gather axis is not 0")
    unsqueeze = producer(gather.inputs[0], "Unsqueeze", "the routing weights column")
    require(axes(unsqueeze, 2) == [1], "the routing weights column is not unsqueezed on axis 1")
    column = producer(unsqueeze.inputs[0], "Gather", "the routing weights column")
    require(column.attributes.get_int("axis", 0) == 1 and column.inputs[1] is expert_index,
            "the routing weights column is not the branch's expert's (Gather axis 1 at its index)")
    dense_TE = column.inputs[0]
    require(static_shape(dense_TE) is not None and len(dense_TE.shape) == 2,
            "the dense routing weights are not [T, E]")
    return dense_TE


def _routing(w_N1: ir.Value, token_N: ir.Value, slot_N: ir.Value | None,
             expert_index: ir.Value) -> tuple[ir.Value, bool]:
    """``(weights, dense)``: the routing weights that ``w_N1`` [N, 1] gathers: ``routing_TK[token_N, slot_N]``
    (the top-k weights [T, K]) or, dense, ``dense_TE[token_N, expert]`` (a [T, E] matrix)."""
    shape = static_shape(w_N1)
    require(shape is not None and len(shape) == 2 and shape[1] == 1, "the routing weight is not [N, 1]")
    gather = producer(skip_reshapes(w_N1), "Gather", "the routing weight")  # the [N, 1] result is checked above
    if gather.inputs[1] is token_N:
        return _dense_column(gather, expert_index), True
    return _top_k_weights(gather, token_N, slot_N), False


def _hit_position(index: ir.Value, expert_mask: ir.Value) -> tuple[ir.Node, int]:
    """The Split output position of ``index = Squeeze(Split(nonzero(ReduceSum(mask, (1, 2)) > 0))[i])``, or of
    its element 0 (GPT-OSS's ``expert_idx[0]``)."""
    pick = index.producer()
    if standard(pick, "Gather") and constant_ints(pick.inputs[1]) == [0] and pick.attributes.get_int("axis", 0) == 0:
        index = pick.inputs[0]
    split, position = _split_of(index, 0, "the hit expert index")
    hit = nonzero_of(split.inputs[0], "the hit experts")
    greater = producer(hit, "Greater", "the hit experts")
    require(constant_scalar(greater.inputs[1]) == 0, "the hit experts are not those with a count > 0")
    reduce = producer(greater.inputs[0], "ReduceSum", "the expert counts")
    require(reduce.inputs[0] is expert_mask, "the expert counts are not summed over the expert mask")
    require(axes(reduce, 3) == [1, 2] and reduce.attributes.get_int("keepdims", 1) == 0,
            "the expert counts are not summed over (slot, token) to [E]")
    return split, position


def _row_ref(row_index: ir.Value, expert_mask: ir.Value) -> int | tuple[ir.Node, int]:
    """The mask row a branch reads: a constant, or its position among the hit experts."""
    constant_row = constant_ints(row_index)
    if constant_row is None:
        return _hit_position(row_index, expert_mask)
    require(len(constant_row) == 1, f"the mask row index {constant_row} is not one row")
    return constant_row[0]


def _scatter_target(scatter: ir.Node) -> int:
    """H of the zeros [T, H] that the branch's ScatterElements (axis 0, no reduction or add) writes into."""
    require(scatter.attributes.get_int("axis", 0) == 0, "ScatterElements axis is not 0")
    reduction = scatter.attributes.get_string("reduction", "none")
    require(reduction in ("none", "add"), f"ScatterElements reduction is {reduction!r}")
    require(is_zeros(scatter.inputs[0]), "the scatter target is not zeros")
    zeros_shape = static_shape(scatter.inputs[0])
    require(zeros_shape is not None and len(zeros_shape) == 2 and zeros_shape[1] is not None,
            "the accumulator is not [T, H] with a static H")
    return zeros_shape[1]


def _weighted_rows(updates: ir.Value, hidden: int) -> ir.Node:
    """The Mul(y_NH, w_N1) that ``updates = Expand(Mul(...), Shape(acc[:1]))`` broadcasts to [N, H] unchanged."""
    expand = producer(updates, "Expand", "the scattered rows")
    target = producer(expand.inputs[1], "Shape", "the scattered rows' shape").inputs[0]
    require(static_shape(target) == (1, hidden) or _first_row(target, hidden),
            "the scattered rows are not expanded to the shape of one accumulator row")
    return producer(_skip_identity_casts(expand.inputs[0]), "Mul", "the weighted expert output")


def _scattered_tokens(index: ir.Value, updates: ir.Value) -> ir.Value:
    """token_N of ``index = Expand(Unsqueeze(token_N, 1), Shape(updates))``: row r of the updates goes to token_N[r]."""
    expand = producer(index, "Expand", "the scatter index")
    require(producer(expand.inputs[1], "Shape", "the scatter index shape").inputs[0] is updates,
            "the scatter index is not expanded to the updates' shape")
    unsqueeze = producer(expand.inputs[0], "Unsqueeze", "the scatter index")
    require(axes(unsqueeze, 2) == [1], "the scatter index is not unsqueezed on axis 1")
    return unsqueeze.inputs[0]


def _routed_tokens(token_N: ir.Value) -> tuple[ir.Value | None, ir.Value, int]:
    """``(slot_N, row, token column)``: token_N is one column of NonZero(mask row ``row``) and slot_N the other
    (None when the branch does not read it)."""
    split, column = _split_of(token_N, 1, "the routed tokens")
    require(len(split.outputs) == 2, "the routed tokens are not a column of NonZero(mask row)")
    slots = [user.outputs[0] for user in split.outputs[1 - column].consumers() if standard(user, "Squeeze")]
    slot_N = slots[0] if slots else None
    require(slot_N is None or _split_of(slot_N, 1, "the slots") == (split, 1 - column),
            "the slots are not the other column of NonZero(mask row)")
    row = nonzero_of(split.inputs[0], "the routed tokens")
    cast = row.producer()
    if standard(cast, "Cast"):
        require(cast.attributes.get_int("to", 0) == ir.DataType.BOOL, "the mask row is cast to a non-bool type")
        row = cast.inputs[0]
    require(static_shape(row) is not None and len(row.shape) == 2, "the mask row is not 2-D")
    return slot_N, row, column


def _expert_tokens(x_NH: ir.Value, token_N: ir.Value, hidden: int) -> ir.Value:
    """tokens_TH of ``x_NH = Gather(tokens_TH, token_N)`` or ``Reshape(Gather(Unsqueeze(tokens_TH, 0), token_N,
    axis=1))`` to [N, H]."""
    require(static_shape(x_NH) is not None and len(x_NH.shape) == 2 and x_NH.shape[1] == hidden,
            f"the expert input is not [N, {hidden}]")
    reshape = x_NH.producer()
    lifted = standard(reshape, "Reshape")
    picked = producer(reshape.inputs[0] if lifted else x_NH, "Gather", "the expert input")
    require(picked.inputs[1] is token_N and picked.attributes.get_int("axis", 0) == int(lifted),
            f"the expert input does not gather the routed tokens on axis {int(lifted)}")
    if not lifted:
        return picked.inputs[0]
    unsqueeze = producer(picked.inputs[0], "Unsqueeze", "the gathered tokens")
    require(axes(unsqueeze, 3) == [0], "the tokens are not unsqueezed on axis 0")
    return unsqueeze.inputs[0]


def _branch(scatter: ir.Node) -> _Branch:
    """Reads and verifies the branch whose result ``scatter`` writes."""
    hidden = _scatter_target(scatter)
    weighted = _weighted_rows(scatter.inputs[2], hidden)
    token_N = _scattered_tokens(scatter.inputs[1], scatter.inputs[2])
    slot_N, row, token_column = _routed_tokens(token_N)
    expert_mask, row_index = mask_row(row)
    for y_NH, w_N1 in (weighted.inputs, reversed(weighted.inputs)):
        if standard(y_NH.producer(), "MatMul") or standard(y_NH.producer(), "Add"):
            break
    else:
        raise MatchFailure("no expert output (MatMul, or MatMul + bias) among the factors of the weighted output")
    routing, dense = _routing(w_N1, token_N, slot_N, row_index)
    if standard(y_NH.producer(), "Add"):
        (x_NH, expert), matmuls = _gathered(y_NH, row_index), []
    else:
        x_NH, expert, matmuls = _linears(y_NH)
    tokens_TH = _expert_tokens(x_NH, token_N, hidden)
    scopes = {match.group(1) for node in matmuls if (match := _SCOPE_EXPERT.search(node.name or ""))}
    scope_expert = int(scopes.pop()) if len(scopes) == 1 and len(matmuls) == 3 else None
    return _Branch(expert_mask, _row_ref(row_index, expert_mask), token_column, tokens_TH, routing, dense, expert,
                   scope_expert)


# ----------------------------------------------------------------------------- the block

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


def _check_shapes(weights: list[tuple[Weight, tuple[int, ...], str]], dtype: ir.DataType) -> None:
    for w, shape, what in weights:
        require(w.shape == shape, f"the {what} is {list(w.shape)}, expected {list(shape)}")
        require(w.dtype == dtype, f"the {what} is {w.dtype}, the tokens are {dtype}")


def _check_alike(branches: list[_Branch], labels: list[str]) -> tuple[int, int]:
    """(H, I): every branch reads the same mask, tokens and routing weights, with experts of one kind, shape,
    type and activation constants."""
    first = branches[0]
    for name in ("expert_mask", "tokens_TH", "routing"):
        require(all(getattr(b, name) is getattr(first, name) for b in branches), f"the branches differ in {name}")
    require(all(type(b.expert) is type(first.expert) for b in branches), "the branches' experts differ in kind")
    dtype = first.tokens_TH.dtype
    tokens_shape = static_shape(first.tokens_TH)
    require(tokens_shape is not None and len(tokens_shape) == 2 and tokens_shape[1] is not None,
            "the tokens are not [T, H] with a static H")
    hidden = tokens_shape[1]
    if isinstance(first.expert, GatheredExpert):
        expert = first.expert
        require(all(b.expert == expert for b in branches),
                "the branches gather different expert weights or differ in the activation constants")
        experts, inter = expert.down_EIH.shape[0], expert.down_EIH.shape[1]
        _check_shapes([(expert.gate_up_EHN, (experts, hidden, 2 * inter), "gate_up weight"),
                       (expert.gate_up_bias_EN, (experts, 2 * inter), "gate_up bias"),
                       (expert.down_EIH, (experts, inter, hidden), "down weight"),
                       (expert.down_bias_EH, (experts, hidden), "down bias")], dtype)
        return hidden, inter
    intermediate = first.expert.gate_HI.shape[1]
    for b, label in zip(branches, labels, strict=True):
        with failing_in(label):
            _check_shapes([(b.expert.gate_HI, (hidden, intermediate), "gate weight"),
                           (b.expert.up_HI, (hidden, intermediate), "up weight"),
                           (b.expert.down_IH, (intermediate, hidden), "down weight")], dtype)
            require(b.expert.alpha == first.expert.alpha,
                    f"swish alpha {b.expert.alpha:g} differs from {first.expert.alpha:g}")
    return hidden, intermediate


def _expert_numbers(branches: list[_Branch], experts: int) -> list[int]:
    """The expert of each branch: its constant mask row, or its hit position mapped to the traced experts.
    Branches that gather their weights at the hit expert's index compute that expert whichever it is: their
    positions only have to be distinct."""
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
        if hits == experts or isinstance(branches[0].expert, GatheredExpert):
            numbers = positions  # the i-th of all E experts in increasing order is expert i
        else:  # the trace missed some experts; only the branches' scope names tell which ones it hit
            numbers = [b.scope_expert for b in branches]
            by_position = [n for _, n in sorted(zip(positions, numbers, strict=True))]
            require(None not in numbers and by_position == sorted(set(by_position)),
                    f"the loop has {hits} of {experts} experts and its node names do not say which")
    require(all(0 <= n < experts for n in numbers), f"expert rows {numbers} are outside [0, {experts})")
    require(len(set(numbers)) == len(numbers), f"two branches compute the same expert ({sorted(numbers)})")
    return numbers


def _block(last: ir.Node) -> LoopBlock:
    """Walks the accumulation chain back from ``last`` and verifies every branch (or the one sorted dispatch)."""
    scatters = _chain(last)
    if len(scatters) == 1 and standard(_skip_identity_casts(_scattered_tokens(*scatters[0].inputs[1:])).producer(),
                                       "Div"):
        return _sorted_block(last, scatters[0])
    labels = [f"branch {i} ('{scatter.name}')" for i, scatter in enumerate(scatters)]
    branches = []
    for scatter, label in zip(scatters, labels, strict=True):
        with failing_in(label):
            branches.append(_branch(scatter))
    hidden, intermediate = _check_alike(branches, labels)
    first = branches[0]
    route = (one_hot_dense_route if first.dense else one_hot_route)(first.expert_mask, first.routing)
    # a mask row [K, T] (perm [2, 1, 0]) has the tokens in column 1 of its NonZero, a row [T, K] in column 0
    token_column = list(first.expert_mask.producer().attributes.get_ints("perm")).index(0) - 1
    require(all(b.token_column == token_column for b in branches),
            f"the routed tokens are not column {token_column} of NonZero(mask row), the mask row's token axis")
    numbers = _expert_numbers(branches, route.experts)
    if isinstance(first.expert, GatheredExpert):
        stacked = first.expert.down_EIH.shape[0]
        require(stacked == route.experts,
                f"the stacked expert weights have {stacked} experts, the router {route.experts}")
        experts: list[LinearExpert | None] | GatheredExpert = first.expert
    else:
        experts = [None] * route.experts
        for n, b in zip(numbers, branches, strict=True):
            experts[n] = b.expert
    return LoopBlock(last.outputs[0].name, first.tokens_TH, route, experts, hidden, intermediate)


# ----------------------------------------------------------------------------- the sorted dispatch
# GraniteMoe / JetMoe (transformers 4.57): one index_add_ of all T * K routed rows, sorted by expert, each
# expert's row block through its own weights (ParallelExperts: Split by the traced counts, MatMul, Concat).

def _sorted_slots(token_R: ir.Value) -> tuple[ir.Value, ir.Value, int]:
    """``(order_R, indices_TK, K)`` of ``token_R = Div(order_R, K)`` with ``order_R`` the indices of an ascending
    TopK over all of ``Reshape(indices_TK, [-1])`` (the slots sorted by expert)."""
    div = producer(_skip_identity_casts(token_R), "Div", "the routed tokens")
    k = constant_ints(div.inputs[1])
    require(k is not None and len(k) == 1 and k[0] > 0, "the routed tokens divide the sorted slots by no constant K")
    order_R = div.inputs[0]
    sort = producer(order_R, "TopK", "the sorted slots")
    flat = sort.inputs[0]
    length = flat.shape[0] if flat.shape is not None and len(flat.shape) == 1 else None
    require(order_R.index() == 1 and sort.attributes.get_int("largest", 1) == 0
            and sort.attributes.get_int("axis", -1) in (0, -1)
            and shape_dims(sort.inputs[1]) == [length if isinstance(length, int) else (flat, 0)],
            "the sorted slots are not the indices of an ascending TopK over all the flat expert indices")
    flatten = producer(flat, "Reshape", "the flat expert indices")
    return order_R, flatten.inputs[0], k[0]


def _sorted_weights(w_R1: ir.Value, order_R: ir.Value) -> ir.Value:
    """weights_TK of ``w_R1 = Unsqueeze(Gather(Reshape(weights_TK, [-1]), order_R), 1)``."""
    unsqueeze = producer(w_R1, "Unsqueeze", "the routing weight")
    require(axes(unsqueeze, 2) == [1], "the routing weight is not unsqueezed on axis 1")
    gather = producer(unsqueeze.inputs[0], "Gather", "the routing weight")
    require(gather.inputs[1] is order_R and gather.attributes.get_int("axis", 0) == 0,
            "the routing weights are not gathered at the sorted slots")
    flatten = producer(gather.inputs[0], "Reshape", "the flat routing weights")
    require(flatten.outputs[0].shape is not None and len(flatten.outputs[0].shape) == 1,
            "the flat routing weights are not 1-D")
    return flatten.inputs[0]


def _expert_blocks(value: ir.Value, what: str) -> tuple[ir.Value, list[Weight], list[int] | None]:
    """``(x_R, [W_e], sizes)`` of ``value = Concat_e(MatMul(Split(x_R, sizes, axis=0)[e], W_e), axis=0)``: row
    block e of x_R through expert e's weight."""
    concat = producer(value, "Concat", what)
    require(concat.attributes.get_int("axis", 0) == 0, f"{what}: Concat axis is not 0")
    split, weights = None, []
    for e, part in enumerate(concat.inputs):
        x, w, _ = _linear(part, f"{what} of expert {e}")
        node = x.producer()
        require(standard(node, "Split") and (split is None or node is split) and list(node.outputs).index(x) == e,
                f"{what}: the rows of expert {e} are not output {e} of one Split")
        split = node
        weights.append(w)
    require(split.attributes.get_int("axis", 0) == 0 and len(split.outputs) == len(weights),
            f"{what}: the Split is not into the {len(weights)} experts' row blocks")
    return split.inputs[0], weights, ints_input_or_attr(split, 1, "split")


def _columns(half: ir.Value, width: int) -> tuple[int, int]:
    """The column range [start, end) of the last axis of ``width`` columns that ``half = Slice(...)`` takes."""
    node = producer(half, "Slice", "a half of gate_up")
    starts, ends, slice_axes, steps = (shape_dims(v) for v in (list(node.inputs) + [None] * 5)[1:5])
    require(starts is not None and ends is not None and len(starts) == len(ends) == 1
            and slice_axes in ([1], [-1]) and steps in (None, [1]) and all(isinstance(d, int) for d in starts + ends),
            "a half of gate_up is not a constant column range of the last axis")
    return starts[0], min(ends[0], width)


def _sorted_block(last: ir.Node, scatter: ir.Node) -> LoopBlock:
    """Reads the sorted dispatch whose one index_add_ ``scatter`` writes."""
    hidden = _scatter_target(scatter)
    weighted = _weighted_rows(scatter.inputs[2], hidden)
    token_R = _scattered_tokens(scatter.inputs[1], scatter.inputs[2])
    order_R, indices_TK, k = _sorted_slots(token_R)
    y_RH, w_R1 = weighted.inputs if standard(weighted.inputs[0].producer(), "Concat") else reversed(weighted.inputs)
    route = _route(indices_TK, _sorted_weights(w_R1, order_R))
    require(route.k == k, f"the routed tokens are the sorted slots divided by {k}, the router picks {route.k}")
    act_RI, downs, down_sizes = _expert_blocks(y_RH, "the down projection")
    activation = read_swiglu(act_RI)
    gate_up = activation.gate.producer().inputs[0] if standard(activation.gate.producer(), "Slice") else None
    require(gate_up is not None and standard(activation.up.producer(), "Slice")
            and activation.up.producer().inputs[0] is gate_up, "gate and up are not Slices of one projection")
    x_R, gate_ups, up_sizes = _expert_blocks(gate_up, "the gate_up projection")
    require(down_sizes == up_sizes, f"the row blocks differ: {up_sizes} into gate_up, {down_sizes} into down")
    require(len(downs) == route.experts, f"{len(downs)} experts' row blocks, the router picks among {route.experts}")
    tokens_TH = _expert_tokens(x_R, token_R, hidden)
    width = gate_ups[0].shape[1]
    inter = width // 2
    gate_cols, up_cols = _columns(activation.gate, width), _columns(activation.up, width)
    require({gate_cols, up_cols} == {(0, inter), (inter, width)},
            f"gate takes columns [{gate_cols[0]}, {gate_cols[1]}) and up [{up_cols[0]}, {up_cols[1]}) of {width}; "
            "expected the two halves")
    dtype = tokens_TH.dtype
    for e, (gate_up, down) in enumerate(zip(gate_ups, downs, strict=True)):
        with failing_in(f"expert {e}"):
            _check_shapes([(gate_up, (hidden, width), "gate_up weight"), (down, (inter, hidden), "down weight")], dtype)
    experts = [LinearExpert(gate_up, gate_up, down, activation.alpha, gate_cols, up_cols)
               for gate_up, down in zip(gate_ups, downs, strict=True)]
    name = last.outputs[0].name
    note = (f"block '{name}': the export splits the sorted rows by its trace's expert counts {up_sizes}, so it runs "
            "only on inputs with those counts; MOE routes any input")
    if k > 1 and scatter.attributes.get_string("reduction", "none") == "none":
        note += (f", and it scatters each token's {k} rows without reduction (duplicate indices: onnxruntime keeps "
                 "one row, torch's index_add_ sums them, as MOE does), so the fused model follows torch where the "
                 "export did not")
    return LoopBlock(name, tokens_TH, route, experts, hidden, inter, note)


class LoopMoeFusion(UnrolledLoopFusion):
    """The unrolled per-expert loop (see the module docstring), matched at its last accumulation::

        acc_TH = Add(acc_TH, ScatterElements(ConstantOfShape(Shape(acc_TH)), token_NH, updates_NH))

    ``read`` walks the chain of such index_add_s back to its zeros and verifies each branch; ``emit``
    (:class:`UnrolledLoopFusion`'s) writes the MOE.
    """

    # the rule set drops the whole dead chain once it is done, so the earlier accumulations are never "last" ones
    matcher = _LastAccumulationMatcher
    removes_matched_nodes = False

    def pattern(self, op, acc_TH, token_NH, updates_NH):
        return op.Add(acc_TH, op.ScatterElements(op.ConstantOfShape(op.Shape(acc_TH)), token_NH, updates_NH))


    def read(self, context, **_) -> LoopBlock:
        return _block(context.root)


FUSIONS = [LoopMoeFusion]
