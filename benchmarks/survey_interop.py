"""One row per fixture family: every way in and out of our ops, on the same inputs.

For the small block fixture of each family (models/fixtures), on seeded random inputs:

- ours: the fused model (target moe) on our C++ kernels, against torch's output stored with the fixture;
- ort: `--target ort` (com.microsoft::MoE) on plain onnxruntime, against ours, or the reason it is refused;
- round trip: that contrib model imported back (`optimize` turns MoE into MOE) on our kernels, against
  onnxruntime running the contrib model;
- int8 / int4: `moe_onnx.quantize` (int8 per column; int4 block-wise, block 16, with zero points), the
  relative error it reports against the fp32 model;
- QMoE: the int4 model written as com.microsoft::QMoE (`--target ort`) on plain onnxruntime, against our
  QMOE kernel on the same packed weights;
- portable: `optimize(portable=True)` on plain onnxruntime (no custom-op library: the function bodies),
  against ours.

  PYTHONPATH=$PWD python benchmarks/survey_interop.py [--families mixtral gpt_oss] [--size small]

Errors are max |a - b| / max |b|. A survey, not a test: tests/test_ort_import.py, test_ort_export.py,
test_quantize.py and test_portable.py assert each of these.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

import moe_onnx
from moe_onnx.rewrite.ort_export import RULE as EXPORT_RULE

FIXTURES = Path(__file__).resolve().parents[1] / "models" / "fixtures"


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b)) / max(float(np.max(np.abs(b))), 1e-30))


def plain(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    """The first output on onnxruntime without our library."""
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def ours(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    return moe_onnx.session(model, backend="cpp").run(None, feeds)[0]


def refusal(report) -> str | None:
    """Why `--target ort` kept one of our ops, or None when every block became a contrib node."""
    if not report.needs_our_library:
        return None
    return "; ".join(miss["reason"] for miss in report.near_misses if miss["rule"] == EXPORT_RULE)


def survey(name: str, entry: dict) -> dict:
    model = onnx.load(FIXTURES / entry["file"])
    stored = np.load(FIXTURES / entry["reference"])
    feeds = {"hidden_states": stored["hidden_states"]}
    row = {"fixture": name}
    fused, _ = moe_onnx.optimize(model)
    y = ours(fused, feeds)
    row["ours vs torch"] = relative(y, stored["expected"])

    contrib, report = moe_onnx.optimize(model, target="ort")
    why = refusal(report)
    if why is None:
        y_ort = plain(contrib, feeds)
        row["ort vs ours"] = relative(y_ort, y)
        back, _ = moe_onnx.optimize(contrib)
        row["round trip vs ort"] = relative(ours(back, feeds), y_ort)
    else:
        row["ort refused"] = why

    for key, settings in (("int8", dict(bits=8, block_size=0)),
                          ("int4", dict(bits=4, block_size=16, zero_points=True))):
        quantized, qreport = moe_onnx.quantize(fused, **settings, sizes=[(2, 3)])
        row[f"{key} error"] = max(stat.relative for stat in qreport.error.outputs)
        if key == "int4":
            qcontrib, qexport = moe_onnx.optimize(quantized, target="ort")
            if refusal(qexport) is None:
                row["QMoE vs ours"] = relative(plain(qcontrib, feeds), ours(quantized, feeds))
            else:
                row["QMoE refused"] = refusal(qexport)

    portable, _ = moe_onnx.optimize(model, portable=True)
    row["portable vs ours"] = relative(plain(portable, feeds), y)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="*", help="fixture families (default: all)")
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    manifest = json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]
    chosen = {}
    for name, entry in sorted(manifest.items()):  # the first fixture of each family at that size
        if entry["size"] == args.size and (not args.families or entry["family"] in args.families):
            chosen.setdefault(entry["family"], name)
    rows = [survey(name, manifest[name]) for name in chosen.values()]

    columns = ["ours vs torch", "ort vs ours", "round trip vs ort", "int8 error", "int4 error", "QMoE vs ours",
               "portable vs ours"]
    print("| family (fixture) | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for family, row in zip(chosen, rows):
        cells = [f"{row[c]:.1e}" if c in row else "refused" for c in columns]
        print(f"| {family} ({row['fixture']}) | " + " | ".join(cells) + " |")
    for family, row in zip(chosen, rows):
        for key in ("ort refused", "QMoE refused"):
            if key in row:
                print(f"- {family}: {key}: {row[key]}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
