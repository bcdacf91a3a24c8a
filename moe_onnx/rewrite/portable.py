"""Portable models: every moe_onnx node's function body written into the model (``--portable``).

``add_function_bodies(model)`` gives each moe_onnx node of a model a model-local function (domain
``moe_onnx``, name the op's) that computes the op's meaning with standard ops only: the body its
``OpDef`` registers (``moe_onnx/ops/<op>.py``, ``moe_onnx/ops/_body.py``), built with the one graph
builder. The model then also runs where our kernels are not registered: plain onnxruntime and
``onnx.reference.ReferenceEvaluator``. Where the C++ library is registered, onnxruntime still runs our
kernels (a kernel wins over a function).

What changes the computation (the attributes, which optional inputs are given, how many outputs the
node has, the element type for MoeRowParallelLinear's int8 path) is fixed when a body is built: one
function per distinct configuration, told apart by the function ``overload`` (IR 10), which the node
names in its own ``overload`` field; the node keeps its op type, so the model still is a moe_onnx model.
onnxruntime 1.31 resolves overloads; onnx 1.23's ReferenceEvaluator keys functions by domain and name
only, so it runs a portable model only while every op has one configuration (``configurations``
says how many; the fixtures have one per op). onnx 1.23's Python ``OpSchema`` takes no function body
(no setter, no constructor argument), so the bodies are written into each model rather than
registered on the schemas.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from .._ir.builder import TapeBuilder
from .._ir.passes import RewritePass, RewriteResult, rewritten
from ..ops import DOMAIN, OPS
from ..ops._body import CANNOT_COMMUNICATE, MIN_OPSET, Config

__all__ = ["AddFunctionBodies", "PortableError", "add_function_bodies", "configurations", "function_for",
           "portable_model", "require_opset", "summary"]


class PortableError(ValueError):
    """A model the function bodies cannot be written into (``moe-onnx optimize --portable``: exit 2)."""


def function_for(config: Config, opset: int) -> ir.Function:
    """The function (domain moe_onnx, the op's name, ``config.overload``) computing ``config``'s op
    with standard ops of ``opset``."""
    op_def = OPS[config.op]
    inputs = [ir.Value(name=param.name) for param in op_def.inputs[: len(config.inputs)]]
    given = {value.name: value for value in inputs if config.has(value.name)}
    op = TapeBuilder()
    values = op_def.body(op, config, given)
    outputs = [op.Identity(values[param.name], _outputs=[param.name]) for param in op_def.outputs[: config.n_outputs]]
    for i, node in enumerate(op.nodes):
        for j, value in enumerate(node.outputs):
            value.name = value.name or f"v{i}_{j}"
        node.name = node.outputs[0].name
    graph = ir.Graph(inputs, outputs, nodes=op.nodes, opset_imports={"": opset},
                     doc_string=f"{op_def.name} as standard ONNX ops ({op_def.body.__module__}), for {config}")
    return ir.Function(DOMAIN, op_def.name, config.overload, graph=graph, attributes=[])


def configurations(model: ir.Model) -> dict[str, int]:
    """How many distinct configurations (functions) each moe_onnx op has in ``model``."""
    counts: dict[str, int] = {}
    for domain, name, _ in model.functions:
        if domain == DOMAIN:
            counts[name] = counts.get(name, 0) + 1
    return counts


def summary(model: ir.Model) -> str:
    """One line for the optimize report: the bodies written, and whether ReferenceEvaluator can run them."""
    counts = configurations(model)
    line = "portable: function bodies " + (", ".join(f"{op} x{n}" for op, n in sorted(counts.items())) or "none")
    mixed = sorted(op for op, n in counts.items() if n > 1)
    if mixed:
        line += (f"; {', '.join(mixed)} with several configurations (overloads): onnxruntime runs this model, "
                 "onnx.reference.ReferenceEvaluator (it ignores overload) cannot")
    return line


def add_function_bodies(model: ir.Model) -> ir.Model:
    """Give every moe_onnx node of ``model`` (in place) its portable function: a model-local function
    per distinct configuration, named by the node's ``overload``. Raises PortableError (a ValueError)
    when the model's default opset is below ``MIN_OPSET``, an int8-capable input's type is unknown, or
    a node needs other processes (an op without a body, a tensor-parallel group of more than one rank)."""
    opset = require_opset(model)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain != DOMAIN or node.op_type not in OPS:
            continue
        _refuse_distributed(node)
        config = _config_of(node)
        key = (DOMAIN, node.op_type, config.overload)
        if key not in model.functions:
            model.functions[key] = function_for(config, opset)
        node.overload = config.overload
    if model.ir_version < 10:  # function overloads are IR 10
        model.ir_version = 10
    return model


def require_opset(model: ir.Model) -> int:
    """The model's default-domain opset; PortableError when the bodies cannot be written in it."""
    opset = model.opset_imports.get("", 0)
    if opset < MIN_OPSET:
        raise PortableError(f"portable function bodies need the default ONNX opset >= {MIN_OPSET}; the model "
                            f"imports {opset or 'none'}")
    return opset


class AddFunctionBodies(RewritePass):
    """:func:`add_function_bodies` as the last pass of ``optimize --portable``; its note is :func:`summary`. The
    element types it reads are those of the optimize path's one shape inference and of the values the passes
    made (a grouped chain's rows have its block's type)."""

    stage = "portable function bodies"

    def call(self, model: ir.Model) -> RewriteResult:
        add_function_bodies(model)
        return rewritten(model, notes=[summary(model)], modified=True)


def portable_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with the portable function bodies (:func:`add_function_bodies`), after
    onnx shape inference (for the element types the bodies depend on)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    return ir.serde.serialize_model(add_function_bodies(ir.serde.deserialize_model(inferred)))


def _config_of(node: ir.Node) -> Config:
    """The configuration of a moe_onnx node."""
    attributes = {name: attr.value for name, attr in node.attributes.items()}
    given = [value is not None for value in node.inputs]
    return Config.of(OPS[node.op_type], attributes, given, len(node.outputs), _int8_input(node))


def _refuse_distributed(node: ir.Node) -> None:
    """PortableError for a node whose meaning needs other processes: no standard op can reach them."""
    reason = OPS[node.op_type].no_body
    tp_size = node.attributes.get("tp_world_size")
    if not reason and tp_size is not None and tp_size.as_int() > 1:
        reason = (f"its attribute 'tp_world_size' is {tp_size.as_int()}: it sums partial results over its "
                  f"tensor-parallel group; {CANNOT_COMMUNICATE}")
    if reason:
        raise PortableError(f"{node.op_type} node '{node.name}' has no portable function body: {reason}")


def _int8_input(node: ir.Node) -> bool:
    if node.op_type != "MoeRowParallelLinear":
        return False
    value = node.inputs[0]
    if value is None or value.dtype is None:
        raise PortableError(f"{node.op_type} node '{node.name}': the element type of input 'X' is unknown; the "
                            "portable body needs it (float or int8): run shape inference first")
    return value.dtype == ir.DataType.INT8
