"""MoE layer speed on this CPU: the fused MOE node against every alternative (not a test).

Two blocks exported by models/export_moe_blocks.py (random weights, fp32):

  gpt_oss  GPT-OSS-like, E=32, k=4, H=I=1024, biases, GEMM2_BIAS_SWIGLU_CLAMP (the `tiled` export)
  qwen3    Qwen3-MoE-like, E=64, k=8, H=1024, I=384, GEMM3_SWIGLU (the `tiled3` export)

For T tokens (default 1, 16, 128, 512) with N intra-op threads (default 2) it times session.run,
interleaving the variants round by round, and prints median times and side-by-side ratios (the
median over rounds of the two variants' medians in that round, so a slow spell of the shared
machine slows both sides of a ratio), of:

  fused    moe_onnx.optimize(export) -> the MOE node on the C++ kernels (the router stays ONNX);
           also the MOE node alone (a one-node model fed the router's outputs)
  unfused  the original export on onnxruntime (every expert on every token)
  ort_moe  onnxruntime's com.microsoft::MoE with the same router and weights (GPT-OSS maps directly;
           Qwen3's gate/up rows are interleaved offline, swiglu_fusion=1, alpha 1, beta 0, no limit)
  grouped  moe_onnx.optimize(export, target="grouped") on the C++ kernels, when the library has
           MoeInitRouting/MoeRowParallelLinear/MoeFinalizeRouting (else the row says why it is skipped)
  python   the fused model on the Python (numpy) kernels, at T=128 only
  bound    max(flops, bytes): `flops` is a dense onnxruntime MatMul [T*k, H] x [H, 3I] (the routed
           work's FLOPs), `bytes` the time to read the touched experts' weights once at the memory
           bandwidth measured in the same run: an onnxruntime GEMV whose weight (a run-time input, so
           never packed) has exactly the touched experts' byte count, so it meets the same caches
  fp16, bf16  the fused model with its MOE weights and activations cast (Cast nodes around the MOE
           node; T=1 and T=128), and that MOE node alone: time and max abs error against fp32
  RSS      of each variant, each in its own subprocess, at the largest T: after session creation and
           the peak of one run (VmHWM reset after creation), so the run's own extra memory shows
  int8     MoeRowParallelLinear alone with the gate/up shape (E experts, N = 2I, K = H) on the T*k rows
           the router makes of T >= 128 tokens: int8 X and W (int32 out) against fp32 X and W holding
           the same integers (so the two outputs must agree exactly)

Every fp32 variant's model output is checked against the fused fp32 output before timing (fp16/bf16
errors are reported against their 1e-2 target). All sessions run with
idle pool threads not spinning (they live side by side and run in turn); one-node models are fed
OrtValues made once, through an IOBinding. A summary checks each target of the performance issue at the end.

The exports are cached in --models-dir (default /tmp/moe-bench), with their optimized forms. torch
is needed only to export; when a file is missing the script prints the command that makes it.

usage: python benchmarks/bench_moe.py [--models-dir DIR] [--shapes gpt_oss qwen3] [--tokens 1 16 128 512]
                                      [--threads 2] [--rounds 5] [--runs 1] [--budget-ms 150]
                                      [--unfused-max-tokens 512] [--skip unfused,python,rss,...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import moe_onnx

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("fused", "unfused", "ort_moe", "grouped", "python", "fp16", "bf16", "rss", "int8")


@dataclass(frozen=True)
class Shape:
    name: str
    family: str
    style: str
    venv: str
    E: int
    k: int
    H: int
    I: int
    gemm2: bool

    @property
    def stem(self) -> str:
        return f"{self.family}_{self.style}_E{self.E}_k{self.k}_H{self.H}_I{self.I}"

    def export_command(self, models_dir: Path) -> str:
        return (f"{self.venv}/bin/python {REPO / 'models/export_moe_blocks.py'} --family {self.family} "
                f"--style {self.style} --hidden {self.H} --intermediate {self.I} --experts {self.E} "
                f"--topk {self.k} -o {models_dir / (self.stem + '.onnx')}")

    def expert_bytes(self, itemsize: int = 4) -> int:
        """Bytes of one expert's weights (and biases)."""
        n = 3 * self.H * self.I + (2 * self.I + self.H if self.gemm2 else 0)
        return n * itemsize


SHAPES = {
    "gpt_oss": Shape("gpt_oss", "gpt_oss", "tiled", "/work/export-venv-457", 32, 4, 1024, 1024, True),
    "qwen3": Shape("qwen3", "qwen3_moe", "tiled3", "/work/export-venv-5", 64, 8, 1024, 384, False),
}


# ----------------------------------------------------------------------------- models

def options(threads: int) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # Idle pool threads must not spin: the variants' sessions are alive side by side and run in turn,
    # and a spinning pool of one would steal the cores from the next.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


