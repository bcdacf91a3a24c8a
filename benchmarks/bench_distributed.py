"""One MoE layer past one process: the layer at 1 rank x N threads, N ranks x 1 thread and 2 ranks x N/2
threads side by side (N cores), the share of its exchanges, and MoeDistributeDispatch against a plain
MPI_Alltoallv of the same rows (docs/distributed.md). A benchmark, not a test: numbers depend on the
machine and its load.

  PYTHONPATH=$PWD python benchmarks/bench_distributed.py [--cores N] [--ranks R ...] [--threads-per-rank T ...]
      [--tokens 256] [--dispatch-tokens 4096] [--shapes gpt_oss qwen3] [--modes ep tp] [--parts layer dispatch]
      [--backend cpp] [--rounds 5]

The configurations are --ranks with --threads-per-rank (one value for all, or one per rank count; default
cores // ranks, at least 1); without --ranks, 1 x N, N x 1 and 2 x N/2 for N = --cores (default: all).

The layer (benchmarks/_ranks.py, random weights, fp32) is router MatMul -> MoeGatingTopK -> MOE on T
tokens, GPT-OSS-shaped (E=32, k=4, H=I=512, clamped SwiGLU with biases) and Qwen3-MoE-shaped (E=128,
k=8, H=512, I=192, SwiGLU): the real models' expert counts, H and I scaled down to fit a small machine.
Each configuration is one `mpirun --oversubscribe` launch of this script in its worker mode, every rank
with its threads (past the core count the ranks share cores). The launcher
saves each layer with external data; each rank shards it (`moe_onnx.distributed.shard.shard_ir`, what
`moe-onnx shard` writes for that rank):

  ep  the experts split over the ranks: every rank holds the whole sequence and routes its share of the
      tokens, MoeDistributeDispatch -> its experts -> MoeDistributeCombine(gather_tokens=1);
  tp  every expert's intermediate size split (MOE with tp_world_size), the partial outputs all-reduced.

Timed in interleaved rounds (the ratios are side by side: both calls of a ratio in every round), each
call after a barrier, as the slowest rank's time; sessions run on OrtValues bound once (no output copied
to numpy):

  layer      the sharded layer (every rank's output checked against the unsharded layer's first);
  exchange   beside it: ep, dispatch -> combine alone on the same tokens and experts (no expert work
             between); tp, a plain MPI_Allreduce of the [T, H] float32 output;
  dispatch   MoeDistributeDispatch alone (EP over all the ranks) of T and of --dispatch-tokens tokens,
  alltoallv  beside a plain MPI_Alltoallv (mpi4py) of exactly the rows the dispatch sends, with its counts
             (read from its assist_info): dispatch bytes/s / Alltoallv bytes/s is the ratio of their times.

The speed-up against 1 rank compares separate launches (not side by side). It ends with Markdown tables,
the first the layer of every configuration side by side; on 2 cores or fewer it says that ranks cannot
beat threads there (they have no more cores, and add the exchanges).
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
import onnx
from onnx.external_data_helper import load_external_data_for_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import (SHAPES, X, Y, RankTimer, allreduce, alltoallv, exchange_models, exchanged_rows,  # noqa: E402
                    layer_model, routing, token_range, tokens)
from _report import fmt  # noqa: E402
from _timing import BoundRunner, session_options  # noqa: E402

MODES = ("ep", "tp")
PARTS = ("layer", "dispatch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cores", type=int, default=os.cpu_count(), help="N, the cores shared by the ranks (default: all)")
    ap.add_argument("--ranks", type=int, nargs="+", help="rank counts (default: 1, N and 2)")
    ap.add_argument("--threads-per-rank", type=int, nargs="+",
                    help="intra-op threads of each rank: one value, or one per --ranks (default: cores // ranks)")
    ap.add_argument("--tokens", type=int, default=256, help="T, the layer's tokens (every rank holds all)")
    ap.add_argument("--dispatch-tokens", type=int, nargs="+", default=[4096],
                    help="more token counts for the dispatch against MPI_Alltoallv (beside --tokens)")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["gpt_oss", "qwen3"])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                    help="the layer, and the dispatch against MPI_Alltoallv (default both)")
    ap.add_argument("--backend", choices=("cpp", "python"), default="cpp", help="the kernels (default cpp)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians over all)")
    ap.add_argument("--budget-ms", type=float, default=150.0, help="time per call per round")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one mpirun launch may take")
    ap.add_argument("--worker", type=Path, metavar="OUT", help=argparse.SUPPRESS)  # a rank; rank 0 writes OUT
    ap.add_argument("--models", type=Path, help=argparse.SUPPRESS)  # a worker's layer files (_layer_file)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)  # a worker's intra-op threads
    args = ap.parse_args(argv)
    if args.threads_per_rank and (not args.ranks or len(args.threads_per_rank) not in (1, len(args.ranks))):
        ap.error("--threads-per-rank takes one value, or one per --ranks (and needs --ranks)")
    return args


def configurations(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(ranks, threads per rank) of each launch, in order, without repeats."""
    if args.ranks is None:
        cores = max(1, args.cores)
        pairs = [(1, cores), (cores, 1), (2, max(1, cores // 2))]
    else:
        threads = args.threads_per_rank or [max(1, args.cores // ranks) for ranks in args.ranks]
        pairs = list(zip(args.ranks, threads * len(args.ranks) if len(threads) == 1 else threads))
    return list(dict.fromkeys(pairs))


# ----------------------------------------------------------------------------- on every rank

def _shard(path: Path, tp: int, ep: int, rank: int) -> onnx.ModelProto:
    """Rank `rank`'s model of the layer at `path` sharded over tp * ep ranks, as `moe-onnx shard` writes it
    (the weights are external data, mapped: each rank reads only its slices)."""
    import onnx_ir as ir

    from moe_onnx.distributed.shard import shard_ir

    sharded = ir.load(path)
    shard_ir(sharded, tp, ep, rank)
    proto = ir.to_proto(sharded)
    load_external_data_for_model(proto, str(path.parent))  # the weights it keeps whole (the router)
    return proto


def _layer_file(folder: Path, name: str) -> Path:
    """The layer `name` saved by the launcher, its weights as external data."""
    return folder / f"{name}.onnx"


def _session(model, args: argparse.Namespace):
    import moe_onnx

    return moe_onnx.session(model.SerializeToString(), backend=args.backend,
                            sess_options=session_options(args.threads))


def _exchange_feeds(comm, name: str, model: onnx.ModelProto, count: int) -> dict[str, np.ndarray]:
    """This rank's share of `count` tokens of the layer `name`, with their experts and routing weights (the
    inputs of the exchange models, routed as the layer `model` routes them)."""
    shape = SHAPES[name]
    x = tokens(shape, count)
    weights, experts = routing(model, shape, x)
    mine = token_range(count, comm.size, comm.rank)
    return {"x": x[mine], "experts": experts[mine], "scales": weights[mine]}


def measure_layer(comm, name: str, mode: str, args: argparse.Namespace) -> dict:
    """One shape and parallelism on this launch's ranks: the layer and its exchanges alone (median ms of the
    slowest rank, the share side by side), its max error against the unsharded layer."""
    from mpi4py import MPI

    ranks, rank, shape = comm.size, comm.rank, SHAPES[name]
    path = _layer_file(args.models, name)
    model, x = onnx.load(path), tokens(shape, args.tokens)
    expected = _session(model, args).run([Y], {X: x})[0]
    rank_model = model if ranks == 1 else _shard(path, *((ranks, 1) if mode == "tp" else (1, ranks)), rank)
    layer = BoundRunner(_session(rank_model, args), [x])
    layer()
    error = comm.allreduce(float(np.abs(layer.outputs()[0] - expected).max()), op=MPI.MAX)
    calls = {"layer": layer}
    if ranks > 1 and mode == "ep":
        feeds = _exchange_feeds(comm, name, model, args.tokens)
        calls["exchange"] = BoundRunner(_session(exchange_models(shape, ranks, rank)[1], args),
                                        [feeds["x"], feeds["experts"], feeds["scales"]])
    elif ranks > 1:
        calls["exchange"] = allreduce(comm, args.tokens, shape.H)
    timer = RankTimer(comm)
    timer.run_rounds(calls, args.rounds, args.budget_ms)
    out = dict(shape=name, mode=mode if ranks > 1 else "-", ranks=ranks, threads=args.threads,
               error=error, layer=timer.median("layer"))
    if "exchange" in calls:
        out.update(exchange=timer.median("exchange"), exchange_share=timer.paired_ratio("exchange", "layer"))
    return out


def measure_dispatch(comm, name: str, count: int, args: argparse.Namespace) -> dict:
    """MoeDistributeDispatch of `count` tokens (EP over every rank) against a plain MPI_Alltoallv of the rows
    it sends, with its counts, side by side."""
    shape = SHAPES[name]
    dispatch = _session(exchange_models(shape, comm.size, comm.rank)[0], args)
    feeds = _exchange_feeds(comm, name, onnx.load(_layer_file(args.models, name)), count)
    del feeds["scales"]
    sent, received = exchanged_rows(dispatch.run(["assist_info"], feeds)[0])
    timer = RankTimer(comm)
    timer.run_rounds({"dispatch": BoundRunner(dispatch, [feeds["x"], feeds["experts"]]),
                      "alltoallv": alltoallv(comm, sent, received, shape.H)}, args.rounds, args.budget_ms)
    return dict(shape=name, ranks=comm.size, threads=args.threads, tokens=count, bytes=comm.allreduce(int(sent.sum())) * shape.H * 4,
                dispatch=timer.median("dispatch"), alltoallv=timer.median("alltoallv"),
                ratio=timer.paired_ratio("alltoallv", "dispatch"))


def worker(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    layers, dispatches = [], []
    for name in args.shapes:
        for mode in (args.modes if comm.size > 1 else args.modes[:1]) if "layer" in args.parts else ():
            layers.append(measure_layer(comm, name, mode, args))
            _say(comm, _layer_line(layers[-1]))
        if comm.size > 1 and "dispatch" in args.parts:
            for count in sorted({args.tokens, *args.dispatch_tokens}):
                dispatches.append(measure_dispatch(comm, name, count, args))
                _say(comm, _dispatch_line(dispatches[-1]))
    if comm.rank == 0:
        args.worker.write_text(json.dumps(dict(layers=layers, dispatches=dispatches)))


def _say(comm, line: str) -> None:
    if comm.rank == 0:
        print(line, flush=True)


# ----------------------------------------------------------------------------- the launcher

def launch(ranks: int, threads: int, args: argparse.Namespace, out: Path) -> dict:
    """This script's worker on `ranks` ranks under mpirun, with `threads` intra-op threads each."""
    from moe_onnx.distributed.run import mpirun_command, package_environment

    # --bind-to none: Open MPI binds 1-2 ranks to one core each, which would leave a rank's threads one core
    command = mpirun_command(ranks, [
        "--bind-to", "none", sys.executable, __file__, "--worker", str(out), "--models", str(out.parent),
        "--threads", str(threads), "--tokens", str(args.tokens), "--parts", *args.parts,
        "--dispatch-tokens", *map(str, args.dispatch_tokens), "--shapes", *args.shapes, "--modes", *args.modes,
        "--backend", args.backend, "--rounds", str(args.rounds), "--budget-ms", str(args.budget_ms)])
    print(f"\n$ {shlex.join(command)}", flush=True)
    subprocess.run(command, check=True, timeout=args.timeout, env=package_environment())
    return json.loads(out.read_text())


def _layer_line(r: dict) -> str:
    line = (f"{r['shape']} {r['mode']} ranks={r['ranks']} threads={r['threads']}: layer {fmt(r['layer'])} ms, "
            f"max abs diff {r['error']:.1e}")
    if "exchange" in r:
        line += f", exchange alone {fmt(r['exchange'])} ms ({r['exchange_share']:.0%} of the layer)"
    return line


def _dispatch_line(r: dict) -> str:
    return (f"{r['shape']} ranks={r['ranks']} threads={r['threads']} T={r['tokens']}: dispatch {fmt(r['dispatch'])} ms, MPI_Alltoallv "
            f"{fmt(r['alltoallv'])} ms of {r['bytes'] / 2**20:.2f} MiB: dispatch / Alltoallv bytes/s {r['ratio']:.2f}x")


def side_by_side(layers: list[dict], configs: list[tuple[int, int]], args: argparse.Namespace) -> str:
    """The layer's ms in every configuration, one row per shape and parallelism (1 rank in every row), and
    on a machine of 2 cores or fewer, why ranks cannot beat threads there."""
    by_config = {(r["shape"], r["mode"], r["ranks"], r["threads"]): r["layer"] for r in layers}
    out = ["| layer (T = %d) | parallelism | " % args.tokens
           + " | ".join(f"{ranks} rank{'s' if ranks > 1 else ''} x {threads} thread{'s' if threads > 1 else ''} ms"
                        for ranks, threads in configs) + " |",
           "|---|---|" + "---|" * len(configs)]
    for name in args.shapes:
        for mode in args.modes:
            cells = [by_config.get((name, "-" if ranks == 1 else mode, ranks, threads)) for ranks, threads in configs]
            out.append(f"| {SHAPES[name].label} | {mode} | "
                       + " | ".join("-" if ms is None else fmt(ms) for ms in cells) + " |")
    if args.cores <= 2:
        out += ["", f"On {args.cores} core{'s' if args.cores > 1 else ''}, ranks cannot beat threads: N ranks x 1 "
                "thread have no more cores than 1 rank x N threads and add the exchanges (at more ranks than cores "
                "they also take turns). The comparison needs a machine with more cores."]
    return "\n".join(out)


def markdown(layers: list[dict], dispatches: list[dict], args: argparse.Namespace) -> str:
    """The layer table (time, speed-up against 1 rank, the exchanges' share, error) and the dispatch table,
    those that have rows."""
    single = {r["shape"]: r["layer"] for r in layers if r["ranks"] == 1}
    out = []
    if layers:
        out += [f"| layer (T = {args.tokens}) | parallelism | ranks | threads per rank | layer ms | 1 rank / this "
                "| exchange alone ms | exchange / layer | max abs diff vs unsharded |",
                "|---|---|---|---|---|---|---|---|---|"]
    for r in layers:
        base = single.get(r["shape"])
        speedup = f"{base / r['layer']:.2f}x" if base else "-"
        exchange = (fmt(r["exchange"]), f"{r['exchange_share']:.0%}") if "exchange" in r else ("-", "-")
        out.append(f"| {SHAPES[r['shape']].describe()} | {r['mode']} | {r['ranks']} | {r['threads']} | "
                   f"{fmt(r['layer'])} | {speedup} | {' | '.join(exchange)} | {r['error']:.1e} |")
    if layers and dispatches:
        out.append("")
    if dispatches:
        out += ["| layer | ranks | threads per rank | tokens | MiB sent | dispatch ms "
                "| MPI_Alltoallv ms | dispatch GB/s | MPI_Alltoallv GB/s | dispatch / Alltoallv bytes/s |",
                "|---|---|---|---|---|---|---|---|---|---|"]
    for r in dispatches:
        out.append(f"| {SHAPES[r['shape']].label} | {r['ranks']} | {r['threads']} | {r['tokens']} | "
                   f"{r['bytes'] / 2**20:.2f} | {fmt(r['dispatch'])} | {fmt(r['alltoallv'])} | "
                   f"{r['bytes'] / r['dispatch'] / 1e6:.2f} | {r['bytes'] / r['alltoallv'] / 1e6:.2f} | "
                   f"{r['ratio']:.2f}x |")
    return "\n".join(out)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    print("command: " + shlex.join([sys.executable] + sys.argv), flush=True)
    layers, dispatches = [], []
    configs = configurations(args)
    with tempfile.TemporaryDirectory() as folder:
        for name in args.shapes:
            onnx.save(layer_model(SHAPES[name]), _layer_file(Path(folder), name), save_as_external_data=True,
                      location=f"{name}.data")
        for ranks, threads in configs:
            launched = launch(ranks, threads, args, Path(folder) / f"ranks{ranks}x{threads}.json")
            layers += launched["layers"]
            dispatches += launched["dispatches"]
    mode_order = ("-", *MODES)  # one rank first
    layers.sort(key=lambda r: (args.shapes.index(r["shape"]), mode_order.index(r["mode"]), r["ranks"], r["threads"]))
    dispatches.sort(key=lambda r: (args.shapes.index(r["shape"]), r["ranks"], r["threads"], r["tokens"]))
    print(f"\n# Markdown ({args.cores} cores in all; exchange alone: ep dispatch -> combine, tp an MPI_Allreduce "
          "of the output)")
    if "layer" in args.parts:
        print("\n" + side_by_side(layers, configs, args))
    print("\n" + markdown(layers, dispatches, args))


if __name__ == "__main__":
    main()
