"""``moe-onnx shard``: one model per rank for tensor (``tp``) and expert (``ep``) parallelism.

Rank ``g`` of ``W = tp * ep`` is EP rank ``g // tp`` and TP rank ``g % tp`` (docs/distributed.md).
What each MoE block becomes on rank ``g``:

- ``ep == 1``: an MOE node keeps its place with its I-slice of the weights and ``tp_world_size``/``tp_rank_id``;
  a grouped chain keeps its MoeInitRouting and MoeFinalizeRouting, its linears get their I-slices and the
  down linear all-reduces over the TP group (``input_is_parallel = 1``);
- ``ep > 1``, and a QMOE node of any ``W > 1``: the block becomes this rank's tokens (the router rebuilt on them:
  ``local_rows.py``) -> MoeDistributeDispatch -> the MOE or QMOE node on the dispatched rows (its local experts,
  I-sliced; QMOE's at whole quantization blocks) -> MoeDistributeCombine(gather_tokens=1), which gives back every
  token; shared experts folded into the node are split off, kept whole on every rank and run on its tokens
  (the combine's x2). A grouped chain's linears and activation take the node's place between the two.

The rest of the graph is replicated. Weights are sliced lazily, one expert at a time, when a rank's
model is written (as ``optimize`` streams them), so a multi-GB model is sharded without loading it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from .._ir import model_files
from .._ir.builder import TapeBuilder, const, insert, int64s, replace
from .._ir.nodes import attribute_value, constant
from .._ir.weights import initializer_expert, streamed_initializer, weight
from ..ops import DOMAIN, IN_OUR_DOMAIN, OPSET_VERSION
from ..ops.layout import Layout
from ..ops.moe import GEMM2_ACT, GEMM2_BIAS_SWIGLU_CLAMP, GEMM3_SWIGLU
from ..ops.signatures import QMOE
from .local_rows import LocalRows, last_dim
from .manifest import METADATA_KEY, Manifest, nodes_fingerprint, rank_file

class ShardError(ValueError):
    """A model (or a tp/ep choice) that cannot be sharded; the message names the node and the reason."""


# ----------------------------------------------------------------------------- weights

def _per_expert(value: ir.Value, where: str) -> tuple[Callable[[int], np.ndarray], ir.Value, tuple[int, ...]]:
    """How to read expert ``e`` of a constant weight: ``(read(e), its source initializer, shape)``."""
    if value.const_value is not None:
        return (lambda e: initializer_expert(value, e)), value, tuple(int(d) for d in value.const_value.shape)
    w = weight(value)
    if w is None:
        raise ShardError(f"{where} is computed at run time; only constant weights can be sharded")
    return w.expert, w.source, w.shape


def _sliced(graph: ir.Graph, value: ir.Value, where: str, experts: range, axis: int | None = None,
            columns: slice | None = None, bits: int = 8) -> ir.Value:
    """A lazy initializer holding ``value``'s ``experts`` (first axis), and ``columns`` of ``axis`` (an axis of
    one expert's slice) when given; ``bits`` 4: ``axis`` packs two 4-bit elements a byte (QMOE's zero points)
    and ``columns`` counts elements."""
    read, source, shape = _per_expert(value, where)

    def expert(local: int) -> np.ndarray:
        part = read(experts[local])
        if axis is None:
            return part
        return part[(slice(None),) * axis + (columns,)] if bits == 8 else _nibbles(part, axis, columns)

    new_shape = [len(experts), *shape[1:]]
    if axis is not None:
        count = len(range(shape[axis + 1] * 8 // bits)[columns])
        new_shape[axis + 1] = -(-count * bits // 8)
    dtype = value.dtype if value.dtype is not None else source.const_value.dtype
    return streamed_initializer(graph, f"{value.name or 'weight'}_shard", expert, dtype, new_shape, [source])


def _nibbles(packed: np.ndarray, axis: int, columns: slice) -> np.ndarray:
    """The 4-bit elements ``columns`` of ``axis`` (two a byte, the even one in the low nibble), packed again
    from the low nibble of the first byte; an odd count leaves the last high nibble 0."""
    moved = np.moveaxis(packed, axis, -1)
    codes = np.stack([moved & 0xF, moved >> 4], axis=-1).reshape(*moved.shape[:-1], -1)[..., columns]
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros_like(codes[..., :1])], axis=-1)
    return np.moveaxis((codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), -1, axis)


def _i_slice(intermediate: int, tp: int, tp_rank: int) -> slice:
    """TP rank ``tp_rank``'s slice of the intermediate size (docs/distributed.md)."""
    return slice(intermediate * tp_rank // tp, intermediate * (tp_rank + 1) // tp)


def _pairs(columns: slice) -> slice:
    """The interleaved gate/up rows (2i, 2i + 1) of the intermediate columns ``columns``."""
    return slice(2 * columns.start, 2 * columns.stop)


# ----------------------------------------------------------------------------- the layout

def _layout(tp: int, ep: int, rank: int) -> Layout:
    """Rank ``rank``'s place in a ``tp`` x ``ep`` world: EP rank ``rank // tp``, TP rank ``rank % tp``."""
    return Layout(ep_size=ep, tp_size=tp).of_rank(rank)


def _local_experts(layout: Layout, experts: int) -> range:
    """EP rank p's experts [p * E_local, (p + 1) * E_local)."""
    per_rank = experts // layout.ep_size
    return range(layout.ep_rank * per_rank, (layout.ep_rank + 1) * per_rank)


def _check_split(layout: Layout, where: str, experts: int, intermediate: int) -> None:
    if experts % layout.ep_size:
        raise ShardError(f"{where}: {experts} experts do not split over ep = {layout.ep_size} ranks "
                         "(num_experts must be divisible by ep)")
    if intermediate < layout.tp_size:
        raise ShardError(f"{where}: the intermediate size I = {intermediate} is smaller than tp = {layout.tp_size} "
                         "(every TP rank needs at least one column)")


def _set_attributes(node: ir.Node, values: dict[str, int]) -> None:
    for name, value in values.items():
        node.attributes[name] = ir.AttrInt64(name, value)


def _where(node: ir.Node) -> str:
    return f"{node.op_type} node '{node.name or '(unnamed)'}'"


# ----------------------------------------------------------------------------- MOE, ep == 1

@dataclasses.dataclass(frozen=True)
class _Cut:
    """How TP rank q cuts one per-expert input of an MOE or QMOE node: ``columns`` of ``axis`` (an axis of one
    expert's slice); ``bits`` 4: that axis packs two 4-bit elements a byte."""

    axis: int
    columns: slice
    bits: int = 8


@dataclasses.dataclass(frozen=True)
class _Block:
    """An MOE or QMOE node's sizes, and its TP cuts for a slice of I's columns (inputs not named stay whole)."""

    experts: int
    hidden: int
    intermediate: int
    cuts: Callable[[slice], dict[int, _Cut]]
    down_bias: int | None  # bias_1's input index (GEMM2 and GEMM2_ACT), counted once over the TP group


def _moe_block(node: ir.Node) -> _Block:
    """An MOE node's cuts: docs/distributed.md's table (GEMM2's gate/up pairs stay together; bias_1 stays whole)."""
    expert_type = attribute_value(node, "expert_type", "")
    _, _, shape = _per_expert(node.inputs[3], f"{_where(node)}: weight_0")
    if expert_type == GEMM2_BIAS_SWIGLU_CLAMP:  # weight_0 [E, H, 2I]
        return _Block(shape[0], shape[1], shape[2] // 2, lambda c: {3: _Cut(1, _pairs(c)), 4: _Cut(0, _pairs(c)),
                                                                    5: _Cut(0, c)}, 6)
    if expert_type == GEMM2_ACT:  # weight_0 [E, I, H]
        return _Block(shape[0], shape[2], shape[1], lambda c: {3: _Cut(0, c), 4: _Cut(0, c), 5: _Cut(1, c)}, 6)
    return _Block(shape[0], shape[2], shape[1], lambda c: {3: _Cut(0, c), 5: _Cut(0, c), 7: _Cut(1, c)}, None)


