"""Helpers shared by the tests and the benchmarks: reading a fused model and making its inputs.

Not used by the package itself.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .ops import DOMAIN


def moe_node(model: onnx.ModelProto) -> onnx.NodeProto:
    """The one MOE node (of the moe_onnx domain); ValueError when there is none or several."""
    (node,) = [n for n in model.graph.node if n.op_type == "MOE" and n.domain == DOMAIN]
    return node


def attributes(node: onnx.NodeProto) -> dict:
    """The node's attributes as set on it (strings stay bytes; no defaults)."""
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    """The value of the one initializer called ``name``."""
    (tensor,) = [t for t in model.graph.initializer if t.name == name]
    return numpy_helper.to_array(tensor)


def random_hidden_states(hidden_size: int, batch: int, seq: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """Standard normal (times ``scale``) float32 hidden states [batch, seq, hidden_size]; the same
    values for the same arguments (the generator is seeded with ``seed + 100 * batch + seq``)."""
    rng = np.random.default_rng(seed + 100 * batch + seq)
    return (rng.standard_normal((batch, seq, hidden_size)) * scale).astype(np.float32)
