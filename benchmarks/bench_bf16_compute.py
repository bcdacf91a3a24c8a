"""The MOE layer at bf16 compute (accuracy_level 3) against fp32 on this CPU, side by side (not a test).

One MOE node with random fp32 weights (initializers in an external data file, made once in --models-dir)
per shape:

  gpt_oss_20b  GPT-OSS-20B's layer: E=32, k=4, H=I=2880, GEMM2_BIAS_SWIGLU_CLAMP with biases
  qwen3_30b    Qwen3-30B-A3B's layer: E=128, k=8, H=2048, I=768, GEMM3_SWIGLU
  gpt_oss      the repo's bench shapes (benchmarks/_exports.py): E=32, k=4, H=I=1024, GEMM2
  qwen3        E=64, k=8, H=1024, I=384, GEMM3

Variants, each a child process per round (the ISA table is filled once per process) timing every shape,
in alternating order round by round:

  fp32         accuracy_level 0: the fp32 kernels (AVX-512 here)
  bf16         accuracy_level 3: AMX's TDPBF16PS from kBf16TileRows (4) rows per task, vdpbf16ps below
  bf16_no_amx  accuracy_level 3 with MOE_ONNX_AMX=off: vdpbf16ps (AVX512-BF16) for every task
  matmul       the same FLOPs in plain onnxruntime: the dense MatMul probe of bench_moe.py
               (_models.dense_model: [T*k, H] x [H, 3I], prepacked by MLAS), a compute bound

Printed: the CPU, the load average before and after, each variant's kernel report, the median time per
(shape, T) of each variant, and the median over rounds of the per-round ratios bf16 / fp32,
bf16_no_amx / fp32 and fp32 / matmul (a slow spell of the shared machine slows both sides of a ratio),
then the issue's targets against them. The bf16 outputs' largest difference from fp32's, relative to
fp32's largest |value|, is checked once per shape (T=16) against 6 x 2^-9 (test_bf16_kernels.py's bound).
T=2048 of the two large layers runs only with --full (the default run takes ~3-4 minutes).

Usage: PYTHONPATH=$PWD python benchmarks/bench_bf16_compute.py [--shapes ...] [--tokens 1 16 128 512 2048]
       [--full] [--threads 2] [--rounds 2] [--budget-ms 300] [--variants fp32 bf16 bf16_no_amx matmul]
       [--models-dir /tmp/moe-bf16-bench]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _exports import SHAPES as BENCH_SHAPES  # noqa: E402
from _timing import cpu_name, load, median_ms  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    E: int
    k: int
    H: int
    I: int
    gemm2: bool
    large: bool = False  # T=2048 only with --full


SHAPES = {"gpt_oss_20b": Shape(32, 4, 2880, 2880, True, large=True),
          "qwen3_30b": Shape(128, 8, 2048, 768, False, large=True),
          **{name: Shape(s.E, s.k, s.H, s.I, s.gemm2) for name, s in BENCH_SHAPES.items()}}
VARIANTS = {  # name: (accuracy_level, extra environment)
    "fp32": (0, {}),
    "bf16": (3, {}),
    "bf16_no_amx": (3, {"MOE_ONNX_AMX": "off"}),
    "matmul": (None, {}),
}
BF16_BOUND = 6 * 2.0 ** -9  # tests/test_bf16_kernels.py's bound, relative to the output's peak |value|


def model_paths(models_dir: Path, name: str, shape: Shape) -> dict[int, Path]:
    stem = f"{name}_E{shape.E}"
    return {level: models_dir / f"{stem}_level{level}.onnx" for level in (0, 3)}


def points(args, shape: Shape) -> list[int]:
    return [T for T in args.tokens if args.full or not (shape.large and T > 512)]


def make_models(models_dir: Path, name: str, shape: Shape) -> None:
    """The one-node MOE models at accuracy_level 0 and 3, sharing one external data file."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    import moe_onnx

    paths = model_paths(models_dir, name, shape)
    if all(p.exists() for p in paths.values()):
        return
    E, H, I = shape.E, shape.H, shape.I
    rng = np.random.default_rng(0)

    def rand(tensor, *dims):
        return numpy_helper.from_array(rng.standard_normal(dims, dtype=np.float32) * 0.03, tensor)

    if shape.gemm2:
        weights = [rand("w0", E, H, 2 * I), rand("b0", E, 2 * I), rand("w1", E, I, H), rand("b1", E, H)]
        inputs, attrs = ["x", "rw", "idx", "w0", "b0", "w1", "b1"], {"expert_alpha": 1.702, "expert_beta": 7.0}
        expert_type = "GEMM2_BIAS_SWIGLU_CLAMP"
    else:
        weights = [rand("w0", E, I, H), rand("w1", E, I, H), rand("w2", E, H, I)]
        inputs, attrs, expert_type = ["x", "rw", "idx", "w0", "", "w1", "", "w2"], {}, "GEMM3_SWIGLU"
    data = f"{paths[0].stem}.weights"
    for level, path in sorted(paths.items()):
        node = helper.make_node("MOE", inputs, ["y"], domain=moe_onnx.DOMAIN, expert_type=expert_type,
                                accuracy_level=level, **attrs)
        graph = helper.make_graph(
            [node], "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
                            helper.make_tensor_value_info("rw", TensorProto.FLOAT, None),
                            helper.make_tensor_value_info("idx", TensorProto.INT64, None)],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], weights)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20),
                                                        helper.make_opsetid(moe_onnx.DOMAIN, 1)], ir_version=10)
        if level == 0:
            onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data, size_threshold=0)
            weights = list(onnx.load_model(str(path), load_external_data=False).graph.initializer)
        else:
            onnx.save_model(model, str(path))