def _moe_tensor_parallel(node: ir.Node, layout: Layout) -> None:
    """ep == 1: give an MOE node its I-slice of the weights and its TP attributes."""
    where, block = _where(node), _moe_block(node)
    _check_split(layout, where, block.experts, block.intermediate)
    cuts = block.cuts(_i_slice(block.intermediate, layout.tp_size, layout.tp_rank))
    names = _input_names(node)
    for index, cut in cuts.items():
        if index < len(node.inputs) and node.inputs[index] is not None:
            node.replace_input_with(index, _sliced(node.graph, node.inputs[index], f"{where}: {names[index]}",
                                                   range(block.experts), cut.axis, cut.columns))
    _set_attributes(node, dict(tp_world_size=layout.tp_size, tp_rank_id=layout.tp_rank))


# ----------------------------------------------------------------------------- the grouped chain

@dataclasses.dataclass
class _Chain:
    """MoeInitRouting -> first linears (gate/up) -> activation -> down linear -> MoeFinalizeRouting."""

    init: ir.Node
    final: ir.Node
    firsts: list[ir.Node]
    down: ir.Node
    experts: int
    capacity: int
    intermediate: int


def _read_chain(final: ir.Node) -> _Chain:
    """The grouped chain ending at ``final``; ShardError naming what is not the expected form."""
    where = _where(final)
    init = final.inputs[1].producer() if final.inputs[1] is not None else None
    if init is None or init.op_type != "MoeInitRouting" or init.domain != DOMAIN:
        raise ShardError(f"{where}: expanded_row_idx does not come from a MoeInitRouting node")
    init_where = _where(init)
    experts = int(attribute_value(init, "expert_num", 0))
    active = attribute_value(init, "active_expert_range", None)
    if (attribute_value(init, "quant_mode", -1) != -1 or attribute_value(init, "active_num", -1) > 0
            or (active is not None and list(active) != [0, experts])):
        raise ShardError(f"{init_where}: quant_mode, active_num or active_expert_range is set; sharding takes "
                         "the plain routing (every expert, no quantization, no row limit)")
    capacity = int(attribute_value(init, "expert_capacity", 0)) if attribute_value(init, "drop_pad_mode", 0) == 1 else 0
    down = final.inputs[0].producer()
    if down is None or down.op_type != "MoeRowParallelLinear" or down.domain != DOMAIN:
        raise ShardError(f"{where}: expanded_x is not computed by a MoeRowParallelLinear (the down projection)")
    offsets = down.inputs[1]
    rows = init.outputs[0]
    # walk back from the down linear's input to the linears that read the routed rows
    firsts, seen, stack = [], set(), [down.inputs[0]]
    while stack:
        node = stack.pop().producer()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.domain == DOMAIN and node.op_type == "MoeRowParallelLinear":
            if node.inputs[0] is not rows or node.inputs[1] is not offsets:
                raise ShardError(f"{_where(node)}: expected a linear of the routed rows of {init_where} with the "
                                 f"expert offsets of {_where(down)}")
            firsts.append(node)
        elif node.domain in ("", "ai.onnx"):
            stack += [v for v in node.inputs if v is not None and v.const_value is None]
        else:
            raise ShardError(f"{_where(node)} between the linears of {init_where}'s chain: only standard ops "
                             "(the activation) may stand between them")
    if not firsts:
        raise ShardError(f"{where}: no MoeRowParallelLinear reads the rows of {init_where}")
    if any(use.node not in firsts for use in rows.uses()):
        raise ShardError(f"{init_where}: its expanded_x is read by nodes other than the chain's linears")
    for linear in [*firsts, down]:
        if attribute_value(linear, "tp_world_size", 1) != 1:
            raise ShardError(f"{_where(linear)} is already sharded (tp_world_size > 1)")
    _, _, down_shape = _per_expert(down.inputs[2], f"{_where(down)}: W")
    intermediate = down_shape[2]
    for linear in firsts:
        _, _, shape = _per_expert(linear.inputs[2], f"{_where(linear)}: W")
        if shape[1] not in (intermediate, 2 * intermediate):
            raise ShardError(f"{_where(linear)}: W has {shape[1]} outputs; expected I = {intermediate} or the "
                             f"interleaved gate/up pairs 2I = {2 * intermediate} (I: the down linear's inputs)")
    return _Chain(init, final, firsts, down, experts, capacity, intermediate)


