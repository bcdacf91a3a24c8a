"""One MoE layer past one process: time per layer at 1, 2 and 4 ranks with the total cores fixed, the
share of its exchanges, and MoeDistributeDispatch against a plain MPI_Alltoallv of the same rows
(docs/distributed.md). A benchmark, not a test: numbers depend on the machine and its load.

  PYTHONPATH=$PWD python benchmarks/bench_distributed.py [--ranks 1 2 4] [--cores N] [--tokens 256]
                                                          [--shapes gpt_oss qwen3] [--modes ep tp] [--rounds 5]

The layer (benchmarks/_ranks.py, random weights, fp32) is router MatMul -> MoeGatingTopK -> MOE on T
tokens, GPT-OSS-shaped (E=32, k=4, H=I=512, clamped SwiGLU with biases) and Qwen3-MoE-shaped (E=128,
k=8, H=512, I=192, SwiGLU): the real models' expert counts, H and I scaled down to fit a small machine.
Each rank count is one `mpirun --oversubscribe` launch of this script in its worker mode; every rank
has cores / ranks intra-op threads (at least 1: past the core count the ranks share cores). Each rank
takes its model from `moe_onnx.distributed.shard` (what `moe-onnx shard` writes):

  ep  the experts split over the ranks: every rank holds the whole sequence and routes its share of the
      tokens, MoeDistributeDispatch -> its experts -> MoeDistributeCombine(gather_tokens=1);
  tp  every expert's intermediate size split (MOE with tp_world_size), the partial outputs all-reduced.

Timed in interleaved rounds (the ratios are side by side: both calls of a ratio in every round), each
call after a barrier, as the slowest rank's time:

  layer      the sharded layer (every rank's output checked against the unsharded layer's first);
  exchange   ep: dispatch -> combine alone on the same tokens and experts (no expert work between);
             tp: a plain MPI_Allreduce of the [T, H] float32 output;
  dispatch   ep: MoeDistributeDispatch alone;
  alltoallv  ep: a plain MPI_Alltoallv (mpi4py) of exactly the rows the dispatch sends, with its counts
             (read from its assist_info): dispatch bytes/s / Alltoallv bytes/s is the ratio of their times.

The speed-up against 1 rank compares separate launches (not side by side). It ends with a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import (SHAPES, X, Y, RankTimer, allreduce, alltoallv, exchange_models, exchanged_rows,  # noqa: E402
                    layer_model, routing, token_range, tokens)
from _report import fmt  # noqa: E402
from _timing import session_options  # noqa: E402

MODES = ("ep", "tp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--cores", type=int, default=os.cpu_count(), help="cores shared by the ranks (default: all)")
    ap.add_argument("--tokens", type=int, default=256, help="T, the layer's tokens (every rank holds all)")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["gpt_oss", "qwen3"])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--backend", choices=("cpp", "python"), default="cpp", help="the kernels (default cpp)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians over all)")
    ap.add_argument("--budget-ms", type=float, default=150.0, help="time per call per round")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one mpirun launch may take")
    ap.add_argument("--worker", type=Path, metavar="OUT", help=argparse.SUPPRESS)  # a rank; rank 0 writes OUT
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)  # a worker's intra-op threads
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- on every rank

def _shard(model, tp: int, ep: int, rank: int):
    """Rank `rank`'s model of `model` sharded over tp * ep ranks, as `moe-onnx shard` writes it."""
    import onnx_ir as ir

    from moe_onnx.distributed.shard import shard_ir

    sharded = ir.from_proto(model)
    shard_ir(sharded, tp, ep, rank)
    return ir.to_proto(sharded)


def _session(model, args: argparse.Namespace):
    import moe_onnx

    return moe_onnx.session(model.SerializeToString(), backend=args.backend,
                            sess_options=session_options(args.threads))


def measure_layer(comm, name: str, mode: str, args: argparse.Namespace) -> dict:
    """One shape and parallelism on this launch's ranks: the timings (on rank 0: every rank's slowest)."""
    from mpi4py import MPI

    ranks, rank, shape = comm.size, comm.rank, SHAPES[name]
    model, x = layer_model(shape), tokens(shape, args.tokens)
    expected = _session(model, args).run([Y], {X: x})[0]
    rank_model = model if ranks == 1 else _shard(model, *((ranks, 1) if mode == "tp" else (1, ranks)), rank)
    layer_session = _session(rank_model, args)
    calls = {"layer": lambda: layer_session.run([Y], {X: x})}
    error = comm.allreduce(float(np.abs(calls["layer"]()[0] - expected).max()), op=MPI.MAX)
    moved_bytes = None
    if ranks > 1 and mode == "ep":
        weights, experts = routing(model, shape, x)
        mine = token_range(args.tokens, ranks, rank)
        feeds = {"x": x[mine], "experts": experts[mine]}
        dispatch_model, exchange_model = exchange_models(shape, ranks, rank)
        dispatch, exchange = _session(dispatch_model, args), _session(exchange_model, args)
        sent, received = exchanged_rows(dispatch.run(["assist_info"], feeds)[0])
        moved_bytes = comm.allreduce(int(sent.sum())) * shape.H * 4
        calls["exchange"] = lambda: exchange.run(["out"], {**feeds, "scales": weights[mine]})
        calls["dispatch"] = lambda: dispatch.run(["expand_x"], feeds)
        calls["alltoallv"] = alltoallv(comm, sent, received, shape.H)
    elif ranks > 1:
        calls["exchange"] = allreduce(comm, args.tokens, shape.H)
    timer = RankTimer(comm)
    timer.run_rounds(calls, args.rounds, args.budget_ms)
    out = dict(shape=name, mode=mode if ranks > 1 else "-", ranks=ranks, threads=args.threads,
               error=error, layer=timer.median("layer"))
    if "exchange" in calls:
        out.update(exchange=timer.median("exchange"), exchange_share=timer.paired_ratio("exchange", "layer"))
    if moved_bytes is not None:
        out.update(bytes=moved_bytes, dispatch=timer.median("dispatch"), alltoallv=timer.median("alltoallv"),
                   dispatch_vs_alltoallv=timer.paired_ratio("alltoallv", "dispatch"))
    return out


