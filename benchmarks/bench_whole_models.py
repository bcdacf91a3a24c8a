"""Survey of whole-model exports: for each exported tiny causal LM, how many MoE layers it has, how
many the rewriter fuses per target (and the near-misses when not), whether the fused logits equal
torch's on both backends, and the fused model's speed-up over the original.

  PYTHONPATH=$PWD python benchmarks/bench_whole_models.py /tmp/whole [--markdown] [--only mixtral]
  PYTHONPATH=$PWD python benchmarks/bench_whole_models.py models/fixtures --markdown

The directory is either an export directory of `models/export_moe_blocks.py --whole` (a
<family>__<tf457|tf5>__<torchscript|dynamo>.json record per attempted export, failed ones included)
or a fixture directory (the manifest's entries of kind "whole"). Each export's .npz holds input_ids
of two shapes and torch's logits for them. Logits are compared with rtol = atol = 1e-4. The speed-up
is original / fused (target "moe", C++ backend): the median over interleaved rounds of each
round's ratio (benchmarks/_timing.py), on input_ids [4, 128]. A benchmark, not a test: the timings
depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

import moe_onnx  # noqa: E402
from moe_onnx.export.families import FAMILIES as EXPORT_FAMILIES  # noqa: E402
from moe_onnx.export.families import REFUSED  # noqa: E402
from _timing import Timer, runner, session_options  # noqa: E402
from moe_export.fixtures import whole_feeds  # noqa: E402 (no torch in there)

TOLERANCE = 1e-4
BACKENDS = ("cpp", "python")
TIMED_SHAPE = (4, 128)
TIMED_VOCAB = 100  # the whole exports' vocabulary is 128; ids 3..99 avoid the special tokens 0..2


@dataclass
class Row:
    """One export's survey results."""

    family: str
    transformers: str
    exporter: str
    moe_layers: int | None = None
    fused: dict[str, int] = field(default_factory=dict)  # target -> fused blocks
    original_diff: float | None = None  # max |original logits - torch|
    fused_diff: dict[str, float] = field(default_factory=dict)  # "target/backend" -> max |fused - torch|
    mismatches: list[str] = field(default_factory=list)  # "target/backend" not within the tolerance
    speedup: float | None = None
    near_misses: list[str] = field(default_factory=list)  # "rule: reason (xN)" of both targets
    notes: list[str] = field(default_factory=list)  # export failures, silent misses, errors


def load_exports(directory: Path) -> list[dict]:
    """The export records of a directory: its manifest's whole-model entries, or its <stem>.json files."""
    manifest = directory / "manifest.json"
    if manifest.exists():
        entries = json.loads(manifest.read_text())["fixtures"].values()
        return [dict(entry, status="ok") for entry in entries if entry.get("kind") == "whole"]
    return [json.loads(path.read_text()) for path in sorted(directory.glob("*__*__*.json"))]


def _tag(record: dict) -> str:
    return "4.57" if record["transformers_version"].startswith("4.") else record["transformers_version"][:4]


def _feeds(session: ort.InferenceSession, input_ids: np.ndarray) -> dict[str, np.ndarray]:
    return whole_feeds([value.name for value in session.get_inputs()], input_ids)


def _compare(session: ort.InferenceSession, data: dict) -> tuple[float, bool]:
    """The largest |logits - torch's| over the export's two reference shapes (inf where a run gives
    another shape), and whether all are within rtol = atol = TOLERANCE. Raises what the run raises."""
    worst, ok = 0.0, True
    for suffix in ("", "_alt"):
        logits = session.run(None, _feeds(session, data[f"input_ids{suffix}"]))[0]
        expected = data[f"expected{suffix}"]
        if logits.shape != expected.shape:
            return float("inf"), False
        worst = max(worst, float(np.max(np.abs(logits - expected))))
        ok = ok and bool(np.allclose(logits, expected, rtol=TOLERANCE, atol=TOLERANCE))
    return worst, ok


