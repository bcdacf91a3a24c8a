"""The fp32 MOE node's time at two ISA levels of the C++ kernels on this CPU (not a test).

The level is fixed per process (MOE_ONNX_GEMM), so each round runs one child process per level, in
alternating order; each child times a one-node MOE model (constant random weights, packed at session
creation) at every shape and token count. Printed: each level's median time per point (over
rounds) and the median over rounds of the per-round ratio, so a slow spell of the shared machine
slows both sides of a ratio.

  gpt_oss  E=32, k=4, H=I=1024, GEMM2_BIAS_SWIGLU_CLAMP with biases
  qwen3    E=64, k=8, H=1024, I=384, GEMM3_SWIGLU

Usage: PYTHONPATH=$PWD python benchmarks/bench_isa_levels.py [--levels avx2 avx512] [--tokens 1 16 128 512]
       [--shapes gpt_oss qwen3] [--threads 2] [--rounds 3] [--budget-ms 300]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _exports import SHAPES  # noqa: E402  (the benchmark shapes: E, k, H, I, gemm2)


def moe_model(E: int, H: int, I: int, expert_type: str):
    """A model of one MOE node whose expert weights are random fp32 initializers."""
    from onnx import TensorProto, helper, numpy_helper

    import moe_onnx

    rng = np.random.default_rng(0)

    def rand(name, *shape):
        return numpy_helper.from_array(rng.standard_normal(shape, dtype=np.float32) * 0.05, name)

    if expert_type == "GEMM3_SWIGLU":
        weights = [rand("w0", E, I, H), rand("w1", E, I, H), rand("w2", E, H, I)]
        inputs, attrs = ["x", "rw", "idx", "w0", "", "w1", "", "w2"], {}
    else:
        weights = [rand("w0", E, H, 2 * I), rand("b0", E, 2 * I), rand("w1", E, I, H), rand("b1", E, H)]
        inputs, attrs = ["x", "rw", "idx", "w0", "b0", "w1", "b1"], {"expert_alpha": 1.702, "expert_beta": 7.0}
    node = helper.make_node("MOE", inputs, ["y"], domain=moe_onnx.DOMAIN, expert_type=expert_type, **attrs)
    graph = helper.make_graph(
        [node], "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
                        helper.make_tensor_value_info("rw", TensorProto.FLOAT, None),
                        helper.make_tensor_value_info("idx", TensorProto.INT64, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], weights)
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def child(shapes: list[str], tokens: list[int], threads: int, budget_ms: float) -> dict:
    """Median ms of session.run per (shape, T) in this process (its MOE_ONNX_GEMM level)."""
    from _timing import median_ms, session_options

    from moe_onnx.runtime import session

    times = {}
    for name in shapes:
        shape = SHAPES[name]
        E, k, H, I = shape.E, shape.k, shape.H, shape.I
        expert_type = "GEMM2_BIAS_SWIGLU_CLAMP" if shape.gemm2 else "GEMM3_SWIGLU"
        sess = session(moe_model(E, H, I, expert_type), sess_options=session_options(threads))
        rng = np.random.default_rng(1)
        for T in tokens:
            feeds = {"x": rng.standard_normal((T, H), dtype=np.float32),
                     "rw": np.full((T, k), 1.0 / k, np.float32),
                     "idx": np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64)}
            times[f"{name} T={T}"] = median_ms(lambda: sess.run(None, feeds), budget_ms, at_least=5)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", nargs=2, default=["avx2", "avx512"])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-ms", type=float, default=300.0, help="time per point per child")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.shapes, args.tokens, args.threads, args.budget_ms)))
        return
    base, other = args.levels
    runs: dict[str, list[dict]] = {base: [], other: []}
    for r in range(args.rounds):
        for level in (args.levels if r % 2 == 0 else args.levels[::-1]):
            cmd = [sys.executable, __file__, "--child", "--threads", str(args.threads), "--budget-ms",
                   str(args.budget_ms), "--shapes", *args.shapes, "--tokens", *map(str, args.tokens)]
            out = subprocess.run(cmd, env={**os.environ, "MOE_ONNX_GEMM": level}, capture_output=True, text=True,
                                 check=True)
            runs[level].append(json.loads(out.stdout.splitlines()[-1]))
            print(f"round {r + 1} {level} done", file=sys.stderr)
    print(f"fp32 MOE node, {args.threads} threads, {args.rounds} rounds; ratio = {other} / {base} time")
    print(f"{'point':<18}{base + ' ms':>12}{other + ' ms':>12}{'ratio':>8}")
    for point in runs[base][0]:
        a = statistics.median(run[point] for run in runs[base])
        b = statistics.median(run[point] for run in runs[other])
        ratio = statistics.median(y[point] / x[point] for x, y in zip(runs[base], runs[other]))
        print(f"{point:<18}{a:>12.3f}{b:>12.3f}{ratio:>8.3f}")


if __name__ == "__main__":
    main()
