"""Reading a node: whether it is a given standard op, the value of an attribute; reading a value: the
constant it holds, the value before the reshapes that made it."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir


def standard(node: ir.Node | None, op_type: str) -> bool:
    """Whether ``node`` is the standard ONNX op ``op_type``."""
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def attribute_value(node: ir.Node, name: str, default: Any) -> Any:
    """The value of ``node``'s attribute ``name``, or ``default`` when the node does not set it."""
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def constant(value: ir.Value | None) -> np.ndarray | None:
    """The value of an initializer or Constant output, also behind Identity nodes (the TorchScript
    exporter shares equal initializers through them); None when not constant. Loads its data."""
    while value is not None and standard(value.producer(), "Identity"):
        value = value.producer().inputs[0]
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def skip_reshapes(value: ir.Value) -> ir.Value:
    """``value`` before the Reshape, Squeeze and Unsqueeze nodes that made it (the same elements in order)."""
    while any(standard(value.producer(), op) for op in ("Reshape", "Squeeze", "Unsqueeze")):
        value = value.producer().inputs[0]
    return value
