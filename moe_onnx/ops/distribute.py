"""The numpy reference of MoeDistributeDispatch and MoeDistributeCombine over every rank at once.

Given every rank's inputs, :func:`dispatch_all_ranks` and :func:`combine_all_ranks` return every rank's
outputs (docs/distributed.md), in global rank order ``g = ep_rank_id * tp_world_size + tp_rank_id``.
Each rank plans as the per-rank kernels do (``_exchange.py``); the collectives between the plans are
plain indexing here: the all-to-all-v in each EP group, the all-gather-v and reduce-scatter-v in each
TP group, the all-gather-v over the world.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import distribute_combine, distribute_dispatch
from ._common import MoeOpError
from ._exchange import arrange_arrivals, plan_dispatch, send_rows, slot_counts, weighted_sum
from .layout import Layout

DISPATCH = distribute_dispatch.MOE_DISTRIBUTE_DISPATCH.name
COMBINE = distribute_combine.MOE_DISTRIBUTE_COMBINE.name


def split_rows(rows: np.ndarray, counts: Sequence[int]) -> list[np.ndarray]:
    """``rows`` cut into consecutive blocks of ``counts`` rows (the blocks of a ``*_v`` collective)."""
    return np.split(rows, np.cumsum(counts)[:-1])


def _world(op: str, ranks: int, ep_world_size: int, tp_world_size: int) -> Layout:
    """The layout of rank 0, after checking that one input per rank of the world was given."""
    layout = Layout(ep_size=int(ep_world_size), tp_size=int(tp_world_size))
    if layout.world_size < 1 or ranks != layout.world_size:
        raise MoeOpError(f"{op}: inputs of {ranks} ranks; expected one per rank of the world, ep_world_size * "
                         f"tp_world_size = {ep_world_size} * {tp_world_size}")
    return layout


def _rank_attrs(layout: Layout, g: int, attrs: dict) -> dict:
    return {**attrs, **layout.of_rank(g).attributes()}


def _same_rows(op: str, name: str, arrays: Sequence[np.ndarray]) -> None:
    """Every rank's ``name`` has rank 0's element type and width H (rows of the world travel together)."""
    first = arrays[0]
    for g, array in enumerate(arrays):
        if array.dtype != first.dtype or array.shape[1:] != first.shape[1:]:
            raise MoeOpError(f"{op}: rank {g}'s {name} is {array.dtype} {list(array.shape)}; expected "
                             f"{first.dtype} with H = {first.shape[1]} as rank 0's")


def dispatch_all_ranks(xs: Sequence[np.ndarray], expert_ids: Sequence[np.ndarray], *, num_experts: int,
                       expert_capacity: int = 0, ep_world_size: int = 1,
                       tp_world_size: int = 1) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every rank's ``(expand_x, expert_offset, assist_info)`` from every rank's ``x`` [Bs_g, H] and
    ``expert_ids`` [Bs_g, K] (global rank order). Raises MoeOpError naming the rank ("rank g" as the node)
    whose node is invalid, or when the ranks' inputs do not fit together."""
    world = _world(DISPATCH, len(xs), ep_world_size, tp_world_size)
    if len(expert_ids) != len(xs):
        raise MoeOpError(f"{DISPATCH}: {len(expert_ids)} expert_ids for {len(xs)} x; expected one of each per rank")
    attrs = dict(num_experts=num_experts, expert_capacity=expert_capacity)
    for g in range(world.world_size):
        distribute_dispatch.validated([xs[g], expert_ids[g]], _rank_attrs(world, g, attrs), f"rank {g}")
    _same_rows(DISPATCH, "x", xs)
    counts = np.stack([slot_counts(ids, num_experts) for ids in expert_ids])  # the world's all-gather
    plans = [plan_dispatch(expert_ids[g], counts, world.of_rank(g), num_experts, expert_capacity)
             for g in range(world.world_size)]
    sent = [split_rows(send_rows(xs[g], plan), plan.send_counts) for g, plan in enumerate(plans)]

    def received(p: int, q: int) -> np.ndarray:  # rank (p, q)'s all-to-all in the EP group of q
        return np.concatenate([sent[world.global_rank_of(source, q)][p] for source in range(world.ep_size)])

    return [arrange_arrivals(np.concatenate([received(plan.layout.ep_rank, q) for q in range(world.tp_size)]), plan)
            for plan in plans]


