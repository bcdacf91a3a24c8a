"""The Python backend's kernels of the ops that communicate, one rank each (docs/distributed.md).

``moe_onnx.session(..., backend="python")`` runs these for a node of more than one rank
(:func:`kernel_for`; the numpy reference runs every other node, and the host imports this module
only when it meets such a node). Each validates its node as the reference does, plans with the
reference's code (``ops/_exchange.py``, ``partial_y``, ``partial_product``) and moves the data with
:mod:`.comm`; given a group of one rank they touch no MPI and give the reference's result.
"""

from __future__ import annotations

import numpy as np

from ..ops import distribute_combine, distribute_dispatch, moe, row_parallel_linear
from ..ops._exchange import arrange_arrivals, plan_dispatch, send_rows, slot_counts, weighted_sum
from ..ops.layout import several_ranks
from . import comm


def dispatch_rank(x, expert_ids, *, _node_name="", _named_outputs=None, **attrs):
    """MoeDistributeDispatch on this rank: the counts all-gathered over the world, the rows all-to-all in the
    EP group (by expert: the counts say each row's expert), then all-gathered in the TP group, arranged
    into expand_x."""
    view, layout, num_experts, capacity = distribute_dispatch.validated([x, expert_ids], attrs, _node_name,
                                                                        _named_outputs)
    op = view.where()
    groups = comm.groups(layout, op)
    counts = groups.world.all_gather(slot_counts(expert_ids, num_experts), op, "the slot counts")
    plan = plan_dispatch(expert_ids, counts, layout, num_experts, capacity)
    received = groups.ep.all_to_all_v(send_rows(x, plan), plan.send_counts, plan.recv_counts, op, "the token rows")
    return arrange_arrivals(groups.tp.all_gather_v(received, plan.tp_blocks, op, "the token rows"), plan)


def combine_rank(expand_y, assist_info, scales, x1=None, x2=None, *, _node_name="", _named_outputs=None, **attrs):
    """MoeDistributeCombine on this rank: dispatch's path backwards (reduce-scatter of the TP partials,
    all-to-all back in the EP group), the weighted sum, and with gather_tokens the world's tokens."""
    view, plan = distribute_combine.validated([expand_y, assist_info, scales, x1, x2], attrs, _node_name,
                                              _named_outputs)
    op = view.where()
    groups = comm.groups(plan.layout, op)
    arrival = expand_y[plan.arrival_to_row].astype(np.float32)
    kept = groups.tp.reduce_scatter_v_sum(arrival, plan.tp_blocks, op, "the partial expert outputs")
    returned = groups.ep.all_to_all_v(kept, plan.recv_counts, plan.send_counts, op, "the expert outputs")
    out = weighted_sum(returned, plan, scales, x1, x2)
    if view.attr("gather_tokens"):
        out = groups.world.all_gather_v(out, plan.tokens_per_rank, op, "the combined tokens")
    return (out,)


def moe_rank(*arrays, _node_name="", _named_outputs=None, **attrs):
    """MOE on this rank: its partial y over its I-slice, all-reduced over the TP group, rounded once."""
    arrays = list(arrays) + [None] * (len(moe.MOE.inputs) - len(arrays))
    view = moe.validated(arrays, attrs, _node_name, _named_outputs)
    op = view.where()
    groups = comm.tp_groups(int(view.attr("tp_world_size")), int(view.attr("tp_rank_id")), op)
    partial = moe.partial_y(view, arrays)
    return (moe.round_like(groups.tp.all_reduce_sum(partial, op, "the partial outputs"), arrays[moe.HIDDEN]),)


def row_parallel_linear_rank(X, expert_offset, W, B=None, *, _node_name="", _named_outputs=None, **attrs):
    """MoeRowParallelLinear on this rank: the group's K_q all-gathered (for this rank's slice of X), the
    bias-free partial all-reduced over the TP group, B added once."""
    view = row_parallel_linear.validated([X, expert_offset, W, B], attrs, _node_name, _named_outputs)
    op = view.where()
    groups = comm.tp_groups(int(view.attr("tp_world_size")), int(view.attr("tp_rank_id")), op)
    widths = groups.tp.all_gather(np.array([W.shape[2]], dtype=np.int64), op, "the K-slice widths").reshape(-1)
    x_q = row_parallel_linear.rank_input(view, X, [int(w) for w in widths])
    partial = row_parallel_linear.partial_product(x_q, expert_offset, W)
    reduced = groups.tp.all_reduce_sum(partial, op, "the partial products")
    return (row_parallel_linear.finish_reduced(reduced, expert_offset, B, X),)


KERNELS = {
    distribute_dispatch.MOE_DISTRIBUTE_DISPATCH.name: dispatch_rank,
    distribute_combine.MOE_DISTRIBUTE_COMBINE.name: combine_rank,
    moe.MOE.name: moe_rank,
    row_parallel_linear.ROW_PARALLEL_LINEAR.name: row_parallel_linear_rank,
}
"""The per-rank kernel of each op that communicates, by op name."""


def kernel_for(op_name: str, attrs: dict):
    """The per-rank kernel of a node whose group has more than one rank (its attributes ep_world_size,
    tp_world_size, :func:`moe_onnx.ops.layout.several_ranks`); None for every other node, which the op's
    numpy reference runs."""
    return KERNELS.get(op_name) if several_ranks(attrs) else None
