"""Peak memory of `moe-onnx optimize --verify`, `moe-onnx quantize` and `moe-onnx check` on a model of
several GB (not a test).

Builds (once, without torch) a model as onnxruntime-genai's builder writes MoE layers: LAYERS x (router
MatMul -> com.microsoft::MoE, SwiGLU with fc1 [E, 2I, H] interleaved, fc2 [E, H, I], fp32), its weights
written one expert at a time into external data. Then, each in a child process whose peak resident memory
(ru_maxrss) it prints with the wall time:

- `moe-onnx optimize SOURCE -o FUSED --verify`: the import to MOE, then the original (onnxruntime's MoE) and
  the fused model (our C++ kernels) on the default sizes;
- `moe-onnx quantize FUSED -o QUANTIZED --bits 4 --block-size 32`, which measures the error of the int4 model
  against FUSED;
- `moe-onnx check FUSED`.

usage: python benchmarks/tools_memory.py [--models-dir /tmp/moe-tools] [--experts 32] [--hidden 2048]
                                         [--inter 768] [--layers 2]

The defaults make 1.2 GB of weights; --experts 128 makes the 4.8 GB Qwen3-30B-A3B-shaped model of issue 23
(run it alone: the tools then hold several GB).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from _memory import run_child

#: the offset of each tensor in the data file is a multiple of this (onnxruntime maps aligned data)
ALIGNMENT = 4096


def _external(name: str, shape: tuple[int, ...], location: str, offset: int, length: int) -> onnx.TensorProto:
    proto = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape)
    proto.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        proto.external_data.add(key=key, value=value)
    return proto


def build_model(path: Path, experts: int, hidden: int, inter: int, layers: int, k: int = 8, seed: int = 0) -> int:
    """Write the model to ``path`` (its data to ``path.data``); returns its weight bytes."""
    rng = np.random.default_rng(seed)
    data_name = path.name + ".data"
    initializers, nodes = [], []
    offset = 0
    with open(path.parent / data_name, "wb") as data:

        def write(name: str, shape: tuple[int, ...]) -> None:
            nonlocal offset
            padding = -offset % ALIGNMENT
            data.write(b"\0" * padding)
            offset += padding
            start = offset
            for _ in range(shape[0]):  # one expert at a time
                block = (rng.standard_normal(shape[1:], dtype=np.float32) * 0.02).tobytes()
                data.write(block)
                offset += len(block)
            initializers.append(_external(name, shape, data_name, start, offset - start))

        tokens, value_info = "hidden_states", []
        for layer in range(layers):  # tokens + MoE(tokens), the MoE's output typed for the next layer's import
            router, fc1, fc2 = f"layer{layer}.router", f"layer{layer}.fc1", f"layer{layer}.fc2"
            write(router, (hidden, experts))
            write(fc1, (experts, 2 * inter, hidden))
            write(fc2, (experts, hidden, inter))
            moe, out = f"layer{layer}.moe", "output" if layer == layers - 1 else f"layer{layer}.output"
            nodes += [helper.make_node("MatMul", [tokens, router], [f"{router}.logits"]),
                      helper.make_node("MoE", [tokens, f"{router}.logits", fc1, "", fc2], [moe], f"layer{layer}/moe",
                                       domain="com.microsoft", k=k, activation_type="swiglu", swiglu_fusion=1,
                                       activation_alpha=1.0, activation_beta=0.0, normalize_routing_weights=1),
                      helper.make_node("Add", [tokens, moe], [out])]
            value_info += [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["T", hidden])
                           for name in (moe, out) if name != "output"]
            tokens = out
    graph = helper.make_graph(nodes, "genai_moe_layers",
                              [helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, ["T", hidden])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["T", hidden])], initializers,
                              value_info=value_info)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18),
                                                                   helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, path)
    return offset


def run_tool(arguments: list[str]) -> tuple[float, float, int]:
    """`moe-onnx ARGUMENTS` in a child, its output shown: (peak RSS in MiB, wall seconds, exit status)."""
    return run_child([sys.executable, "-m", "moe_onnx.cli", *arguments])[:3]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/moe-tools"))
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    args.models_dir.mkdir(parents=True, exist_ok=True)
    stem = f"genai_moe_E{args.experts}_H{args.hidden}_I{args.inter}_L{args.layers}"
    source = args.models_dir / f"{stem}.onnx"
    fused, quantized = args.models_dir / f"{stem}.moe.onnx", args.models_dir / f"{stem}.int4.onnx"
    weight_bytes = build_model(source, args.experts, args.hidden, args.inter, args.layers)
    print(f"model: {source} ({weight_bytes / 2**30:.2f} GiB of fp32 weights, external data)")
    print("| command | peak RSS | peak / weights | wall time | exit |")
    print("|---|---|---|---|---|")
    for name, arguments in (("optimize --verify", ["optimize", str(source), "-o", str(fused), "--verify"]),
                            ("quantize --bits 4 --block-size 32",
                             ["quantize", str(fused), "-o", str(quantized), "--bits", "4", "--block-size", "32"]),
                            ("check", ["check", str(fused)])):
        peak, seconds, status = run_tool(arguments)
        print(f"| {name} | {peak:.0f} MiB | {peak * 2**20 / weight_bytes:.2f}x | {seconds:.1f} s | {status} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