def worker(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    results = []
    for name in args.shapes:
        for mode in args.modes if comm.size > 1 else args.modes[:1]:
            results.append(measure_layer(comm, name, mode, args))
            if comm.rank == 0:
                print(_line(results[-1]), flush=True)
    if comm.rank == 0:
        args.worker.write_text(json.dumps(results))


# ----------------------------------------------------------------------------- the launcher

def launch(ranks: int, args: argparse.Namespace, out: Path) -> list[dict]:
    """This script's worker on `ranks` ranks under mpirun, with cores / ranks threads each."""
    from moe_onnx.run import mpirun_command, package_environment

    # --bind-to none: Open MPI binds 1-2 ranks to one core each, which would leave a rank's threads one core
    command = mpirun_command(ranks, [
        "--bind-to", "none", sys.executable, __file__, "--worker", str(out),
        "--threads", str(max(1, args.cores // ranks)), "--tokens", str(args.tokens), "--shapes", *args.shapes,
        "--modes", *args.modes, "--backend", args.backend, "--rounds", str(args.rounds), "--budget-ms", str(args.budget_ms)])
    print(f"\n$ {shlex.join(command)}", flush=True)
    subprocess.run(command, check=True, timeout=args.timeout, env=package_environment())
    return json.loads(out.read_text())


def _line(r: dict) -> str:
    parts = [f"{r['shape']} {r['mode']} ranks={r['ranks']} threads={r['threads']}: layer {fmt(r['layer'])} ms",
             f"max abs diff {r['error']:.1e}"]
    if "exchange" in r:
        parts.append(f"exchange alone {fmt(r['exchange'])} ms ({r['exchange_share']:.0%} of the layer)")
    if "bytes" in r:
        parts.append(f"dispatch {fmt(r['dispatch'])} ms, MPI_Alltoallv {fmt(r['alltoallv'])} ms of "
                     f"{r['bytes'] / 2**20:.1f} MiB: dispatch / Alltoallv bytes/s {r['dispatch_vs_alltoallv']:.2f}x")
    return "  ".join(parts)


def markdown(results: list[dict], tokens: int) -> str:
    single = {r["shape"]: r["layer"] for r in results if r["ranks"] == 1}
    out = [f"| layer (T = {tokens}) | parallelism | ranks | threads per rank | layer ms | 1 rank / this "
           "| exchange alone ms | exchange / layer | dispatch GB/s | MPI_Alltoallv GB/s | dispatch / Alltoallv "
           "| max abs diff vs unsharded |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = single.get(r["shape"])
        speedup = f"{base / r['layer']:.2f}x" if base else "-"
        exchange = (fmt(r["exchange"]), f"{r['exchange_share']:.0%}") if "exchange" in r else ("-", "-")
        moved = ((f"{r['bytes'] / r['dispatch'] / 1e6:.2f}", f"{r['bytes'] / r['alltoallv'] / 1e6:.2f}",
                  f"{r['dispatch_vs_alltoallv']:.2f}x") if "bytes" in r else ("-", "-", "-"))
        out.append(f"| {SHAPES[r['shape']].describe()} | {r['mode']} | {r['ranks']} | {r['threads']} | "
                   f"{fmt(r['layer'])} | {speedup} | {' | '.join(exchange)} | {' | '.join(moved)} | "
                   f"{r['error']:.1e} |")
    return "\n".join(out)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    print("command: " + shlex.join([sys.executable] + sys.argv), flush=True)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for ranks in args.ranks:
            results += launch(ranks, args, Path(folder) / f"ranks{ranks}.json")
    mode_order = ("-", *MODES)  # one rank first
    results.sort(key=lambda r: (args.shapes.index(r["shape"]), mode_order.index(r["mode"]), r["ranks"]))
    print(f"\n# Markdown ({args.cores} cores in all; exchange: ep dispatch -> combine, tp an MPI_Allreduce "
          "of the output)\n\n" + markdown(results, args.tokens))


if __name__ == "__main__":
    main()
