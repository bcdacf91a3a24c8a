"""Measuring one shape: every variant's session, each variant's output checked against the fused
model's, interleaved rounds per token count, and the int8 MoeRowParallelLinear; results of several
runs merged into medians. The results' layout is described in _report.py."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort

import moe_onnx
from moe_onnx.testing import random_hidden_states
from _exports import Shape
from _models import (LOW_PRECISION, cast_model, dense_model, gemv_model, linear_model, moe_node_model,
                     ort_moe_model, with_moe_inputs)
from _report import print_int8_row, print_row
from _timing import BoundRunner, Timer, runner, session_options

#: side-by-side ratios reported for each token count (when the first variant ran)
PAIRS = [("fused", "bound"), ("node", "bound"), ("unfused", "fused"), ("ort_moe", "fused"),
         ("grouped", "fused"), ("fp16", "fused"), ("bf16", "fused"), ("node_fp16", "node"), ("node_bf16", "node")]


@dataclass
class Settings:
    """The command line's measurement options."""

    tokens: Sequence[int]
    threads: int
    rounds: int
    budget_ms: float
    unfused_max_tokens: int
    skip: set[str] = field(default_factory=set)


@dataclass
class Sessions:
    """One shape's sessions, made once for all token counts."""

    fused: ort.InferenceSession
    variants: dict[str, ort.InferenceSession]  # whole-model variants (fused included), checked and timed
    moe_inputs: ort.InferenceSession  # the fused model that also outputs its MOE node's inputs
    node: ort.InferenceSession  # the MOE node alone
    node_low_precision: dict[str, ort.InferenceSession]  # the fp16/bf16 MOE node alone
    dense: ort.InferenceSession  # the FLOPs probe
    gemv: ort.InferenceSession  # the bandwidth probe
    creation: tuple[float, float]  # s: the fused model, the export alone
    grouped_note: str | None  # why grouped did not run


def _ort_session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), session_options(threads),
                                providers=["CPUExecutionProvider"])


def _moe_session(model: onnx.ModelProto, threads: int, backend: str = "cpp") -> ort.InferenceSession:
    return moe_onnx.session(model.SerializeToString(), backend=backend, sess_options=session_options(threads))


def make_sessions(shape: Shape, models: dict[str, onnx.ModelProto], settings: Settings) -> Sessions:
    skip, threads = settings.skip, settings.threads
    t0 = time.perf_counter()
    fused = _moe_session(models["moe"], threads)
    create_fused = time.perf_counter() - t0
    t0 = time.perf_counter()
    unfused = _ort_session(models["export"], threads)  # the same load without packing
    create_plain = time.perf_counter() - t0
    print(f"session creation: fused {create_fused:.2f} s (of which packing ~{create_fused - create_plain:.2f} s; "
          f"the unfused export loads in {create_plain:.2f} s)", flush=True)

    variants = {"fused": fused}
    moe_inputs = _moe_session(with_moe_inputs(models["moe"]), 1)
    node = _moe_session(moe_node_model(models["moe"]), threads)
    if "unfused" not in skip:
        variants["unfused"] = unfused
    del unfused
    if "ort_moe" not in skip:
        variants["ort_moe"] = _ort_session(ort_moe_model(models["moe"], shape), threads)
    grouped_note = None
    if "grouped" not in skip:
        try:
            variants["grouped"] = _moe_session(models["grouped"], threads)
        except Exception as e:  # a library built elsewhere (MOE_ONNX_CUSTOM_OPS_LIBRARY) may lack them
            grouped_note = str(e).splitlines()[0][:200]
            print(f"grouped (cpp): skipped, the library {moe_onnx.custom_ops_library()} cannot run it: "
                  f"{grouped_note}", flush=True)
    if "python" not in skip:
        variants["python"] = _moe_session(models["moe"], threads, backend="python")
    node_low_precision = {}
    for key, (_, elem) in LOW_PRECISION.items():
        if key not in skip:
            cast = cast_model(models["moe"], key)
            variants[key] = _moe_session(cast, threads)
            node_low_precision[key] = _moe_session(moe_node_model(cast, elem), threads)
    return Sessions(fused, variants, moe_inputs, node, node_low_precision,
                    dense=_ort_session(dense_model(shape.H, 3 * shape.I), threads),
                    gemv=_ort_session(gemv_model(shape.H), threads),
                    creation=(create_fused, create_plain), grouped_note=grouped_note)


