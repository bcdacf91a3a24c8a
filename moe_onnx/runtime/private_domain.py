"""Copies of a model with some moe_onnx nodes moved to a library's private domain.

* C++ (``moe_onnx.cpp``, custom_ops/src/host/ops_library.cc): quantizing MoeInitRouting nodes, whose expanded_x
  is int8 whatever x is; onnxruntime takes output types from the registration that matches the
  input types, so these nodes need a registration of their own.
* Python host (``moe_onnx.python``): every moe_onnx node, as the variant whose output types ONNX
  shape inference gives it (see :mod:`moe_onnx.runtime.python_host`).
"""

from __future__ import annotations

import os

import onnx

from .._ir.graph import graphs, walk
from ..ops import DOMAIN, OPS
from .python_host import PYTHON_DOMAIN, output_choices, variant_name

CPP_PRIVATE_DOMAIN = "moe_onnx.cpp"  # custom_ops/src/host/ops_library.cc


def structure(model: str | os.PathLike | bytes | onnx.ModelProto) -> onnx.ModelProto:
    """``model`` as a ModelProto: parsed (a path: without its external data), or itself."""
    if isinstance(model, (str, os.PathLike)):
        return onnx.load(os.fspath(model), load_external_data=False)
    if isinstance(model, bytes):
        return onnx.ModelProto.FromString(model)
    return model


def cpp_model(model: str | os.PathLike | bytes | onnx.ModelProto, proto: onnx.ModelProto | None = None):
    """``model`` unchanged when it has no quantizing MoeInitRouting node, else a ModelProto copy
    (with its external data loaded) whose quantizing MoeInitRouting nodes are in ``moe_onnx.cpp``.
    ``proto``: ``structure(model)`` when the caller has it already."""
    proto = structure(model) if proto is None else proto
    if not any(_quantizing_init_routing(node) for node, _ in walk(proto.graph)):
        return model
    if isinstance(model, (str, os.PathLike)):
        onnx.load_external_data_for_model(proto, os.path.dirname(os.path.abspath(os.fspath(model))))
    elif proto is model:
        proto = onnx.ModelProto.FromString(model.SerializeToString())
    for node, _ in walk(proto.graph):
        if _quantizing_init_routing(node):
            node.domain = CPP_PRIVATE_DOMAIN
    _import_domain(proto, CPP_PRIVATE_DOMAIN)
    return proto


def _quantizing_init_routing(node: onnx.NodeProto) -> bool:
    quant = next((a.i for a in node.attribute if a.name == "quant_mode"), -1)
    return node.domain == DOMAIN and node.op_type == "MoeInitRouting" and quant in (0, 1)


def python_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, rewritten in place, with its moe_onnx nodes on the Python host: each becomes the
    variant (domain ``moe_onnx.python``) whose output types shape inference gives it; where
    inference cannot tell (an invalid node), the declared type, else the type of input 0, else float."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # an invalid node: the kernel will say what is wrong
        inferred = model
    types: dict[str, int] = {}
    for graph in graphs(inferred.graph):
        for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                types.setdefault(vi.name, vi.type.tensor_type.elem_type)
        for init in graph.initializer:
            types.setdefault(init.name, init.data_type)

    for node, _ in walk(model.graph):
        if node.domain != DOMAIN or node.op_type not in OPS:
            continue
        op = OPS[node.op_type]
        first = types.get(node.input[0]) if node.input else None
        out_types = []
        for i, options in enumerate(output_choices(op)):
            t = types.get(node.output[i]) if i < len(node.output) and node.output[i] else None
            if t not in options:
                t = first if first in options else options[0]
            out_types.append(t)
        node.op_type = variant_name(op.name, out_types)
        node.domain = PYTHON_DOMAIN
    _import_domain(model, PYTHON_DOMAIN)
    return model


def _import_domain(model: onnx.ModelProto, domain: str) -> None:
    if not any(o.domain == domain for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(domain, 1))
