"""The models the benchmark builds: a block's export and its optimized forms (cached beside the export),
variants of a fused model (the MOE node alone, com.microsoft::MoE on the same weights, fp16/bf16 casts)
and one-node probes (dense MatMul, GEMV, MoeRowParallelLinear)."""

from __future__ import annotations

import time
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import moe_onnx
from _exports import Shape
from moe_onnx.testing import attributes, initializer, moe_node

#: the low-precision variants: numpy type and ONNX element type
LOW_PRECISION = {"fp16": (np.float16, TensorProto.FLOAT16), "bf16": (ml_dtypes.bfloat16, TensorProto.BFLOAT16)}
_PROBE_OPSET = [helper.make_opsetid("", 21)]


def copy(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def replace_nodes(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> None:
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def only_first_output(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with one graph output (the block's), dead nodes and initializers removed."""
    m = copy(model)
    del m.graph.output[1:]
    needed = {m.graph.output[0].name}
    keep = []
    for node in reversed(m.graph.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    replace_nodes(m, list(reversed(keep)))
    inits = [t for t in m.graph.initializer if t.name in needed]
    del m.graph.initializer[:]
    m.graph.initializer.extend(inits)
    return m


def load_models(shape: Shape, models_dir: Path, need_grouped: bool) -> dict[str, onnx.ModelProto]:
    """The export cut to its block output ("export") and its optimized forms ("moe", "grouped"),
    read from models_dir when cached there after the export was last written."""
    source = shape.source(models_dir)
    export = onnx.load(source)  # optimize() sees every output (router_scores changes what fuses)
    out = {"export": only_first_output(export)}
    for target in ("moe", "grouped") if need_grouped else ("moe",):
        cached = models_dir / f"{shape.stem}.{target}.onnx"
        if cached.exists() and cached.stat().st_mtime >= source.stat().st_mtime:
            out[target] = onnx.load(cached)
        else:
            t0 = time.perf_counter()
            optimized, _ = moe_onnx.optimize(export, target=target)
            print(f"[{shape.name}] optimize(target={target!r}) took {time.perf_counter() - t0:.1f} s, "
                  f"cached in {cached}", flush=True)
            optimized = only_first_output(optimized)
            onnx.save(optimized, cached)
            out[target] = optimized
    return out


def router_logits(model: onnx.ModelProto) -> str:
    """The router's logits: the output of the (only) Gemm/MatMul, whose weight is [E, H] or [H, E]."""
    gemms = [n for n in model.graph.node if n.op_type in ("Gemm", "MatMul")]
    assert len(gemms) == 1, [n.op_type for n in gemms]
    return gemms[0].output[0]


def ort_moe_model(fused: onnx.ModelProto, shape: Shape) -> onnx.ModelProto:
    """The fused model with its MOE node replaced by com.microsoft::MoE on the router's logits."""
    m = copy(fused)
    node = moe_node(m)
    attrs = attributes(node)
    ins = list(node.input) + [""] * (8 - len(node.input))
    if shape.gemm2:
        assert attrs.get("gate_parity", 0) == 0
        fc1 = initializer(m, ins[3]).transpose(0, 2, 1)  # [E, H, 2I] -> [E, 2I, H], gate rows even
        fc2 = initializer(m, ins[5]).transpose(0, 2, 1)  # [E, I, H] -> [E, H, I]
        b1, b2 = initializer(m, ins[4]), initializer(m, ins[6])
        activation = dict(activation_alpha=float(attrs["expert_alpha"]), activation_beta=1.0,
                          swiglu_limit=float(attrs["expert_beta"]))
    else:
        gate, up, down = (initializer(m, ins[i]) for i in (3, 5, 7))  # [E, I, H], [E, I, H], [E, H, I]
        fc1 = np.empty((shape.E, 2 * shape.I, shape.H), np.float32)
        fc1[:, 0::2], fc1[:, 1::2] = gate, up
        fc2, b1, b2 = down, None, None
        activation = dict(activation_alpha=float(attrs.get("expert_alpha", 1.0)), activation_beta=0.0)
    inits = {"ort_fc1": fc1, "ort_fc1_b": b1, "ort_fc2": fc2, "ort_fc2_b": b2}
    new = helper.make_node(
        "MoE", [ins[0], router_logits(m), "ort_fc1", "ort_fc1_b" if b1 is not None else "", "ort_fc2",
                "ort_fc2_b" if b2 is not None else ""], list(node.output), domain="com.microsoft",
        k=shape.k, activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=1, **activation)
    replace_nodes(m, [new if n is node else n for n in m.graph.node])
    m.graph.initializer.extend(numpy_helper.from_array(np.ascontiguousarray(a), n)
                               for n, a in inits.items() if a is not None)
    if not any(o.domain == "com.microsoft" for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return only_first_output(m)


def cast_model(fused: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """The fused model with the MOE node's weights, hidden_states and routing weights in `precision`
    (a key of LOW_PRECISION; Cast nodes around the node, the router stays fp32)."""
    dtype, to = LOW_PRECISION[precision]
    m = copy(fused)
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
        nodes += casts + [n, after] if n is node else [n]
    replace_nodes(m, nodes)
    return m


def with_moe_inputs(fused: onnx.ModelProto) -> onnx.ModelProto:
    """The fused model that also outputs its MOE node's hidden_states, routing weights and indices."""
    m = copy(fused)
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
    return helper.make_model(graph, opset_imports=_PROBE_OPSET, ir_version=10)


def gemv_model(H: int) -> onnx.ModelProto:
    """The bandwidth probe: y = x @ W, x [1, H], W [H, N] a run-time input (read once, never packed)."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "gemv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, H]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [H, "N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "N"])], [])
    return helper.make_model(graph, opset_imports=_PROBE_OPSET, ir_version=10)


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
    return helper.make_model(graph, opset_imports=_PROBE_OPSET + [helper.make_opsetid(moe_onnx.DOMAIN, 1)],
                             ir_version=10)


def save_random_checkpoint(model_type: str, config: dict, folder: Path, **save_options) -> None:
    """A transformers checkpoint of ``model_type`` with ``config`` and random weights (std 0.02, norms 1, attention
    sinks 0, seed 0) saved in ``folder`` (needs torch and transformers; ``save_options`` go to save_pretrained)."""
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(model_type, **config), dtype=torch.float32)
        for name, parameter in model.named_parameters():
            if "norm" in name or "sinks" in name:
                parameter.fill_(1.0 if "norm" in name else 0.0)
            else:
                parameter.normal_(0.0, 0.02)
    model.save_pretrained(folder, **save_options)
