"""The ``moe-onnx`` command line: argument parsing only; the work lives in the package modules."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path


def _check(args: argparse.Namespace) -> int:
    import onnx
    from google.protobuf.message import DecodeError

    from .check import check_loaded, summarize

    status = 0
    for path in args.models:
        proto = None
        try:
            proto = onnx.load(path, load_external_data=False)
            problems = check_loaded(proto, Path(path))
        except (OSError, DecodeError) as error:
            problems = [f"cannot read the model: {error}"]
        if problems:
            status = 1
            print(f"{path}: INVALID ({len(problems)} problem{'s' if len(problems) > 1 else ''})")
            for problem in problems:
                print(f"  {problem}")
        else:
            print(f"{path}: OK ({summarize(proto)})")
    return status


def _optimize(args: argparse.Namespace) -> int:
    import json
    import time

    from . import io
    from .check import check_model
    from .rewrite import optimize_ir

    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {message}", file=sys.stderr, flush=True)

    if Path(args.input).resolve() == Path(args.output).resolve():
        print(f"moe-onnx optimize: OUT is the same file as IN ({args.input}); write to another path",
              file=sys.stderr)
        return 2
    progress(f"loading {args.input}")
    model = io.load(args.input)
    report = optimize_ir(model, args.target, progress=progress)
    progress(f"saving {args.output}")
    io.save(model, args.output, progress=progress)
    print(report.summary())
    document = dataclasses.asdict(report)
    status = 0
    problems = check_model(args.output)
    if problems:
        print("the optimized model does not pass `moe-onnx check`:")
        print("\n".join(f"  {p}" for p in problems))
        status = 1
    if args.verify:
        from .verify import verify

        sizes = [tuple(int(d) for d in size.split("x")) for size in args.sizes.split(",")]
        progress(f"verifying on the {args.backend} backend at sizes {args.sizes}")
        result = verify(args.input, args.output, backend=args.backend, sizes=sizes, threads=args.threads)
        print(f"verify ({args.backend} backend):")
        print(result.summary())
        document["verify"] = {"ok": result.ok, "backend": result.backend,
                              "sizes": [dataclasses.asdict(r) for r in result.results],
                              "original_ms": result.original_ms, "optimized_ms": result.optimized_ms}
        if not result.ok:
            print("MISMATCH: the optimized model differs from the original")
            status = 1
    if args.report:
        with open(args.report, "w") as handle:
            json.dump(document, handle, indent=2)
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-onnx", description="Fused Mixture-of-Experts ops for ONNX.")
    commands = parser.add_subparsers(dest="command", required=True)

    check = commands.add_parser(
        "check", help="validate models: onnx checker, strict shape inference and the moe_onnx op rules",
        description="Exit 0 when every model is valid; otherwise print each problem (node, input or "
                    "attribute, what was expected) and exit 1.")
    check.add_argument("models", nargs="+", metavar="MODEL", help="ONNX model file(s); external data is supported")
    check.set_defaults(run=_check)

    opt = commands.add_parser(
        "optimize", help="fuse the MoE blocks of an exported model into moe_onnx ops",
        description="Rewrite IN into OUT; prints per-rule counts, near-misses, nodes before and after and the "
                    "parameters kept. Models over 2 GB are read lazily and written with external data.")
    opt.add_argument("input", metavar="IN", help="the exported ONNX model")
    opt.add_argument("-o", "--output", metavar="OUT", required=True, help="where to write the optimized model")
    opt.add_argument("--target", choices=("moe", "grouped"), default="moe",
                     help="moe: one MOE node per block (default); grouped: MoeInitRouting -> MoeRowParallelLinear "
                          "-> activation -> MoeRowParallelLinear -> MoeFinalizeRouting")
    opt.add_argument("--verify", action="store_true",
                     help="run both models on random inputs and compare (exit 1 on a mismatch), and time them")
    opt.add_argument("--backend", choices=("cpp", "python"), default="cpp", help="kernels used by --verify")
    opt.add_argument("--sizes", default="1x1,2x5,3x17",
                     help="values of the symbolic input dims (batch x sequence ...) for --verify")
    opt.add_argument("--threads", type=int, default=None, help="intra-op threads for --verify")
    opt.add_argument("--report", metavar="FILE.json", help="write the report (and verify results) as JSON")
    opt.set_defaults(run=_optimize)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