def _runs_at(name: str, tokens: int, settings: Settings) -> bool:
    """Whether variant `name` is measured at `tokens`."""
    if name == "python":
        return tokens == 128
    if name in LOW_PRECISION:
        return tokens in (1, 128)
    if name == "unfused":
        return tokens <= settings.unfused_max_tokens
    return True


def _checked_calls(shape: Shape, sessions: Sessions, feeds: dict, y_ref: np.ndarray, tokens: int,
                   settings: Settings) -> tuple[dict[str, Callable], dict[str, float]]:
    """A call per whole-model variant run at `tokens`, each output checked against the fused model's
    (fp16/bf16: errors only, with the output's scale and the error of rounding the fp32 output)."""
    calls, errors = {}, {}
    for name, sess in sessions.variants.items():
        if not _runs_at(name, tokens, settings):
            continue
        call = runner(sess, feeds)
        y = np.asarray(call()[0], dtype=np.float32)
        errors[name] = float(np.abs(y - y_ref).max())
        if name in LOW_PRECISION:
            dt = LOW_PRECISION[name][0]
            errors[name + "_rounding"] = float(np.abs(y_ref.astype(dt).astype(np.float32) - y_ref).max())
            errors[name + "_scale"] = float(np.abs(y_ref).max())
        elif name != "fused" and not errors[name] <= 1e-3:
            raise SystemExit(f"[{shape.name}] T={tokens}: {name} differs from fused by {errors[name]:.3g}")
        calls[name] = call
    return calls, errors


