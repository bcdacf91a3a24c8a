"""benchmarks/bench_generation.py --smoke: the committed tiny KV fixture as our fused fp32 model, quantized to
int4 experts (QMOE) and timed beside it in alternating rounds; the script prints each contender's tokens/s and
the side-by-side ratios. (The real-shape run needs torch and minutes: docs/benchmarks.md.)"""

from __future__ import annotations

import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_smoke_times_fp32_and_int4_side_by_side(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_generation

    assert bench_generation.main(["--smoke", "--shape", "qwen3", "--threads", "1", "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {match[0]: match[1:] for match in re.findall(
        r"^\| (ours [^|]+?) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([^|]+) \|$", out, flags=re.M)}
    assert set(rows) == {"ours fused", "ours int4 experts", "ours fused fp32"}, out
    assert all(float(speed) > 0 for row in rows.values() for speed in row[:3])
    assert rows["ours fused"][3].strip() == rows["ours int4 experts"][3].strip() == "(reference)"
    ratios = [float(value) for value in re.findall(r"([\d.]+)x", rows["ours fused fp32"][3])]
    assert len(ratios) == 3 and all(ratio > 0 for ratio in ratios)  # int4 / fp32: prefill T=8, T=16, decode
    assert (tmp_path / "smoke_qwen3_moe" / "ours_int4_experts" / "model.onnx").is_file()
    assert "no llama.cpp figures" in out
