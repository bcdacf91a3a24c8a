"""Under ``mpirun -n W``: the Python backend's per-rank kernels against the all-ranks numpy references.

Every rank builds the inputs of every rank from one seed, computes the all-ranks reference
(``dispatch_all_ranks``, ``combine_all_ranks``, ``moe_tensor_parallel``,
``row_parallel_linear_tensor_parallel``), runs its own one-node model on
``moe_onnx.session(..., backend="python")`` and compares. Rank 0 prints one line
``RESULT {"ranks": W, "results": [{"config": ..., "ok": ..., "problems": [...]}, ...]}``;
tests/test_mpi_python_kernels.py runs it with 2 and 4 ranks.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import ml_dtypes
import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the case machinery

from backends import as_float64, run_case  # noqa: E402
from cases import Case  # noqa: E402

from moe_onnx.distributed import comm  # noqa: E402
from moe_onnx.ops.layout import Layout  # noqa: E402
from moe_onnx.ops.distribute import combine_all_ranks, dispatch_all_ranks  # noqa: E402
from moe_onnx.ops.moe import moe_tensor_parallel  # noqa: E402
from moe_onnx.ops.row_parallel_linear import row_parallel_linear_tensor_parallel  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
E, H, K = 8, 6, 2
TOKEN_PATTERNS = {"uneven": [5, 0, 3, 7], "one_token": [1, 0, 0, 0], "no_tokens": [0, 0, 0, 0]}


def rank_world(tokens, dtype, seed):
    """Every rank's tokens, distinct expert ids (experts 2 and 6 never chosen: idle experts) and scales."""
    rng = np.random.default_rng(seed)
    pool = [e for e in range(E) if e not in (2, 6)]
    world = []
    for n in tokens:
        ids = np.array([rng.choice(pool, K, replace=False) for _ in range(n)], dtype=np.int64).reshape(n, K)
        world.append(dict(x=rng.standard_normal((n, H)).astype(np.float32).astype(dtype), ids=ids,
                          scales=rng.random((n, K)).astype(np.float32).astype(dtype),
                          x1=rng.standard_normal((n, H)).astype(np.float32).astype(dtype)))
    return world


