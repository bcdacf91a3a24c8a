"""Is a shared expert faster beside the fused MOE or folded into it?

A shared expert (Qwen2-MoE, DeepSeek, GLM, dots...) is a gated MLP that every token runs, of width
S = m * I. Down-projection is linear, so it equals m extra routed experts of width I that every
token selects, each weighted by the shared gate (sigmoid of a [H, 1] projection for Qwen2-MoE, 1 for
DeepSeek). This script builds both on the same random weights, checks they agree, and times them
side by side in interleaved rounds:

- ``beside``: MOE(E experts, k) + the shared MLP as onnxruntime MatMuls (what the rewriter leaves);
- ``folded``: one MOE over E + m experts, k + m per token (routing weights and indices concatenated).

  PYTHONPATH=$PWD python benchmarks/bench_shared_expert.py [--tokens 1 16 128 512] [--threads 2]

A benchmark, not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_onnx  # noqa: E402
from _timing import BoundRunner, Timer, session_options  # noqa: E402

#: (name, H, I, E, k, m, gated): scaled-down Qwen1.5-MoE (shared width 4I, sigmoid gate) and
#: DeepSeek-V2-Lite (2 shared experts, no gate)
SHAPES = {
    "qwen2_moe": (1024, 352, 60, 4, 4, True),
    "deepseek_v2_lite": (1024, 352, 64, 6, 2, False),
}


def _weights(H: int, I: int, E: int, m: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)  # noqa: E731
    return {"gate": w(E, I, H), "up": w(E, I, H), "down": w(E, H, I),
            "shared_gate_proj": w(m * I, H), "shared_up": w(m * I, H), "shared_down": w(H, m * I),
            "shared_gate": w(H, 1)}


def _inputs(H: int, k: int):
    return [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", H]),
              helper.make_tensor_value_info("routing_weights", TensorProto.FLOAT, ["T", k]),
              helper.make_tensor_value_info("indices", TensorProto.INT64, ["T", k])]


def _model(nodes, inits: dict[str, np.ndarray], H: int, k: int) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "shared_expert", _inputs(H, k),
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", H])],
                              [numpy_helper.from_array(v, n) for n, v in inits.items()])
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18),
                                                                  helper.make_opsetid(moe_onnx.DOMAIN, 1)])


def _shared_scale_nodes(gated: bool) -> list[onnx.NodeProto]:
    """`shared_scale` [T, 1]: sigmoid(x @ shared_gate), or 1."""
    if gated:
        return [helper.make_node("MatMul", ["x", "shared_gate"], ["shared_logit"]),
                helper.make_node("Sigmoid", ["shared_logit"], ["shared_scale"])]
    return [helper.make_node("Shape", ["x"], ["x_shape"], end=1),
            helper.make_node("Concat", ["x_shape", "one_i64"], ["scale_shape"], axis=0),
            helper.make_node("ConstantOfShape", ["scale_shape"], ["shared_scale"],
                             value=numpy_helper.from_array(np.ones(1, np.float32)))]


def beside_model(w, H, I, E, k, m, gated) -> onnx.ModelProto:
    nodes = [
        helper.make_node("MOE", ["x", "routing_weights", "indices", "gate", "", "up", "", "down"], ["routed"],
                         domain=moe_onnx.DOMAIN, expert_type="GEMM3_SWIGLU"),
        helper.make_node("MatMul", ["x", "shared_gate_proj_t"], ["sg"]),
        helper.make_node("MatMul", ["x", "shared_up_t"], ["su"]),
        helper.make_node("Sigmoid", ["sg"], ["sg_sig"]),
        helper.make_node("Mul", ["sg", "sg_sig"], ["sg_silu"]),
        helper.make_node("Mul", ["sg_silu", "su"], ["sh_act"]),
        helper.make_node("MatMul", ["sh_act", "shared_down_t"], ["shared"]),
        *_shared_scale_nodes(gated),
        helper.make_node("Mul", ["shared", "shared_scale"], ["shared_scaled"]),
        helper.make_node("Add", ["routed", "shared_scaled"], ["y"]),
    ]
    inits = {"gate": w["gate"], "up": w["up"], "down": w["down"],
             "shared_gate_proj_t": np.ascontiguousarray(w["shared_gate_proj"].T),
             "shared_up_t": np.ascontiguousarray(w["shared_up"].T),
             "shared_down_t": np.ascontiguousarray(w["shared_down"].T),
             "shared_gate": w["shared_gate"], "one_i64": np.ones(1, np.int64)}
    return _model(nodes, inits, H, k)


def folded_model(w, H, I, E, k, m, gated) -> onnx.ModelProto:
    """The shared MLP as m more experts of width I, selected by every token with the shared scale."""
    chunks = range(m)
    gate = np.concatenate([w["gate"], *(w["shared_gate_proj"][None, c * I:(c + 1) * I] for c in chunks)])
    up = np.concatenate([w["up"], *(w["shared_up"][None, c * I:(c + 1) * I] for c in chunks)])
    down = np.concatenate([w["down"], *(w["shared_down"][None, :, c * I:(c + 1) * I] for c in chunks)])
    nodes = [
        *_shared_scale_nodes(gated),
        helper.make_node("Shape", ["x"], ["rows"], end=1),
        helper.make_node("Concat", ["rows", "m_i64"], ["shared_shape"], axis=0),
        helper.make_node("Expand", ["shared_scale", "shared_shape"], ["shared_weights"]),
        helper.make_node("Expand", ["shared_ids", "shared_shape"], ["shared_indices"]),
        helper.make_node("Concat", ["routing_weights", "shared_weights"], ["all_weights"], axis=1),
        helper.make_node("Concat", ["indices", "shared_indices"], ["all_indices"], axis=1),
        helper.make_node("MOE", ["x", "all_weights", "all_indices", "gate", "", "up", "", "down"], ["y"],
                         domain=moe_onnx.DOMAIN, expert_type="GEMM3_SWIGLU"),
    ]
    inits = {"gate": gate, "up": up, "down": down, "shared_gate": w["shared_gate"],
             "m_i64": np.array([m], np.int64), "one_i64": np.ones(1, np.int64),
             "shared_ids": np.arange(E, E + m, dtype=np.int64)[None, :]}
    return _model(nodes, inits, H, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--budget-ms", type=float, default=200)
    args = ap.parse_args()
    print(f"threads {args.threads}; times in ms, medians of {args.rounds} interleaved rounds")
    print("| shape | H/I/E/k/m | T | beside | folded | folded / beside |")
    print("|---|---|---|---|---|---|")
    for name in args.shapes:
        H, I, E, k, m, gated = SHAPES[name]
        w = _weights(H, I, E, m, seed=0)
        sessions = {variant: moe_onnx.session(build(w, H, I, E, k, m, gated).SerializeToString(),
                                              sess_options=session_options(args.threads))
                    for variant, build in (("beside", beside_model), ("folded", folded_model))}
        rng = np.random.default_rng(1)
        for tokens in args.tokens:
            x = rng.standard_normal((tokens, H)).astype(np.float32)
            indices = np.argsort(rng.random((tokens, E)), axis=1)[:, :k].astype(np.int64)
            weights = rng.random((tokens, k)).astype(np.float32)
            runners = {v: BoundRunner(s, [x, weights, indices]) for v, s in sessions.items()}
            for r in runners.values():
                r()
            beside, folded = (runners[v].outputs()[0] for v in ("beside", "folded"))
            diff = float(np.abs(beside - folded).max()) if tokens else 0.0
            if diff > 1e-4 * max(1.0, float(np.abs(beside).max())):
                raise SystemExit(f"{name} T={tokens}: folded differs from beside by {diff:.3g}")
            timer = Timer()
            timer.run_rounds(runners, args.rounds, args.budget_ms)
            print(f"| {name} | {H}/{I}/{E}/{k}/{m} | {tokens} | {timer.median('beside'):.3f} | "
                  f"{timer.median('folded'):.3f} | {timer.paired_ratio('folded', 'beside'):.2f} |", flush=True)


if __name__ == "__main__":
    main()
