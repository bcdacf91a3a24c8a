"""QMOE (quantized experts) against fp32 MOE on the same, dequantized, weights and against
onnxruntime's com.microsoft::QMoE on the same packed weights: one node each, timed side by side in
interleaved rounds (benchmarks/_timing.py) per token count. A benchmark, not a test: numbers depend
on the machine and its load.

  PYTHONPATH=$PWD python benchmarks/bench_quantized.py [--shapes gpt_oss qwen3] [--tokens 1 16 128 512]
                                                       [--threads 2] [--rounds 5]

Variants: int4 and int8 with block 32 and per column, mxfp4 (block 32, E8M0 scales), and int4/int8
block 32 with int8 activations (accuracy_level 4, `_a8`); the codes and
scales are random (the time does not depend on their values), and fp32 MOE runs on the int4 block-32
weights dequantized. QMoE gets the same codes and scales (gate/up rows interleaved: swiglu_fusion 1)
and router logits that select the same experts with the same weights, so its output is checked
against ours; where its CPU kernel refuses a variant the reason is printed. Decode (T = 1) reads
each selected expert's weights once, so int4 / fp32 there is about the ratio of bytes read (the
target: int4 block 32 <= 0.3x fp32 at T = 1).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import fmt  # noqa: E402
from _timing import BoundRunner, Timer, session_options  # noqa: E402

import moe_onnx  # noqa: E402
from moe_onnx.ops.qmoe import dequantize  # noqa: E402
from moe_onnx.runtime import kernel_report  # noqa: E402


@dataclass(frozen=True)
class QShape:
    E: int
    k: int
    H: int
    I: int
    gemm2: bool  # GEMM2_BIAS_SWIGLU_CLAMP with biases (GPT-OSS), else GEMM3_SWIGLU (Qwen3)


SHAPES = {
    "gpt_oss": QShape(32, 4, 2880, 2880, True),
    "gpt_oss_1k": QShape(32, 4, 1024, 1024, True),
    "qwen3": QShape(128, 8, 2048, 768, False),
}
# name: (bits, block_size, quant_type, accuracy_level)
VARIANTS = {"int4": (4, 32, "int", 0), "int4_col": (4, 0, "int", 0), "int8": (8, 32, "int", 0),
            "int8_col": (8, 0, "int", 0), "mxfp4": (4, 32, "mxfp4", 0), "int4_a8": (4, 32, "int", 4),
            "int8_a8": (8, 32, "int", 4)}
REFERENCE = "int4"  # fp32 MOE runs on these weights, dequantized
GPT_OSS_SWIGLU = dict(expert_alpha=1.702, expert_beta=7.0)


@dataclass
class Linear:
    """One quantized linear of all experts: codes [E, N, K*bits/8], scales, its N and K."""

    codes: np.ndarray
    scales: np.ndarray
    n: int
    k: int


def quantized_linears(shape: QShape, bits: int, block: int, quant_type: str, rng) -> list[Linear]:
    """Random codes and scales of the expert type's linears (QMOE's [E, N, K] layout)."""
    dims = [(2 * shape.I, shape.H), (shape.H, shape.I)] if shape.gemm2 else \
        [(shape.I, shape.H), (shape.I, shape.H), (shape.H, shape.I)]
    out = []
    for n, k in dims:
        codes = rng.integers(0, 256, (shape.E, n, k * bits // 8), dtype=np.uint8)
        scale_shape = (shape.E, n, k // block) if block else (shape.E, n)
        if quant_type == "mxfp4":
            scales = rng.integers(118, 124, scale_shape, dtype=np.uint8)
        else:
            scales = (rng.random(scale_shape, dtype=np.float32) * 0.02 / 2 ** (bits - 1)).astype(np.float32)
        out.append(Linear(codes, scales, n, k))
    return out


def _save(model: onnx.ModelProto, folder: Path, name: str) -> str:
    """The model written with its weights as external data (models past protobuf's 2 GB)."""
    path = folder / f"{name}.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location=f"{name}.bin", size_threshold=1024)
    return str(path)


def _model(node: onnx.NodeProto, inputs: list[tuple[str, int]], inits: dict[str, np.ndarray],
           domain: str) -> onnx.ModelProto:
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, None) for n, t in inputs],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.ascontiguousarray(a), n) for n, a in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)],
                             ir_version=10)