def _shard_linear(linear: ir.Node, experts: range, intermediate: int, columns: slice, *, inputs_axis: bool,
                  keep_bias: bool = True) -> None:
    """Slice a chain linear's W ``[E, N, K]`` (and B) to ``experts`` and the intermediate ``columns``: of its
    outputs N (gate/up; N = 2I: the interleaved pairs) or, with ``inputs_axis``, of its inputs K (down)."""
    graph, where = linear.graph, _where(linear)
    w = linear.inputs[2]
    _, _, shape = _per_expert(w, f"{where}: W")
    axis = 1 if inputs_axis else 0
    if not inputs_axis and shape[1] == 2 * intermediate:
        columns = _pairs(columns)
    linear.replace_input_with(2, _sliced(graph, w, f"{where}: W", experts, axis, columns))
    bias = linear.inputs[3] if len(linear.inputs) > 3 else None
    if bias is not None:
        if not keep_bias:
            linear.replace_input_with(3, None)
        elif not inputs_axis:
            linear.replace_input_with(3, _sliced(graph, bias, f"{where}: B", experts, 0, columns))
        elif len(experts) != shape[0]:
            linear.replace_input_with(3, _sliced(graph, bias, f"{where}: B", experts))
    sliced = linear.inputs[2].shape
    updates = {"num_experts": len(experts), ("in_features" if inputs_axis else "out_features"): sliced[1 + axis]}
    if bias is not None and not keep_bias:
        updates["bias_term"] = 0
    _set_attributes(linear, {name: value for name, value in updates.items() if name in linear.attributes})