def feeds(shape: Shape, T: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(T)
    return {"x": rng.standard_normal((T, shape.H), dtype=np.float32),
            "rw": np.full((T, shape.k), 1.0 / shape.k, np.float32),
            "idx": np.stack([rng.permutation(shape.E)[:shape.k] for _ in range(T)]).astype(np.int64)}


def child(args) -> dict:
    """This process's variant on every shape: median ms per (shape, T), the kernel report, session creation
    times, and (MOE variants) the T=16 outputs saved beside the models."""
    from _models import dense_model
    from _timing import session_options

    from moe_onnx.runtime import kernel_report, session

    level, _ = VARIANTS[args.variant]
    result = {"times": {}, "create_s": {}, "report": kernel_report()}
    for name in args.shapes:
        shape = SHAPES[name]
        t0 = time.perf_counter()
        if level is None:
            sess = session(dense_model(shape.H, 3 * shape.I), sess_options=session_options(args.threads))
        else:
            sess = session(str(model_paths(args.models_dir, name, shape)[level]),
                           sess_options=session_options(args.threads))
        result["create_s"][name] = time.perf_counter() - t0
        for T in points(args, shape):
            if level is None:
                f = {"x": np.random.default_rng(T).standard_normal((T * shape.k, shape.H), dtype=np.float32)}
            else:
                f = feeds(shape, T)
            result["times"][f"{name} {T}"] = median_ms(lambda: sess.run(None, f), args.budget_ms)
        if level is not None and args.save_outputs:
            np.save(args.models_dir / f"{name}_{args.variant}_T16.npy", sess.run(None, feeds(shape, 16))[0])
        sess = None  # freed before the next shape's session is built
    return result


def run_child(args, variant: str, save_outputs: bool) -> dict:
    _, env = VARIANTS[variant]
    cmd = [sys.executable, __file__, "--child", "--variant", variant, "--threads", str(args.threads),
           "--budget-ms", str(args.budget_ms), "--models-dir", str(args.models_dir), "--shapes", *args.shapes,
           "--tokens", *map(str, args.tokens)] + (["--full"] if args.full else []) + \
          (["--save-outputs"] if save_outputs else [])
    out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512, 2048])
    ap.add_argument("--full", action="store_true", help="T=2048 for the large layers too")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget-ms", type=float, default=300.0, help="time per point per child (3 calls at least)")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/moe-bf16-bench"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--save-outputs", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    args.models_dir.mkdir(parents=True, exist_ok=True)
    for name in args.shapes:
        make_models(args.models_dir, name, SHAPES[name])
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; {args.threads} threads, {args.rounds} rounds, medians; "
          f"before: {load()}", flush=True)
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    started = time.perf_counter()
    for r in range(args.rounds):
        for variant in (args.variants if r % 2 == 0 else args.variants[::-1]):
            runs[variant].append(run_child(args, variant, save_outputs=r == 0 and variant != "matmul"))
            print(f"  round {r + 1} {variant} done ({time.perf_counter() - started:.0f} s, {load()})",
                  file=sys.stderr, flush=True)
    print(f"after: {load()}")
    for variant in args.variants:
        report = runs[variant][0]["report"]
        print(f"  {variant}: level={report['level']} gemm_panels={report['gemm_panels']} "
              f"bf16_gemm={report['bf16_gemm']} bf16_gemm_tiles={report['bf16_gemm_tiles']} amx={report['amx']}")

    def ratio(a: str, b: str, point: str) -> float:
        return statistics.median(x["times"][point] / y["times"][point] for x, y in zip(runs[a], runs[b]))

    pairs = [(a, b) for a, b in (("bf16", "fp32"), ("bf16_no_amx", "fp32"), ("fp32", "matmul"))
             if a in runs and b in runs]
    targets = [("bf16", "fp32", lambda T: T >= 128, 0.4, "bf16 on AMX <= 0.4x fp32 at T >= 128"),
               ("bf16", "fp32", lambda T: T == 1, 0.55, "bf16 on AMX <= 0.55x fp32 at decode (T=1)"),
               ("bf16_no_amx", "fp32", lambda T: T >= 128, 0.7, "bf16 on AVX512-BF16 <= 0.7x fp32 at T >= 128"),
               ("fp32", "matmul", lambda T: T >= 128, 1.1, "fp32 <= 1.1x the MatMul bound at T >= 128")]
    for name in args.shapes:
        shape = SHAPES[name]
        created = ", ".join(f"{v} {runs[v][0]['create_s'][name]:.1f} s" for v in args.variants)
        print(f"\n{name}: E={shape.E} k={shape.k} H={shape.H} I={shape.I} (session creation: {created})")
        if "fp32" in runs:
            reference = np.load(args.models_dir / f"{name}_fp32_T16.npy").astype(np.float64)
            peak = np.abs(reference).max()
            for variant in ("bf16", "bf16_no_amx"):
                if variant in runs:
                    error = np.abs(np.load(args.models_dir / f"{name}_{variant}_T16.npy") - reference).max() / peak
                    print(f"  {variant} vs fp32 at T=16: max |difference| = {error:.2e} of the peak |y| "
                          f"(bound {BF16_BOUND:.2e}: {'ok' if error <= BF16_BOUND else 'EXCEEDED'})")
        header = "".join(f"{v + ' ms':>15}" for v in args.variants)
        print(f"  {'T':>6}{header}" + "".join(f"{a + '/' + b:>20}" for a, b in pairs))
        for T in points(args, shape):
            point = f"{name} {T}"
            times = "".join(f"{statistics.median(r['times'][point] for r in runs[v]):>15.2f}" for v in args.variants)
            print(f"  {T:>6}{times}" + "".join(f"{ratio(a, b, point):>20.3f}" for a, b in pairs))
        print("  targets:")
        for a, b, which, limit, words in targets:
            chosen = [T for T in points(args, shape) if which(T)]
            if a in runs and b in runs and chosen:
                got = {T: ratio(a, b, f"{name} {T}") for T in chosen}
                verdict = "met" if all(v <= limit for v in got.values()) else "NOT met"
                print(f"    {words}: {verdict} ({', '.join(f'T={T}: {v:.2f}' for T, v in got.items())})")


if __name__ == "__main__":
    main()