def only_first_output(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with one graph output (the block's), dead nodes and initializers removed."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.output[1:]
    needed = {m.graph.output[0].name}
    keep = []
    for node in reversed(m.graph.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    del m.graph.node[:]
    m.graph.node.extend(reversed(keep))
    inits = [t for t in m.graph.initializer if t.name in needed]
    del m.graph.initializer[:]
    m.graph.initializer.extend(inits)
    return m


def moe_node(model: onnx.ModelProto) -> onnx.NodeProto:
    nodes = [n for n in model.graph.node if n.op_type == "MOE" and n.domain == moe_onnx.DOMAIN]
    assert len(nodes) == 1, f"expected one MOE node, found {len(nodes)}"
    return nodes[0]


def attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            v = helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default


def initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    for t in model.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    raise KeyError(name)


def router_logits(model: onnx.ModelProto) -> str:
    """The router's logits: the output of the (only) Gemm/MatMul whose weight is [E, H] or [H, E]."""
    gemms = [n for n in model.graph.node if n.op_type in ("Gemm", "MatMul")]
    assert len(gemms) == 1, [n.op_type for n in gemms]
    return gemms[0].output[0]


def ort_moe_model(fused: onnx.ModelProto, shape: Shape) -> onnx.ModelProto:
    """The fused model with its MOE node replaced by com.microsoft::MoE on the router's logits."""
    m = onnx.ModelProto()
    m.CopyFrom(fused)
    node = moe_node(m)
    ins = list(node.input) + [""] * (8 - len(node.input))
    if shape.gemm2:
        assert attr(node, "gate_parity", 0) == 0
        fc1 = initializer(m, ins[3]).transpose(0, 2, 1)  # [E, H, 2I] -> [E, 2I, H], gate rows even
        fc2 = initializer(m, ins[5]).transpose(0, 2, 1)  # [E, I, H] -> [E, H, I]
        b1, b2 = initializer(m, ins[4]), initializer(m, ins[6])
        attrs = dict(activation_alpha=float(attr(node, "expert_alpha")), activation_beta=1.0,
                     swiglu_limit=float(attr(node, "expert_beta")))
    else:
        gate, up, down = (initializer(m, ins[i]) for i in (3, 5, 7))  # [E, I, H], [E, I, H], [E, H, I]
        fc1 = np.empty((shape.E, 2 * shape.I, shape.H), np.float32)
        fc1[:, 0::2], fc1[:, 1::2] = gate, up
        fc2, b1, b2 = down, None, None
        attrs = dict(activation_alpha=float(attr(node, "expert_alpha", 1.0)), activation_beta=0.0)
    inits = {"ort_fc1": fc1, "ort_fc1_b": b1, "ort_fc2": fc2, "ort_fc2_b": b2}
    new = helper.make_node(
        "MoE", [ins[0], router_logits(m), "ort_fc1", "ort_fc1_b" if b1 is not None else "", "ort_fc2",
                "ort_fc2_b" if b2 is not None else ""], list(node.output), domain="com.microsoft",
        k=shape.k, activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=1, **attrs)
    nodes = [new if n is node else n for n in m.graph.node]
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    m.graph.initializer.extend(numpy_helper.from_array(np.ascontiguousarray(a), n)
                               for n, a in inits.items() if a is not None)
    if not any(o.domain == "com.microsoft" for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return only_first_output(m)


def cast_model(fused: onnx.ModelProto, dtype) -> onnx.ModelProto:
    """The fused model with the MOE node's weights, hidden_states and routing weights in `dtype`
    (Cast nodes around it; the router stays fp32)."""
    to = {np.float16: TensorProto.FLOAT16, ml_dtypes.bfloat16: TensorProto.BFLOAT16}[dtype]
    m = onnx.ModelProto()
    m.CopyFrom(fused)
    node = moe_node(m)
    weights = set(list(node.input)[3:])
    for i, t in enumerate(m.graph.initializer):
        if t.name in weights:
            a = numpy_helper.to_array(t).astype(dtype)
            if dtype is ml_dtypes.bfloat16:
                new = helper.make_tensor(t.name, TensorProto.BFLOAT16, a.shape, a.view(np.uint16).tobytes(), raw=True)
            else:
                new = numpy_helper.from_array(a, t.name)
            m.graph.initializer[i].CopyFrom(new)
    casts = []
    for j in (0, 1):
        src = node.input[j]
        node.input[j] = f"{src}__lowp"
        casts.append(helper.make_node("Cast", [src], [node.input[j]], to=to))
    out = node.output[0]
    node.output[0] = f"{out}__lowp"
    after = helper.make_node("Cast", [node.output[0]], [out], to=TensorProto.FLOAT)
    nodes = []
    for n in m.graph.node:
        if n is node:
            nodes += casts + [n, after]
        else:
            nodes.append(n)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


def with_moe_inputs(fused: onnx.ModelProto) -> onnx.ModelProto:
    """The fused model that also outputs its MOE node's hidden_states, routing weights and indices."""
    m = onnx.ModelProto()
    m.CopyFrom(fused)
    node = moe_node(m)
    for name, elem in zip(node.input[:3], (TensorProto.FLOAT, TensorProto.FLOAT, TensorProto.INT64)):
        m.graph.output.append(helper.make_tensor_value_info(name, elem, None))
    return m


def moe_node_model(fused: onnx.ModelProto, elem: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """The MOE node alone (its weights as initializers): the kernel without the router's ONNX ops (and,
    for fp16/bf16, without the Cast nodes around it); `elem` is its activations' type."""
    node = moe_node(fused)
    weights = set(node.input[3:])
    inputs = [helper.make_tensor_value_info(name, e, None)
              for name, e in zip(node.input[:3], (elem, elem, TensorProto.INT64))]
    graph = helper.make_graph([node], "moe_node", inputs,
                              [helper.make_tensor_value_info(node.output[0], elem, None)],
                              [t for t in fused.graph.initializer if t.name in weights])
    return helper.make_model(graph, opset_imports=fused.opset_import, ir_version=fused.ir_version)


def dense_model(H: int, N: int, seed: int = 0) -> onnx.ModelProto:
    """Y = X @ W with W [H, N] an initializer (MLAS prepacks it)."""
    w = np.random.default_rng(seed).standard_normal((H, N)).astype(np.float32) * 0.02
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])], [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def gemv_model(H: int) -> onnx.ModelProto:
    """The bandwidth probe: y = x @ W, x [1, H], W [H, N] a run-time input (read once, never packed)."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "gemv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, H]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [H, "N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "N"])], [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def linear_model(w: np.ndarray) -> onnx.ModelProto:
    """MoeRowParallelLinear alone, W [E, N, K] an initializer (packed once at session creation)."""
    E, N, K = w.shape
    elem = TensorProto.INT8 if w.dtype == np.int8 else TensorProto.FLOAT
    out = TensorProto.INT32 if w.dtype == np.int8 else TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("MoeRowParallelLinear", ["x", "expert_offset", "w"], ["y"], domain=moe_onnx.DOMAIN)],
        "linear", [helper.make_tensor_value_info("x", elem, ["R", K]),
                   helper.make_tensor_value_info("expert_offset", TensorProto.INT64, [E + 1])],
        [helper.make_tensor_value_info("y", out, ["R", N])], [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(moe_onnx.DOMAIN, 1)],
                             ir_version=10)


def bench_int8(shape: Shape, args, counts: dict) -> dict:
    """int8 against fp32 MoeRowParallelLinear (gate/up shape) on the router's rows for each T in `counts`."""
    E, N, K = shape.E, 2 * shape.I, shape.H
    rng = np.random.default_rng(5)
    w8 = rng.integers(-128, 128, (E, N, K), dtype=np.int8)
    sessions = {"int8": moe_onnx.session(linear_model(w8).SerializeToString(), sess_options=options(args.threads)),
                "fp32": moe_onnx.session(linear_model(w8.astype(np.float32)).SerializeToString(),
                                         sess_options=options(args.threads))}
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
        first = {}
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            first[name] = (time.perf_counter() - t0) * 1e3
        timer = Timer()
        for _ in range(args.rounds):
            for name, call in calls.items():
                timer.measure(name, call, reps_for(first[name], args.budget_ms))
        med = {name: timer.median(name) for name in calls}
        ops = 2 * offsets[-1] * N * K
        out[tokens] = dict(rows=int(offsets[-1]), fp32=med["fp32"], int8=med["int8"],
                           speedup=timer.paired_ratio("fp32", "int8"),
                           gops={n: ops / (m * 1e-3) / 1e9 for n, m in med.items()})
        r = out[tokens]
        print(f"T={tokens:<4} int8 MoeRowParallelLinear [{r['rows']} rows, N={N}, K={K}]: fp32 {fmt(r['fp32'])} ms "
              f"({r['gops']['fp32']:.0f} GFLOP/s), int8 {fmt(r['int8'])} ms ({r['gops']['int8']:.0f} GOP/s), "
              f"int8 throughput {r['speedup']:.2f}x fp32", flush=True)
    return out


def load_models(shape: Shape, models_dir: Path, need_grouped: bool) -> dict | None:
    src = models_dir / f"{shape.stem}.onnx"
    if not src.exists():
        print(f"[{shape.name}] missing {src}; make it with (torch + transformers, see models/README.md):\n"
              f"  {shape.export_command(models_dir)}", flush=True)
        return None
    export = onnx.load(src)  # optimize() sees every output (router_scores changes what fuses)
    out = {"export": only_first_output(export)}
    for target in ("moe", "grouped") if need_grouped else ("moe",):
        cached = models_dir / f"{shape.stem}.{target}.onnx"
        if cached.exists() and cached.stat().st_mtime >= src.stat().st_mtime:
            out[target] = onnx.load(cached)
        else:
            t0 = time.perf_counter()
            optimized, report = moe_onnx.optimize(export, target=target)
            print(f"[{shape.name}] optimize(target={target!r}) took {time.perf_counter() - t0:.1f} s, "
                  f"cached in {cached}", flush=True)
            optimized = only_first_output(optimized)
            onnx.save(optimized, cached)
            out[target] = optimized
    return out


# ----------------------------------------------------------------------------- timing

class Timer:
    """Interleaved timing: each round runs every variant a few times; medians over all rounds."""

    def __init__(self):
        self.rounds: dict[str, list[list[float]]] = {}  # per variant, the times (ms) of each round

    def measure(self, name: str, fn, reps: int) -> None:
        """One round of `name`: `reps` calls."""
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        self.rounds.setdefault(name, []).append(times)

    def median(self, name: str) -> float | None:
        values = [t for r in self.rounds.get(name, []) for t in r]
        return statistics.median(values) if values else None

    def round_medians(self, name: str) -> list[float]:
        return [statistics.median(r) for r in self.rounds[name]]

    def paired_ratio(self, a: str, b: str) -> float:
        """Median over rounds of a / b, each round's two medians taken side by side: a slow spell of
        the (shared) machine slows both. `bound` is max(bytes, dense) of the same round."""
        def per_round(name):
            if name == "bound":
                return [max(x, y) for x, y in zip(self.round_medians("bytes"), self.round_medians("dense"))]
            return self.round_medians(name)
        return statistics.median(x / y for x, y in zip(per_round(a), per_round(b)))


def runner(sess, feeds):
    names = [sess.get_outputs()[0].name]
    return lambda: sess.run(names, feeds)


class BoundRunner:
    """Runs `sess` on OrtValues made once (bfloat16 too) through an IOBinding, so no conversion is
    timed. (run_with_ort_values would add ~40 us per call in Python wrapping its outputs, the
    whole run time of a small decode.) `outputs()` returns the last run's outputs as numpy."""

    def __init__(self, sess, arrays):
        def value(a):
            if a.dtype == ml_dtypes.bfloat16:
                return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(np.uint16), TensorProto.BFLOAT16)
            return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a))
        self.sess = sess
        self.values = [value(a) for a in arrays]  # kept alive: the binding points at them
        self.binding = sess.io_binding()
        for i, v in zip(sess.get_inputs(), self.values):
            self.binding.bind_ortvalue_input(i.name, v)
        self.binding.bind_output(sess.get_outputs()[0].name)

    def __call__(self) -> None:
        self.sess.run_with_iobinding(self.binding)

    def outputs(self) -> list[np.ndarray]:
        return self.binding.copy_outputs_to_cpu()


