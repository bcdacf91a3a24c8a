"""The all-ranks references of docs/distributed.md against the single-process ops.

dispatch -> experts -> combine over W ranks (ep 1/2/4, tp 1/2, ep 2 x tp 2) gives what MoeInitRouting ->
MoeRowParallelLinear -> MoeFinalizeRouting (and MOE) give on the concatenated tokens; MOE's tensor-parallel
reference gives MOE; assist_info holds what docs/distributed.md says it holds.
"""

from __future__ import annotations

import numpy as np
import pytest
from cases import ALL_CASES

from moe_onnx.distributed.kernels import KERNELS, kernel_for
from moe_onnx.ops import OPS, MoeOpError
from moe_onnx.ops.distribute import combine_all_ranks, dispatch_all_ranks
from moe_onnx.ops.distribute_combine import moe_distribute_combine
from moe_onnx.ops.distribute_dispatch import moe_distribute_dispatch
from moe_onnx.ops.finalize_routing import moe_finalize_routing
from moe_onnx.ops.init_routing import moe_init_routing
from moe_onnx.ops.moe import moe, moe_tensor_parallel
from moe_onnx.ops.row_parallel_linear import partial_product, row_parallel_linear

E, H, INTER, K = 8, 6, 10, 2
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]  # (ep_world_size, tp_world_size)


