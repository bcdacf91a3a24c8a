"""Multi-rank check of the C++ MoeDistributeDispatch/MoeDistributeCombine kernels, one mpirun launch per
rank count: ``mpirun -n P python tests/mpi/distribute_driver.py OUT_DIR``.

Every rank runs every configuration of its rank count (``configurations(P)``): the Dispatch node on this
rank's tokens, a numpy expert on the rows it got (a per-expert, per-TP-rank matrix: with TP each rank's
output is a partial sum), then the Combine node, all on the C++ kernels; and compares its outputs with
the all-ranks reference (``dispatch_all_ranks`` / ``combine_all_ranks``, which every rank computes for
the whole world from the same seeded inputs): expand_x, expert_offset and assist_info element for
element, out within 1e-6. It writes ``OUT_DIR/rank<g>.json``: ``{"rank", "world", "results": [{"name",
"problems", "rows", "dropped"}]}`` (no problems: the configuration matched). Never imports mpi4py: the kernels' own
communication layer runs MPI.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from moe_onnx import DOMAIN  # noqa: E402
from moe_onnx.ops.distribute import combine_all_ranks, dispatch_all_ranks  # noqa: E402
from moe_onnx.runtime import run, session  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
OUT_TOLERANCE = 1e-6


def configurations(world: int) -> list[dict]:
    """The configurations one launch of ``world`` ranks runs: layouts x routing x sizes x types."""
    layouts = {2: [(2, 1), (1, 2)], 4: [(4, 1), (2, 2), (1, 4)]}[world]  # (ep, tp)
    configs = []
    for ep, tp in layouts:
        base = dict(ep=ep, tp=tp, experts=4 * ep, k=2, hidden=6, dtype="float32", ids="int64", capacity=0,
                    gather_tokens=0, routing="uniform", tokens=[5 + g for g in range(ep * tp)], x1=True, x2=False)
        variants = [
            dict(),
            dict(capacity=2),                                   # drop/pad: most experts drop some slots
            dict(capacity=7, routing="skewed"),                 # uneven loads, the first experts overflow
            dict(routing="first_rank"),                         # EP ranks other than 0 receive no rows
            dict(routing="first_rank", capacity=3),
            dict(tokens=[0] * (ep * tp)),                       # T = 0 everywhere
            dict(tokens=[1] * (ep * tp), capacity=1),           # T = 1
            dict(tokens=[0 if g % 2 else 4 for g in range(ep * tp)]),  # ranks with no tokens
            dict(gather_tokens=1, x2=True),
            dict(gather_tokens=1, tokens=[3 if g == 0 else 0 for g in range(ep * tp)], capacity=2),
            dict(dtype="float16", ids="int32", x1=False),
            dict(dtype="bfloat16", capacity=3, gather_tokens=1),
            dict(k=1, experts=ep, hidden=0),                    # one expert per EP rank, H = 0
            dict(k=3, experts=3 * ep, hidden=33, routing="skewed", tokens=[9 + 3 * g for g in range(ep * tp)]),
        ]
        for i, change in enumerate(variants):
            config = {**base, **change}
            config["name"] = (f"ep{ep}xtp{tp}-{i}-cap{config['capacity']}-{config['routing']}-{config['dtype']}"
                              f"-gather{config['gather_tokens']}")
            config["seed"] = 1000 * world + 10 * i + ep
            configs.append(config)
    return configs


def make_inputs(config: dict) -> dict:
    """Every rank's inputs (x, expert_ids, scales, x1, x2) and the experts' matrices, from the seed."""
    rng = np.random.default_rng(config["seed"])
    dtype = BF16 if config["dtype"] == "bfloat16" else np.dtype(config["dtype"])
    E, k, H, ep, tp = config["experts"], config["k"], config["hidden"], config["ep"], config["tp"]
    local = E // ep

    def ids_of(tokens):
        rows = []
        for _ in range(tokens):
            if config["routing"] == "first_rank":  # only EP rank 0's experts
                rows.append(rng.permutation(local)[:k])
            elif config["routing"] == "skewed":  # expert 0 in every row, low experts preferred
                rest = rng.choice(np.arange(1, E), size=k - 1, replace=False, p=_skew(E - 1))
                rows.append(np.concatenate([[0], rest]))
            else:
                rows.append(rng.permutation(E)[:k])
        return np.array(rows, dtype=config["ids"]).reshape(tokens, k)

    def values(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)

    inputs = dict(x=[], expert_ids=[], scales=[], x1=[], x2=[])
    for tokens in config["tokens"]:
        inputs["x"].append(values(tokens, H))
        inputs["expert_ids"].append(ids_of(tokens))
        inputs["scales"].append(rng.random((tokens, k)).astype(np.float32).astype(dtype))
        inputs["x1"].append(values(tokens, H) if config["x1"] else None)
        inputs["x2"].append(values(tokens, H) if config["x2"] else None)
    inputs["matrices"] = rng.standard_normal((tp, E, H, H)).astype(np.float32) / max(H, 1) ** 0.5
    return inputs


def _skew(n: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** 2
    return weights / weights.sum()


def expert(expand_x: np.ndarray, expert_offset: np.ndarray, matrices: np.ndarray, ep_rank: int,
           tp_rank: int) -> np.ndarray:
    """The expert outputs (this TP rank's partial) on dispatch's rows: local expert l's rows times its matrix."""
    local = len(expert_offset) - 1
    y = np.zeros(expand_x.shape, np.float32)
    for l in range(local):
        rows = slice(int(expert_offset[l]), int(expert_offset[l + 1]))
        y[rows] = expand_x[rows].astype(np.float32) @ matrices[tp_rank, ep_rank * local + l]
    return y.astype(expand_x.dtype)


def run_node(op: str, inputs: list[tuple[str, np.ndarray | None]], outputs: list[str], attrs: dict) -> list:
    """The outputs of one node of ``op`` on the C++ kernels (one intra-op thread)."""
    names = [name if a is not None else "" for name, a in inputs]
    while names and not names[-1]:
        names.pop()
    node = helper.make_node(op, names, outputs, domain=DOMAIN, name=f"{op}_node", **attrs)
    given = [(name, a) for name, a in inputs if a is not None]
    graph_inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
                    for name, a in given]
    graph = helper.make_graph([node], op, graph_inputs, [onnx.ValueInfoProto(name=n) for n in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)],
                              ir_version=10)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return run(session(model, backend="cpp", sess_options=options), dict(given))


