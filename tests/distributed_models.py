"""Small MoE models whose routing is an input, for the sharding tests: the test chooses every token's
experts (uneven loads, an EP rank without tokens, drops) instead of a router.

``moe_model`` is one MOE node; ``grouped_model`` the same block as the grouped chain (``optimize``
target grouped); ``drop_pad_model`` a hand-written MoeInitRouting(drop/pad) -> MoeRowParallelLinear ->
SwiGLU -> MoeRowParallelLinear -> MoeFinalizeRouting chain with a residual input.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from moe_onnx import DOMAIN, OPSET_VERSION
from moe_onnx.ops.moe import GEMM2_ACT, GEMM2_BIAS_SWIGLU_CLAMP

OPSETS = [helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, OPSET_VERSION)]


def _graph_inputs(hidden: int, k: int, rank3: bool) -> list[onnx.ValueInfoProto]:
    tokens = ["batch", "seq"] if rank3 else ["tokens"]
    return [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [*tokens, hidden]),
            helper.make_tensor_value_info("routing", TensorProto.FLOAT, [*tokens, k]),
            helper.make_tensor_value_info("indices", TensorProto.INT64, [*tokens, k])]


def moe_model(expert_type: str, experts: int = 4, hidden: int = 8, inter: int = 6, k: int = 2, seed: int = 0,
              rank3: bool = False) -> onnx.ModelProto:
    """One MOE node: ``y = MOE(hidden, routing, indices)``; GEMM2_BIAS_SWIGLU_CLAMP (GPT-OSS, biases,
    clamp 7, gate_parity 1), GEMM2_ACT (Nemotron-H, biases, relu2) or GEMM3_SWIGLU (Mixtral/Qwen)."""
    rng = np.random.default_rng(seed)

    def tensor(name, *shape, scale=0.3):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    if expert_type == GEMM2_BIAS_SWIGLU_CLAMP:
        weights = [tensor("w0", experts, hidden, 2 * inter), tensor("b0", experts, 2 * inter),
                   tensor("w1", experts, inter, hidden), tensor("b1", experts, hidden)]
        names = ["w0", "b0", "w1", "b1"]
        attrs = dict(expert_type=expert_type, expert_alpha=1.702, expert_beta=7.0, gate_parity=1)
    elif expert_type == GEMM2_ACT:
        weights = [tensor("w0", experts, inter, hidden), tensor("b0", experts, inter),
                   tensor("w1", experts, hidden, inter), tensor("b1", experts, hidden)]
        names = ["w0", "b0", "w1", "b1"]
        attrs = dict(expert_type=expert_type, activation="relu2")
    else:
        weights = [tensor("w0", experts, inter, hidden), tensor("w1", experts, inter, hidden),
                   tensor("w2", experts, hidden, inter)]
        names = ["w0", "", "w1", "", "w2"]
        attrs = dict(expert_type=expert_type)
    node = helper.make_node("MOE", ["hidden", "routing", "indices", *names], ["y"], name="moe", domain=DOMAIN,
                            **attrs)
    tokens = ["batch", "seq"] if rank3 else ["tokens"]
    graph = helper.make_graph([node], "moe", _graph_inputs(hidden, k, rank3),
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*tokens, hidden])], weights)
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=10)


def grouped_model(expert_type: str, **kwargs) -> onnx.ModelProto:
    """:func:`moe_model` as the grouped chain."""
    from moe_onnx.rewrite import optimize

    model, _ = optimize(moe_model(expert_type, **kwargs), "grouped")
    return model


def drop_pad_model(capacity: int, experts: int = 4, hidden: int = 8, inter: int = 6, k: int = 2,
                   seed: int = 0) -> onnx.ModelProto:
    """MoeInitRouting(drop/pad, capacity) -> gate and up MoeRowParallelLinear -> silu(gate) * up -> down
    MoeRowParallelLinear (with bias) -> MoeFinalizeRouting(drop/pad) with the residual ``hidden`` as x1;
    inputs hidden [T, H], routing [T, k], indices [T, k]."""
    rng = np.random.default_rng(seed)

    def tensor(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    initializers = [tensor("gate", experts, inter, hidden), tensor("up", experts, inter, hidden),
                    tensor("down", experts, hidden, inter), tensor("down_bias", experts, hidden),
                    numpy_helper.from_array(np.arange(experts + 1, dtype=np.int64) * capacity, "offsets")]

    def ours(op, inputs, outputs, **attrs):
        return helper.make_node(op, inputs, outputs, name=outputs[0], domain=DOMAIN, **attrs)

    nodes = [
        ours("MoeInitRouting", ["hidden", "indices"], ["rows", "row_idx", ""], expert_num=experts,
             drop_pad_mode=1, expert_capacity=capacity),
        ours("MoeRowParallelLinear", ["rows", "offsets", "gate"], ["g"]),
        ours("MoeRowParallelLinear", ["rows", "offsets", "up"], ["u"]),
        helper.make_node("Sigmoid", ["g"], ["sig"]),
        helper.make_node("Mul", ["g", "sig"], ["silu"]),
        helper.make_node("Mul", ["silu", "u"], ["act"]),
        ours("MoeRowParallelLinear", ["act", "offsets", "down", "down_bias"], ["d"]),
        ours("MoeFinalizeRouting", ["d", "row_idx", "hidden", "", "", "routing"], ["y"], drop_pad_mode=1),
    ]
    graph = helper.make_graph(nodes, "drop_pad", _graph_inputs(hidden, k, False),
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["tokens", hidden])],
                              initializers)
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=10)


def routing_feeds(tokens: int, experts: int = 4, hidden: int = 8, k: int = 2, seed: int = 0,
                  only: tuple[int, ...] | None = None, rank3: bool = False) -> dict[str, np.ndarray]:
    """Random inputs for the models above: ``tokens`` rows, each with k distinct experts drawn from
    ``only`` (default: all), and routing weights; ``rank3`` gives [1, tokens, ...]."""
    rng = np.random.default_rng(seed)
    pool = np.array(only if only is not None else range(experts))
    indices = np.array([rng.choice(pool, size=k, replace=False) for _ in range(tokens)]).reshape(tokens, k)
    feeds = {"hidden": rng.standard_normal((tokens, hidden)).astype(np.float32),
             "routing": rng.random((tokens, k)).astype(np.float32),
             "indices": indices.astype(np.int64)}
    return {name: value[None] for name, value in feeds.items()} if rank3 else feeds


def with_bfloat16_blocks(model: onnx.ModelProto) -> onnx.ModelProto:
    """A fused ``model`` whose MOE blocks compute in bfloat16: their hidden states and routing weights cast to
    bfloat16, their weights stored so, their outputs cast back (onnxruntime's CPU provider runs few other ops in
    bfloat16, a rotary embedding's Sin not among them)."""
    blocks = onnx.ModelProto()
    blocks.CopyFrom(model)
    graph = blocks.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    nodes = []
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type != "MOE":
            nodes.append(node)
            continue
        for index in (0, 1):
            cast = f"{node.input[index]}_{node.name}_bf16"
            nodes.append(helper.make_node("Cast", [node.input[index]], [cast], to=TensorProto.BFLOAT16))
            node.input[index] = cast
        for name in node.input[3:]:
            if name in initializers:
                bits = numpy_helper.to_array(initializers[name]).astype(ml_dtypes.bfloat16).view(np.uint16)
                initializers[name].CopyFrom(helper.make_tensor(name, TensorProto.BFLOAT16, bits.shape, bits.tobytes(),
                                                               raw=True))
        output = node.output[0]
        node.output[0] = f"{output}_bf16"
        nodes += [node, helper.make_node("Cast", [node.output[0]], [output], to=TensorProto.FLOAT)]
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]
    return blocks
