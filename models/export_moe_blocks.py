"""Export random-weight MoE blocks of transformers models to ONNX, and check/describe the fixtures.

Exporting needs torch and transformers (see models/README.md for the two export environments);
--check and --op-table need only onnx, onnxruntime and numpy.

    python models/export_moe_blocks.py --family gpt_oss --style tiled --size tiny -o OUT.onnx
    python models/export_moe_blocks.py --all --out-dir models/fixtures
    python models/export_moe_blocks.py --check models/fixtures --op-table models/fixtures --update-readme
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_export import fixtures, specs  # noqa: E402

README = Path(__file__).resolve().parent / "README.md"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_argument_group("what to export")
    what.add_argument("--family", choices=specs.FAMILIES)
    what.add_argument("--style", choices=list(specs.STYLES))
    what.add_argument("--size", choices=("tiny", "small"), default="tiny")
    what.add_argument("--hidden", type=int, help="override H")
    what.add_argument("--intermediate", type=int, help="override I (expert intermediate size)")
    what.add_argument("--experts", type=int, help="override E")
    what.add_argument("--topk", type=int, help="override k")
    what.add_argument("--shared-intermediate", type=int, help="override the Qwen2-MoE shared expert's size")
    what.add_argument("--seed", type=int, default=0)
    what.add_argument(
        "--output-only", action="store_true",
        help="export only the block output, dropping the router scores/logits that some blocks also return",
    )  # fmt: skip
    what.add_argument("-o", "--output", type=Path, help="the .onnx to write (a .npz of reference data goes beside it)")
    what.add_argument("--all", action="store_true", help="every committed fixture this transformers version exports")
    what.add_argument("--out-dir", type=Path, help="with --all: where fixtures and manifest.json go")
    report = parser.add_argument_group("checking fixtures (no torch needed)")
    report.add_argument("--check", type=Path, metavar="DIR", help="compare onnxruntime with the torch outputs")
    report.add_argument("--op-table", type=Path, metavar="DIR", help="print the op-type table of the fixtures")
    report.add_argument("--update-readme", action="store_true", help="with --op-table: write it into models/README.md")
    args = parser.parse_args(argv)
    if not (args.all or args.check or args.op_table or (args.family and args.style and args.output)):
        parser.error("give --family, --style and -o, or --all --out-dir, or --check/--op-table")
    if args.all and not args.out_dir:
        parser.error("--all needs --out-dir")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.all or args.family:
        from moe_export import blocks, exporting  # torch and transformers from here on

        if args.all:
            jobs = [
                (spec, args.out_dir / f"{spec.name}.onnx") for spec in specs.fixture_specs(blocks.transformers_major())
            ]
        else:
            if args.family not in specs.STYLES[args.style].families:
                raise SystemExit(f"style {args.style!r} does not exist for {args.family!r}")
            spec = specs.custom(
                specs.preset(args.family, args.style, args.size),
                hidden=args.hidden,
                intermediate=args.intermediate,
                experts=args.experts,
                topk=args.topk,
                shared_intermediate=args.shared_intermediate,
            )
            jobs = [(spec, args.output)]
            if spec.transformers_major != blocks.transformers_major():
                raise SystemExit(
                    f"style {spec.style!r} needs transformers {spec.transformers_major}.x (see models/README.md)"
                )
        for spec, path in jobs:
            entry = exporting.export_block(spec, path, keep_router_output=not args.output_only, seed=args.seed)
            fixtures.record(path.parent, path.stem, entry)
            missing = f", missing experts {entry.missing_experts}" if entry.missing_experts else ""
            print(f"wrote {path} ({entry.bytes / 1024:.0f} KB{missing})")
    mismatch = False
    if args.check:
        lines = fixtures.check_with_onnxruntime(args.check)
        print("\n".join(lines))
        mismatch = any("MISMATCH" in line for line in lines)
        if mismatch:
            print("some fixtures differ from torch: see ort_check in the manifest", file=sys.stderr)
    if args.op_table:
        table = fixtures.op_table(args.op_table)
        if args.update_readme:
            fixtures.replace_marked_section(README, "op-table", table)
        print(table)
    return 1 if mismatch else 0


if __name__ == "__main__":
    raise SystemExit(main())