def _chain_tensor_parallel(chain: _Chain, layout: Layout) -> None:
    """ep == 1: the linears get their I-slices; the down linear all-reduces its partials over the TP group."""
    columns = _i_slice(chain.intermediate, layout.tp_size, layout.tp_rank)
    everyone = range(chain.experts)
    for linear in chain.firsts:
        _shard_linear(linear, everyone, chain.intermediate, columns, inputs_axis=False)
    _shard_linear(chain.down, everyone, chain.intermediate, columns, inputs_axis=True)
    tensor_parallel = dict(tp_world_size=layout.tp_size, tp_rank_id=layout.tp_rank, input_is_parallel=1)
    if "in_features" in chain.down.attributes:  # with tp_world_size > 1 it names the full K, not this rank's
        tensor_parallel["in_features"] = chain.intermediate
    _set_attributes(chain.down, tensor_parallel)


def _chain_expert_parallel(chain: _Chain, layout: Layout, name: str) -> None:
    """ep > 1: this rank's tokens -> MoeDistributeDispatch -> the local experts' linears (I-sliced) and the
    activation -> MoeDistributeCombine(gather_tokens=1), in place of the routing and finalize nodes."""
    init, final = chain.init, chain.final
    x, expert_ids = init.inputs[0], init.inputs[1]
    _, _, x1, x2, bias, scales = (list(final.inputs) + [None] * 6)[:6]
    if bias is not None:
        raise ShardError(f"{_where(final)}: a MoeFinalizeRouting bias is not supported by expert parallelism "
                         "(MoeDistributeCombine has none); put it in the down MoeRowParallelLinear's B")
    groups = layout.attributes()

    op = TapeBuilder()
    rows = LocalRows(op, x, layout)
    local_ids = rows.of(expert_ids)
    expand_x, offsets, assist = op.MoeDistributeDispatch(
        rows.tokens, local_ids, num_experts=chain.experts, expert_capacity=chain.capacity, **groups,
        _outputs=3, _name=f"{name}/MoeDistributeDispatch", **IN_OUR_DOMAIN)
    if scales is None:  # absent scales count as 1
        local_scales = op.Expand(const(op, 1, final.inputs[0].dtype), op.Shape(local_ids))
    else:
        local_scales = rows.of(scales)
    extras = [rows.of(v) if v is not None else None for v in (x1, x2)]
    insert(init, op)

    experts = _local_experts(layout, chain.experts)
    columns = _i_slice(chain.intermediate, layout.tp_size, layout.tp_rank)
    for linear in chain.firsts:
        _shard_linear(linear, experts, chain.intermediate, columns, inputs_axis=False)
        linear.replace_input_with(0, expand_x)
        linear.replace_input_with(1, offsets)
    # the combine's reduce-scatter sums the TP partials: the down bias counts once, on TP rank 0
    _shard_linear(chain.down, experts, chain.intermediate, columns, inputs_axis=True, keep_bias=layout.tp_rank == 0)
    chain.down.replace_input_with(1, offsets)

    while extras and extras[-1] is None:
        extras.pop()
    tail = TapeBuilder()
    out = tail.MoeDistributeCombine(final.inputs[0], assist, local_scales, *extras, num_experts=chain.experts,
                                    gather_tokens=1, _name=f"{name}/MoeDistributeCombine", **groups, **IN_OUR_DOMAIN)
    replace(final, out, tail)


# ----------------------------------------------------------------------------- shared experts under ep

@dataclasses.dataclass
class _SharedExperts:
    """The ``count`` shared experts ``optimize`` folded into an MOE or QMOE node (the last ``count`` experts, which
    every token selects with the weight ``scale``), split off it: under ep they are not spread over the EP
    ranks but replicated, and every rank computes them for its own tokens (docs/distributed.md)."""

    op_type: str
    attributes: dict
    inputs: list[ir.Value | None]  # the node's inputs from weight_0 on, holding the shared experts only
    scale: ir.Value  # [T, 1] per token, or a constant
    count: int


