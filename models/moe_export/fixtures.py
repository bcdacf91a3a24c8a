"""The fixture manifest, the onnxruntime-vs-torch check and the op-type table (no torch needed)."""

from __future__ import annotations

import collections
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx

from .specs import STYLES, BlockSpec

MANIFEST = "manifest.json"
TOLERANCE = 1e-4  # rtol and atol of the onnxruntime-vs-torch check

# Op types worth counting in the table: the MoE block's telltale operators and the GEMMs.
TABLE_OPS = (
    "Tile", "GatherND", "Gather", "NonZero", "OneHot", "ScatterElements", "ScatterND", "TopK", "Softmax",
    "MatMul", "Gemm", "Split", "Slice", "Clip", "Sigmoid", "Transpose", "Expand", "Unsqueeze", "ReduceSum",
)  # fmt: skip


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _value_info(value: onnx.ValueInfoProto) -> dict:
    dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
    return {
        "name": value.name,
        "shape": dims,
        "dtype": onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name,
    }


@dataclass
class ExportRecord:
    """One manifest entry."""

    file: str
    reference: str
    family: str
    style: str
    size: str
    exporter: str
    opset: int
    transformers_version: str
    torch_version: str
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    has_bias: bool
    activation: str
    activation_formula: str
    gate_up_layout: str
    weight_layout: str
    router: str
    renormalize: bool
    shared_expert: bool
    shared_intermediate_size: int | None
    missing_experts: list[int]
    trace_shape: list[int]
    inputs: list[dict]
    outputs: list[dict]
    bytes: int
    sha256: str
    note: str | None = None
    ort_check: dict = field(default_factory=dict)

    @classmethod
    def describe(cls, spec: BlockSpec, onnx_path: Path, **facts) -> ExportRecord:
        model = onnx.load(str(onnx_path), load_external_data=False)
        return cls(
            file=onnx_path.name,
            reference=onnx_path.with_suffix(".npz").name,
            family=spec.family,
            style=spec.style,
            size=spec.size,
            hidden_size=spec.hidden,
            intermediate_size=spec.intermediate,
            num_experts=spec.experts,
            top_k=spec.topk,
            has_bias=spec.has_bias,
            gate_up_layout=spec.gate_up_layout,
            weight_layout=spec.weight_layout,
            shared_expert=spec.shared_intermediate is not None,
            shared_intermediate_size=spec.shared_intermediate,
            inputs=[_value_info(v) for v in model.graph.input],
            outputs=[_value_info(v) for v in model.graph.output],
            bytes=onnx_path.stat().st_size,
            sha256=sha256(onnx_path),
            **facts,
        )


def load_manifest(directory: Path) -> dict[str, dict]:
    path = directory / MANIFEST
    return json.loads(path.read_text())["fixtures"] if path.exists() else {}


def save_manifest(directory: Path, entries: dict[str, dict]) -> None:
    ordered = {name: entries[name] for name in sorted(entries)}
    text = json.dumps({"tolerance": TOLERANCE, "fixtures": ordered}, indent=1) + "\n"
    (directory / MANIFEST).write_text(text)


def record(directory: Path, name: str, entry: ExportRecord) -> None:
    """Add or replace one fixture's entry in the directory's manifest."""
    entries = load_manifest(directory)
    entries[name] = asdict(entry)
    save_manifest(directory, entries)


def op_counts(path: Path) -> collections.Counter:
    model = onnx.load(str(path), load_external_data=False)
    return collections.Counter(node.op_type for node in model.graph.node)


def check_with_onnxruntime(directory: Path) -> list[str]:
    """Run every manifest fixture in onnxruntime on its reference inputs; store and return the results."""
    import onnxruntime

    entries = load_manifest(directory)
    lines = []
    for name, entry in entries.items():
        path = directory / entry["file"]
        onnx.checker.check_model(str(path))
        if sha256(path) != entry["sha256"]:
            raise ValueError(f"{name}: {path} does not match the manifest's sha256")
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        data = np.load(directory / entry["reference"])
        results = {}
        for suffix in ("", "_alt"):
            inputs = data[f"hidden_states{suffix}"]
            outputs = session.run(None, {"hidden_states": inputs})
            for value, info in zip(outputs, entry["outputs"], strict=True):
                key = "expected" if info["name"] == "output" else f"expected_{info['name']}"
                expected = data[key + suffix]
                label = f"{info['name']}{list(inputs.shape[:2])}"
                results[label] = {
                    "max_abs_diff": float(np.max(np.abs(value - expected))),
                    "ok": bool(np.allclose(value, expected, rtol=TOLERANCE, atol=TOLERANCE)),
                }
        entry["ort_check"] = {"onnxruntime": onnxruntime.__version__, "results": results}
        broken = STYLES[entry["style"]].broken
        verdict = "ok" if all(r["ok"] for r in results.values()) else "broken" if broken else "MISMATCH"
        worst = max(r["max_abs_diff"] for r in results.values())
        lines.append(
            f"{name:32s} {verdict:8s} max|diff|={worst:.2e} "
            + " ".join(f"{label}:{'ok' if r['ok'] else 'FAIL'}" for label, r in results.items())
            + (f" (known: {broken})" if verdict == "broken" else "")
        )
    save_manifest(directory, entries)
    return lines


def op_table(directory: Path) -> str:
    """A markdown table of the fixtures, their size and the counts of the telltale op types."""
    entries = load_manifest(directory)
    counts = {name: op_counts(directory / entry["file"]) for name, entry in entries.items()}
    columns = [op for op in TABLE_OPS if any(c[op] for c in counts.values())]
    header = ["fixture", "H/I/E/k", "KB", "nodes", *columns]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, entry in entries.items():
        shape = f"{entry['hidden_size']}/{entry['intermediate_size']}/{entry['num_experts']}/{entry['top_k']}"
        cells = [f"`{name}`", shape, str(round(entry["bytes"] / 1024)), str(sum(counts[name].values()))]
        cells += [str(counts[name][op] or "") for op in columns]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def replace_marked_section(path: Path, marker: str, content: str) -> None:
    """Replace the text between `<!-- marker:start -->` and `<!-- marker:end -->` in a file."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    text = path.read_text()
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{content}\n{end}{tail}")
