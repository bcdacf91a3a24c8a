"""benchmarks/bench_generation.py --smoke: the committed tiny KV fixture as our fused fp32 model, quantized to
int4 experts (QMOE) and timed beside it in alternating rounds; the script prints each contender's tokens/s and
the side-by-side ratios. (The real-shape run needs torch and minutes: docs/benchmarks.md.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import backends
import pytest

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


def test_shipped_report_names_each_target_against_the_like_for_like_gguf(monkeypatch):
    """--shipped's table and targets from kept results (no model made): ours against the GGUF llama.cpp quantized to
    (Qwen3's Q4_0), each of issue 34's targets met or not with its figure."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_generation

    def timing(prefill_short, prefill_long, decode, rss_mib):
        speeds = {"prefill_short": prefill_short, "prefill_long": prefill_long, "decode": decode}
        return {"loaded": {"seconds": 2.0}, "speeds": [speeds], "generating": {"VmRSS": rss_mib}}

    results = {"layers": 18, "checkpoint_gib": 24.0,
               "ours: moe-onnx export --bits 4": {"seconds": 600, "peak_mib": 2048},
               "llama.cpp: convert_hf_to_gguf.py --outtype bf16": {"seconds": 300, "peak_mib": 1024},
               "llama.cpp: llama_model_quantize Q4_0": {"seconds": 100, "peak_mib": 512},
               "ours_gib": 7.0, "gguf_gib": 24.0, "gguf_quantized_gib": 6.5,
               "timing": {"ours|1": timing(20, 30, 10, 7.5 * 1024), "llama.cpp Q4_0|1": timing(10, 40, 5, 7 * 1024)}}
    lines = bench_generation.shipped_report(bench_generation.SHIPPED["qwen3_30b_a3b"], results)
    text = "\n".join(lines)
    assert "| ours | 600 | 2.00 | 7.00 | 1.08x | 2.0 | 7.50 | 1.07x | 20.0, 30.0, 10.0 |" in text, text
    assert "(ours / it: 2.00x, 0.75x, 2.00x)" in text
    assert "- [met] export peak RSS 2.00 GiB <= 4 GiB" in lines
    assert "- [met] file 7.00 GiB = 1.08x llama.cpp Q4_0's (<= 1.1x)" in lines
    assert "- [met] RSS generating (1 thread(s)) 7.50 GiB = 1.07x the file (<= 1.15x)" in lines
    assert ("- [NOT met] 1 thread(s), ours / llama.cpp Q4_0 in tokens/s (>= 1.0x): prefill_short 2.00x, "
            "prefill_long 0.75x, decode 2.00x") in lines


def test_our_sessions_spin_for_work_only_while_a_run_lasts(monkeypatch):
    """Our contenders' pool threads spin within a run (a decode step's small nodes do not wake a sleeping thread
    each) and stop when it returns, so a session alive beside another takes no core between its runs; the other
    benchmarks' sessions never spin."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    backends.sessions_as_onnxruntime_makes_them(monkeypatch)  # not the suite's sessions that never spin
    import bench_generation
    from _timing import session_options

    contender = bench_generation.OrtContender(bench_generation.KV_FIXTURES / "qwen3_moe", threads=2)
    options = contender.decoder.decoder.get_session_options()
    assert options.intra_op_num_threads == 2
    assert options.get_session_config_entry("session.force_spinning_stop") == "1"
    with pytest.raises(RuntimeError, match="allow_spinning"):  # unset: onnxruntime's default, spinning allowed
        options.get_session_config_entry("session.intra_op.allow_spinning")
    assert session_options(2).get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_compare_with_times_each_model_by_both_checkouts_side_by_side(tmp_path, capsys, monkeypatch):
    """--compare-with: the other checkout's side runs in its own Python (here a wrapper of this one that leaves a
    mark: an A/A run of this checkout), each row both sides' tokens/s and after / before (one round: the ratio of
    the two figures)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_generation

    mark = tmp_path / "before_python_ran"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\ntouch "{mark}"\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    assert bench_generation.main(["--smoke", "--shape", "qwen3", "--precision", "fp32", "--threads", "1",
                                  "--work-dir", str(tmp_path), "--compare-with", str(BENCHMARKS.parent),
                                  "--compare-python", str(python)]) == 0
    out = capsys.readouterr().out
    assert mark.is_file()
    rows = re.findall(r"^\| qwen3 \(smoke\) ours fused \| 1 \| ([^|]+) \| ([\d.]+) \(([\d.]+)\) \| ([\d.]+) \(([\d.]+)\) "
                      r"\| ([\d.]+)x \(([\d.]+)-([\d.]+)\) \|", out, flags=re.M)
    assert [row[0].strip() for row in rows] == ["prefill T=8", "prefill T=16", "decode 4 after 16"], out
    for _, before, before_min, after, after_min, ratio, low, high in rows:
        assert float(before) == float(before_min) > 0 and float(after) == float(after_min) > 0
        # after / before, not inverted (the ratio printed to 3 decimals)
        assert float(ratio) == pytest.approx(float(after) / float(before), rel=1e-3, abs=6e-4)
        assert float(low) == float(high) == float(ratio)


def test_compare_rounds_alternate_which_side_runs_first(monkeypatch):
    """A warm-up round of each side, then the rounds back to back, the order alternating (a slow spell of the shared
    machine falls on both sides alike)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_generation

    calls = []

    class Fake:
        def __init__(self, side, speed):
            self.side, self.speed = side, speed

        def round(self, prompt, prefill_tokens, decode_tokens):
            calls.append(self.side)
            return dict.fromkeys(bench_generation.METRICS, self.speed)

    rounds = bench_generation.compare_rounds({"before": Fake("before", 1.0), "after": Fake("after", 2.0)},
                                             [5, 6], 1, 1, rounds=3)
    assert calls == ["before", "after", "before", "after", "after", "before", "before", "after"]
    assert [r["decode"] for r in rounds["after"]] == [2.0] * 3 and len(rounds["before"]) == 3


def test_compare_refuses_a_before_side_that_runs_other_code(tmp_path, monkeypatch):
    """The "before" worker's package and library must be the other checkout's, unless it is this checkout (A/A)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_generation

    other, this = tmp_path / "other", BENCHMARKS.parent

    def identity(root):
        return {"python": f"{root}/.venv/bin/python", "moe_onnx": f"{root}/moe_onnx/__init__.py",
                "library": f"{root}/moe_onnx/_lib/libmoe_onnx_ops.so", "level": "avx2"}

    bench_generation.check_sides({"before": identity(other), "after": identity(this)}, {"before": other, "after": this})
    bench_generation.check_sides({"before": identity(this), "after": identity(this)}, {"before": this, "after": this})
    with pytest.raises(ValueError, match=r"--compare-with .*other: its Python .* loads moe_onnx .*, not the checkout's"):
        bench_generation.check_sides({"before": identity(this), "after": identity(this)},
                                     {"before": other, "after": this})
    mixed = dict(identity(other), library=identity(this)["library"])
    with pytest.raises(ValueError, match="loads library"):
        bench_generation.check_sides({"before": mixed, "after": identity(this)}, {"before": other, "after": this})


def test_compare_starts_half_the_rounds_workers_the_other_way_round(monkeypatch):
    """A row's rounds in two halves, the second on fresh workers started after-first (an odd round to the first)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_generation

    assert bench_generation.start_order_halves(1) == [(("before", "after"), 1)]
    assert bench_generation.start_order_halves(7) == [(("before", "after"), 4), (("after", "before"), 3)]
