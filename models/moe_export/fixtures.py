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


# ----------------------------------------------------------------------------- whole models

WHOLE_DIRECTORY = "whole"  # models/fixtures/whole: the whole-model fixtures and their manifest


def strip_debug_info(model: onnx.ModelProto) -> None:
    """Drop the exporters' per-node source locations (doc strings, metadata_props): they make up most
    of a tiny export's bytes and no rule reads them. Nothing else changes."""
    for graph in [model.graph] + [a.g for n in model.graph.node for a in n.attribute if a.HasField("g")]:
        for node in graph.node:
            node.ClearField("doc_string")
            del node.metadata_props[:]
        for value in list(graph.value_info) + list(graph.input) + list(graph.output):
            del value.metadata_props[:]


def copy_whole_fixture(export_dir: Path, fixture_dir: Path, stem: str) -> None:
    """Copy one whole-model export (onnx without debug info, npz, its record) into a fixture directory."""
    record = json.loads((export_dir / f"{stem}.json").read_text())
    if record["status"] != "ok":
        raise ValueError(f"{stem}: the export failed ({record['error']}), there is no fixture to copy")
    model = onnx.load(str(export_dir / record["file"]))
    strip_debug_info(model)
    fixture_dir.mkdir(parents=True, exist_ok=True)
    path = fixture_dir / record["file"]
    onnx.save(model, str(path))
    (fixture_dir / record["reference"]).write_bytes((export_dir / record["reference"]).read_bytes())
    entry = {key: value for key, value in record.items() if key not in ("status", "traceback")}
    entry.update(bytes=path.stat().st_size, sha256=sha256(path), note=_join(record.get("note"), _STRIPPED))
    entries = load_manifest(fixture_dir)
    entries[stem] = dict(entries.get(stem, {}), **entry)
    save_manifest(fixture_dir, entries)


_STRIPPED = "node doc strings and metadata_props (source locations) dropped from the export"


def _join(*notes: str | None) -> str:
    return "; ".join(note for note in notes if note)


def record_fusion_state(fixture_dir: Path) -> list[str]:
    """Store what the current rewriter does to each whole-model fixture, per target, as `expected_fusion`:
    the fused block count, the near-miss reasons and whether the optimized model's logits (C++ backend)
    equal torch's on the reference inputs. tests/test_rewrite_fixtures.py asserts exactly that state,
    so a rewriter change that fuses more (or less) shows up there until this is re-run."""
    import moe_onnx

    entries = load_manifest(fixture_dir)
    lines = []
    for name, entry in entries.items():
        model = onnx.load(str(fixture_dir / entry["file"]))
        data = np.load(fixture_dir / entry["reference"])
        state = {}
        for target in moe_onnx.TARGETS:
            optimized, report = moe_onnx.optimize(model, target=target)
            reasons = sorted({f"{miss['rule']}: {miss['reason']}" for miss in report.near_misses})
            matches = all(whole_logits_match(moe_onnx.session(optimized), data, suffix) for suffix in ("", "_alt"))
            state[target] = {"fused": report.fused_blocks, "near_misses": reasons, "matches_torch": matches}
        entry["expected_fusion"] = state
        lines.append(f"{name:40s} " + " ".join(
            f"{t}: {s['fused']}/{entry['moe_layers']} fused, logits {'ok' if s['matches_torch'] else 'OFF'}"
            for t, s in state.items()))  # fmt: skip
    save_manifest(fixture_dir, entries)
    return lines


def whole_feeds(input_names: list[str], input_ids: np.ndarray) -> dict[str, np.ndarray]:
    """A whole model's inputs: `input_ids`, and an all-ones `attention_mask` where the export takes one
    (the TorchScript exports)."""
    feeds = {"input_ids": input_ids.astype(np.int64)}
    if "attention_mask" in input_names:
        feeds["attention_mask"] = np.ones_like(feeds["input_ids"])
    return feeds


def whole_logits_match(session, data, suffix: str) -> bool:
    """Whether a whole model's session gives torch's logits (within TOLERANCE) on the reference input
    `input_ids<suffix>`; False where the run fails (a traced loop on routing it was not traced for)."""
    feeds = whole_feeds([value.name for value in session.get_inputs()], data[f"input_ids{suffix}"])
    try:
        logits = session.run(None, feeds)[0]
    except Exception:  # noqa: BLE001 - onnxruntime's error types vary; a failed run does not match
        return False
    expected = data[f"expected{suffix}"]
    return logits.shape == expected.shape and bool(np.allclose(logits, expected, rtol=TOLERANCE, atol=TOLERANCE))