def layout_attrs(g, ep, tp):
    return dict(ep_world_size=ep, ep_rank_id=g // tp, tp_world_size=tp, tp_rank_id=g % tp)


def compare(name, got, expected, rtol, atol):
    """Problems of one output against its reference (empty: equal)."""
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return [f"{name}: {got.dtype}{list(got.shape)}, expected {expected.dtype}{list(expected.shape)}"]
    try:
        np.testing.assert_allclose(as_float64(got), as_float64(expected), rtol=rtol, atol=atol)
    except AssertionError as error:
        return [f"{name}: {str(error).strip()[:400]}"]
    return []


def check_dispatch_combine(g, world_size, ep, tp, tokens, capacity, gather, dtype):
    world = rank_world(tokens[:world_size], dtype, seed=world_size * 100 + ep * 10 + capacity)
    common = dict(num_experts=E, ep_world_size=ep, tp_world_size=tp)
    dispatched = dispatch_all_ranks([r["x"] for r in world], [r["ids"] for r in world], expert_capacity=capacity,
                                    **common)
    mine = world[g]
    attrs = dict(num_experts=E, expert_capacity=capacity, **layout_attrs(g, ep, tp))
    got = run_case(Case("MoeDistributeDispatch", "mpi", [mine["x"], mine["ids"]], attrs), "python", threads=1)
    problems = []
    for name, a, b in zip(("expand_x", "expert_offset", "assist_info"), got, dispatched[g]):
        problems += compare(f"dispatch {name}", a, b, 0, 0)
    expand_ys = [np.random.default_rng(7 + r).standard_normal(d[0].shape).astype(np.float32).astype(dtype)
                 for r, d in enumerate(dispatched)]  # every rank's expert outputs (TP: its partials)
    expected = combine_all_ranks(expand_ys, [d[2] for d in dispatched], [r["scales"] for r in world],
                                 [r["x1"] for r in world], gather_tokens=gather, **common)
    attrs = dict(num_experts=E, gather_tokens=gather, **layout_attrs(g, ep, tp))
    inputs = [expand_ys[g], dispatched[g][2], mine["scales"], mine["x1"]]
    got = run_case(Case("MoeDistributeCombine", "mpi", inputs, attrs), "python", threads=1)
    tol = 1e-5 if dtype == np.float32 else 2e-2
    return problems + compare("combine out", got[0], expected[g], tol, tol)


def check_moe(g, world_size, tp, expert_type, dtype):
    """MOE with tp_world_size = tp: the world is world_size / tp TP groups, each with its own tokens."""
    group, q = divmod(g, tp)
    rng = np.random.default_rng(500 + group)
    tokens, inter, experts = 5 + group, 9, 4
    x = rng.standard_normal((tokens, H)).astype(np.float32).astype(dtype)
    ids = np.array([rng.choice(experts, 2, replace=False) for _ in range(tokens)])
    scales = rng.random((tokens, 2)).astype(np.float32).astype(dtype)
    slices = [slice(inter * r // tp, inter * (r + 1) // tp) for r in range(tp)]

    def w(*shape):
        return (rng.standard_normal(shape) / 3).astype(np.float32).astype(dtype)

    if expert_type == "GEMM3_SWIGLU":
        full = [w(experts, inter, H), w(experts, inter, H), w(experts, H, inter)]
        attrs = dict(expert_type=expert_type)

        def shard(s):
            return [full[0][:, s], None, full[1][:, s], None, full[2][:, :, s]]
    else:
        full = [w(experts, inter, H), w(experts, inter), w(experts, H, inter), w(experts, H)]
        attrs = dict(expert_type="GEMM2_ACT", activation="silu")

        def shard(s):
            return [full[0][:, s], full[1][:, s], full[2][:, :, s], full[3], None]
    rank_inputs = [[x, scales, ids, *shard(s)] for s in slices]
    expected, = moe_tensor_parallel(rank_inputs, **attrs)
    case = Case("MOE", "mpi", rank_inputs[q], dict(attrs, tp_world_size=tp, tp_rank_id=q))
    got = run_case(case, "python", threads=1)
    tol = 1e-5 if dtype == np.float32 else 2e-2
    return compare("MOE y", got[0], expected, tol, tol)


def check_row_parallel(g, world_size, tp, input_is_parallel, dtype):
    group, q = divmod(g, tp)
    rng = np.random.default_rng(900 + group)
    rows, k, n = 11, 10, 5
    offsets = np.array([1, 3, 3, 8, 11], dtype=np.int64)
    if dtype == np.int8:
        x = rng.integers(-8, 8, (rows, k)).astype(np.int8)
        w = rng.integers(-8, 8, (4, n, k)).astype(np.int8)
        b = rng.integers(-100, 100, (4, n)).astype(np.int32)
    else:
        x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((rows, k), (4, n, k), (4, n)))
    cuts = [k * r // tp + (1 if r == 1 else 0) for r in range(1, tp)]  # uneven K-slices
    w_shards = np.split(w, cuts, axis=2)
    x_shards = np.split(x, cuts, axis=1)
    given = x_shards if input_is_parallel else x
    expected, = row_parallel_linear_tensor_parallel(given, offsets, w_shards, b, input_is_parallel=input_is_parallel)
    attrs = dict(input_is_parallel=input_is_parallel, in_features=k, tp_world_size=tp, tp_rank_id=q)
    case = Case("MoeRowParallelLinear", "mpi", [x_shards[q] if input_is_parallel else x, offsets, w_shards[q], b],
                attrs)
    got = run_case(case, "python", threads=1)
    tol = 0 if dtype == np.int8 else 1e-5
    return compare("MoeRowParallelLinear Y", got[0], expected, tol, tol)


def late_completion(request) -> list[str]:
    """The timed-out collective completes once the other ranks come (2 s later): MPI can then finalize, so this
    process need not abort the job at exit as comm.py arranged after the timeout."""
    deadline = time.monotonic() + 30
    while not request.Test():
        if time.monotonic() > deadline:
            return ["the timed-out all-gather did not complete when the other ranks came"]
        time.sleep(1e-3)
    MPI._set_abort_status(0)  # noqa: SLF001 -- mpi4py.run.set_abort_status cannot take it back
    return []


def check_timeout(g, world_size):
    """A collective that rank 0 enters alone fails there within MOE_ONNX_COMM_TIMEOUT_S, naming the op, the
    collective and the group; the other ranks enter it later and it completes for them. Runs last: the
    group it uses is stuck on rank 0 afterwards."""
    groups = comm.groups(Layout(ep_size=world_size, ep_rank=g), "timeout check")
    counts = np.arange(3, dtype=np.int64) + g
    if g != 0:
        time.sleep(2.0)
        got = groups.world.all_gather(counts, "timeout check", "the test counts")
        return [] if got[1:].tolist() == [(np.arange(3) + r).tolist() for r in range(1, world_size)] else [str(got)]
    os.environ[comm.TIMEOUT_VARIABLE] = "0.5"
    started = time.monotonic()
    try:
        groups.world.all_gather(counts, "timeout check", "the test counts")
    except comm.CommError as error:
        expected = (f"timeout check: the all-gather of the test counts over the world group (world ranks "
                    f"[{', '.join(map(str, range(world_size)))}]) did not complete within 0.5 s "
                    f"(MOE_ONNX_COMM_TIMEOUT_S): a rank of the group failed or never reached it")
        took = time.monotonic() - started
        return ([] if str(error) == expected else [f"message {str(error)!r}, expected {expected!r}"]) + \
            ([] if took < 1.5 else [f"the timeout took {took:.2f} s"]) + late_completion(error.pending)
    finally:
        del os.environ[comm.TIMEOUT_VARIABLE]
    return ["the all-gather completed without the other ranks"]


def configurations(world_size):
    """(name, check) for every configuration this world size runs, in the same order on every rank."""
    found = []
    layouts = [(ep, world_size // ep) for ep in (1, 2, 4) if world_size % ep == 0]
    for ep, tp in layouts:
        for pattern, tokens in TOKEN_PATTERNS.items():
            for capacity in (0, 2):
                name = f"dispatch_combine ep{ep} tp{tp} {pattern} capacity{capacity}"
                found.append((name, lambda g, ep=ep, tp=tp, tokens=tokens, capacity=capacity: check_dispatch_combine(
                    g, world_size, ep, tp, tokens, capacity, 0, np.float32)))
        found.append((f"dispatch_combine ep{ep} tp{tp} gather_tokens bf16", lambda g, ep=ep, tp=tp:
                      check_dispatch_combine(g, world_size, ep, tp, TOKEN_PATTERNS["uneven"], 2, 1, BF16)))
    for tp in (t for t in (2, 4) if world_size % t == 0):
        for expert_type in ("GEMM3_SWIGLU", "GEMM2_ACT"):
            for dtype in (np.float32, np.float16):
                found.append((f"MOE tp{tp} {expert_type} {np.dtype(dtype).name}",
                              lambda g, tp=tp, et=expert_type, dt=dtype: check_moe(g, world_size, tp, et, dt)))
        for parallel in (0, 1):
            for dtype in (np.float32, np.int8):
                found.append((f"MoeRowParallelLinear tp{tp} input_is_parallel{parallel} {np.dtype(dtype).name}",
                              lambda g, tp=tp, p=parallel, dt=dtype: check_row_parallel(g, world_size, tp, p, dt)))
    found.append(("comm timeout names the op, the collective and the group", lambda g: check_timeout(g, world_size)))
    return found


def main() -> None:
    world = MPI.COMM_WORLD
    g, world_size = world.Get_rank(), world.Get_size()
    mine = []
    for name, check in configurations(world_size):
        try:
            problems = check(g)
        except Exception:  # reported, not raised: the other ranks' results still come back
            problems = [traceback.format_exc(limit=3)[-1500:]]
        mine.append((name, [f"rank {g}: {p}" for p in problems]))
    everyone = world.gather(mine, root=0)
    if g == 0:
        results = [{"config": name, "problems": [p for rank in everyone for p in dict(rank)[name]]}
                   for name, _ in mine]
        for result in results:
            result["ok"] = not result["problems"]
        print("RESULT " + json.dumps({"ranks": world_size, "results": results}), flush=True)


if __name__ == "__main__":
    main()
