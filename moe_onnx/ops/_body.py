"""What the ops' function bodies share: the configuration a body is built for, and the graph pieces
several bodies use.

A function body is an op's meaning as standard ONNX ops, so a model with our ops also runs where our
kernels are not registered: plain onnxruntime and ``onnx.reference.ReferenceEvaluator``
(``moe-onnx optimize --portable``, ``moe_onnx/rewrite/portable.py``). Each op registers its body on
its :class:`~moe_onnx.ops.OpDef` (``OpDef.of(..., body=...)``), or the reason standard ops cannot
express it (``no_body=...``).

A body is ``body(op, c, x) -> {formal output name: value}``: ``op`` is the graph builder
(``op.MatMul(a, b)`` -> a value, ``_outputs=n`` -> n values, keyword arguments are node attributes;
onnxscript's tape builder, which ``moe_onnx/_ir/builder.py`` exports), ``c`` the node's
:class:`Config`, ``x`` the given inputs' values by formal name. The ops layer imports no builder:
constants are Constant nodes made with plain attributes (:func:`ints`, :func:`int64`, :func:`scalar`)
or an onnx tensor (:func:`constant`).

The bodies compute densely (every expert on every token, then the chosen ones gathered), in float32
for float16/bfloat16 inputs, as the references do: slower, the same numbers within float rounding.
They check nothing: a node outside its op's contract gives an unspecified result there, where the
kernels and the reference raise (run ``moe-onnx check``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from onnx import TensorProto, numpy_helper

from ._common import OpDef

MIN_OPSET = 18  # the bodies use ReduceMax/ReduceProd with axes inputs, Pad with a constant_value input
INT64_MAX = int(np.iinfo(np.int64).max)  # a Slice end: up to the end of the axis
CANNOT_COMMUNICATE = "standard ONNX ops cannot exchange data between processes (docs/distributed.md)"


@dataclasses.dataclass(frozen=True)
class Config:
    """What a body depends on: the attributes (defaults applied), the inputs given, the outputs."""

    op: str
    attrs: tuple[tuple[str, object], ...]
    inputs: tuple[str, ...]  # the formal names of the inputs given, "" for those not, up to the node's last input
    n_outputs: int
    int8: bool  # input 0 is int8 (MoeRowParallelLinear accumulates in int32)

    @classmethod
    def of(cls, op: OpDef, attributes: Mapping[str, Any], given: Sequence[bool], n_outputs: int,
           int8: bool = False) -> Config:
        """The configuration of a node of ``op`` with ``attributes`` (name -> value, as the node gives
        them), ``given[i]`` telling whether its input i is given, and ``n_outputs`` outputs. Attributes in
        ``op.checked_only`` do not count."""
        attrs = []
        for spec in op.attributes:
            if spec.name in op.checked_only:
                continue
            value = attributes.get(spec.name, spec.default)
            if spec.kind == "float":
                value = float(np.float32(value))  # as the node stores it
            elif spec.kind == "ints" and value is not None:
                value = tuple(int(v) for v in value)
            attrs.append((spec.name, value))
        inputs = tuple(param.name if is_given else "" for param, is_given in zip(op.inputs, given))
        return cls(op.name, tuple(attrs), inputs, n_outputs, int8)

    def attr(self, name: str):
        return dict(self.attrs)[name]

    def has(self, input_name: str) -> bool:
        return input_name in self.inputs

    @property
    def overload(self) -> str:
        """A short, stable name of this configuration."""
        return hashlib.sha1(repr(self).encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------- constants

def ints(op, *values: int):
    """A 1-D int64 constant."""
    return op.Constant(value_ints=[int(v) for v in values])


def int64(op, value: int):
    """A scalar int64 constant."""
    return op.Constant(value_int=int(value))


def scalar(op, value: float):
    """A scalar float32 constant."""
    return op.Constant(value_float=float(value))


def constant(op, value, dtype) -> Any:
    """A constant of any element type and shape (``value`` as numpy makes it of ``dtype``)."""
    return op.Constant(value=numpy_helper.from_array(np.asarray(value, dtype=dtype)))


# ----------------------------------------------------------------------------- shapes and rows

def float32(op, value):
    return op.Cast(value, to=TensorProto.FLOAT)


def to_rows(op, x):
    """``x`` [..., H] as [rows, H] (no -1 in the shape: right also when a size is 0)."""
    shape = op.Concat(op.ReduceProd(op.Shape(x, end=-1), keepdims=1), op.Shape(x, start=-1), axis=0)
    return op.Reshape(x, shape, allowzero=1)


def reshape(op, x, *parts):
    """``x`` reshaped to the concatenation of the 1-D int64 ``parts``."""
    return op.Reshape(x, op.Concat(*parts, axis=0), allowzero=1)


def positions(op, length):
    """0, 1, ..., length - 1 (``length`` a 1-D int64 of one element)."""
    return op.Range(int64(op, 0), op.Squeeze(length), int64(op, 1))


def take_rows(op, data, idx):
    """``data`` [R, E, ...] at ``idx`` [R, k] (int64) per row: [R, k, ...], ``data[r, idx[r, j]]``.
    A Gather over the flattened first two axes: onnx.reference's GatherElements fails past 64
    entries along the axis and its GatherND with batch_dims on empty inputs."""
    count, width = op.Shape(data, end=1), op.Shape(data, start=1, end=2)
    flat = reshape(op, data, op.Mul(count, width), op.Shape(data, start=2))
    row_start = op.Unsqueeze(op.Mul(positions(op, count), op.Squeeze(width)), ints(op, 1))
    return op.Gather(flat, op.Add(idx, row_start), axis=0)


def abs_max(op, values, axis: int):
    """max |values| along ``axis`` (kept, as size 1), 0 over an empty axis (numpy's ``initial=0``).
    ``axis`` >= 0: onnxruntime 1.31 reduces nothing along a negative axis of an empty tensor."""
    return op.Max(op.ReduceMax(op.Abs(values), ints(op, axis), keepdims=1), scalar(op, 0.0))
