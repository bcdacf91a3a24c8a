"""benchmarks/bench_real_size.py --smoke: every step from the original export to the quantized model's first run runs
on the README's quick-start checkpoint (Qwen3-MoE, committed), each with its time and peak memory, and the work folder
is left empty (the real-size run and its figures: docs/benchmarks.md). The original is the export group's
(``--original``): its trace is the same as the benchmark's export step, which is the command the export tests run."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_real_size.py"
QUICK_START = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "checkpoints" / "qwen3_moe"
STEPS = ["plain onnxruntime, original: session creation",
         "plain onnxruntime, original: first run", "moe-onnx optimize", "ours, fused fp32: session creation",
         "ours, fused fp32: first run", "moe-onnx pack (fused fp32)", "ours, fused fp32, packed file: session creation",
         "ours, fused fp32, packed file: first run", "moe-onnx shard --ep 2", "moe-onnx quantize --bits 4",
         "ours, int4 experts: session creation", "ours, int4 experts: first run", "moe-onnx pack (int4 experts)",
         "ours, int4 experts, packed file: session creation", "ours, int4 experts, packed file: first run"]


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
                    reason="the original export needs torch and transformers")
@pytest.mark.xdist_group("export")
def test_smoke_measures_every_step(exported, tmp_path):
    original = exported(QUICK_START, "--no-optimize")
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--shape", "qwen3", "--work-dir",
                           str(tmp_path), "--original", str(original)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for shape in ("qwen3",):
        table = done.stdout.split(f"{shape} (smoke): ")[1].split("\n\n")[0]
        rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
        assert [next(s for s in STEPS if row[0][2:].startswith(s)) for row in rows] == STEPS
        for row in rows:
            assert float(row[1]) > 0 and float(row[2]) > 50, row  # seconds; MiB (a Python process is larger)
        ours = [row[3] for row in rows if row[0].startswith("| ours")]
        assert len(ours) == 8 and all(re.search(r"vs plain onnxruntime: [\d.]+x time, [\d.]+x RSS", n) for n in ours)
    assert not any(tmp_path.iterdir()), "the work folder keeps files"