def compare(name: str, got: np.ndarray, expected: np.ndarray, tolerance: float | None) -> list[str]:
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return [f"{name}: {got.dtype}{list(got.shape)}, expected {expected.dtype}{list(expected.shape)}"]
    if tolerance is None:
        if not np.array_equal(got.view(np.uint8) if got.dtype == BF16 else got,
                              expected.view(np.uint8) if expected.dtype == BF16 else expected):
            where = np.argwhere(got != expected)[:3].tolist()
            return [f"{name}: differs at {where}"]
        return []
    diff = np.abs(got.astype(np.float64) - expected.astype(np.float64))
    if diff.size and not diff.max() <= tolerance:
        return [f"{name}: max difference {diff.max():.3g} at {np.unravel_index(diff.argmax(), diff.shape)}"]
    return []


def check(config: dict, rank: int) -> dict:
    """This rank's result of one configuration: its problems (none: every output matched the reference),
    the rows it received and the slots it dropped (what the configuration exercised)."""
    ep, tp = config["ep"], config["tp"]
    ep_rank, tp_rank = divmod(rank, tp)
    layout = dict(ep_world_size=ep, ep_rank_id=ep_rank, tp_world_size=tp, tp_rank_id=tp_rank,
                  num_experts=config["experts"])
    inputs = make_inputs(config)
    dispatched = dispatch_all_ranks(inputs["x"], inputs["expert_ids"], num_experts=config["experts"],
                                    expert_capacity=config["capacity"], ep_world_size=ep, tp_world_size=tp)
    ys = [expert(ex, off, inputs["matrices"], g // tp, g % tp) for g, (ex, off, _) in enumerate(dispatched)]
    combined = combine_all_ranks(ys, [info for _, _, info in dispatched], inputs["scales"], inputs["x1"],
                                 inputs["x2"], num_experts=config["experts"],
                                 gather_tokens=config["gather_tokens"], ep_world_size=ep, tp_world_size=tp)

    got = run_node("MoeDistributeDispatch", [("x", inputs["x"][rank]), ("expert_ids", inputs["expert_ids"][rank])],
                   ["expand_x", "expert_offset", "assist_info"],
                   {**layout, "expert_capacity": config["capacity"]})
    problems = []
    for name, g, e in zip(("expand_x", "expert_offset", "assist_info"), got, dispatched[rank]):
        problems += compare(name, g, e, None)
    y = expert(got[0], got[1], inputs["matrices"], ep_rank, tp_rank)
    (out,) = run_node("MoeDistributeCombine",
                      [("expand_y", y), ("assist_info", got[2]), ("scales", inputs["scales"][rank]),
                       ("x1", inputs["x1"][rank]), ("x2", inputs["x2"][rank])],
                      ["out"], {**layout, "gather_tokens": config["gather_tokens"]})
    problems += compare("out", out, combined[rank], OUT_TOLERANCE)
    k = config["k"]
    slot_to_send = got[2][8 + ep * tp + tp + 2 * ep:][: len(inputs["x"][rank]) * k]
    return {"problems": problems, "rows": int(got[0].shape[0]), "dropped": int((slot_to_send < 0).sum())}


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
    results = []
    for config in configurations(world):
        try:
            result = check(config, rank)
        except Exception:  # reported; the next configuration still runs (a rank left waiting times out)
            result = {"problems": [traceback.format_exc(limit=3)], "rows": 0, "dropped": 0}
        results.append({"name": config["name"], **result})
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world": world, "results": results}))


if __name__ == "__main__":
    main()
