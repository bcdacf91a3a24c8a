"""int8 on AMX, on AVX512-VNNI and fp32, side by side: int8 MoeRowParallelLinear (the gate/up linear:
N = 2I, K = H) against the fp32 MoeRowParallelLinear on the same integers, and QMOE accuracy_level 4
(int8 codes, block 64, int8 activations) against fp32 MOE on its dequantized weights. A benchmark, not
a test: numbers depend on the machine and its load (the load average is printed with them).

  PYTHONPATH=$PWD python benchmarks/bench_int8.py            # the bench shapes, T = 1 16 128 512 (~2 min)
  PYTHONPATH=$PWD python benchmarks/bench_int8.py --full     # + GPT-OSS-20B and Qwen3-30B-A3B, T up to 2048
      [--shapes ...] [--tokens ...] [--ops linear qmoe] [--kernels vnni amx avx2] [--threads 2] [--runs 1]
      [--rounds 3]
  On aarch64 the children are its levels (default --kernels neon dotprod i8mm; a level the CPU lacks fails its child).

The ISA table is filled once per process, so each int8 kernel runs in its own child process: "amx" (nothing switched:
the tiles for calls from the threshold's rows, VNNI below it), "vnni" (MOE_ONNX_AMX=off) and, asked for, "avx2"
(MOE_ONNX_GEMM=avx2: int16 pairs); each child times its int8 op and the fp32 op in interleaved rounds
(benchmarks/_timing.py), so each int8 / fp32 ratio is side by side, and AMX / VNNI is the ratio of the two children's
ratios. Rows per expert come from a uniform random top-k router (T * k rows in all).
Target (issue 24): int8 on AMX >= 4x the fp32 throughput at T >= 128.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _models import linear_model  # noqa: E402
from _report import fmt  # noqa: E402
from _timing import BoundRunner, Timer, cpu_name, load  # noqa: E402
from bench_quantized import QShape, _save, moe_model, qmoe_model, quantized_linears, routing, session  # noqa: E402

from moe_onnx.ops.qmoe import dequantize  # noqa: E402
from moe_onnx.runtime import kernel_report  # noqa: E402

SHAPES = {
    "gpt_oss_20b": QShape(32, 4, 2880, 2880, True),
    "qwen3_30b": QShape(128, 8, 2048, 768, False),
    "gpt_oss": QShape(32, 4, 1024, 1024, True),  # bench_moe's shapes
    "qwen3": QShape(64, 8, 1024, 384, False),
}
QUICK = dict(shapes=["gpt_oss", "qwen3"], tokens=[1, 16, 128, 512])
FULL = dict(shapes=list(SHAPES), tokens=[1, 16, 128, 512, 2048])
# a child's environment per int8 kernel: amx (AMX where the call has the rows), vnni, avx2 (int16 pairs); aarch64's
# levels: neon (SMULL + SADALP), dotprod (SDOT), i8mm (SMMLA; level 4's dots on SDOT)
KERNELS = {"amx": {}, "vnni": {"MOE_ONNX_AMX": "off"}, "avx2": {"MOE_ONNX_GEMM": "avx2"},
           "neon": {"MOE_ONNX_GEMM": "neon"}, "dotprod": {"MOE_ONNX_GEMM": "dotprod"}, "i8mm": {"MOE_ONNX_GEMM": "i8mm"}}
DEFAULT_KERNELS = ["neon", "dotprod", "i8mm"] if platform.machine().lower() in ("aarch64", "arm64") else ["vnni", "amx"]
QMOE_BLOCK = 64  # the largest power of two dividing every shape's K (2880 = 45 * 64): AMX takes blocks >= 64
REPORT_KEYS = ("int8_gemm", "int8_gemm_tiles", "quant_dots", "quant_tiles", "amx", "amx_reason")


def expert_rows(shape: QShape, tokens: int, rng) -> np.ndarray:
    """Rows per expert of a uniform random top-k router."""
    experts = np.argsort(rng.random((tokens, shape.E)), axis=1)[:, : shape.k]
    return np.bincount(experts.ravel(), minlength=shape.E)


def linear_sessions(shape: QShape, threads: int, folder: Path) -> dict:
    rng = np.random.default_rng(5)
    w8 = rng.integers(-128, 128, (shape.E, 2 * shape.I, shape.H), dtype=np.int8)
    paths = {"int8": _save(linear_model(w8), folder, "linear_int8"),
             "fp32": _save(linear_model(w8.astype(np.float32)), folder, "linear_fp32")}
    del w8
    return {key: session(path, threads, ours=True) for key, path in paths.items()}


def linear_calls(shape: QShape, sessions: dict, tokens: int, rng) -> tuple[dict, int, float]:
    """Both calls (int8 checked against fp32 where its sums are exact in fp32), the rows and the ops."""
    rows = expert_rows(shape, tokens, rng)
    offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    x8 = rng.integers(-128, 128, (int(offsets[-1]), shape.H), dtype=np.int8)
    calls = {"int8": BoundRunner(sessions["int8"], (x8, offsets)),
             "fp32": BoundRunner(sessions["fp32"], (x8.astype(np.float32), offsets))}
    for call in calls.values():
        call()
    y8, y32 = calls["int8"].outputs()[0], calls["fp32"].outputs()[0]
    if shape.H <= 1024 and not np.array_equal(y8.astype(np.float32), y32):  # |sum| <= 2^24
        raise SystemExit(f"int8 MoeRowParallelLinear differs from fp32 at T={tokens}")
    return calls, int(offsets[-1]), 2.0 * offsets[-1] * 2 * shape.I * shape.H


def qmoe_sessions(shape: QShape, threads: int, folder: Path) -> dict:
    rng = np.random.default_rng(0)
    biases = [(rng.standard_normal((shape.E, n), dtype=np.float32) * 0.1) for n in (2 * shape.I, shape.H)]
    linears = quantized_linears(shape, 8, QMOE_BLOCK, "int", rng)
    paths = {"int8": _save(qmoe_model(shape, linears, biases, 8, QMOE_BLOCK, "int", 4), folder, "qmoe")}
    weights = [dequantize(l.codes, l.scales, None, bits=8, block_size=QMOE_BLOCK, k_dim=l.k) for l in linears]
    del linears
    paths["fp32"] = _save(moe_model(shape, weights, biases), folder, "moe_fp32")
    del weights  # the sessions load the files: no copy of the weights stays in this process
    return {key: session(path, threads, ours=True) for key, path in paths.items()}


def qmoe_calls(shape: QShape, sessions: dict, tokens: int, rng) -> tuple[dict, int, float]:
    feeds = routing(shape, tokens, rng)
    calls = {key: BoundRunner(sess, [feeds[i.name] for i in sess.get_inputs()]) for key, sess in sessions.items()}
    for call in calls.values():
        call()
    y8, y32 = calls["int8"].outputs()[0], calls["fp32"].outputs()[0]
    error = float(np.abs(y8 - y32).max()) / (float(np.abs(y32).max()) or 1.0)
    if not error < 0.05:  # int8 activations: ~1% of the output's scale
        raise SystemExit(f"QMOE level 4 differs from fp32 MOE by {error:.3g} (relative) at T={tokens}")
    # GEMM2: gate/up [2I, H] and down [H, I]; GEMM3: gate and up [I, H], down [H, I]: 3 H I each
    return calls, tokens * shape.k, 2.0 * tokens * shape.k * 3 * shape.H * shape.I


OPS = {"linear": (linear_sessions, linear_calls), "qmoe": (qmoe_sessions, qmoe_calls)}


def child(args: argparse.Namespace) -> None:
    """Measures in this process: one JSON line per (op, shape, T), then the kernel report."""
    report = kernel_report()
    print("REPORT " + json.dumps({k: report[k] for k in REPORT_KEYS}), flush=True)
    for name in args.shapes:
        shape = SHAPES[name]
        for op in args.ops:
            make_sessions, make_calls = OPS[op]
            with tempfile.TemporaryDirectory() as folder:
                sessions = make_sessions(shape, args.threads, Path(folder))
                rng = np.random.default_rng(3)
                for t in args.tokens:
                    calls, rows, ops = make_calls(shape, sessions, t, rng)
                    timer = Timer()
                    timer.run_rounds(calls, args.rounds, budget_ms=200)
                    print("RESULT " + json.dumps(dict(op=op, shape=name, tokens=t, rows=rows, ops=ops,
                                                      int8=timer.median("int8"), fp32=timer.median("fp32"),
                                                      speedup=timer.paired_ratio("fp32", "int8"))), flush=True)
                del sessions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="every shape, T = 1 16 128 512 2048")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int)
    ap.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS))
    ap.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=DEFAULT_KERNELS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=1, help="child processes per kernel, alternating")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    preset = FULL if args.full else QUICK
    args.shapes = args.shapes or preset["shapes"]
    args.tokens = args.tokens or preset["tokens"]
    if args.child:
        return child(args)
    print(f"{cpu_name()}; {args.threads} threads; before: {load()}", flush=True)
    results: dict[tuple, dict[str, list[dict]]] = {}
    reports = {}
    for _ in range(args.runs):
        for kernel in args.kernels:
            cmd = [sys.executable, __file__, "--child", "--threads", str(args.threads), "--rounds", str(args.rounds),
                   "--shapes", *args.shapes, "--tokens", *map(str, args.tokens), "--ops", *args.ops]
            base = {k: v for k, v in os.environ.items() if k not in ("MOE_ONNX_AMX", "MOE_ONNX_GEMM")}
            with subprocess.Popen(cmd, env={**base, **KERNELS[kernel]}, stdout=subprocess.PIPE, text=True) as child_run:
                for line in child_run.stdout:
                    if line.startswith("REPORT "):
                        reports[kernel] = json.loads(line[len("REPORT "):])
                    elif line.startswith("RESULT "):
                        r = json.loads(line[len("RESULT "):])
                        results.setdefault((r["op"], r["shape"], r["tokens"]), {}).setdefault(kernel, []).append(r)
                        print(f"  {kernel}: {r['op']} {r['shape']} T={r['tokens']}: int8 {fmt(r['int8'])} ms, fp32 "
                              f"{fmt(r['fp32'])} ms, {r['speedup']:.2f}x", flush=True)
            if child_run.returncode != 0:
                raise SystemExit(f"the {kernel} child failed (its error above)")
    for kernel, report in reports.items():
        print(f"{kernel} child: " + ", ".join(f"{k}={v}" for k, v in report.items()), flush=True)
    print(f"after: {load()}")
    print(table(results, args))
    if "amx" in reports:
        print(target(results, reports["amx"]))


def table(results: dict, args: argparse.Namespace) -> str:
    """The Markdown table: per (op, shape, T) each kernel's ms and int8 / fp32 throughput (its child's
    side-by-side ratio), AMX / VNNI throughput (the children's int8 times) and AMX's rate."""
    kernels = args.kernels
    both = "amx" in kernels and "vnni" in kernels
    head = ["op", "shape", "T", "rows", "fp32 ms", *(f"{k} ms" for k in kernels), *(f"{k} / fp32" for k in kernels)]
    head += ["amx / vnni"] * both + ["amx GOP/s"] * ("amx" in kernels)
    lines = [f"\nint8 / fp32 throughput, {args.threads} threads, median of {args.runs} run(s) x {args.rounds} rounds "
             f"(linear: int8 MoeRowParallelLinear N=2I K=H against fp32 on the same integers; qmoe: QMOE int8 "
             f"block {QMOE_BLOCK} accuracy_level 4 against fp32 MOE on its dequantized weights)",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (op, shape, t), by_kernel in results.items():
        med = {k: {key: statistics.median(r[key] for r in rs) for key in ("int8", "speedup")}
               for k, rs in by_kernel.items()}
        fp32 = statistics.median(r["fp32"] for rs in by_kernel.values() for r in rs)
        first = next(iter(by_kernel.values()))[0]
        cells = [op, shape, str(t), str(first["rows"]), fmt(fp32), *(fmt(med[k]["int8"]) for k in kernels),
                 *(f"{med[k]['speedup']:.2f}x" for k in kernels)]
        if both:
            cells.append(f"{med['vnni']['int8'] / med['amx']['int8']:.2f}x")
        if "amx" in kernels:
            cells.append(f"{first['ops'] / (med['amx']['int8'] * 1e-3) / 1e9:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def target(results: dict, report: dict) -> str:
    """Issue 24's target against the AMX child's ratios at T >= 128."""
    if report["amx"] != "usable":
        return f"\nAMX is not usable here ({report['amx']}: {report['amx_reason']}): the amx child ran VNNI"
    ratios = sorted((statistics.median(x["speedup"] for x in r["amx"]), key)
                    for key, r in results.items() if key[2] >= 128 and "amx" in r)
    if not ratios:
        return ""
    met = [x for x in ratios if x[0] >= 4.0]
    return (f"\nTarget int8 on AMX >= 4x fp32 at T >= 128: met in {len(met)} of {len(ratios)} (lowest "
            f"{ratios[0][0]:.2f}x: {' '.join(map(str, ratios[0][1]))}; highest {ratios[-1][0]:.2f}x: "
            f"{' '.join(map(str, ratios[-1][1]))})")


if __name__ == "__main__":
    main()