def qmoe_model(shape: QShape, linears: list[Linear], biases: list[np.ndarray], bits: int, block: int,
               quant_type: str, accuracy_level: int) -> onnx.ModelProto:
    w = [f"w{i}" for i in range(len(linears))]
    s = [f"s{i}" for i in range(len(linears))]
    if shape.gemm2:
        ins = ["x", "rw", "idx", w[0], "b0", w[1], "b1", "", s[0], s[1]]
        attrs = dict(expert_type="GEMM2_BIAS_SWIGLU_CLAMP", **GPT_OSS_SWIGLU)
    else:
        ins = ["x", "rw", "idx", w[0], "", w[1], "", w[2], s[0], s[1], s[2]]
        attrs = dict(expert_type="GEMM3_SWIGLU")
    inits = {**{n: l.codes for n, l in zip(w, linears)}, **{n: l.scales for n, l in zip(s, linears)}}
    if shape.gemm2:
        inits.update(b0=biases[0], b1=biases[1])
    node = helper.make_node("QMOE", ins, ["y"], domain=moe_onnx.DOMAIN, bits=bits, block_size=block,
                            quant_type=quant_type, accuracy_level=accuracy_level, **attrs)
    return _model(node, [("x", TensorProto.FLOAT), ("rw", TensorProto.FLOAT), ("idx", TensorProto.INT64)], inits,
                  moe_onnx.DOMAIN)


def moe_model(shape: QShape, weights: list[np.ndarray], biases: list[np.ndarray]) -> onnx.ModelProto:
    """fp32 MOE on dequantized [E, N, K] weights (GEMM2 takes them as [E, K, N])."""
    if shape.gemm2:
        inits = {"w0": weights[0].transpose(0, 2, 1), "b0": biases[0], "w1": weights[1].transpose(0, 2, 1),
                 "b1": biases[1]}
        node = helper.make_node("MOE", ["x", "rw", "idx", "w0", "b0", "w1", "b1"], ["y"], domain=moe_onnx.DOMAIN,
                                expert_type="GEMM2_BIAS_SWIGLU_CLAMP", **GPT_OSS_SWIGLU)
    else:
        inits = {"w0": weights[0], "w1": weights[1], "w2": weights[2]}
        node = helper.make_node("MOE", ["x", "rw", "idx", "w0", "", "w1", "", "w2"], ["y"], domain=moe_onnx.DOMAIN,
                                expert_type="GEMM3_SWIGLU")
    return _model(node, [("x", TensorProto.FLOAT), ("rw", TensorProto.FLOAT), ("idx", TensorProto.INT64)], inits,
                  moe_onnx.DOMAIN)


