"""Reading a node: whether it is a given standard op, the value of an attribute."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir


def standard(node: ir.Node | None, op_type: str) -> bool:
    """Whether ``node`` is the standard ONNX op ``op_type``."""
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def attribute_value(node: ir.Node, name: str, default: Any) -> Any:
    """The value of ``node``'s attribute ``name``, or ``default`` when the node does not set it."""
    attr = node.attributes.get(name)
    return default if attr is None else attr.value
