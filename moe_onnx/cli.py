"""The ``moe-onnx`` command line: argument parsing only; the work lives in the package modules."""

from __future__ import annotations

import argparse
import sys


def _check(args: argparse.Namespace) -> int:
    import onnx
    from google.protobuf.message import DecodeError

    from .check import check_model, summarize

    status = 0
    for path in args.models:
        try:
            problems = check_model(path)
        except (OSError, DecodeError) as error:
            problems = [f"cannot read the model: {error}"]
        if problems:
            status = 1
            print(f"{path}: INVALID ({len(problems)} problem{'s' if len(problems) > 1 else ''})")
            for problem in problems:
                print(f"  {problem}")
        else:
            print(f"{path}: OK ({summarize(onnx.load(path, load_external_data=False))})")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