def _split_shared(node: ir.Node) -> _SharedExperts | None:
    """The shared experts of a folded MOE or QMOE ``node`` (shared_expert.py: its routing is the router's,
    then ``Expand`` of the ids ``[E_routed, E)`` and of the shared scale), or None when none were folded.
    The node is left with its routed experts and the router's weights and indices."""
    ids_concat, weights_concat = node.inputs[2].producer(), node.inputs[1].producer()
    if any(n is None or n.op_type != "Concat" or len(n.inputs) != 2 for n in (ids_concat, weights_concat)):
        return None
    ids_expand, weights_expand = ids_concat.inputs[1].producer(), weights_concat.inputs[1].producer()
    if any(n is None or n.op_type != "Expand" for n in (ids_expand, weights_expand)):
        return None
    ids = constant(ids_expand.inputs[0])
    _, _, shape = _per_expert(node.inputs[3], f"{_where(node)}: weight_0")
    experts = shape[0]
    if ids is None or ids.ndim != 2 or ids.shape[0] != 1:
        return None
    count = ids.shape[1]
    if ids[0].tolist() != list(range(experts - count, experts)):
        return None
    graph, where = node.graph, _where(node)
    names = _input_names(node)
    routed, shared = range(experts - count), range(experts - count, experts)
    shared_inputs = []
    for index in range(3, len(node.inputs)):
        value = node.inputs[index]
        if value is None:
            shared_inputs.append(None)
            continue
        shared_inputs.append(_sliced(graph, value, f"{where}: {names[index]}", shared))
        node.replace_input_with(index, _sliced(graph, value, f"{where}: {names[index]}", routed))
    node.replace_input_with(1, weights_concat.inputs[0])
    node.replace_input_with(2, ids_concat.inputs[0])
    attributes = {name: attr.value for name, attr in node.attributes.items()}
    return _SharedExperts(node.op_type, attributes, shared_inputs, weights_expand.inputs[0], count)


def _shared_rows(op: TapeBuilder, rows: LocalRows, shared: _SharedExperts, hidden: ir.Value) -> ir.Value:
    """The shared experts on this rank's tokens (each token takes all of them, with the shared scale, of the type
    of the block's ``hidden`` states): the combine's x2."""
    ids_dtype = ir.DataType.INT64
    shape = op.Concat(op.Shape(rows.tokens, start=0, end=1), int64s(op, [shared.count]), axis=0)
    ids = op.Expand(const(op, np.arange(shared.count)[None, :], ids_dtype), shape)
    scale = shared.scale if constant(shared.scale) is not None else rows.of(shared.scale)
    y = op.op(shared.op_type, rows.tokens, _expanded(op, scale, shape, hidden), ids, *shared.inputs,
              _domain=DOMAIN, **shared.attributes)
    return y


# ----------------------------------------------------------------------------- QMOE

# (weight_i, its bias, scales, zero points) per projection: the first ones' outputs N are I (GEMM2: the
# interleaved gate/up pairs 2I), the down projection's inputs K are I
_QMOE_PROJECTIONS = {
    GEMM2_BIAS_SWIGLU_CLAMP: ([(3, 4, 8, 11)], (5, 6, 9, 12)),
    GEMM3_SWIGLU: ([(3, None, 8, 11), (5, None, 9, 12)], (7, None, 10, 13)),
    GEMM2_ACT: ([(3, 4, 8, 11)], (5, 6, 9, 12)),
}


def _input_names(node: ir.Node) -> list[str]:
    return [spec.name for spec in QMOE.inputs] if node.op_type == "QMOE" else \
        ["hidden_states", "routing_weights", "indices", "weight_0", "bias_0", "weight_1", "bias_1", "weight_2"]