def i_slices(tp: int) -> list[slice]:
    """TP rank q's slice of the intermediate size, as moe-onnx shard cuts it."""
    return [slice(INTER * q // tp, INTER * (q + 1) // tp) for q in range(tp)]


def make_world(tokens_per_rank, seed=0, skew=None):
    """Every rank's tokens, expert ids (distinct per row), scales and residuals, and the experts' weights.
    ``skew``: the experts every token picks from (uneven loads, experts with no tokens)."""
    rng = np.random.default_rng(seed)
    pool = np.arange(E) if skew is None else np.asarray(skew)
    world = []
    for tokens in tokens_per_rank:
        ids = np.array([rng.choice(pool, K, replace=False) for _ in range(tokens)], dtype=np.int64).reshape(tokens, K)
        world.append(dict(x=rng.standard_normal((tokens, H)).astype(np.float32), ids=ids,
                          scales=rng.random((tokens, K)).astype(np.float32),
                          x1=rng.standard_normal((tokens, H)).astype(np.float32),
                          x2=rng.standard_normal((tokens, H)).astype(np.float32)))
    weights = dict(up=rng.standard_normal((E, INTER, H)).astype(np.float32) / 3,
                   up_bias=rng.standard_normal((E, INTER)).astype(np.float32) / 3,
                   down=rng.standard_normal((E, H, INTER)).astype(np.float32) / 3,
                   down_bias=rng.standard_normal((E, H)).astype(np.float32) / 3)
    return world, weights


def experts_on_rows(rows, offsets, weights, experts, inter=slice(None), down_bias=True):
    """relu experts (GEMM2_ACT's up -> relu -> down) on rows grouped by expert, over an I-slice:
    two MoeRowParallelLinear nodes; the down partial carries the bias only when asked (TP rank 0)."""
    up, = row_parallel_linear(rows, offsets, weights["up"][experts, inter], weights["up_bias"][experts, inter])
    hidden = np.maximum(up, 0)
    partial = partial_product(hidden, offsets, weights["down"][experts][:, :, inter])
    if down_bias:
        for e, (start, stop) in enumerate(zip(offsets[:-1], offsets[1:])):
            partial[start:stop] += weights["down_bias"][experts[e]]
    return partial.astype(rows.dtype)


def distributed(world, weights, ep, tp, capacity=0, gather=0):
    """dispatch -> experts (each rank its experts, its I-slice) -> combine; every rank's out."""
    ranks = [world[g] for g in range(ep * tp)]
    dispatched = dispatch_all_ranks([r["x"] for r in ranks], [r["ids"] for r in ranks], num_experts=E,
                                    expert_capacity=capacity, ep_world_size=ep, tp_world_size=tp)
    local = E // ep
    expand_ys = []
    for g, (expand_x, offsets, _) in enumerate(dispatched):
        p, q = divmod(g, tp)
        experts = np.arange(p * local, (p + 1) * local)
        expand_ys.append(experts_on_rows(expand_x, offsets, weights, experts, i_slices(tp)[q], down_bias=q == 0))
    return combine_all_ranks(expand_ys, [d[2] for d in dispatched], [r["scales"] for r in ranks],
                             [r["x1"] for r in ranks], [r["x2"] for r in ranks], num_experts=E, gather_tokens=gather,
                             ep_world_size=ep, tp_world_size=tp)


def one_process(world, weights, capacity=0):
    """MoeInitRouting -> the experts -> MoeFinalizeRouting on the world's tokens, concatenated in rank order."""
    x, ids, scales, x1, x2 = (np.concatenate([r[n] for r in world]) for n in ("x", "ids", "scales", "x1", "x2"))
    drop = dict(drop_pad_mode=1, expert_capacity=capacity) if capacity else {}
    expanded, row_idx, counts, _ = moe_init_routing(x, ids, expert_num=E, expert_tokens_num_type=1, **drop)
    rows = expanded.reshape(-1, H)
    offsets = np.arange(E + 1, dtype=np.int64) * capacity if capacity else np.concatenate([[0], np.cumsum(counts)])
    y = experts_on_rows(rows, offsets, weights, np.arange(E))
    out, = moe_finalize_routing(y.reshape(expanded.shape), row_idx, x1, x2, scales=scales, expert_idx=ids,
                                drop_pad_mode=1 if capacity else 0)
    return out


def split_like(full, world):
    return np.split(full, np.cumsum([r["x"].shape[0] for r in world])[:-1])


@pytest.mark.parametrize("capacity", [0, 1, 3], ids=["dropless", "cap1", "cap3"])
@pytest.mark.parametrize("tokens", [(5, 3, 0, 7), (4, 4, 4, 4), (0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 1, 0), (9, 0, 2, 1)],
                         ids=["uneven", "even", "T0", "T1", "one_each", "skewed_counts"])
@pytest.mark.parametrize("ep,tp", LAYOUTS, ids=[f"ep{e}tp{t}" for e, t in LAYOUTS])
def test_dispatch_experts_combine_equals_one_process(ep, tp, tokens, capacity):
    world, weights = make_world(tokens[: ep * tp], seed=ep * 10 + tp)
    expected = split_like(one_process(world, weights, capacity), world)
    for g, out in enumerate(distributed(world, weights, ep, tp, capacity)):
        np.testing.assert_allclose(out, expected[g], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ep,tp", LAYOUTS, ids=[f"ep{e}tp{t}" for e, t in LAYOUTS])
@pytest.mark.parametrize("capacity", [0, 2], ids=["dropless", "cap2"])
def test_uneven_loads_and_experts_without_tokens(ep, tp, capacity):
    world, weights = make_world((6, 2, 5, 3)[: ep * tp], seed=7, skew=[0, 1, 5])  # experts 2-4, 6, 7 idle
    expected = split_like(one_process(world, weights, capacity), world)
    for g, out in enumerate(distributed(world, weights, ep, tp, capacity)):
        np.testing.assert_allclose(out, expected[g], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ep,tp", [(2, 1), (2, 2)])
def test_gather_tokens_gives_every_rank_the_world(ep, tp):
    world, weights = make_world((3, 0, 2, 4)[: ep * tp], seed=3)
    expected = one_process(world, weights)
    for out in distributed(world, weights, ep, tp, gather=1):
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_dropless_equals_moe_on_the_concatenated_tokens():
    world, weights = make_world((4, 2, 0, 5), seed=11)
    x, ids, scales = (np.concatenate([r[n] for r in world]) for n in ("x", "ids", "scales"))
    y, = moe(x, scales, ids, weights["up"], weights["up_bias"], weights["down"], weights["down_bias"],
             expert_type="GEMM2_ACT", activation="relu")
    for r in world:
        r["x1"], r["x2"] = np.zeros_like(r["x"]), np.zeros_like(r["x"])
    for g, out in enumerate(distributed(world, weights, 2, 2)):
        np.testing.assert_allclose(out, split_like(y, world)[g], rtol=1e-5, atol=1e-5)


def test_one_rank_reference_is_the_all_ranks_reference_of_one_rank():
    world, _ = make_world((6,), seed=5)
    r = world[0]
    for capacity in (0, 2):
        single = moe_distribute_dispatch(r["x"], r["ids"], num_experts=E, expert_capacity=capacity)
        (simulated,) = dispatch_all_ranks([r["x"]], [r["ids"]], num_experts=E, expert_capacity=capacity)
        for a, b in zip(single, simulated):
            np.testing.assert_array_equal(a, b)
        expand_y = single[0] * 2
        out, = moe_distribute_combine(expand_y, single[2], r["scales"], r["x1"], num_experts=E)
        (all_out,) = combine_all_ranks([expand_y], [single[2]], [r["scales"]], [r["x1"]], num_experts=E)
        np.testing.assert_array_equal(out, all_out)


def read_assist(info, ep, tp, tokens, k):
    """assist_info cut into the sections of docs/distributed.md."""
    arrivals = int(info[6])
    lengths = [8, ep * tp, tp, ep, ep, tokens * k, arrivals]
    names = ["header", "tokens_per_rank", "tp_blocks", "recv_counts", "send_counts", "slot_to_send", "arrival_to_row"]
    assert info.dtype == np.int64 and info.ndim == 1 and info.size == sum(lengths)
    return dict(zip(names, np.split(info, np.cumsum(lengths)[:-1])))


# ep 2 x tp 2, E 4: EP rank 0 owns experts 0, 1 and EP rank 1 experts 2, 3; ranks g = (p, q): 0 = (0, 0),
# 1 = (0, 1), 2 = (1, 0), 3 = (1, 1). Rank g's token t is the row g + t / 10.
LAYOUT_IDS = [np.array([[0], [3], [1]]), np.array([[2]]), np.array([[3], [0]]), np.zeros((0, 1), np.int64)]
LAYOUT_XS = [(g + np.arange(len(i))[:, None] / 10 + np.zeros((1, 2))).astype(np.float32)
             for g, i in enumerate(LAYOUT_IDS)]


def test_assist_info_layout_as_documented():
    """Every section of every rank, by hand."""
    out = dispatch_all_ranks(LAYOUT_XS, LAYOUT_IDS, num_experts=4, ep_world_size=2, tp_world_size=2)
    a = [read_assist(info, 2, 2, len(LAYOUT_IDS[g]), 1) for g, (_, _, info) in enumerate(out)]
    assert [s["tokens_per_rank"].tolist() for s in a] == [[3, 1, 2, 0]] * 4
    # rank 0 sends its slots 0 (e0) and 2 (e1) to EP rank 0, slot 1 (e3) to EP rank 1
    assert a[0]["header"].tolist() == [2, 2, 4, 3, 1, 3, 3, 0]
    assert a[0]["send_counts"].tolist() == [2, 1] and a[0]["slot_to_send"].tolist() == [0, 2, 1]
    # rank 0's all-to-all (EP group of TP rank 0: ranks 0, 2): 2 rows from rank 0, rank 2's token 1 (e0)
    assert a[0]["recv_counts"].tolist() == [2, 1]
    assert a[1]["recv_counts"].tolist() == [0, 0]  # ranks 1 and 3 send EP rank 0 nothing
    assert a[0]["tp_blocks"].tolist() == a[1]["tp_blocks"].tolist() == [3, 0]
    # arrivals (g0 t0 e0, g0 t2 e1, g2 t1 e0) sorted by (local expert, global token)
    assert a[0]["arrival_to_row"].tolist() == a[1]["arrival_to_row"].tolist() == [0, 2, 1]
    for g in (0, 1):
        np.testing.assert_allclose(out[g][0][:, 0], [0.0, 2.1, 0.2], rtol=1e-6)
        assert out[g][1].tolist() == [0, 2, 3]
    assert a[1]["header"].tolist() == [2, 2, 4, 1, 1, 3, 3, 0]
    assert a[1]["send_counts"].tolist() == [0, 1] and a[1]["slot_to_send"].tolist() == [0]
    # EP rank 1: TP rank 0 (rank 2) gets rank 0's e3 and its own e3, TP rank 1 (rank 3) rank 1's e2
    assert a[2]["recv_counts"].tolist() == [1, 1] and a[3]["recv_counts"].tolist() == [1, 0]
    assert a[2]["tp_blocks"].tolist() == [2, 1] and a[2]["send_counts"].tolist() == [1, 1]
    assert a[2]["slot_to_send"].tolist() == [1, 0]  # slot 0 (e3) to EP rank 1 after slot 1 (e0) to EP rank 0
    assert a[2]["arrival_to_row"].tolist() == a[3]["arrival_to_row"].tolist() == [1, 2, 0]
    for g in (2, 3):
        np.testing.assert_allclose(out[g][0][:, 0], [1.0, 0.1, 2.0], rtol=1e-6)
        assert out[g][1].tolist() == [0, 1, 3]
    assert a[3]["header"].tolist() == [2, 2, 4, 0, 1, 3, 3, 0] and a[3]["slot_to_send"].size == 0


def test_rows_travel_by_expert_without_their_ids():
    """A rank sends its rows by expert (destination EP rank, local expert, slot), so the receiver places them
    from the counts alone: rank 0's slots (t0: e1, e0; t1: e0, e1) leave as e0 (slots 1, 2), e1 (0, 3)."""
    ids = [np.array([[1, 0], [0, 1]]), np.array([[3, 0], [2, 1]])]
    xs = [np.arange(2, dtype=np.float32)[:, None] + 10 * g + np.zeros((1, 3), np.float32) for g in range(2)]
    out = dispatch_all_ranks(xs, ids, num_experts=4, ep_world_size=2)
    a = [read_assist(info, 2, 1, 2, 2) for _, _, info in out]
    assert a[0]["slot_to_send"].tolist() == [2, 0, 1, 3] and a[0]["send_counts"].tolist() == [4, 0]
    assert a[1]["slot_to_send"].tolist() == [3, 0, 2, 1] and a[1]["send_counts"].tolist() == [2, 2]
    # EP rank 0 gets rank 0's e0, e0, e1, e1 then rank 1's e0, e1: expand_x by (expert, rank, token)
    assert a[0]["arrival_to_row"].tolist() == [0, 1, 3, 4, 2, 5]
    np.testing.assert_array_equal(out[0][0][:, 0], [0, 1, 10, 0, 1, 11])
    assert out[0][1].tolist() == [0, 3, 6]


def test_assist_info_with_drops():
    """Capacity 1: each expert keeps its first slot over the world; rank 2's two slots are both dropped."""
    out = dispatch_all_ranks(LAYOUT_XS, LAYOUT_IDS, num_experts=4, expert_capacity=1, ep_world_size=2,
                             tp_world_size=2)
    a = [read_assist(info, 2, 2, len(LAYOUT_IDS[g]), 1) for g, (_, _, info) in enumerate(out)]
    assert a[0]["header"].tolist() == [2, 2, 4, 3, 1, 2, 2, 1]
    assert a[2]["slot_to_send"].tolist() == [-1, -1] and a[2]["send_counts"].tolist() == [0, 0]
    assert a[0]["tp_blocks"].tolist() == [2, 0] and a[0]["arrival_to_row"].tolist() == [0, 1]
    np.testing.assert_allclose(out[0][0][:, 0], [0.0, 0.2])
    assert out[0][1].tolist() == [0, 1, 2]
    # EP rank 1: e2 keeps rank 1's slot, e3 rank 0's; padded rows (none here) would be zeros
    assert a[2]["tp_blocks"].tolist() == [1, 1] and a[2]["arrival_to_row"].tolist() == [1, 0]
    np.testing.assert_allclose(out[2][0][:, 0], [1.0, 0.1])


def test_padding_rows_are_zero():
    out = dispatch_all_ranks(LAYOUT_XS, LAYOUT_IDS, num_experts=4, expert_capacity=3, ep_world_size=2,
                             tp_world_size=2)
    expand_x, offsets, _ = out[0]
    assert expand_x.shape == (6, 2) and offsets.tolist() == [0, 3, 6]
    np.testing.assert_allclose(expand_x[:, 0], [0.0, 2.1, 0.0, 0.2, 0.0, 0.0])
    np.testing.assert_array_equal(expand_x[[2, 4, 5]], 0)


@pytest.mark.parametrize("tp", [1, 2, 3])
@pytest.mark.parametrize("expert_type", ["GEMM2_BIAS_SWIGLU_CLAMP", "GEMM3_SWIGLU", "GEMM2_ACT"])
def test_moe_tensor_parallel_equals_moe(expert_type, tp):
    rng = np.random.default_rng(tp)
    tokens, experts, inter = 7, 4, 9
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    ids = np.array([rng.choice(experts, 2, replace=False) for _ in range(tokens)])
    scales = rng.random((tokens, 2)).astype(np.float32)
    attrs = dict(expert_type=expert_type)
    if expert_type == "GEMM2_BIAS_SWIGLU_CLAMP":
        w0 = rng.standard_normal((experts, H, 2 * inter)).astype(np.float32)
        weights = [w0, rng.standard_normal((experts, 2 * inter)).astype(np.float32),
                   rng.standard_normal((experts, inter, H)).astype(np.float32),
                   rng.standard_normal((experts, H)).astype(np.float32), None]
        attrs["expert_beta"] = 7.0

        def shard(q):
            pairs = np.r_[2 * s.start:2 * s.stop] if (s := slices[q]) else None
            return [weights[0][:, :, pairs], weights[1][:, pairs], weights[2][:, s], weights[3], None]
    elif expert_type == "GEMM3_SWIGLU":
        weights = [rng.standard_normal((experts, inter, H)).astype(np.float32), None,
                   rng.standard_normal((experts, inter, H)).astype(np.float32), None,
                   rng.standard_normal((experts, H, inter)).astype(np.float32)]

        def shard(q):
            s = slices[q]
            return [weights[0][:, s], None, weights[2][:, s], None, weights[4][:, :, s]]
    else:
        attrs["activation"] = "gelu"
        weights = [rng.standard_normal((experts, inter, H)).astype(np.float32),
                   rng.standard_normal((experts, inter)).astype(np.float32),
                   rng.standard_normal((experts, H, inter)).astype(np.float32),
                   rng.standard_normal((experts, H)).astype(np.float32), None]

        def shard(q):
            s = slices[q]
            return [weights[0][:, s], weights[1][:, s], weights[2][:, :, s], weights[3], None]
    slices = [slice(inter * q // tp, inter * (q + 1) // tp) for q in range(tp)]
    expected, = moe(x, scales, ids, *weights, **attrs)
    got, = moe_tensor_parallel([[x, scales, ids, *shard(q)] for q in range(tp)], **attrs)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_one_process_refuses_a_node_of_a_larger_group():
    """In the words the backends use in a process of its own (a world of one MPI rank)."""
    x = np.zeros((2, H), np.float32)
    ids = np.array([[0, 1], [2, 3]])
    with pytest.raises(MoeOpError, match=r"^MoeDistributeDispatch: attributes 'ep_world_size' and 'tp_world_size' "
                       r"are 2 and 2: this node is one of 4 ranks and runs only with its group \(under MPI, "
                       r"docs/distributed.md\), not on one process$"):
        moe_distribute_dispatch(x, ids, num_experts=E, ep_world_size=2, tp_world_size=2)
    with pytest.raises(MoeOpError, match=r"^MOE: attribute 'tp_world_size' is 2: this node is one of 2 ranks and "
                       r"runs only with its group \(under MPI, docs/distributed.md\), not on one process$"):
        moe(x, np.ones((2, 2), np.float32), ids, np.zeros((E, 3, H), np.float32), None,
            np.zeros((E, 3, H), np.float32), None, np.zeros((E, H, 3), np.float32), expert_type="GEMM3_SWIGLU",
            tp_world_size=2, tp_rank_id=1)


@pytest.mark.parametrize("change,error", [
    (lambda xs, ids: (xs[:3], ids[:3]), r"inputs of 3 ranks; expected one per rank of the world"),
    (lambda xs, ids: (xs, [ids[0], np.array([[4]]), ids[2], ids[3]]),
     r"MoeDistributeDispatch node 'rank 1': expert_ids\[0, 0\] = 4 is outside \[0, 4\)"),
    (lambda xs, ids: ([xs[0], xs[1][:, :1], xs[2], xs[3]], ids), r"rank 1's x is float32 \[1, 1\]; expected float32 "
     r"with H = 2"),
])
def test_all_ranks_inputs_that_do_not_fit(change, error):
    xs, ids = change(LAYOUT_XS, LAYOUT_IDS)
    with pytest.raises(MoeOpError, match=error):
        dispatch_all_ranks(xs, ids, num_experts=4, ep_world_size=2, tp_world_size=2)


# ----------------------------------------------------------------------------- comm on one process (no MPI)

def test_one_rank_groups_copy_without_mpi():
    from moe_onnx.distributed import comm
    from moe_onnx.ops.layout import Layout

    groups = comm.groups(Layout(), "MOE")
    rows = np.arange(6, dtype=np.float32).reshape(3, 2)
    assert groups.world.size == groups.tp.size == groups.ep.size == 1
    np.testing.assert_array_equal(groups.ep.all_to_all_v(rows, [3], [3], "MOE", "rows"), rows)
    np.testing.assert_array_equal(groups.world.all_gather(rows[0], "MOE", "rows"), rows[:1])
    with pytest.raises(MoeOpError, match=r"^MOE: the all-to-all-v of rows sends 3 rows to its own rank but "
                       r"receives 2$"):
        groups.ep.all_to_all_v(rows, [3], [2], "MOE", "rows")


@pytest.mark.parametrize("layout,error", [
    (dict(ep_size=0), r"attribute 'ep_world_size' is 0; expected >= 1"),
    (dict(tp_size=2, tp_rank=2), r"attribute 'tp_rank_id' is 2; expected 0 <= tp_rank_id < tp_world_size = 2"),
])
def test_groups_of_an_invalid_layout(layout, error):
    from moe_onnx.distributed import comm
    from moe_onnx.ops.layout import Layout

    with pytest.raises(MoeOpError, match=r"^op: " + error):
        comm.groups(Layout(**layout), "op")


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf"])
def test_timeout_variable_must_be_seconds(monkeypatch, value):
    from moe_onnx.distributed import comm

    monkeypatch.setenv("MOE_ONNX_COMM_TIMEOUT_S", value)
    with pytest.raises(MoeOpError, match=rf"^op: environment variable MOE_ONNX_COMM_TIMEOUT_S is '{value}'; "
                       r"expected a number of seconds > 0 \(default 300\)$"):
        comm.timeout_s("op")
    monkeypatch.setenv("MOE_ONNX_COMM_TIMEOUT_S", "2.5")
    assert comm.timeout_s("op") == 2.5


@pytest.mark.parametrize("case", [c for c in ALL_CASES if c.op in KERNELS and c.error is None], ids=lambda c: c.id)
def test_per_rank_kernels_on_one_rank_equal_the_reference(case):
    """The Python backend runs these only for nodes of several ranks; on one rank (groups that copy) they
    give the reference's outputs exactly."""
    named = [i < case.n_outputs for i in range(len(OPS[case.op].outputs))]
    got = KERNELS[case.op](*case.inputs, _named_outputs=named, **case.attrs)
    for g, e in zip(got, case.run_reference()):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_array_equal(g, e)


def test_only_nodes_of_several_ranks_take_the_per_rank_kernels():
    assert kernel_for("MOE", {}) is None and kernel_for("MOE", {"tp_world_size": 1}) is None
    assert kernel_for("MOE", {"tp_world_size": 2}) is KERNELS["MOE"]
    assert kernel_for("MoeDistributeCombine", {"ep_world_size": 2}) is KERNELS["MoeDistributeCombine"]
    assert kernel_for("MoeGatingTopK", {"tp_world_size": 2}) is None
