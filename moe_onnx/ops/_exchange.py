"""What one rank of MoeDistributeDispatch / MoeDistributeCombine decides locally (docs/distributed.md).

The numpy reference of all ranks (``ops/distribute.py``) and the Python backend's per-rank kernels
(``distributed/kernels.py``) share this: the slot counts every rank all-gathers, the drops, the send
order, the arrival order, the rows of expand_x, assist_info, and combine's weighted sum. Nothing
here communicates: the callers move the rows (the reference by indexing, the kernels over MPI).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ._common import MoeOpError, NodeView, check_group_attrs
from .layout import Layout

# assist_info's header, by position
HEADER = ("ep_world_size", "tp_world_size", "num_experts", "Bs", "K", "rows of expand_x", "R (arrival rows)",
          "expert_capacity")
H_EP, H_TP, H_EXPERTS, H_TOKENS, H_K, H_ROWS, H_ARRIVALS = range(len(HEADER) - 1)  # then expert_capacity


def read_layout(v: NodeView) -> tuple[Layout, int]:
    """The node's layout and num_experts, each checked (num_experts divisible by ep_world_size)."""
    ep_size, ep_rank = check_group_attrs(v, "ep_world_size", "ep_rank_id")
    tp_size, tp_rank = check_group_attrs(v, "tp_world_size", "tp_rank_id")
    num_experts = int(v.attr("num_experts"))
    if num_experts < 1 or num_experts % ep_size:
        v.fail("attribute 'num_experts'", f"is {num_experts}; expected a multiple >= 1 of ep_world_size = {ep_size} "
               "(each EP rank owns num_experts / ep_world_size experts)")
    return Layout(ep_size, ep_rank, tp_size, tp_rank), num_experts


def check_expert_ids(expert_ids: np.ndarray, num_experts: int, where: str) -> None:
    """Every id in [0, num_experts), the K ids of a row distinct (MoeOpError naming the first that is not)."""
    bad = (expert_ids < 0) | (expert_ids >= num_experts)
    if bad.any():
        t, j = (int(p) for p in np.argwhere(bad)[0])
        raise MoeOpError(f"{where}: expert_ids[{t}, {j}] = {int(expert_ids[t, j])} is outside [0, {num_experts}) "
                         "(num_experts)")
    ordered = np.sort(expert_ids, axis=1)
    repeats = np.argwhere(ordered[:, 1:] == ordered[:, :-1])
    if repeats.size:
        t = int(repeats[0][0])
        expert = ordered[t, repeats[0][1]]
        first, second = (int(j) for j in np.flatnonzero(expert_ids[t] == expert)[:2])
        raise MoeOpError(f"{where}: expert_ids[{t}, {second}] = {int(expert)} repeats expert_ids[{t}, {first}]; "
                         "expected the K experts of a row to be distinct")