def ort_qmoe_model(shape: QShape, linears: list[Linear], biases: list[np.ndarray], bits: int, block: int,
                   quant_type: str, accuracy_level: int) -> onnx.ModelProto:
    """com.microsoft::QMoE on the same codes: gate/up interleaved in FC1 (swiglu_fusion 1)."""
    if shape.gemm2:
        fc1, fc1_scales, fc2 = linears[0].codes, linears[0].scales, linears[1]
        activation = dict(activation_alpha=GPT_OSS_SWIGLU["expert_alpha"], activation_beta=1.0,
                          swiglu_limit=GPT_OSS_SWIGLU["expert_beta"])
    else:
        gate, up, fc2 = linears
        fc1 = np.empty((shape.E, 2 * shape.I, gate.codes.shape[2]), np.uint8)
        fc1[:, 0::2], fc1[:, 1::2] = gate.codes, up.codes
        fc1_scales = np.empty((shape.E, 2 * shape.I, *gate.scales.shape[2:]), gate.scales.dtype)
        fc1_scales[:, 0::2], fc1_scales[:, 1::2] = gate.scales, up.scales
        activation = dict(activation_alpha=1.0, activation_beta=0.0)
    inits = {"fc1": fc1, "fc1_s": fc1_scales, "fc2": fc2.codes, "fc2_s": fc2.scales}
    if shape.gemm2:
        inits.update(fc1_b=biases[0], fc2_b=biases[1])
    ins = ["x", "logits", "fc1", "fc1_s", "fc1_b" if shape.gemm2 else "", "fc2", "fc2_s", "fc2_b" if shape.gemm2 else ""]
    extra = {} if block == 0 else {"block_size": block}
    node = helper.make_node("QMoE", ins, ["y"], domain="com.microsoft", k=shape.k, activation_type="swiglu",
                            swiglu_fusion=1, normalize_routing_weights=1, expert_weight_bits=bits,
                            accuracy_level=accuracy_level,
                            quant_type="fp4" if quant_type == "mxfp4" else "int", **extra, **activation)
    model = _model(node, [("x", TensorProto.FLOAT), ("logits", TensorProto.FLOAT)], inits, "com.microsoft")
    if quant_type == "mxfp4":  # float8e8m0 scales: the same bytes
        for t in model.graph.initializer:
            if t.name in ("fc1_s", "fc2_s"):
                t.data_type = TensorProto.FLOAT8E8M0
    return model


def routing(shape: QShape, tokens: int, rng) -> dict[str, np.ndarray]:
    """Inputs of one token count: x, k distinct experts per token with weights summing to 1, and router
    logits whose softmax top-k (renormalized) picks the same experts with the same weights."""
    x = rng.standard_normal((tokens, shape.H), dtype=np.float32)
    idx = np.argsort(rng.random((tokens, shape.E)), axis=1)[:, :shape.k].astype(np.int64)
    rw = rng.random((tokens, shape.k), dtype=np.float32) + 0.5
    rw /= rw.sum(axis=1, keepdims=True)
    logits = np.full((tokens, shape.E), -30.0, np.float32)
    np.put_along_axis(logits, idx, np.log(rw), axis=1)
    return dict(x=x, rw=rw, idx=idx, logits=logits)


def session(path_or_bytes, threads: int, ours: bool) -> ort.InferenceSession:
    opts = session_options(threads)
    if ours:
        return moe_onnx.session(path_or_bytes, backend="cpp", sess_options=opts)
    return ort.InferenceSession(path_or_bytes, opts, providers=["CPUExecutionProvider"])


