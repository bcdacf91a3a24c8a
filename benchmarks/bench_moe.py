"""MoE layer speed on this CPU: the fused MOE node against every alternative (not a test).

Two blocks exported by models/export_moe_blocks.py (random weights, fp32):

  gpt_oss  GPT-OSS-like, E=32, k=4, H=I=1024, biases, GEMM2_BIAS_SWIGLU_CLAMP (the `tiled` export)
  qwen3    Qwen3-MoE-like, E=64, k=8, H=1024, I=384, GEMM3_SWIGLU (the `tiled3` export)

For T tokens (default 1, 16, 128, 512) with N intra-op threads (default 2) it times session.run,
interleaving the variants round by round, and prints median times and side-by-side ratios (the
median over rounds of the two variants' medians in that round, so a slow spell of the shared
machine slows both sides of a ratio), of:

  fused    moe_onnx.optimize(export) -> the MOE node on the C++ kernels (the router stays ONNX);
           also the MOE node alone (a one-node model fed the router's outputs)
  unfused  the original export on onnxruntime (every expert on every token)
  ort_moe  onnxruntime's com.microsoft::MoE with the same router and weights (GPT-OSS maps directly;
           Qwen3's gate/up rows are interleaved offline, swiglu_fusion=1, alpha 1, beta 0, no limit)
  grouped  moe_onnx.optimize(export, target="grouped") on the C++ kernels, when the library has
           MoeInitRouting/MoeRowParallelLinear/MoeFinalizeRouting (else the row says why it is skipped)
  python   the fused model on the Python (numpy) kernels, at T=128 only
  bound    max(flops, bytes): `flops` is a dense onnxruntime MatMul [T*k, H] x [H, 3I] (the routed
           work's FLOPs), `bytes` the time to read the touched experts' weights once at the memory
           bandwidth measured in the same run: an onnxruntime GEMV whose weight (a run-time input, so
           never packed) has exactly the touched experts' byte count, so it meets the same caches
  fp16, bf16  the fused model with its MOE weights and activations cast (Cast nodes around the MOE
           node; T=1 and T=128), and that MOE node alone: time and max abs error against fp32
  RSS      of each variant, each in its own subprocess, at the largest T: after session creation and
           the peak of one run (VmHWM reset after creation), so the run's own extra memory shows
  int8     MoeRowParallelLinear alone with the gate/up shape (E experts, N = 2I, K = H) on the T*k rows
           the router makes of T >= 128 tokens: int8 X and W (int32 out) against fp32 X and W holding
           the same integers (so the two outputs must agree exactly)

Every fp32 variant's model output is checked against the fused fp32 output before timing (fp16/bf16
errors are reported against their 1e-2 target). All sessions run with idle pool threads not spinning
(they live side by side and run in turn); one-node models are fed OrtValues made once, through an
IOBinding. A summary checks each performance target (fused within 1.25x of the bound, ahead of
com.microsoft::MoE, ...) against the run's figures at the end.

The exports are cached in --models-dir, with their optimized forms. Exporting needs torch and
transformers (4.57 for gpt_oss, 5 for qwen3): when an export is missing, the script makes it with the
python given by --export-python-457 / --export-python-5 (or the environment variables
MOE_ONNX_EXPORT_PYTHON_457 / MOE_ONNX_EXPORT_PYTHON_5), else it prints the commands of
models/README.md that make those environments and the exports. --fixtures measures the small
committed fixtures of the same export styles instead (models/fixtures/*_small.onnx: no torch needed;
the figures are only a check that everything runs).

The modules beside this one: _exports.py (shapes, exports), _models.py (the cached optimized forms,
the variant and probe models), _timing.py (sessions and interleaved timing), _measure.py (one shape's
measurements), _memory.py (RSS, in child processes), _report.py (progress lines, tables, targets).

Options (defaults):
  --models-dir DIR            exports and cached models (default /tmp/moe-bench)
  --export-python-457 PY      python with torch + transformers 4.57 (exports gpt_oss)
  --export-python-5 PY        python with torch + transformers 5 (exports qwen3)
  --fixtures                  measure the committed small fixtures instead of the exports
  --shapes gpt_oss qwen3      which blocks
  --tokens 1 16 128 512       token counts
  --threads 2                 intra-op threads of every session
  --rounds 5                  interleaved rounds (medians over all)
  --runs 1                    repeat each shape's measurement; report the median of the runs' figures
  --budget-ms 150             time per variant per round
  --unfused-max-tokens 512    largest T for the (slow) unfused export
  --skip unfused,python,...   comma-separated variants to leave out: unfused, ort_moe, grouped, python,
                              fp16, bf16, rss, int8
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import onnxruntime as ort

import moe_onnx
from _exports import REPO, SHAPES, add_export_options, ensure_export, export_pythons, fixture_shape, how_to_export
from _measure import Settings, measure_shape, merge_runs
from _memory import measure_rss
from _models import load_models
from _report import markdown, targets

VARIANTS = ("unfused", "ort_moe", "grouped", "python", "fp16", "bf16", "rss", "int8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/moe-bench"), help="exports and cached models")
    add_export_options(ap)
    ap.add_argument("--fixtures", action="store_true",
                    help="measure the committed small fixtures of the same export styles (no torch needed)")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["gpt_oss", "qwen3"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians over all)")
    ap.add_argument("--runs", type=int, default=1,
                    help="repeat each shape's measurement; report the median of the runs' figures")
    ap.add_argument("--budget-ms", type=float, default=150.0, help="time per variant per round")
    ap.add_argument("--unfused-max-tokens", type=int, default=512)
    ap.add_argument("--skip", type=lambda s: {x for x in s.split(",") if x}, default=set(),
                    help=f"comma-separated variants to leave out: {','.join(VARIANTS)}")
    args = ap.parse_args(argv)
    unknown = args.skip - set(VARIANTS)
    if unknown:
        ap.error(f"--skip: unknown variant(s) {','.join(sorted(unknown))}; choose from {','.join(VARIANTS)}")
    return args


def main() -> None:
    args = parse_args()
    args.models_dir.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    print("command: " + shlex.join([os.path.relpath(python, REPO) if python.startswith(str(REPO)) else python]
                                   + sys.argv), flush=True)
    print(f"onnxruntime {ort.__version__}, library {moe_onnx.custom_ops_library()}", flush=True)
    settings = Settings(tokens=args.tokens, threads=args.threads, rounds=args.rounds, budget_ms=args.budget_ms,
                        unfused_max_tokens=args.unfused_max_tokens, skip=args.skip)
    pythons = export_pythons(args)
    measured, missing = [], []
    for name in args.shapes:
        shape = fixture_shape(SHAPES[name]) if args.fixtures else SHAPES[name]
        if ensure_export(shape, args.models_dir, pythons) is None:
            missing.append(shape)
            continue
        models = load_models(shape, args.models_dir, "grouped" not in args.skip)
        runs = []
        for run in range(args.runs):
            if args.runs > 1:
                print(f"\n# {name}: run {run + 1} of {args.runs}", flush=True)
            runs.append(measure_shape(shape, models, settings))
        data = merge_runs(runs) if args.runs > 1 else runs[0]
        if "rss" not in args.skip:
            data["rss"] = measure_rss(shape, models, args.models_dir, max(args.tokens), args.threads, args.skip)
        measured.append((shape, data))
        del models
    print("\n# Markdown\n" + markdown(measured, args.threads, max(args.tokens)))
    print("\n# Targets (fused MOE performance goals against this run's figures)\n" + "\n".join(targets(measured)))
    if missing:
        print("\nmissing exports; make them with (models/README.md, 'Export environments'):\n"
              + how_to_export(missing, args.models_dir))


if __name__ == "__main__":
    main()
