"""`moe-onnx optimize`: report, verification, JSON, external data, refusal to overwrite its input."""

from __future__ import annotations

import json

import onnx
import pytest

from fixture_models import FIXTURES, TARGETS
from moe_onnx import io
from moe_onnx.check import check_model
from moe_onnx.cli import main
from moe_onnx.verify import verify


@pytest.mark.parametrize("target", TARGETS)
def test_optimize_verify_and_report(target, tmp_path, capsys):
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    status = main(["optimize", str(FIXTURES / "qwen3_moe_batched_mm_tiny.onnx"), "-o", str(out), "--target", target,
                   "--verify", "--backend", "python", "--sizes", "1x1,2x3", "--report", str(report)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "BatchedMmSwiglu: 1 block fused" in printed and "OK" in printed and "speed-up" in printed
    document = json.loads(report.read_text())
    assert document["target"] == target and document["fused"]["BatchedMmSwiglu"] == 1
    assert document["verify"]["ok"] and len(document["verify"]["sizes"]) == 2
    assert document["nodes_before"].get("GatherND") == 2 and "GatherND" not in document["nodes_after"]
    assert check_model(out) == []


def test_external_data_is_written_slice_by_slice(tmp_path, monkeypatch):
    """Lazy (transposed) weights streamed into external data give the same numbers."""
    monkeypatch.setattr(io, "EXTERNAL_DATA_THRESHOLD", 0)
    original = FIXTURES / "gpt_oss_tiled_tiny.onnx"
    out = tmp_path / "grouped.onnx"
    assert main(["optimize", str(original), "-o", str(out), "--target", "grouped"]) == 0
    assert (tmp_path / "grouped.onnx.data").stat().st_size > 0
    assert any(t.data_location == onnx.TensorProto.EXTERNAL
               for t in onnx.load(out, load_external_data=False).graph.initializer)
    assert check_model(out) == []
    assert verify(original, out, backend="python", sizes=[(2, 3)], time_it=False).ok


def test_refuses_to_overwrite_its_input(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    model.write_bytes((FIXTURES / "mixtral_batched_mm_tiny.onnx").read_bytes())
    assert main(["optimize", str(model), "-o", str(model)]) == 2
    assert "same file" in capsys.readouterr().err


def test_unknown_target_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["optimize", str(FIXTURES / "mixtral_batched_mm_tiny.onnx"), "-o", str(tmp_path / "o.onnx"),
              "--target", "dense"])
    assert exit_info.value.code == 2
