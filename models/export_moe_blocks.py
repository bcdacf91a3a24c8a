"""Export random-weight MoE blocks of transformers models to ONNX, and check/describe the fixtures.

Exporting needs torch and transformers (see models/README.md for the two export environments);
--check and --op-table need only onnx, onnxruntime and numpy.

    python models/export_moe_blocks.py --family gpt_oss --style tiled --size tiny -o OUT.onnx
    python models/export_moe_blocks.py --all --out-dir models/fixtures
    python models/export_moe_blocks.py --check models/fixtures --op-table models/fixtures --update-readme
    python models/export_moe_blocks.py --whole --out-dir /tmp/whole                 # every family, both exporters
    python models/export_moe_blocks.py --whole --family mixtral --exporter dynamo --out-dir DIR
    python models/export_moe_blocks.py --whole --list-families
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_export import fixtures, specs  # noqa: E402

README = Path(__file__).resolve().parent / "README.md"
WHOLE_FIXTURES = Path(__file__).resolve().parent / "fixtures" / fixtures.WHOLE_DIRECTORY


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_argument_group("what to export")
    what.add_argument("--family", help=f"a block family {specs.FAMILIES}, or with --whole a whole-model family")
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
    whole = parser.add_argument_group("whole tiny causal LMs (input_ids -> logits)")
    whole.add_argument("--whole", action="store_true", help="export whole models into --out-dir (all families unless --family)")
    whole.add_argument("--exporter", choices=("torchscript", "dynamo", "both"), default="both")
    whole.add_argument("--families", nargs="+", help="these whole-model families, in this order")
    whole.add_argument(
        "--resume", action="store_true", help="skip the exports already recorded, ok or failed (delete a record to redo it)"
    )
    whole.add_argument("--timeout", type=int, default=600, help="seconds per export (each runs in its own process)")
    whole.add_argument("--list-families", action="store_true", help="the installed transformers' MoE model types")
    whole.add_argument(
        "--whole-fixtures", type=Path, metavar="EXPORT_DIR",
        help="copy the committed whole-model exports (specs.WHOLE_FIXTURES) from EXPORT_DIR into "
        "models/fixtures/whole and record their fusion state (needs moe_onnx, no torch)",
    )  # fmt: skip
    whole.add_argument(
        "--record-fusion", type=Path, metavar="DIR",
        help="re-record what the current rewriter fuses in each whole-model fixture of DIR (needs moe_onnx)",
    )  # fmt: skip
    report = parser.add_argument_group("checking fixtures (no torch needed)")
    report.add_argument("--check", type=Path, metavar="DIR", help="compare onnxruntime with the torch outputs")
    report.add_argument("--op-table", type=Path, metavar="DIR", help="print the op-type table of the fixtures")
    report.add_argument("--update-readme", action="store_true", help="with --op-table: write it into models/README.md")
    args = parser.parse_args(argv)
    if args.whole_fixtures or args.record_fusion:
        return args
    if args.whole:
        if not (args.out_dir or args.list_families):
            parser.error("--whole needs --out-dir")
        return args
    if args.family and args.family not in specs.FAMILIES:
        parser.error(f"--family must be one of {specs.FAMILIES} (or use --whole)")
    if not (args.all or args.check or args.op_table or (args.family and args.style and args.output)):
        parser.error("give --family, --style and -o, or --all --out-dir, or --check/--op-table")
    if args.all and not args.out_dir:
        parser.error("--all needs --out-dir")
    return args


def _export_whole(args: argparse.Namespace) -> int:
    """One whole model in this process, or every (family, exporter) pair in a child process each."""
    from moe_export import whole  # torch and transformers from here on

    if args.list_families:
        for model_type, outcome in whole.discover_moe_model_types().items():
            print(f"{model_type:24s} {outcome}")
        return 0
    exporters = ("dynamo", "torchscript") if args.exporter == "both" else (args.exporter,)
    if args.family and len(exporters) == 1:
        record = whole.export_and_record(args.family, exporters[0], args.out_dir, args.seed)
        whole.write_index(args.out_dir)
        print(f"{whole.export_stem(args.family, exporters[0])}: {record['status']} {record.get('error', '')}")
        return 0 if record["status"] == "ok" else 1
    families = args.families or ([args.family] if args.family else whole.installed_families())
    done = set(whole.load_records(args.out_dir)) if args.resume else set()
    for family in families:
        for exporter in exporters:
            if whole.export_stem(family, exporter) in done:
                continue
            command = [sys.executable, __file__, "--whole", "--family", family, "--exporter", exporter,
                       "--out-dir", str(args.out_dir), "--seed", str(args.seed)]  # fmt: skip
            try:
                finished = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
                print(finished.stdout.strip().splitlines()[-1] if finished.stdout.strip() else finished.stderr[-300:])
                if finished.returncode not in (0, 1):  # killed or crashed before writing its record
                    whole.record_failure(args.out_dir, family, exporter, f"exit {finished.returncode}: "
                                         + finished.stderr.strip()[-200:])  # fmt: skip
            except subprocess.TimeoutExpired:
                whole.record_failure(args.out_dir, family, exporter, f"timed out after {args.timeout} s")
                print(f"{whole.export_stem(family, exporter)}: timed out")
            whole.write_index(args.out_dir)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.whole_fixtures:
        for stem in specs.WHOLE_FIXTURES:
            fixtures.copy_whole_fixture(args.whole_fixtures, WHOLE_FIXTURES, stem)
    if args.whole_fixtures or args.record_fusion:
        print("\n".join(fixtures.record_fusion_state(args.record_fusion or WHOLE_FIXTURES)))
        return 0
    if args.whole:
        return _export_whole(args)
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
