"""How much slower is a portable model without our library?

`moe-onnx optimize --portable` writes each moe_onnx op's function body (standard ONNX ops, from
moe_onnx/ops/<op>.py) into the model. This script times the same portable model three ways, side by
side in interleaved rounds: on our C++ kernels (the library registered: kernels win over functions),
on plain onnxruntime (the function bodies: every expert on every token), and the original unfused
export. Fixtures (models/fixtures) by name, and a GPT-OSS-shaped MOE block (`gpt_oss_block`:
E=32, k=4, H=I=1024; router outside) built here.

  PYTHONPATH=$PWD python benchmarks/bench_portable.py [--models gpt_oss_tiled_small gpt_oss_block]
      [--tokens 1 16 128 512] [--threads 2]

A benchmark, not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_onnx  # noqa: E402
from _timing import BoundRunner, Timer, session_options  # noqa: E402
from moe_onnx.rewrite.portable import portable_model  # noqa: E402

FIXTURES = ROOT / "models" / "fixtures"
GPT_OSS_BLOCK = dict(E=32, k=4, H=1024, I=1024)


def gpt_oss_block(E: int, k: int, H: int, I: int) -> onnx.ModelProto:  # noqa: E741
    """One GPT-OSS MOE node (clamped SwiGLU, biases) with random weights; inputs x, routing, indices."""
    rng = np.random.default_rng(0)
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-2] if len(shape) > 2 else 1)  # noqa: E731
                        ).astype(np.float32)
    inits = {"w0": w(E, H, 2 * I), "b0": w(E, 2 * I) * 0.1, "w1": w(E, I, H), "b1": w(E, H) * 0.1}
    node = helper.make_node("MOE", ["x", "routing", "indices", "w0", "b0", "w1", "b1"], ["y"],
                            domain=moe_onnx.DOMAIN, expert_type="GEMM2_BIAS_SWIGLU_CLAMP", expert_alpha=1.702,
                            expert_beta=7.0)
    graph = helper.make_graph(
        [node], "gpt_oss_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", H]),
         helper.make_tensor_value_info("routing", TensorProto.FLOAT, ["T", k]),
         helper.make_tensor_value_info("indices", TensorProto.INT64, ["T", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", H])],
        [numpy_helper.from_array(v, n) for n, v in inits.items()])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18),
                                                                   helper.make_opsetid(moe_onnx.DOMAIN, 1)])
    return portable_model(model)


def block_inputs(tokens: int, rng: np.random.Generator, E: int, k: int, H: int, I: int) -> list[np.ndarray]:  # noqa: E741
    indices = np.argsort(rng.random((tokens, E)), axis=1)[:, :k].astype(np.int64)
    routing = rng.random((tokens, k)).astype(np.float32)
    return [rng.standard_normal((tokens, H)).astype(np.float32), routing / routing.sum(1, keepdims=True), indices]


def variants(name: str, threads: int) -> tuple[dict[str, ort.InferenceSession], int]:
    """The sessions to compare and the model's hidden size."""
    def plain(model: onnx.ModelProto) -> ort.InferenceSession:
        return ort.InferenceSession(model.SerializeToString(), session_options(threads),
                                    providers=["CPUExecutionProvider"])

    if name == "gpt_oss_block":
        portable = gpt_oss_block(**GPT_OSS_BLOCK)
        sessions = {}
        hidden = GPT_OSS_BLOCK["H"]
    else:
        original = onnx.load(FIXTURES / f"{name}.onnx")
        portable, _ = moe_onnx.optimize(original, portable=True)
        sessions = {"unfused": plain(original)}
        hidden = original.graph.input[0].type.tensor_type.shape.dim[-1].dim_value
    sessions = {"kernels": moe_onnx.session(portable.SerializeToString(), sess_options=session_options(threads)),
                "portable": plain(portable), **sessions}
    return sessions, hidden


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt_oss_tiled_small", "qwen3_moe_batched_mm_small",
                                                    "gpt_oss_block"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-ms", type=float, default=200)
    args = ap.parse_args()
    print(f"threads {args.threads}; times in ms, medians of {args.rounds} interleaved rounds")
    print("| model | T | our kernels | portable, plain onnxruntime | portable / kernels | unfused export |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        sessions, hidden = variants(name, args.threads)
        rng = np.random.default_rng(1)
        for tokens in args.tokens:
            if name == "gpt_oss_block":
                arrays = block_inputs(tokens, rng, **GPT_OSS_BLOCK)
            else:
                arrays = [rng.standard_normal((1, tokens, hidden)).astype(np.float32)]
            runners = {variant: BoundRunner(sess, arrays) for variant, sess in sessions.items()}
            for runner in runners.values():
                runner()
            kernels, portable = runners["kernels"].outputs()[0], runners["portable"].outputs()[0]
            diff = float(np.abs(kernels - portable).max()) if tokens else 0.0
            if diff > 1e-4 * max(1.0, float(np.abs(kernels).max())):
                raise SystemExit(f"{name} T={tokens}: the portable model differs from our kernels by {diff:.3g}")
            timer = Timer()
            timer.run_rounds(runners, args.rounds, args.budget_ms)
            unfused = timer.median("unfused")
            print(f"| {name} | {tokens} | {timer.median('kernels'):.3f} | {timer.median('portable'):.3f} | "
                  f"{timer.paired_ratio('portable', 'kernels'):.1f}x | "
                  f"{'-' if unfused is None else f'{unfused:.3f}'} |", flush=True)


if __name__ == "__main__":
    main()