def slot_counts(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """This rank's row of the counts every rank all-gathers: int64 ``[Bs, slots of expert 0, ..., E - 1]``."""
    per_expert = np.bincount(expert_ids.reshape(-1).astype(np.int64), minlength=num_experts)
    return np.concatenate([[expert_ids.shape[0]], per_expert]).astype(np.int64)


def kept_counts(counts: np.ndarray, capacity: int) -> np.ndarray:
    """[W, E]: the slots each rank keeps per expert, from the all-gathered ``counts`` [W, 1 + E]. Drop/pad:
    an expert keeps its first ``capacity`` slots in global-token order (rank first)."""
    per_expert = counts[:, 1:]
    if capacity == 0:
        return per_expert
    before = np.cumsum(per_expert, axis=0) - per_expert  # slots of each expert on the ranks before
    return np.clip(capacity - before, 0, per_expert)


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """One rank's dispatch, decided from its expert ids and every rank's counts."""

    layout: Layout
    num_experts: int
    capacity: int
    k: int
    tokens_per_rank: np.ndarray  # [W]: Bs of every rank
    send_slots: np.ndarray  # this rank's kept slots t * K + j, in send order (by expert: destination EP rank,
    #                          local expert, slot)
    send_counts: np.ndarray  # [ep]: rows sent to each EP rank
    slot_to_send: np.ndarray  # [Bs * K]: slot -> its position in the send buffer, -1 if dropped
    recv_counts: np.ndarray  # [ep]: rows this rank receives from each EP rank (its all-to-all)
    tp_blocks: np.ndarray  # [tp]: rows each TP rank of the group receives in its all-to-all
    arrival_sources: np.ndarray  # [R]: the global rank each arrival row comes from
    arrival_experts: np.ndarray  # [R]: the local expert of each arrival row (known from the counts)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.layout.ep_size

    @property
    def expand_rows(self) -> int:
        """Rows of expand_x: the arrivals (dropless), or E_local * C (drop/pad)."""
        return self.local_experts * self.capacity if self.capacity else int(self.arrival_sources.size)


def plan_dispatch(expert_ids: np.ndarray, counts: np.ndarray, layout: Layout, num_experts: int,
                  capacity: int) -> DispatchPlan:
    """The dispatch of rank ``layout`` with ``expert_ids`` [Bs, K] (checked), given the all-gathered ``counts``
    [W, 1 + E] of every rank (:func:`slot_counts`)."""
    ep, tp = layout.ep_size, layout.tp_size
    local = num_experts // ep
    kept = kept_counts(counts, capacity)
    kept_by_ep = kept.reshape(layout.world_size, ep, local).sum(axis=2)  # [source rank, destination EP rank]

    flat = expert_ids.reshape(-1).astype(np.int64)
    by_expert = np.argsort(flat, kind="stable")
    if capacity:  # a slot's place among its expert's slots over the world: the ranks before, then this rank's
        before = counts[: layout.global_rank, 1:].sum(axis=0)
        sorted_experts = flat[by_expert]
        first = np.searchsorted(sorted_experts, sorted_experts)  # where each expert's run starts
        place = np.empty_like(flat)
        place[by_expert] = before[sorted_experts] + np.arange(flat.size) - first
        is_kept = place < capacity
    else:
        is_kept = np.ones(flat.size, dtype=bool)
    kept_slots = np.flatnonzero(is_kept)
    send_slots = kept_slots[np.argsort(flat[kept_slots], kind="stable")]
    slot_to_send = np.full(flat.size, -1, dtype=np.int64)
    slot_to_send[send_slots] = np.arange(send_slots.size)

    def sources(q: int) -> list[int]:  # the global ranks of the EP group of TP rank q, by EP rank
        return [layout.global_rank_of(p, q) for p in range(ep)]

    def received(q: int) -> np.ndarray:  # [ep]: rows rank (this EP rank, q) receives from each EP rank
        return kept_by_ep[sources(q), layout.ep_rank]

    mine = slice(layout.ep_rank * local, (layout.ep_rank + 1) * local)  # this EP rank's experts
    arrival_sources = [np.repeat(sources(q), received(q)) for q in range(tp)]
    arrival_experts = [np.repeat(np.tile(np.arange(local), ep), kept[sources(q), mine].reshape(-1))
                       for q in range(tp)]  # each source sends its rows by local expert
    return DispatchPlan(
        layout=layout, num_experts=num_experts, capacity=capacity, k=expert_ids.shape[1],
        tokens_per_rank=counts[:, 0].copy(), send_slots=send_slots,
        send_counts=np.bincount(flat[send_slots] // local, minlength=ep).astype(np.int64),
        slot_to_send=slot_to_send, recv_counts=received(layout.tp_rank).astype(np.int64),
        tp_blocks=np.array([s.size for s in arrival_sources], dtype=np.int64),
        arrival_sources=np.concatenate(arrival_sources).astype(np.int64),
        arrival_experts=np.concatenate(arrival_experts).astype(np.int64))


def send_rows(x: np.ndarray, plan: DispatchPlan) -> np.ndarray:
    """The rows this rank sends, in send order. Their experts do not travel: the receiver knows from the
    counts how many rows of each of its local experts a source sends, in that order."""
    return x[plan.send_slots // plan.k]


def arrange_arrivals(arrival_rows: np.ndarray, plan: DispatchPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """expand_x, expert_offset and assist_info from the arrival buffer (every TP rank's received rows,
    TP rank 0 first, each block by source EP rank, each source's rows by local expert)."""
    local, capacity, arrival_experts = plan.local_experts, plan.capacity, plan.arrival_experts
    order = np.lexsort((plan.arrival_sources, arrival_experts))  # by (local expert, global token); stable
    per_expert = np.bincount(arrival_experts, minlength=local)
    starts = np.cumsum(per_expert) - per_expert
    sorted_experts = arrival_experts[order]
    if capacity:
        rows = sorted_experts * capacity + np.arange(order.size) - starts[sorted_experts]
        expert_offset = np.arange(local + 1, dtype=np.int64) * capacity
    else:
        rows = np.arange(order.size)
        expert_offset = np.concatenate([[0], np.cumsum(per_expert)]).astype(np.int64)
    arrival_to_row = np.empty(order.size, dtype=np.int64)
    arrival_to_row[order] = rows
    expand_x = np.zeros((plan.expand_rows, arrival_rows.shape[1]), dtype=arrival_rows.dtype)
    expand_x[arrival_to_row] = arrival_rows
    return expand_x, expert_offset, encode_assist_info(plan, arrival_to_row)


def encode_assist_info(plan: DispatchPlan, arrival_to_row: np.ndarray) -> np.ndarray:
    """assist_info (docs/distributed.md): header, tokens_per_rank, tp_blocks, recv_counts, send_counts,
    slot_to_send, arrival_to_row."""
    layout = plan.layout
    tokens = plan.tokens_per_rank[layout.global_rank]
    header = [layout.ep_size, layout.tp_size, plan.num_experts, tokens, plan.k, plan.expand_rows,
              arrival_to_row.size, plan.capacity]
    return np.concatenate([header, plan.tokens_per_rank, plan.tp_blocks, plan.recv_counts, plan.send_counts,
                           plan.slot_to_send, arrival_to_row]).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class CombinePlan:
    """assist_info read back, checked against the combine node that takes it."""

    layout: Layout
    tokens_per_rank: np.ndarray
    tp_blocks: np.ndarray
    recv_counts: np.ndarray
    send_counts: np.ndarray
    slot_to_send: np.ndarray
    arrival_to_row: np.ndarray


def read_assist_info(assist_info: np.ndarray, layout: Layout, num_experts: int, tokens: int, k: int,
                     expand_rows: int, where: str) -> CombinePlan:
    """assist_info of rank ``layout`` for a combine of ``tokens`` x ``k`` slots over ``expand_rows`` rows of
    expand_y; MoeOpError naming the first entry that does not fit (before any of it indexes anything)."""
    info = assist_info.astype(np.int64, copy=False)

    def fail(what: str, expected: str) -> None:
        raise MoeOpError(f"{where}: input 'assist_info'{what}; expected {expected} (the assist_info of the "
                         "matching MoeDistributeDispatch)")

    if info.size < len(HEADER):
        fail(f" has {info.size} entries", f"at least the {len(HEADER)} of its header")
    expected_header = {H_EP: (layout.ep_size, "attribute 'ep_world_size'"),
                       H_TP: (layout.tp_size, "attribute 'tp_world_size'"),
                       H_EXPERTS: (num_experts, "attribute 'num_experts'"),
                       H_TOKENS: (tokens, "dim 0 of input 'scales'"), H_K: (k, "dim 1 of input 'scales'"),
                       H_ROWS: (expand_rows, "dim 0 of input 'expand_y'")}
    for position, (value, source) in expected_header.items():
        if info[position] != value:
            fail(f"[{position}] ({HEADER[position]}) is {int(info[position])}", f"{value}, {source}")
    arrivals = int(info[H_ARRIVALS])
    world, tp, ep = layout.world_size, layout.tp_size, layout.ep_size
    lengths = (world, tp, ep, ep, tokens * k)
    expected_size = len(HEADER) + sum(lengths) + max(arrivals, 0)
    if arrivals < 0 or info.size != expected_size:
        fail(f" has {info.size} entries with R = {arrivals}", f"8 + W + tp + 2 * ep + Bs * K + R = {expected_size}")
    cuts = np.cumsum([len(HEADER), *lengths])
    tokens_per_rank, tp_blocks, recv_counts, send_counts, slot_to_send = np.split(info[: cuts[-1]], cuts[:-1])[1:]
    arrival_to_row = info[cuts[-1]:]
    for name, counts in (("tokens_per_rank", tokens_per_rank), ("tp_blocks", tp_blocks),
                         ("recv_counts", recv_counts), ("send_counts", send_counts)):
        if (counts < 0).any():
            fail(f" section {name} has a negative count {int(counts.min())}", "counts >= 0")
    if tokens_per_rank[layout.global_rank] != tokens:
        fail(f" section tokens_per_rank has [{layout.global_rank}] = {int(tokens_per_rank[layout.global_rank])}",
             f"Bs = {tokens} on this rank (dim 0 of input 'scales')")
    if tp_blocks.sum() != arrivals or tp_blocks[layout.tp_rank] != recv_counts.sum():
        fail(" section tp_blocks does not add up", f"sum = R = {arrivals} and tp_blocks[{layout.tp_rank}] = the sum "
             f"of recv_counts ({int(recv_counts.sum())})")
    own = layout.ep_rank
    if send_counts[own] != recv_counts[own]:  # the rows a rank sends its own EP rank come back to it
        fail(f" sections send_counts and recv_counts differ at [{own}] ({int(send_counts[own])} and "
             f"{int(recv_counts[own])})", "equal counts for this rank's own EP rank (it sends those rows to itself)")
    sent = int(send_counts.sum())
    kept = slot_to_send[slot_to_send >= 0]
    if (slot_to_send < -1).any() or (kept >= sent).any() or np.unique(kept).size != kept.size or kept.size != sent:
        fail(" section slot_to_send is not a one-to-one map of slots onto the send buffer",
             f"each of the {sent} send positions once, -1 for a dropped slot")
    if ((arrival_to_row < 0) | (arrival_to_row >= expand_rows)).any() \
            or np.unique(arrival_to_row).size != arrival_to_row.size:
        fail(" section arrival_to_row is not a one-to-one map into expand_y", f"distinct rows in [0, {expand_rows})")
    return CombinePlan(layout, tokens_per_rank, tp_blocks, recv_counts, send_counts, slot_to_send, arrival_to_row)


def weighted_sum(returned: np.ndarray, plan: CombinePlan, scales: np.ndarray, x1: np.ndarray | None,
                 x2: np.ndarray | None) -> np.ndarray:
    """out[t] = x1[t] + x2[t] + sum_j scales[t, j] * y(t, j) over the kept slots: ``returned`` is the send
    buffer's rows back from the experts (float32), summed in float32 (j ascending, then x1, then x2) and
    rounded once to the type of ``scales``."""
    tokens, k = scales.shape
    out = np.zeros((tokens, returned.shape[1]), dtype=np.float32)
    positions = plan.slot_to_send.reshape(tokens, k)
    weights = scales.astype(np.float32)
    for j in range(k):
        kept = np.flatnonzero(positions[:, j] >= 0)
        out[kept] += weights[kept, j, None] * returned[positions[kept, j]]
    for residual in (x1, x2):
        if residual is not None:
            out += residual.astype(np.float32)
    return out.astype(scales.dtype)
