"""Speed sanity of the MOE C++ kernel on a GPT-OSS-shaped block (not a test).

E=32 experts, k=4, H=I=1024, fp32, random weights as initializers, 2 intra-op threads. Times
session.run (median of repeats) for:
  fused    moe_onnx::MOE on the C++ kernels (moe_onnx.session)
  unfused  the tiled graph transformers' GPT-OSS exports (every expert on every token, weighted
           by a dense routing matrix, reduced over experts)
  ort_moe  onnxruntime's com.microsoft::MoE (router inside: softmax of logits, top-k, renormalized)

usage: python benchmarks/bench_moe_kernel.py [--tokens 1 16 128 512] [--threads 2] [--skip-unfused]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import moe_onnx

E, K, H, I = 32, 4, 1024, 1024
ALPHA, LIMIT = 1.702, 7.0


def weights(seed: int = 0):
    rng = np.random.default_rng(seed)
    w0 = (rng.standard_normal((E, H, 2 * I)) * 0.02).astype(np.float32)
    b0 = (rng.standard_normal((E, 2 * I)) * 0.02).astype(np.float32)
    w1 = (rng.standard_normal((E, I, H)) * 0.02).astype(np.float32)
    b1 = (rng.standard_normal((E, H)) * 0.02).astype(np.float32)
    return w0, b0, w1, b1


def routing(tokens: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((tokens, E)).astype(np.float32)
    idx = np.argsort(-logits, axis=1, kind="stable")[:, :K]
    top = np.take_along_axis(logits, idx, axis=1)
    w = np.exp(top - top.max(axis=1, keepdims=True))
    w = (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    return x, logits, w, idx.astype(np.int64)


def model(nodes, inputs, outputs, inits, opsets):
    graph = helper.make_graph(nodes, "bench", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], ir_version=10)


def fused_model(w0, b0, w1, b1) -> onnx.ModelProto:
    node = helper.make_node("MOE", ["x", "w", "idx", "w0", "b0", "w1", "b1"], ["y"], domain=moe_onnx.DOMAIN,
                            expert_type="GEMM2_BIAS_SWIGLU_CLAMP", expert_alpha=ALPHA, expert_beta=LIMIT,
                            gate_parity=0)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", H]),
              helper.make_tensor_value_info("w", TensorProto.FLOAT, ["T", K]),
              helper.make_tensor_value_info("idx", TensorProto.INT64, ["T", K])]
    inits = [numpy_helper.from_array(a, n) for a, n in ((w0, "w0"), (b0, "b0"), (w1, "w1"), (b1, "b1"))]
    return model([node], inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", H])], inits,
                 [("", 21), (moe_onnx.DOMAIN, 1)])


def unfused_model(w0, b0, w1, b1) -> onnx.ModelProto:
    """The tiled GPT-OSS experts: every expert on every token; dense routing [E, T, 1]."""
    c = lambda name, a: numpy_helper.from_array(np.asarray(a), name)  # noqa: E731
    inits = [c("w0", w0), c("b0", b0[:, None, :]), c("w1", w1), c("b1", b1[:, None, :]),
             c("reps", np.array([E, 1, 1], np.int64)), c("axes0", np.array([0], np.int64)),
             c("s0", np.array([0], np.int64)), c("s1", np.array([1], np.int64)),
             c("end", np.array([2 * I], np.int64)), c("ax2", np.array([2], np.int64)),
             c("step2", np.array([2], np.int64)), c("lim", np.array(LIMIT, np.float32)),
             c("nlim", np.array(-LIMIT, np.float32)), c("one", np.array(1.0, np.float32)),
             c("alpha", np.array(ALPHA, np.float32))]
    n = helper.make_node
    nodes = [
        n("Unsqueeze", ["x", "axes0"], ["x3"]),
        n("Tile", ["x3", "reps"], ["xt"]),
        n("MatMul", ["xt", "w0"], ["gu0"]),
        n("Add", ["gu0", "b0"], ["gu"]),
        n("Slice", ["gu", "s0", "end", "ax2", "step2"], ["gate0"]),
        n("Slice", ["gu", "s1", "end", "ax2", "step2"], ["up0"]),
        n("Clip", ["gate0", "", "lim"], ["gate"]),
        n("Clip", ["up0", "nlim", "lim"], ["up"]),
        n("Mul", ["gate", "alpha"], ["ag"]),
        n("Sigmoid", ["ag"], ["sg"]),
        n("Mul", ["gate", "sg"], ["glu"]),
        n("Add", ["up", "one"], ["up1"]),
        n("Mul", ["up1", "glu"], ["act"]),
        n("MatMul", ["act", "w1"], ["y0"]),
        n("Add", ["y0", "b1"], ["ye"]),
        n("Mul", ["ye", "dense"], ["yw"]),
        n("ReduceSum", ["yw", "axes0"], ["y3"], keepdims=0),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", H]),
              helper.make_tensor_value_info("dense", TensorProto.FLOAT, [E, "T", 1])]
    return model(nodes, inputs, [helper.make_tensor_value_info("y3", TensorProto.FLOAT, ["T", H])], inits,
                 [("", 21)])


def ort_moe_model(w0, b0, w1, b1) -> onnx.ModelProto:
    """com.microsoft::MoE: fc1 [E, 2I, H] interleaved gate/up, fc2 [E, H, I]."""
    fc1 = np.ascontiguousarray(w0.transpose(0, 2, 1))
    fc2 = np.ascontiguousarray(w1.transpose(0, 2, 1))
    inits = [numpy_helper.from_array(a, n) for a, n in ((fc1, "fc1"), (b0, "b0"), (fc2, "fc2"), (b1, "b1"))]
    node = helper.make_node("MoE", ["x", "logits", "fc1", "b0", "fc2", "b1"], ["y"], domain="com.microsoft",
                            k=K, activation_type="swiglu", swiglu_fusion=1, activation_alpha=ALPHA,
                            activation_beta=1.0, swiglu_limit=LIMIT, normalize_routing_weights=1)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", H]),
              helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", E])]
    return model([node], inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", H])], inits,
                 [("", 21), ("com.microsoft", 1)])


def options(threads: int) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return opts


def median_ms(sess, feeds, repeats: int, budget_s: float = 3.0) -> float:
    sess.run(None, feeds)
    times, start = [], time.perf_counter()
    while len(times) < repeats and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--skip-unfused", action="store_true")
    ap.add_argument("--skip-ort-moe", action="store_true")
    args = ap.parse_args()

    w = weights()
    t0 = time.perf_counter()
    fused = moe_onnx.session(fused_model(*w), sess_options=options(args.threads))
    print(f"fused session created in {time.perf_counter() - t0:.2f} s (weights packed)")
    unfused = None if args.skip_unfused else ort.InferenceSession(
        unfused_model(*w).SerializeToString(), options(args.threads), providers=["CPUExecutionProvider"])
    ort_moe = None if args.skip_ort_moe else ort.InferenceSession(
        ort_moe_model(*w).SerializeToString(), options(args.threads), providers=["CPUExecutionProvider"])

    print(f"E={E} k={K} H={H} I={I} fp32, {args.threads} intra-op threads; median ms of session.run")
    print(f"{'T':>5} {'fused':>9} {'unfused':>9} {'ort_moe':>9} {'unfused/fused':>14} {'ort_moe/fused':>14} {'max|diff|':>10}")
    for tokens in args.tokens:
        x, logits, rw, idx = routing(tokens)
        fused_ms = median_ms(fused, {"x": x, "w": rw, "idx": idx}, args.repeats)
        y = fused.run(None, {"x": x, "w": rw, "idx": idx})[0]
        row = [f"{tokens:>5}", f"{fused_ms:>9.2f}"]
        diff = 0.0
        if unfused is not None:
            dense = np.zeros((E, tokens, 1), np.float32)
            for j in range(K):
                dense[idx[:, j], np.arange(tokens), 0] += rw[:, j]
            feeds = {"x": x, "dense": dense}
            un_ms = median_ms(unfused, feeds, max(3, args.repeats // 4))
            diff = max(diff, float(np.abs(unfused.run(None, feeds)[0] - y).max()))
        if ort_moe is not None:
            om_ms = median_ms(ort_moe, {"x": x, "logits": logits}, args.repeats)
            diff = max(diff, float(np.abs(ort_moe.run(None, {"x": x, "logits": logits})[0] - y).max()))
        row.append(f"{un_ms:>9.2f}" if unfused is not None else f"{'-':>9}")
        row.append(f"{om_ms:>9.2f}" if ort_moe is not None else f"{'-':>9}")
        row.append(f"{un_ms / fused_ms:>14.1f}" if unfused is not None else f"{'-':>14}")
        row.append(f"{om_ms / fused_ms:>14.2f}" if ort_moe is not None else f"{'-':>14}")
        row.append(f"{diff:>10.2e}")
        print(" ".join(row), flush=True)


if __name__ == "__main__":
    main()
