"""int8 against fp32 MoeRowParallelLinear (the gate/up linear of the bench shapes) for each int8
kernel this machine has, in alternating child processes (the kernel is chosen once per process:
MOE_ONNX_GEMM=avx2 forces the AVX2 int16-pair kernel; unset, the best one, AVX512-VNNI where the
CPU has it). A benchmark, not a test: numbers depend on the machine and its load.

  PYTHONPATH=$PWD python benchmarks/bench_int8.py [--shapes gpt_oss qwen3] [--tokens 128 512]
                                                  [--threads 2] [--runs 3]

Rows per expert come from a uniform random top-k router (T * k rows in all). Each child prints one
row per (shape, T) through benchmarks/_measure.py's measure_int8 (fp32 and int8 sessions timed in
interleaved rounds; int8 results checked against fp32's); the parent prints the median speedup
over the runs of each kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def child(shapes: list[str], tokens: list[int], threads: int) -> None:
    """Measures in this process and prints one JSON line per (shape, T)."""
    sys.path.insert(0, str(HERE))
    from _exports import SHAPES
    from _measure import Settings, measure_int8

    from moe_onnx.runtime import kernel_report

    isa = kernel_report()["int8_gemm"]
    settings = Settings(tokens=tokens, threads=threads, rounds=5, budget_ms=300, unfused_max_tokens=0)
    rng = np.random.default_rng(3)
    for name in shapes:
        shape = SHAPES[name]
        counts = {}
        for t in tokens:
            experts = np.argsort(rng.random((t, shape.E)), axis=1)[:, : shape.k]  # k distinct experts per token
            counts[t] = np.bincount(experts.ravel(), minlength=shape.E)
        for t, r in measure_int8(shape, settings, counts).items():
            print("RESULT " + json.dumps(dict(isa=isa, shape=name, tokens=t, **r)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["gpt_oss", "qwen3"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.shapes, args.tokens, args.threads)
    results: dict[tuple[str, str, int], list[dict]] = {}
    for _ in range(args.runs):
        for level in ("avx2", ""):  # "": the best kernel of this CPU
            env = {**os.environ, "MOE_ONNX_GEMM": level}
            cmd = [sys.executable, __file__, "--child", "--threads", str(args.threads), "--shapes", *args.shapes,
                   "--tokens", *map(str, args.tokens)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    r = json.loads(line[len("RESULT "):])
                    results.setdefault((r["isa"], r["shape"], r["tokens"]), []).append(r)
    print(f"int8 vs fp32 MoeRowParallelLinear, {args.threads} threads, median of {args.runs} runs")
    print("| int8 kernel | shape | T | rows | fp32 ms | int8 ms | int8 GOP/s | int8 / fp32 throughput |")
    print("|---|---|---|---|---|---|---|---|")
    for (isa, shape, t), rs in sorted(results.items()):
        med = {k: statistics.median(r[k] for r in rs) for k in ("fp32", "int8", "speedup")}
        gops = statistics.median(r["gops"]["int8"] for r in rs)
        print(f"| {isa} | {shape} | {t} | {rs[0]['rows']} | {med['fp32']:.2f} | {med['int8']:.2f} | {gops:.0f} "
              f"| {med['speedup']:.2f}x |")


if __name__ == "__main__":
    main()