def _qmoe_block(node: ir.Node) -> _Block:
    """A QMOE node's cuts: the first projections' rows (with their biases, scales and zero points: per column,
    packed along N) and the down projection's bytes of K with their blocks' scales and zero points."""
    expert_type = attribute_value(node, "expert_type", "")
    bits, block_size = int(attribute_value(node, "bits", 8)), int(attribute_value(node, "block_size", 0))
    firsts, (down, _, down_scales, down_zero_points) = _QMOE_PROJECTIONS[expert_type]
    _, _, first_shape = _per_expert(node.inputs[3], f"{_where(node)}: weight_0")
    _, _, down_shape = _per_expert(node.inputs[down], f"{_where(node)}: {QMOE.inputs[down].name}")

    def cuts(columns: slice) -> dict[int, _Cut]:
        rows = _pairs(columns) if expert_type == GEMM2_BIAS_SWIGLU_CLAMP else columns
        result = {}
        for weight, bias, scales, zero_points in firsts:
            result.update({index: _Cut(0, rows) for index in (weight, bias, scales) if index is not None})
            result[zero_points] = _Cut(0, rows, bits if block_size == 0 else 8)
        result[down] = _Cut(1, slice(columns.start * bits // 8, columns.stop * bits // 8))
        if block_size:
            blocks = slice(columns.start // block_size, columns.stop // block_size)
            result.update({down_scales: _Cut(1, blocks), down_zero_points: _Cut(1, blocks, bits)})
        return result

    intermediate = first_shape[1] // 2 if expert_type == GEMM2_BIAS_SWIGLU_CLAMP else first_shape[1]
    return _Block(first_shape[0], down_shape[1], intermediate, cuts, _QMOE_PROJECTIONS[expert_type][1][1])


def _qmoe_columns(node: ir.Node, intermediate: int, layout: Layout) -> slice:
    """TP rank q's columns of I for a QMOE node: whole quantization blocks of the down projection's K (whole
    bytes of 4-bit codes per column), ``unit * [n * q // tp, n * (q + 1) // tp)`` of the ``n = I / unit`` units."""
    where = _where(node)
    bits, block = int(attribute_value(node, "bits", 8)), int(attribute_value(node, "block_size", 0))
    if block == 0 and attribute_value(node, "accuracy_level", 0) == 4 and layout.tp_size > 1:
        raise ShardError(f"{where}: accuracy_level 4 with per-column scales (block_size 0) quantizes the down "
                         f"projection's activations over all of I = {intermediate}, which tp = {layout.tp_size} "
                         "would split; quantize block-wise or shard with tp = 1")
    unit = block or (2 if bits == 4 else 1)
    units = intermediate // unit
    if units < layout.tp_size:
        what = f"{units} quantization blocks of block_size {block}" if block else \
            f"{units} byte{'s' if units != 1 else ''} of 4-bit codes"
        raise ShardError(f"{where}: I = {intermediate} holds {what}, fewer than tp = {layout.tp_size} "
                         "(a TP slice may not split a block)")
    part = _i_slice(units, layout.tp_size, layout.tp_rank)
    return slice(part.start * unit, part.stop * unit)


def _block_on_rows(node: ir.Node, layout: Layout, name: str) -> None:
    """An MOE node under ep, or a QMOE node of more than one rank (any tp and ep): this rank's tokens ->
    MoeDistributeDispatch -> the node on the dispatched rows, one local expert each (its experts, I-sliced; the
    down bias on TP rank 0 only) -> MoeDistributeCombine(gather_tokens=1), which sums the TP partials and gives
    back every token; shared experts folded into the node are split off and run on this rank's tokens."""
    graph, where = node.graph, _where(node)
    shared = _split_shared(node) if layout.ep_size > 1 else None
    block = _qmoe_block(node) if node.op_type == "QMOE" else _moe_block(node)
    _check_split(layout, where, block.experts, block.intermediate)
    columns = _qmoe_columns(node, block.intermediate, layout) if node.op_type == "QMOE" else \
        _i_slice(block.intermediate, layout.tp_size, layout.tp_rank)
    cuts = block.cuts(columns) if layout.tp_size > 1 else {}
    local, names = _local_experts(layout, block.experts), _input_names(node)
    weights = list(node.inputs[3:])
    for index, value in enumerate(weights, start=3):
        if value is None:
            continue
        cut = cuts.get(index)
        weights[index - 3] = None if index == block.down_bias and layout.tp_rank != 0 else _sliced(
            graph, value, f"{where}: {names[index]}", local, *((cut.axis, cut.columns, cut.bits) if cut else ()))

    hidden, routing, indices = node.inputs[:3]
    op = TapeBuilder()
    rows = LocalRows(op, op.Reshape(hidden, int64s(op, [-1, block.hidden])), layout)
    local_ids, local_scales = rows.of(_token_rows(op, indices)), rows.of(_token_rows(op, routing))
    groups = layout.attributes()
    expand_x, offsets, assist = op.MoeDistributeDispatch(
        rows.tokens, local_ids, num_experts=block.experts, expert_capacity=0, **groups, _outputs=3,
        _name=f"{name}/MoeDistributeDispatch", **IN_OUR_DOMAIN)
    row_experts = _row_experts(op, expand_x, offsets, len(local))
    ones = _expanded(op, const(op, [[1]], ir.DataType.FLOAT), op.Shape(row_experts), hidden)
    attributes = {attr_name: attr.value for attr_name, attr in node.attributes.items()}
    expand_y = op.op(node.op_type, expand_x, ones, row_experts, *weights, _name=f"{name}/{node.op_type}",
                     **attributes, **IN_OUR_DOMAIN)
    x2 = _shared_rows(op, rows, shared, hidden) if shared is not None else None
    out = op.MoeDistributeCombine(expand_y, assist, local_scales, *([None, x2] if x2 is not None else []),
                                  num_experts=block.experts, gather_tokens=1, _name=f"{name}/MoeDistributeCombine",
                                  **groups, **IN_OUR_DOMAIN)
    replace(node, op.Reshape(out, op.Shape(hidden), allowzero=1), op)


def _expanded(op: TapeBuilder, value: ir.Value, shape: ir.Value, like: ir.Value) -> ir.Value:
    """``value`` expanded to ``shape`` in float32 and cast to ``like``'s type (onnxruntime's CPU provider has no
    bfloat16 Expand; CastLike where the graph does not say the type: ``like`` must be a value the rank computes
    anyway, never the unsharded router's)."""
    filled = op.Expand(op.Cast(value, to=ir.DataType.FLOAT), shape)
    return op.Cast(filled, to=like.dtype) if like.dtype is not None else op.CastLike(filled, like)


def _token_rows(op: TapeBuilder, value: ir.Value) -> ir.Value:
    """``value`` ([..., k], a row per token) as [T, k]."""
    k = last_dim(value)
    if k is not None:
        return op.Reshape(value, int64s(op, [-1, k]))
    last = op.Slice(op.Shape(value), int64s(op, [-1]), int64s(op, [np.iinfo(np.int64).max]))
    return op.Reshape(value, op.Concat(int64s(op, [-1]), last, axis=0))


def _row_experts(op: TapeBuilder, rows: ir.Value, offsets: ir.Value, experts: int) -> ir.Value:
    """[A, 1] int64: the local expert of each row of dispatch's ``rows`` (expert l owns rows
    ``[offsets[l], offsets[l + 1])``): how many of ``offsets[1:experts]`` are at most the row's index."""
    count = op.Squeeze(op.Shape(rows, start=0, end=1))
    index = op.Unsqueeze(op.Range(const(op, 0, ir.DataType.INT64), count, const(op, 1, ir.DataType.INT64)),
                         int64s(op, [1]))
    starts = op.Slice(offsets, int64s(op, [1]), int64s(op, [experts]))
    passed = op.Cast(op.GreaterOrEqual(index, op.Unsqueeze(starts, int64s(op, [0]))), to=ir.DataType.INT64)
    return op.ReduceSum(passed, int64s(op, [1]), keepdims=1)


# ----------------------------------------------------------------------------- the model

def has_blocks(nodes) -> bool:
    """Whether the main graph has fused MoE blocks (MOE, QMOE, or a grouped chain's MoeFinalizeRouting)."""
    return any(node.domain == DOMAIN and node.op_type in ("MOE", "QMOE", "MoeFinalizeRouting") for node in nodes)


def shard_ir(model: ir.Model, tp: int, ep: int, rank: int) -> None:
    """Make ``model`` (in place) rank ``rank``'s model of a ``tp`` x ``ep`` shard (see the module's doc).

    Raises ShardError for tp/ep < 1, a rank outside the world, a model without fused MoE blocks (run
    ``optimize`` first; :func:`shard` and :func:`moe_onnx.pipeline.shard_file` do), an expert count not divisible
    by ep, an intermediate size below tp (for QMOE: fewer quantization blocks than tp), or a block not in a form
    this pass knows (the message names the node).
    """
    if tp < 1 or ep < 1:
        raise ShardError(f"tp = {tp}, ep = {ep}: both must be >= 1")
    layout = _layout(tp, ep, rank)
    if not 0 <= rank < layout.world_size:
        raise ShardError(f"rank {rank} is outside the world of tp * ep = {layout.world_size} ranks")
    graph = model.graph
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.domain != DOMAIN:
            continue
        if node.op_type in ("MoeDistributeDispatch", "MoeDistributeCombine") or \
                any(attribute_value(node, name, 1) > 1 for name in ("tp_world_size", "ep_world_size")):
            raise ShardError(f"{_where(node)}: the model is already sharded")
        if node.graph is not graph and node.op_type in ("MOE", "QMOE", "MoeFinalizeRouting"):
            raise ShardError(f"{_where(node)} is inside a subgraph; only the main graph's MoE blocks can be sharded")
    blocks = [node for node in graph if node.domain == DOMAIN and node.op_type in ("MOE", "QMOE")]
    chains = [_read_chain(node) for node in graph if node.domain == DOMAIN and node.op_type == "MoeFinalizeRouting"]
    if not blocks and not chains:
        raise ShardError("the model has no MoE block to shard (no MOE or QMOE node or MoeInitRouting -> "
                         "MoeFinalizeRouting chain after `moe-onnx optimize`)")
    for index, node in enumerate(blocks):
        if node.op_type == "MOE" and ep == 1:
            _moe_tensor_parallel(node, layout)
        elif layout.world_size > 1:
            _block_on_rows(node, layout, node.name or f"moe_block_{index}")
    for index, chain in enumerate(chains):
        _check_split(layout, _where(chain.final), chain.experts, chain.intermediate)
        if ep > 1:
            _chain_expert_parallel(chain, layout, chain.final.name or f"moe_chain_{index}")
        else:
            _chain_tensor_parallel(chain, layout)
    common_passes.RemoveUnusedNodesPass()(model)
    graph.sort()  # the rebuilt router reads this rank's tokens, which a block's first nodes take
    model.opset_imports[DOMAIN] = OPSET_VERSION


def _mark(model: ir.Model, source_fingerprint: str, layout: Layout) -> None:
    model.metadata_props[METADATA_KEY] = json.dumps(
        {"source_fingerprint": source_fingerprint, "tp": layout.tp_size, "ep": layout.ep_size,
         "rank": layout.global_rank}, sort_keys=True)


def shard(model: onnx.ModelProto | ir.Model, tp: int, ep: int = 1) -> list:
    """The ``tp * ep`` rank models of ``model`` (an ``onnx.ModelProto`` or ``onnx_ir.Model``; the result has the
    same kind), rank g at index g; a model without fused MoE blocks is optimized first (target moe). Raises
    what :func:`shard_ir` raises. For files, and models over 2 GB, use :func:`moe_onnx.pipeline.shard_file`,
    which streams the weights to disk one rank at a time."""
    proto = model if isinstance(model, onnx.ModelProto) else ir.serde.serialize_model(model)
    fingerprint = hashlib.sha256(proto.SerializeToString()).hexdigest()
    if not has_blocks(proto.graph.node):
        from ..rewrite import optimize_ir  # onnxscript's rewriter, only when needed

        fused = ir.serde.deserialize_model(proto)
        optimize_ir(fused, "moe")
        proto = ir.serde.serialize_model(fused)
    ranks = []
    for rank in range(max(tp, 1) * max(ep, 1)):
        copy = ir.serde.deserialize_model(proto)
        shard_ir(copy, tp, ep, rank)
        _mark(copy, fingerprint, _layout(tp, ep, rank))
        ranks.append(ir.serde.serialize_model(copy) if isinstance(model, onnx.ModelProto) else copy)
    return ranks


def write_ranks(fused: str | os.PathLike, proto: onnx.ModelProto, out_dir: Path, tp: int, ep: int, *,
                source_name: str, fingerprint: str, progress: Callable[[str], None] | None = None) -> Manifest:
    """Write the ``tp * ep`` rank models of the fused model at ``fused`` (``proto``: it, read without its external
    data) as ``out_dir/rank<g>.onnx`` (with external data ``rank<g>.onnx.data`` when large, see
    :func:`moe_onnx._ir.model_files.save`; weights sliced one expert at a time while writing); returns their
    manifest (of the source model ``source_name`` with ``fingerprint``), which the caller writes. Raises
    ShardError (see :func:`shard_ir`) and :class:`moe_onnx._ir.model_files.ModelFileError` for a file that
    cannot be written. :func:`moe_onnx.pipeline.shard_file` optimizes an unfused source first."""
    say = progress or (lambda message: None)
    files, fingerprints = [], []
    for rank in range(tp * ep):
        layout = _layout(tp, ep, rank)
        model = model_files.load(fused, proto)
        say(f"rank {rank}: ep rank {layout.ep_rank}, tp rank {layout.tp_rank}")
        shard_ir(model, tp, ep, rank)
        _mark(model, fingerprint, layout)
        path = out_dir / rank_file(rank)
        say(f"saving {path}")
        model_files.save(model, path, progress=progress)
        files.append(path.name)
        fingerprints.append(nodes_fingerprint(model_files.read_proto(path)))
    return Manifest(source_name, fingerprint, tp, ep, files, fingerprints)