def measure_tokens(shape: Shape, sessions: Sessions, tokens: int, settings: Settings) -> tuple[dict, np.ndarray]:
    """One token count's medians, ratios and errors; and how many of the T*k rows go to each expert."""
    feeds = {"hidden_states": random_hidden_states(shape.H, 1, tokens)}
    y_ref = sessions.fused.run(None, feeds)[0]
    _, node_x, node_w, indices = sessions.moe_inputs.run(None, feeds)
    touched = len(np.unique(indices))
    calls, errors = _checked_calls(shape, sessions, feeds, y_ref, tokens, settings)
    calls["node"] = BoundRunner(sessions.node, (node_x, node_w, indices))
    for key, sess in sessions.node_low_precision.items():
        if _runs_at(key, tokens, settings):
            dt = LOW_PRECISION[key][0]
            calls[f"node_{key}"] = BoundRunner(sess, (node_x.astype(dt), node_w.astype(dt), indices))
    calls["dense"] = runner(sessions.dense, {"x": np.random.default_rng(3).standard_normal(
        (tokens * shape.k, shape.H)).astype(np.float32)})
    # Reading the touched experts' bytes once: a GEMV over a weight of exactly that size (so it meets
    # the same caches), fed as an input (no packing).
    touched_bytes = touched * shape.expert_bytes()
    bw_w = np.random.default_rng(2).standard_normal((shape.H, touched_bytes // (4 * shape.H))).astype(np.float32)
    calls["bytes"] = runner(sessions.gemv, {"x": np.ones((1, shape.H), np.float32), "w": bw_w})
    # The Python backend runs numpy, whose BLAS threads keep spinning after a call and would slow
    # whatever runs next: it is timed on its own, after the interleaved rounds of the others.
    python = calls.pop("python", None)
    timer = Timer()
    timer.run_rounds(calls, settings.rounds, settings.budget_ms)
    ratios = {f"{a}/{b}": timer.paired_ratio(a, b) for a, b in PAIRS if a in calls}
    if python is not None:
        timer.run_rounds({"python": python}, settings.rounds, settings.budget_ms)
        calls["python"] = python
    med = {name: timer.median(name) for name in calls}
    if python is not None:  # timed after the others, not side by side
        ratios["python/fused"] = med["python"] / med["fused"]
    bandwidth = bw_w.nbytes / (med["bytes"] * 1e-3)  # bytes/s
    med["flops"] = med.pop("dense")
    med["bound"] = max(med["bytes"], med["flops"])
    result = dict(med=med, ratios=ratios, errors=errors, touched=touched, bandwidth=bandwidth / 1e9)
    return result, np.bincount(indices.reshape(-1), minlength=shape.E)


def measure_shape(shape: Shape, models: dict[str, onnx.ModelProto], settings: Settings) -> dict:
    """One run over every token count, then the int8 linear on the rows of the counts >= 128."""
    print(f"\n## {shape.name}: E={shape.E} k={shape.k} H={shape.H} I={shape.I} "
          f"{'GEMM2 + biases' if shape.gemm2 else 'GEMM3'}, fp32, {settings.threads} intra-op threads", flush=True)
    sessions = make_sessions(shape, models, settings)
    results, counts = {}, {}
    for tokens in settings.tokens:
        results[tokens], per_expert = measure_tokens(shape, sessions, tokens, settings)
        if tokens >= 128:
            counts[tokens] = per_expert
        print_row(tokens, results[tokens])
    creation, grouped_note = sessions.creation, sessions.grouped_note
    del sessions
    int8 = measure_int8(shape, settings, counts) if "int8" not in settings.skip else {}
    return dict(results=results, grouped_note=grouped_note, int8=int8, creation=creation)


def measure_int8(shape: Shape, settings: Settings, counts: dict[int, np.ndarray]) -> dict:
    """int8 against fp32 MoeRowParallelLinear (gate/up shape) on the router's rows for each T in
    `counts` (rows per expert)."""
    E, N, K = shape.E, 2 * shape.I, shape.H
    rng = np.random.default_rng(5)
    w8 = rng.integers(-128, 128, (E, N, K), dtype=np.int8)
    sessions = {"int8": _moe_session(linear_model(w8), settings.threads),
                "fp32": _moe_session(linear_model(w8.astype(np.float32)), settings.threads)}
    del w8
    out = {}
    for tokens, per_expert in counts.items():
        offsets = np.concatenate([[0], np.cumsum(per_expert)]).astype(np.int64)
        x8 = rng.integers(-128, 128, (int(offsets[-1]), K), dtype=np.int8)
        calls = {"int8": BoundRunner(sessions["int8"], (x8, offsets)),
                 "fp32": BoundRunner(sessions["fp32"], (x8.astype(np.float32), offsets))}
        for call in calls.values():
            call()
        y8, y32 = calls["int8"].outputs()[0], calls["fp32"].outputs()[0]
        # |sum| <= K * 128 * 128 <= 2^24 for K <= 1024: the fp32 sums of these integers are exact.
        if K <= 1024 and not np.array_equal(y8.astype(np.float32), y32):
            raise SystemExit(f"[{shape.name}] int8 MoeRowParallelLinear differs from fp32 at T={tokens}")
        timer = Timer()
        timer.run_rounds(calls, settings.rounds, settings.budget_ms)
        med = {name: timer.median(name) for name in calls}
        ops = 2 * offsets[-1] * N * K
        out[tokens] = dict(rows=int(offsets[-1]), fp32=med["fp32"], int8=med["int8"],
                           speedup=timer.paired_ratio("fp32", "int8"),
                           gops={n: ops / (m * 1e-3) / 1e9 for n, m in med.items()})
        print_int8_row(tokens, out[tokens], N, K)
    return out


def merge_runs(runs: list[dict]) -> dict:
    """One shape's results over several runs: each time, ratio and rate is the median of the runs'
    (each run's own figure is a median over its rounds); errors are the largest; session creation
    is the last run's."""
    def med(values):
        return statistics.median(values)

    first = runs[0]
    results = {}
    for t, r in first["results"].items():
        rs = [run["results"][t] for run in runs]
        results[t] = dict(med={k: med([x["med"][k] for x in rs]) for k in r["med"]},
                          ratios={k: med([x["ratios"][k] for x in rs]) for k in r["ratios"]},
                          errors={k: max(x["errors"][k] for x in rs) for k in r["errors"]},
                          touched=r["touched"], bandwidth=med([x["bandwidth"] for x in rs]))
    int8 = {}
    for t, r in first["int8"].items():
        rs = [run["int8"][t] for run in runs]
        int8[t] = dict(rows=r["rows"], fp32=med([x["fp32"] for x in rs]), int8=med([x["int8"] for x in rs]),
                       speedup=med([x["speedup"] for x in rs]),
                       gops={k: med([x["gops"][k] for x in rs]) for k in r["gops"]})
    return dict(results=results, grouped_note=first["grouped_note"], int8=int8, runs=len(runs),
                creation=runs[-1]["creation"])