def bench_shape(name: str, shape: QShape, tokens: list[int], threads: int, rounds: int, folder: Path) -> dict:
    rng = np.random.default_rng(0)
    biases = [(rng.standard_normal((shape.E, n), dtype=np.float32) * 0.1) for n in (2 * shape.I, shape.H)]
    sessions: dict[str, ort.InferenceSession] = {}
    notes: dict[str, str] = {}
    for variant, (bits, block, quant_type, level) in VARIANTS.items():
        linears = quantized_linears(shape, bits, block, quant_type, rng)
        model = qmoe_model(shape, linears, biases, bits, block, quant_type, level)
        sessions[variant] = session(_save(model, folder, variant), threads, ours=True)
        try:
            ort_model = ort_qmoe_model(shape, linears, biases, bits, block, quant_type, level)
            sessions[f"ort_{variant}"] = session(_save(ort_model, folder, f"ort_{variant}"), threads, ours=False)
        except Exception as e:  # noqa: BLE001 - onnxruntime's refusal is the finding
            notes[f"ort_{variant}"] = str(e).splitlines()[0][:200]
        if variant == REFERENCE:
            weights = [dequantize(l.codes, l.scales, None, bits=bits, block_size=block, quant_type=quant_type,
                                  k_dim=l.k) for l in linears]
            sessions["fp32"] = session(_save(moe_model(shape, weights, biases), folder, "fp32"), threads, ours=True)
            del weights
        del linears
    for key, why in notes.items():
        print(f"  {key}: onnxruntime refuses it: {why}", flush=True)

    results = {}
    for t in tokens:
        feeds = routing(shape, t, rng)
        runners = {}
        for key, sess in sessions.items():
            names = [i.name for i in sess.get_inputs()]
            runners[key] = BoundRunner(sess, [feeds[n] for n in names])
        timer = Timer()
        timer.run_rounds(runners, rounds, budget_ms=200)
        outs = {key: r.outputs()[0] for key, r in runners.items()}
        scale = float(np.abs(outs["fp32"]).max()) or 1.0
        errors = {"int4 vs fp32": float(np.abs(outs[REFERENCE] - outs["fp32"]).max()) / scale}
        for variant in VARIANTS:
            if f"ort_{variant}" in outs:
                ref = outs[variant]
                errors[f"ort_{variant} vs {variant}"] = float(np.abs(outs[f"ort_{variant}"] - ref).max()) / (
                    float(np.abs(ref).max()) or 1.0)
        med = {key: timer.median(key) for key in runners}
        ratios = {f"{v}/fp32": timer.paired_ratio(v, "fp32") for v in VARIANTS}
        ratios.update({f"{v}/ort": timer.paired_ratio(v, f"ort_{v}") for v in VARIANTS if f"ort_{v}" in runners})
        results[t] = dict(med=med, ratios=ratios, errors=errors)
        print(f"{name} T={t:<4} " + "  ".join(f"{k} {fmt(v)}" for k, v in med.items()) + "  [ms]", flush=True)
        print("   " + "  ".join(f"{k} {v:.2f}x" for k, v in ratios.items()) + "   max rel err: " +
              ", ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)
    return dict(results=results, notes=notes)


def markdown(name: str, shape: QShape, data: dict, threads: int) -> str:
    rows = [f"### {name}: E={shape.E}, k={shape.k}, H={shape.H}, I={shape.I}, "
            f"{'GEMM2 (GPT-OSS)' if shape.gemm2 else 'GEMM3 (Qwen3)'}, {threads} threads; ms, ratio to fp32 MOE "
            "(and to onnxruntime QMoE)", "",
            "| T | fp32 MOE | " + " | ".join(VARIANTS) + " |", "|---|---|" + "---|" * len(VARIANTS)]
    for t, r in data["results"].items():
        cells = []
        for v in VARIANTS:
            ort_ratio = r["ratios"].get(f"{v}/ort")
            vs_ort = f", {ort_ratio:.2f}x ort" if ort_ratio is not None else ""
            cells.append(f"{fmt(r['med'][v])} ({r['ratios'][f'{v}/fp32']:.2f}x{vs_ort})")
        rows.append(f"| {t} | {fmt(r['med']['fp32'])} | " + " | ".join(cells) + " |")
    for key, why in data["notes"].items():
        rows.append(f"\n{key}: not measured, onnxruntime refuses it ({why})")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["gpt_oss", "qwen3"], choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    kernels = kernel_report()
    print(f"quantized GEMM kernels: {kernels['quant_fused']} fused, {kernels['quant_decode']} decode "
          f"(accuracy_level 4: {kernels['quant_dots']}); {args.threads} threads", flush=True)
    tables, targets = [], []
    for name in args.shapes:
        shape = SHAPES[name]
        with tempfile.TemporaryDirectory() as folder:
            data = bench_shape(name, shape, args.tokens, args.threads, args.rounds, Path(folder))
        tables.append(markdown(name, shape, data, args.threads))
        if 1 in data["results"]:
            r = data["results"][1]["ratios"][f"{REFERENCE}/fp32"]
            targets.append(f"- {name}: int4 (block 32) / fp32 MOE at T=1: {r:.2f}x (target <= 0.30x: "
                           f"{'met' if r <= 0.30 else 'NOT met'})")
    print("\n" + "\n\n".join(tables) + "\n\nTarget:\n" + "\n".join(targets))


if __name__ == "__main__":
    main()
