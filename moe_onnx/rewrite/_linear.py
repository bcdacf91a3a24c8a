"""Reading a Linear layer: a MatMul, or a Gemm in either weight layout, by a constant matrix."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from .._ir.nodes import standard
from .._ir.weights import Weight, weight
from ._match import require


@dataclasses.dataclass(frozen=True)
class Linear:
    """``y = x @ W``: a MatMul (W stored [in, out]) or a Gemm without bias, whose transB=1 stores W
    [out, in] (an nn.Linear weight, the dynamo exporter's)."""

    x: ir.Value
    weight: Weight
    in_out: bool  # the stored weight is [in, out]

    @property
    def out_features(self) -> int:
        return self.weight.shape[1] if self.in_out else self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[0] if self.in_out else self.weight.shape[1]

    def out_in(self) -> np.ndarray:
        """W as [out, in] (loads it)."""
        array = self.weight.array()
        return array.T if self.in_out else array


def read_linear(value: ir.Value, what: str) -> Linear:
    """The Linear computing ``value``: a MatMul, or a Gemm with neither transA, alpha nor a bias C, by a
    constant matrix (the match fails naming ``what`` otherwise)."""
    node = value.producer()
    require(standard(node, "Gemm") or standard(node, "MatMul"),
            f"{what} is not computed by Gemm or MatMul (found {'no node' if node is None else node.op_type})")
    in_out = True
    if node.op_type == "Gemm":
        require(node.attributes.get_int("transA", 0) == 0 and node.attributes.get_float("alpha", 1.0) == 1.0
                and (len(node.inputs) < 3 or node.inputs[2] is None),
                f"{what} Gemm is not x @ W (transA, alpha or a bias C)")
        in_out = node.attributes.get_int("transB", 0) == 0
    w = weight(node.inputs[1])
    require(w is not None and len(w.shape) == 2, f"{what} weight is not a constant matrix")
    return Linear(node.inputs[0], w, in_out)
