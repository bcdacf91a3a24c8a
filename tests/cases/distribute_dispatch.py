"""MoeDistributeDispatch case table on one rank (W = 1: a sort by expert, no MPI) and an independent oracle.

The multi-rank meaning is tested against the one-process ops in tests/test_distribute_reference.py and,
under mpirun, in tests/test_mpi_python_kernels.py.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import Case

OP = "MoeDistributeDispatch"
BF16 = np.dtype(ml_dtypes.bfloat16)


def oracle(x, expert_ids, *, num_experts, expert_capacity=0, **_layout):
    """Expert by expert, token by token: written apart from the reference on purpose (one rank)."""
    tokens, k = expert_ids.shape
    rows, offsets, slot_rows = [], [0], {}
    for e in range(num_experts):
        kept = [(t, j) for t in range(tokens) for j in range(k) if expert_ids[t, j] == e]
        if expert_capacity:
            kept = kept[:expert_capacity]
        for t, j in kept:
            slot_rows[t * k + j] = len(rows) if not expert_capacity else e * expert_capacity + kept.index((t, j))
            rows.append(x[t])
        if expert_capacity:
            rows += [np.zeros_like(x[0]) if tokens else np.zeros(x.shape[1], x.dtype)] * (expert_capacity - len(kept))
        offsets.append(len(rows))
    expand_x = np.array(rows, dtype=x.dtype).reshape(len(rows), x.shape[1])
    sent = list(slot_rows)  # one rank: the send buffer is the kept slots by expert (slot order inside), and so are
    #                         the arrivals
    slot_to_send = [sent.index(s) if s in slot_rows else -1 for s in range(tokens * k)]
    arrival_to_row = [slot_rows[s] for s in sent]
    header = [1, 1, num_experts, tokens, k, len(rows), len(sent), expert_capacity]
    assist = header + [tokens, len(sent), len(sent), len(sent)] + slot_to_send + arrival_to_row
    return expand_x, np.array(offsets, dtype=np.int64), np.array(assist, dtype=np.int64)


def make_inputs(tokens, hidden, experts, k, ids=None, dtype=np.float32, index_dtype=np.int64, seed=0):
    """Random tokens and, unless given, k distinct random experts per token."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32).astype(dtype)
    if ids is None:
        ids = [rng.choice(experts, k, replace=False) for _ in range(tokens)]
    return x, np.array(ids, dtype=index_dtype).reshape(tokens, k)


def _case(name, tokens=6, hidden=4, experts=4, k=2, ids=None, dtype=np.float32, index_dtype=np.int64, seed=0,
          **attrs):
    x, expert_ids = make_inputs(tokens, hidden, experts, k, ids, dtype, index_dtype, seed)
    return Case(OP, name, [x, expert_ids], {"num_experts": experts, **attrs})


_base = _case("fp32")
_drop = _case("drop_pad_with_drops", tokens=7, ids=[[0, 1], [0, 2], [0, 1], [3, 0], [1, 0], [2, 3], [0, 3]],
              expert_capacity=2)
CASES = [
    _base,
    _case("empty", tokens=0),
    _case("empty_drop_pad", tokens=0, expert_capacity=3),
    _case("one_token", tokens=1, ids=[[2, 0]]),
    _case("every_token_on_one_expert", tokens=5, k=1, ids=[[3]] * 5),
    _case("experts_without_tokens", experts=8, ids=[[1, 6]] * 3 + [[6, 1]] * 3),
    _case("k_equals_e", tokens=3, experts=3, k=3),
    _case("h_zero", hidden=0),
    _drop,
    _case("drop_pad_no_drops", expert_capacity=12),
    _case("drop_pad_capacity_1", tokens=5, experts=2, k=2, expert_capacity=1),
    _case("fp16", dtype=np.float16, seed=1),
    _case("bf16", dtype=BF16, seed=2, expert_capacity=2),
    _case("int32_ids", index_dtype=np.int32, seed=3),
    _case("explicit_layout_of_one", ep_world_size=1, ep_rank_id=0, tp_world_size=1, tp_rank_id=0),
    # errors: attributes
    _base.mutated("no_num_experts", r"attribute 'num_experts' is required", num_experts=None),
    _base.mutated("num_experts_0", r"attribute 'num_experts' is 0; expected a multiple >= 1 of ep_world_size = 1",
                  num_experts=0),
    _base.mutated("capacity_negative", r"attribute 'expert_capacity' is -1; expected 0 \(dropless\) or a capacity "
                  r">= 1", expert_capacity=-1),
    _base.mutated("ep_world_size_0", r"attribute 'ep_world_size' is 0; expected >= 1", ep_world_size=0),
    _base.mutated("ep_rank_outside", r"attribute 'ep_rank_id' is 1; expected 0 <= ep_rank_id < ep_world_size = 1",
                  ep_rank_id=1),
    _base.mutated("tp_rank_negative", r"attribute 'tp_rank_id' is -1; expected 0 <= tp_rank_id < tp_world_size = 1",
                  tp_rank_id=-1),
    _base.mutated("attr_misspelled", r"attribute 'expert_capacities' is not an attribute of MoeDistributeDispatch; "
                  r"expected one of 'num_experts', 'expert_capacity', 'ep_world_size', 'ep_rank_id', "
                  r"'tp_world_size', 'tp_rank_id'$", session=True, expert_capacities=2),
    # errors: shapes and types
    _base.mutated("x_rank_3", r"input 'x' has rank 3 \(shape \[1, 6, 4\]\); expected rank 2",
                  x=_base.inputs[0][None]),
    _base.mutated("ids_rank_1", r"input 'expert_ids' has rank 1 \(shape \[12\]\); expected rank 2",
                  expert_ids=_base.inputs[1].reshape(-1)),
    _base.mutated("tokens_disagree", r"input 'expert_ids' dim 0 is 5; expected Bs = 6 \(from input 'x' dim 0\)",
                  expert_ids=_base.inputs[1][:5]),
    _base.mutated("k_above_e", r"input 'expert_ids' dim 1 is 5; expected K <= num_experts = 4",
                  expert_ids=np.zeros((6, 5), np.int64)),
    _base.mutated("x_int8", r"input 'x' has type int8; expected float32, float16, bfloat16",
                  x=_base.inputs[0].astype(np.int8)),
    _base.mutated("ids_float", r"input 'expert_ids' has type float32; expected int32, int64",
                  expert_ids=_base.inputs[1].astype(np.float32)),
    # errors: values
    _base.mutated("id_outside", r"expert_ids\[2, 1\] = 4 is outside \[0, 4\) \(num_experts\)", runtime=True,
                  expert_ids=np.array([[0, 1], [2, 3], [1, 4], [0, 2], [3, 1], [2, 0]])),
    _base.mutated("id_negative", r"expert_ids\[0, 0\] = -1 is outside \[0, 4\)", runtime=True,
                  expert_ids=np.array([[-1, 1], [2, 3], [1, 0], [0, 2], [3, 1], [2, 0]])),
    _base.mutated("id_repeated", r"expert_ids\[3, 1\] = 2 repeats expert_ids\[3, 0\]; expected the K experts of a "
                  r"row to be distinct", runtime=True,
                  expert_ids=np.array([[0, 1], [2, 3], [1, 0], [2, 2], [3, 1], [2, 0]])),
]