def combine_all_ranks(expand_ys: Sequence[np.ndarray], assist_infos: Sequence[np.ndarray],
                      scales: Sequence[np.ndarray], x1s: Sequence[np.ndarray | None] | None = None,
                      x2s: Sequence[np.ndarray | None] | None = None, *, num_experts: int, gather_tokens: int = 0,
                      ep_world_size: int = 1, tp_world_size: int = 1) -> list[np.ndarray]:
    """Every rank's ``out`` from every rank's inputs (global rank order; ``x1s``/``x2s`` None or a list with
    None where a rank has none). Raises MoeOpError naming the rank whose node is invalid, or when the
    ranks' assist_info do not come from one dispatch."""
    world = _world(COMBINE, len(expand_ys), ep_world_size, tp_world_size)
    ranks = range(world.world_size)
    x1s, x2s = (list(xs) if xs is not None else [None] * len(expand_ys) for xs in (x1s, x2s))
    if not len(assist_infos) == len(scales) == len(x1s) == len(x2s) == len(expand_ys):
        raise MoeOpError(f"{COMBINE}: {len(expand_ys)} expand_y, {len(assist_infos)} assist_info, {len(scales)} "
                         f"scales, {len(x1s)} x1 and {len(x2s)} x2; expected one of each per rank")
    attrs = dict(num_experts=num_experts, gather_tokens=gather_tokens)
    plans = [distribute_combine.validated([expand_ys[g], assist_infos[g], scales[g], x1s[g], x2s[g]],
                                          _rank_attrs(world, g, attrs), f"rank {g}")[1] for g in ranks]
    _same_rows(COMBINE, "expand_y", expand_ys)
    arrivals = [expand_ys[g][plan.arrival_to_row].astype(np.float32) for g, plan in enumerate(plans)]

    def group_of(g: int) -> list[int]:  # the TP group of g, by TP rank
        return [world.global_rank_of(plans[g].layout.ep_rank, q) for q in range(world.tp_size)]

    kept = []  # the reduce-scatter-v in each TP group: rank q keeps the sum of block q
    for g in ranks:
        group = group_of(g)
        if any(not np.array_equal(plans[r].tp_blocks, plans[g].tp_blocks) for r in group):
            raise MoeOpError(f"{COMBINE}: the assist_info of ranks {group} (one TP group) hold different tp_blocks; "
                             "expected those of one dispatch")
        q = plans[g].layout.tp_rank
        kept.append(sum(split_rows(arrivals[r], plans[r].tp_blocks)[q] for r in group))
    returned = []  # the all-to-all-v back in each EP group: counts swapped
    for g, plan in enumerate(plans):
        q, p = plan.layout.tp_rank, plan.layout.ep_rank
        blocks = [split_rows(kept[world.global_rank_of(dest, q)], plans[world.global_rank_of(dest, q)].recv_counts)
                  for dest in range(world.ep_size)]
        rows = np.concatenate([block[p] for block in blocks])
        if rows.shape[0] != plan.send_counts.sum():
            raise MoeOpError(f"{COMBINE}: rank {g} gets {rows.shape[0]} rows back for the {plan.send_counts.sum()} it "
                             "sent; expected the assist_info of one dispatch on every rank")
        returned.append(rows)
    outs = [weighted_sum(returned[g], plans[g], scales[g], x1s[g], x2s[g]) for g in ranks]
    if gather_tokens:
        everyone = np.concatenate(outs)
        return [everyone.copy() for _ in ranks]
    return outs