def reps_for(ms: float, budget_ms: float) -> int:
    return max(1, min(10, int(budget_ms / max(ms, 1e-3))))


def rss_child(args) -> None:
    """Subprocess: create one variant's session, run it once at T tokens, print VmHWM and VmRSS (MB)."""
    def status(key: str) -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
        return float("nan")

    path, backend, tokens, H = args.rss_child
    tokens, H = int(tokens), int(H)
    base = status("VmRSS")
    opts = options(args.threads)
    sess = (ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"]) if backend == "ort"
            else moe_onnx.session(path, backend=backend, sess_options=opts))
    x = np.random.default_rng(7).standard_normal((1, tokens, H)).astype(np.float32)
    created = status("VmRSS")
    created_hwm = status("VmHWM")
    try:  # reset VmHWM to the current RSS (Linux >= 4.0), so the peak below is the run's own
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    sess.run(None, {sess.get_inputs()[0].name: x})
    print(json.dumps({"base": base, "created": created, "created_hwm": created_hwm, "hwm": status("VmHWM"),
                      "reset": reset, "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


# ----------------------------------------------------------------------------- the benchmark

def bench_shape(shape: Shape, models: dict, args, rows: dict) -> None:
    skip = set(args.skip)
    threads = args.threads
    print(f"\n## {shape.name}: E={shape.E} k={shape.k} H={shape.H} I={shape.I} "
          f"{'GEMM2 + biases' if shape.gemm2 else 'GEMM3'}, fp32, {threads} intra-op threads", flush=True)

    t0 = time.perf_counter()
    fused = moe_onnx.session(models["moe"].SerializeToString(), sess_options=options(threads))
    create_fused = time.perf_counter() - t0
    t0 = time.perf_counter()
    unfused = ort.InferenceSession(models["export"].SerializeToString(), options(threads),
                                   providers=["CPUExecutionProvider"])  # the same load without packing
    create_plain = time.perf_counter() - t0
    print(f"session creation: fused {create_fused:.2f} s (of which packing ~{create_fused - create_plain:.2f} s; "
          f"the unfused export loads in {create_plain:.2f} s)", flush=True)
    rows.setdefault("_creation", {})[shape.name] = (create_fused, create_plain)

    sessions = {"fused": fused}
    idx_sess = moe_onnx.session(with_moe_inputs(models["moe"]).SerializeToString(), sess_options=options(1))
    node_sess = moe_onnx.session(moe_node_model(models["moe"]).SerializeToString(), sess_options=options(threads))
    if "unfused" not in skip:
        sessions["unfused"] = unfused
    del unfused
    if "ort_moe" not in skip:
        sessions["ort_moe"] = ort.InferenceSession(ort_moe_model(models["moe"], shape).SerializeToString(),
                                                   options(threads), providers=["CPUExecutionProvider"])
    grouped_note = None
    if "grouped" not in skip:
        try:
            sessions["grouped"] = moe_onnx.session(models["grouped"].SerializeToString(), sess_options=options(threads))
        except Exception as e:  # a library built elsewhere (MOE_ONNX_CUSTOM_OPS_LIBRARY) may lack them
            grouped_note = str(e).splitlines()[0][:200]
            print(f"grouped (cpp): skipped, the library {moe_onnx.custom_ops_library()} cannot run it: "
                  f"{grouped_note}", flush=True)
    if "python" not in skip:
        sessions["python"] = moe_onnx.session(models["moe"].SerializeToString(), backend="python",
                                              sess_options=options(threads))
    node_sessions = {}  # the MOE node alone, per weight type
    for dt, key, elem in ((np.float16, "fp16", TensorProto.FLOAT16), (ml_dtypes.bfloat16, "bf16", TensorProto.BFLOAT16)):
        if key not in skip:
            cast = cast_model(models["moe"], dt)
            sessions[key] = moe_onnx.session(cast.SerializeToString(), sess_options=options(threads))
            node_sessions[key] = (dt, moe_onnx.session(moe_node_model(cast, elem).SerializeToString(),
                                                       sess_options=options(threads)))
    dense = ort.InferenceSession(dense_model(shape.H, 3 * shape.I).SerializeToString(), options(threads),
                                 providers=["CPUExecutionProvider"])
    bw = ort.InferenceSession(gemv_model(shape.H).SerializeToString(), options(threads),
                              providers=["CPUExecutionProvider"])

    results, counts = {}, {}
    for tokens in args.tokens:
        x = np.random.default_rng(100 + tokens).standard_normal((1, tokens, shape.H)).astype(np.float32)
        feeds = {"hidden_states": x}
        y_ref = fused.run(None, feeds)[0]
        _, node_x, node_w, indices = idx_sess.run(None, feeds)
        touched = len(np.unique(indices))
        if tokens >= 128:
            counts[tokens] = np.bincount(indices.reshape(-1), minlength=shape.E)
        calls, errors = {}, {}
        for name, sess in sessions.items():
            if name == "python" and tokens != 128:
                continue
            if name in ("fp16", "bf16") and tokens not in (1, 128):
                continue
            if name == "unfused" and tokens > args.unfused_max_tokens:
                continue
            call = runner(sess, feeds)
            y = np.asarray(call()[0], dtype=np.float32)
            errors[name] = float(np.abs(y - y_ref).max())
            if name in ("fp16", "bf16"):  # the error of rounding the fp32 result alone to that type
                dt = np.float16 if name == "fp16" else ml_dtypes.bfloat16
                errors[name + "_rounding"] = float(np.abs(y_ref.astype(dt).astype(np.float32) - y_ref).max())
                errors[name + "_scale"] = float(np.abs(y_ref).max())
            limit = 1e-2 if name in ("fp16", "bf16") else 1e-3
            if name not in ("fp16", "bf16", "fused") and not errors[name] <= limit:
                raise SystemExit(f"[{shape.name}] T={tokens}: {name} differs from fused by {errors[name]:.3g}")
            calls[name] = call
        calls["node"] = BoundRunner(node_sess, (node_x, node_w, indices))
        for key, (dt, sess) in node_sessions.items():
            if tokens in (1, 128):
                calls[f"node_{key}"] = BoundRunner(sess, (node_x.astype(dt), node_w.astype(dt), indices))
        calls["dense"] = runner(dense, {"x": np.random.default_rng(3).standard_normal(
            (tokens * shape.k, shape.H)).astype(np.float32)})
        # Reading the touched experts' bytes once: a GEMV over a weight of exactly that size (so it meets
        # the same caches), fed as an input (no packing).
        touched_bytes = touched * shape.expert_bytes()
        bw_w = np.random.default_rng(2).standard_normal((shape.H, touched_bytes // (4 * shape.H))).astype(np.float32)
        calls["bytes"] = runner(bw, {"x": np.ones((1, shape.H), np.float32), "w": bw_w})
        # The Python backend runs numpy, whose BLAS threads keep spinning after a call and would slow
        # whatever runs next: it is timed on its own, after the interleaved rounds of the others.
        interleaved = [name for name in calls if name != "python"]
        timer, first = Timer(), {}

        def warm_up(names):
            for name in names:
                calls[name]()
            for name in names:
                t0 = time.perf_counter()
                calls[name]()
                first[name] = (time.perf_counter() - t0) * 1e3

        warm_up(interleaved)
        for _ in range(args.rounds):
            for name in interleaved:
                timer.measure(name, calls[name], reps_for(first[name], args.budget_ms))
        if "python" in calls:
            warm_up(["python"])
            for _ in range(args.rounds):
                timer.measure("python", calls["python"], reps_for(first["python"], args.budget_ms))
        med = {name: timer.median(name) for name in calls}
        pairs = [("fused", "bound"), ("node", "bound"), ("unfused", "fused"), ("ort_moe", "fused"),
                 ("grouped", "fused"), ("fp16", "fused"), ("bf16", "fused"), ("node_fp16", "node"),
                 ("node_bf16", "node")]
        ratios = {f"{a}/{b}": timer.paired_ratio(a, b) for a, b in pairs if a in interleaved}
        if "python" in calls:  # timed after the others, not side by side
            ratios["python/fused"] = med["python"] / med["fused"]
        bandwidth = bw_w.nbytes / (med["bytes"] * 1e-3)  # bytes/s
        del bw_w
        med["flops"] = med.pop("dense")
        med["bound"] = max(med["bytes"], med["flops"])
        results[tokens] = dict(med=med, ratios=ratios, errors=errors, touched=touched, bandwidth=bandwidth / 1e9)
        print_row(tokens, results[tokens])
    del sessions, fused, dense, bw, idx_sess, node_sess, node_sessions
    int8 = bench_int8(shape, args, counts) if "int8" not in skip else {}
    rows[shape.name] = dict(results=results, grouped_note=grouped_note, int8=int8)


def merge_runs(runs: list[dict]) -> dict:
    """One shape's results over several runs: each time, ratio and rate is the median of the runs'
    (each run's own figure is a median over its rounds); errors are the largest."""
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
    return dict(results=results, grouped_note=first["grouped_note"], int8=int8, runs=len(runs))


def fmt(v: float | None, digits: int = 2) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if v < 100 else f"{v:.0f}"


def print_row(tokens, r) -> None:
    m = r["med"]
    f = m["fused"]
    parts = [f"T={tokens:<4}", f"fused {fmt(f)} (MOE node alone {fmt(m['node'])})",
             f"bound {fmt(m['bound'])} (flops {fmt(m['flops'])}, "
             f"bytes {fmt(m['bytes'])} for {r['touched']} experts at {r['bandwidth']:.1f} GB/s)"]
    for name in ("unfused", "ort_moe", "grouped", "python", "fp16", "bf16"):
        if name in m:
            err = f", err {r['errors'][name]:.1e}" if name in ("fp16", "bf16") else ""
            parts.append(f"{name} {fmt(m[name])}{err}")
    print("  ".join(parts) + "  [ms]", flush=True)


def ratio(r: dict, a: str, b: str) -> str:
    """The side-by-side ratio a / b of one token count's results ("-" when a variant did not run)."""
    v = r["ratios"].get(f"{a}/{b}")
    return "-" if v is None else f"{v:.2f}x"


def markdown(rows: dict, args) -> str:
    out = []
    for name, data in rows.items():
        if name.startswith("_") or data is None:
            continue
        shape = SHAPES[name]
        created = rows.get("_creation", {}).get(name)
        creation = (f"; session creation {created[0]:.2f} s, the export alone {created[1]:.2f} s" if created else "")
        runs_note = f" and ratios: medians of {data['runs']} runs" if data.get("runs") else ""
        out.append(f"\n**{name}** (E={shape.E}, k={shape.k}, H={shape.H}, I={shape.I}, "
                   f"{'GEMM2 + biases' if shape.gemm2 else 'GEMM3'}, fp32, {args.threads} threads; median ms"
                   f"{runs_note}"
                   f"{creation})\n")
        out.append("| tokens | fused MOE (cpp) | MOE node alone | bound (flops / bytes) | fused / bound | node / bound "
                   "| unfused | unfused / fused | `com.microsoft::MoE` | MoE / fused | grouped (cpp) | grouped / fused |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for tokens, r in data["results"].items():
            m = r["med"]
            f = m["fused"]
            out.append(
                f"| {tokens} | {fmt(f)} | {fmt(m['node'])} | {fmt(m['bound'])} ({fmt(m['flops'])} / {fmt(m['bytes'])}) | "
                f"{ratio(r, 'fused', 'bound')} | {ratio(r, 'node', 'bound')} | {fmt(m.get('unfused'))} | "
                f"{ratio(r, 'unfused', 'fused')} | "
                f"{fmt(m.get('ort_moe'))} | {ratio(r, 'ort_moe', 'fused')} | {fmt(m.get('grouped'))} | "
                f"{ratio(r, 'grouped', 'fused')} |")
        extra = []
        for tokens, r in data["results"].items():
            m = r["med"]
            for key in ("fp16", "bf16"):
                if key in m:
                    e = r["errors"]
                    extra.append(f"| {tokens} | {key} | {fmt(m[key])} | {ratio(r, key, 'fused')} | "
                                 f"{fmt(m.get('node_' + key))} | {ratio(r, 'node_' + key, 'node')} | "
                                 f"{e[key]:.1e} | {e[key] / e[key + '_scale']:.1e} | {e[key + '_rounding']:.1e} |")
            if "python" in m:
                extra.append(f"| {tokens} | python backend (fp32) | {fmt(m['python'])} | "
                             f"{ratio(r, 'python', 'fused')} | | | {r['errors']['python']:.1e} | | |")
        if extra:
            out.append("\n| tokens | variant | model ms | / fp32 model | MOE node alone ms | / fp32 node "
                       "| max abs err vs fp32 | relative to max abs output | rounding the fp32 output alone |")
            out.append("|---|---|---|---|---|---|---|---|---|")
            out += extra
        if data.get("int8"):
            out.append(f"\nint8 `MoeRowParallelLinear` (gate/up shape: E={shape.E}, N={2 * shape.I}, K={shape.H}) on "
                       "the rows the router makes of T tokens, against fp32 with the same integer values\n")
            out.append("| tokens | rows | fp32 ms | int8 ms | fp32 GFLOP/s | int8 GOP/s | int8 throughput / fp32 |")
            out.append("|---|---|---|---|---|---|---|")
            for tokens, r in data["int8"].items():
                out.append(f"| {tokens} | {r['rows']} | {fmt(r['fp32'])} | {fmt(r['int8'])} | {r['gops']['fp32']:.0f} | "
                           f"{r['gops']['int8']:.0f} | {r['speedup']:.2f}x |")
        if data.get("grouped_note"):
            out.append(f"\ngrouped (cpp) skipped: {data['grouped_note']}")
        if data.get("rss"):
            out.append(f"\nRSS at T={max(args.tokens)} (MB; each variant in its own process): after session "
                       "creation, peak during the first run (VmHWM reset after creation), extra = the run's own\n")
            out.append("| variant | created | peak | extra |")
            out.append("|---|---|---|---|")
            for v, r in data["rss"].items():
                out.append(f"| {v} | {r['created']:.0f} | {r['hwm']:.0f} | {r['hwm'] - r['created']:.0f} |"
                           if "hwm" in r else f"| {v} | - | - | {r.get('error', '')} |")
    return "\n".join(out)


def targets(rows: dict) -> list[str]:
    """Each target of the performance issue against this run's figures."""
    out = []

    def check(what: str, ok: bool, figures: str) -> None:
        out.append(f"- [{'met' if ok else 'NOT met'}] {what}: {figures}")

    for name, data in rows.items():
        if name.startswith("_") or data is None:
            continue
        shape = SHAPES[name]
        res = data["results"]
        rat = {t: r["ratios"] for t, r in res.items()}
        b = {t: q["fused/bound"] for t, q in rat.items()}
        check(f"{name}: fused <= 1.25x bound (whole model: router ops + MOE node)", all(v <= 1.25 for v in b.values()),
              ", ".join(f"T={t} {v:.2f}x" for t, v in b.items()))
        nb = {t: q["node/bound"] for t, q in rat.items()}
        check(f"{name}: MOE node alone <= 1.25x bound", all(v <= 1.25 for v in nb.values()),
              ", ".join(f"T={t} {v:.2f}x" for t, v in nb.items()))
        o = {t: q["ort_moe/fused"] for t, q in rat.items() if "ort_moe/fused" in q}
        if o:
            check(f"{name}: fused <= com.microsoft::MoE", all(v >= 1 for v in o.values()),
                  ", ".join(f"T={t} MoE/fused {v:.2f}x" for t, v in o.items()))
        u = {t: q["unfused/fused"] for t, q in rat.items() if "unfused/fused" in q and t >= 128}
        need = 0.8 * shape.E / shape.k
        if u:
            check(f"{name}: unfused/fused >= 0.8 E/k = {need:.1f} at T >= 128", all(v >= need for v in u.values()),
                  ", ".join(f"T={t} {v:.1f}x" for t, v in u.items()))
        for key in ("fp16", "bf16"):
            if 1 in rat and f"{key}/fused" in rat[1]:
                v = rat[1][f"{key}/fused"]
                check(f"{name}: {key} decode (T=1) <= 0.6x fp32, whole model (router ops and Casts included)",
                      v <= 0.6, f"{v:.2f}x")
            if 1 in rat and f"node_{key}/node" in rat[1]:
                v = rat[1][f"node_{key}/node"]
                check(f"{name}: {key} decode (T=1) <= 0.6x fp32, MOE node alone", v <= 0.6, f"{v:.2f}x")
            errs = {t: r["errors"][key] / r["errors"][key + "_scale"] for t, r in res.items() if key in r["errors"]}
            if errs:
                check(f"{name}: {key} error within 1e-2 (relative to the largest output)",
                      all(v <= 1e-2 for v in errs.values()), ", ".join(f"T={t} {v:.1e}" for t, v in errs.items()))
        g = {t: q["grouped/fused"] for t, q in rat.items() if "grouped/fused" in q}
        if g:
            check(f"{name}: grouped (cpp) within 1.3x of MOE", all(v <= 1.3 for v in g.values()),
                  ", ".join(f"T={t} {v:.2f}x" for t, v in g.items()))
        if 128 in rat and "python/fused" in rat[128]:
            v = rat[128]["python/fused"]
            check(f"{name}: Python backend within 5x of cpp at T=128", v <= 5, f"{v:.2f}x")
        if data.get("int8"):
            i8 = {t: r["speedup"] for t, r in data["int8"].items()}
            check(f"{name}: int8 MoeRowParallelLinear >= 1.5x fp32 throughput at T >= 128 ({shape.k} rows per token)",
                  all(v >= 1.5 for v in i8.values()),
                  ", ".join(f"T={t} ({data['int8'][t]['rows']} rows) {v:.2f}x" for t, v in i8.items()))
        rss = data.get("rss", {}).get("fused (cpp)")
        if rss and "hwm" in rss:
            tokens = max(res)
            unit = tokens * shape.k * max(shape.H, 2 * shape.I) * 4 / 2**20
            extra = rss["hwm"] - rss["created"]
            check(f"{name}: fused extra memory O(T*k*max(H, 2I))", extra <= 4 * unit + 16,
                  f"{extra:.0f} MB at T={tokens} = {extra / unit:.1f} x T*k*max(H, 2I)*4 bytes ({unit:.0f} MB)")
    return out


def measure_rss(shape: Shape, models: dict, args, rows: dict) -> None:
    data = rows.get(shape.name)
    if not data:
        return
    d = args.models_dir
    variants = {"fused (cpp)": (d / f"{shape.stem}.moe.onnx", "cpp"),
                "unfused": (d / f"{shape.stem}.export1.onnx", "ort"),
                "com.microsoft::MoE": (d / f"{shape.stem}.ortmoe.onnx", "ort"),
                "grouped (cpp)": (d / f"{shape.stem}.grouped.onnx", "cpp")}
    skipped = {"unfused": "unfused", "com.microsoft::MoE": "ort_moe", "grouped (cpp)": "grouped"}
    variants = {v: pb for v, pb in variants.items() if skipped.get(v) not in args.skip}
    if "unfused" in variants:  # each child loads its model from a file
        onnx.save(models["export"], variants["unfused"][0])
    if "com.microsoft::MoE" in variants:
        onnx.save(ort_moe_model(models["moe"], shape), variants["com.microsoft::MoE"][0])
    tokens = max(args.tokens)
    data["rss"] = {}
    for v, (path, backend) in variants.items():
        if not path.exists():
            continue
        cmd = [sys.executable, __file__, "--threads", str(args.threads), "--rss-child", str(path), backend,
               str(tokens), str(shape.H)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            data["rss"][v] = {"error": (p.stderr.strip().splitlines() or ["failed"])[-1][:120]}
        else:
            data["rss"][v] = json.loads(p.stdout.strip().splitlines()[-1])
        r = data["rss"][v]
        print(f"[{shape.name}] RSS {v}: " + (f"created {r['created']:.0f} MB, peak {r['hwm']:.0f} MB"
                                                if "hwm" in r else r["error"]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/moe-bench"))
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["gpt_oss", "qwen3"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians over all)")
    ap.add_argument("--runs", type=int, default=1,
                    help="repeat each shape's measurement; report the median of the runs' figures")
    ap.add_argument("--budget-ms", type=float, default=150.0, help="time per variant per round")
    ap.add_argument("--unfused-max-tokens", type=int, default=512)
    ap.add_argument("--skip", type=lambda s: [x for x in s.split(",") if x], default=[],
                    help=f"comma-separated variants to leave out: {','.join(VARIANTS[1:])}")
    ap.add_argument("--rss-child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        rss_child(args)
        return
    args.models_dir.mkdir(parents=True, exist_ok=True)
    print("command: " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable, REPO) if
                                                        sys.executable.startswith(str(REPO)) else sys.executable]
                                 + sys.argv), flush=True)
    print(f"onnxruntime {ort.__version__}, library {moe_onnx.custom_ops_library()}", flush=True)
    rows: dict = {}
    for name in args.shapes:
        shape = SHAPES[name]
        models = load_models(shape, args.models_dir, "grouped" not in args.skip)
        if models is None:
            rows[name] = None
            continue
        runs = []
        for run in range(args.runs):
            if args.runs > 1:
                print(f"\n# {name}: run {run + 1} of {args.runs}", flush=True)
            bench_shape(shape, models, args, rows)
            runs.append(rows[name])
        if args.runs > 1:
            rows[name] = merge_runs(runs)
        if "rss" not in args.skip:
            measure_rss(shape, models, args, rows)
        del models
    print("\n# Markdown\n" + markdown(rows, args))
    print("\n# Targets (issue 5)\n" + "\n".join(targets(rows)))
    missing = [SHAPES[n] for n, d in rows.items() if d is None and not n.startswith("_")]
    if missing:
        print("\nmissing exports; regenerate with:")
        for s in missing:
            print("  " + s.export_command(args.models_dir))


if __name__ == "__main__":
    main()