def _first_line(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


_NODE_NAME = re.compile(r" ?\('[^']*'\)")


def _near_miss_notes(report) -> list[str]:
    """The report's near-misses as "rule: reason (xN)", node names left out so that layers add up."""
    counts = Counter(_NODE_NAME.sub("", f"{miss['rule']}: {miss['reason']}") for miss in report.near_misses)
    return [f"{reason} (x{count})" if count > 1 else reason for reason, count in counts.items()]


def survey_one(record: dict, directory: Path, threads: int, rounds: int, budget_ms: float) -> Row:
    """Optimize one export on both targets, compare its logits with torch's, time the fused model."""
    row = Row(record["family"], _tag(record), record["exporter"])
    if record["status"] != "ok":
        row.notes.append(f"export failed: {record['error']}")
        return row
    row.moe_layers = record["moe_layers"]
    try:
        _survey_export(row, record, directory, threads, rounds, budget_ms)
    except Exception as error:  # noqa: BLE001 - e.g. onnxruntime refuses the original export
        row.notes.append(_first_line(error))
    return row


def _survey_export(row: Row, record: dict, directory: Path, threads: int, rounds: int, budget_ms: float) -> None:
    path = directory / record["file"]
    data = dict(np.load(directory / record["reference"]))
    original = onnx.load(str(path))
    for value in original.graph.input:
        dims = [dim.dim_param or dim.dim_value for dim in value.type.tensor_type.shape.dim]
        if any(isinstance(dim, int) for dim in dims):
            row.notes.append(f"the exporter fixed {value.name} to {dims} (the trace shape is {record['trace_shape']})")
    options = session_options(threads)
    original_session = ort.InferenceSession(path.read_bytes(), options, providers=["CPUExecutionProvider"])
    try:
        row.original_diff, original_ok = _compare(original_session, data)
    except Exception as error:  # noqa: BLE001 - e.g. a traced Split that only fits the trace's routing
        row.original_diff, original_ok = float("inf"), False
        row.notes.append(f"the original export fails on the reference inputs: {_first_line(error)}")
    if not original_ok and row.original_diff != float("inf"):
        row.notes.append("the original export differs from torch")
    fused_sessions = {}
    for target in moe_onnx.TARGETS:
        try:
            model, report = moe_onnx.optimize(original, target=target)
        except Exception as error:  # noqa: BLE001 - a survey row, not a crash
            row.notes.append(f"optimize {target} raised {type(error).__name__}: {error}")
            continue
        row.fused[target] = report.fused_blocks
        row.near_misses += [note for note in _near_miss_notes(report) if note not in row.near_misses]
        for backend in BACKENDS:
            key = f"{target}/{backend}"
            try:
                session = moe_onnx.session(model, backend=backend, sess_options=session_options(threads))
                row.fused_diff[key], ok = _compare(session, data)
            except Exception as error:  # noqa: BLE001
                row.fused_diff[key] = float("inf")
                row.mismatches.append(key)
                if row.fused[target] or row.original_diff != float("inf"):  # else: the original's failure again
                    row.notes.append(f"{key} failed: {_first_line(error)}")
                continue
            if not ok:
                row.mismatches.append(key)
            if key == "moe/cpp":
                fused_sessions[target] = session
    for target, count in row.fused.items():
        if count < row.moe_layers and not row.near_misses:
            row.notes.append(f"SILENT MISS: {row.moe_layers - count} of {row.moe_layers} MoE layers not fused "
                             f"({target}), no near-miss")  # fmt: skip
    if "moe" in fused_sessions and row.fused["moe"]:
        ids = np.random.default_rng(0).integers(3, TIMED_VOCAB, size=TIMED_SHAPE)
        timer = Timer()
        timer.run_rounds(
            {"original": runner(original_session, _feeds(original_session, ids)),
             "fused": runner(fused_sessions["moe"], _feeds(fused_sessions["moe"], ids))},
            rounds, budget_ms,
        )  # fmt: skip
        row.speedup = timer.paired_ratio("original", "fused")


HEADER = ["family", "transformers", "exporter", "MoE layers", "fused moe", "fused grouped",
          "original vs torch", "fused vs torch", "speed-up", "KV cache", "why not fused / notes"]  # fmt: skip


def kv_cache(row: Row) -> str:
    """Whether `moe-onnx export` (transformers 5.23, dynamo) exports the family with a KV cache, or why not."""
    if not (row.transformers.startswith("5") and row.exporter == "dynamo"):
        return "-"
    if row.family in EXPORT_FAMILIES:
        return "yes"
    if row.family in REFUSED:
        return f"no: {REFUSED[row.family]}"
    return "no: the export fails" if row.moe_layers is None else "no: not fused"


def cells(row: Row) -> list[str]:
    def diff(value: float | None) -> str:
        return "-" if value is None else f"{value:.1e}"

    fused_worst = max(row.fused_diff.values()) if row.fused_diff else None
    verdict = diff(fused_worst)
    if row.fused_diff:
        verdict += " ok" if not row.mismatches else " MISMATCH " + ",".join(row.mismatches)
    return [
        row.family, row.transformers, row.exporter, "-" if row.moe_layers is None else str(row.moe_layers),
        str(row.fused.get("moe", "-")), str(row.fused.get("grouped", "-")), diff(row.original_diff), verdict,
        "-" if row.speedup is None else f"{row.speedup:.2f}x", kv_cache(row), "; ".join(row.notes + row.near_misses),
    ]  # fmt: skip


def format_table(rows: list[Row], markdown: bool) -> str:
    table = [HEADER] + [cells(row) for row in rows]
    if markdown:
        lines = ["| " + " | ".join(c.replace("|", "\\|") for c in line) + " |" for line in table]
        lines.insert(1, "|" + "---|" * len(HEADER))
        return "\n".join(lines)
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADER) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + line[-1] for line in table)


def summary(rows: list[Row]) -> str:
    exported = [row for row in rows if row.moe_layers is not None]
    complete = [row for row in exported if row.moe_layers and row.fused.get("moe", 0) >= row.moe_layers]
    silent = [row for row in exported if any("SILENT MISS" in note for note in row.notes)]
    broken = [row for row in exported if row.original_diff == float("inf")]
    wrong = [row for row in exported if row.mismatches and row.original_diff != float("inf")]
    return (f"{len(rows)} exports attempted, {len(exported)} exported; of these {len(complete)} with every MoE layer "
            f"fused (target moe), {len(silent)} silent misses, {len(broken)} whose original export fails on its "
            f"reference inputs, {len(wrong)} with fused logits off torch's where the original matches")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help="an export directory or a fixture directory")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--only", nargs="*", default=None, help="these families only")
    parser.add_argument("--exporter", choices=("dynamo", "torchscript"), help="this exporter's exports only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--budget-ms", type=float, default=200.0, help="time per variant per round")
    args = parser.parse_args(argv)
    rows = []
    for record in load_exports(args.directory):
        if (args.only and record["family"] not in args.only) or args.exporter not in (None, record["exporter"]):
            continue
        rows.append(survey_one(record, args.directory, args.threads, args.rounds, args.budget_ms))
        if not args.markdown:
            print(" | ".join(cells(rows[-1])), file=sys.stderr, flush=True)
    print(format_table(rows, args.markdown))
    print(("\n" if args.markdown else "") + summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
