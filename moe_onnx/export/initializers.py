"""The exported decoder's weights: each initializer of the traced graph becomes a lazy tensor computed from the
checkpoint when it is read or written, a range of its first axis at a time (no torch here: the ranges come from
``rows`` functions the torch side made)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np
import onnx_ir as ir

from .._ir.weights import SlicedTensor
from .checkpoint import Mxfp4Source


class RowSource(Protocol):
    """What an initializer is computed from: its ``shape``, numpy ``dtype``, ``rows(start, stop)`` of its first
    axis, ``how`` (for messages) and ``mxfp4``: the checkpoint's MXFP4 tensor it is as stored, or None."""

    shape: tuple[int, ...]
    dtype: np.dtype
    how: str
    mxfp4: Mxfp4Source | None

    def rows(self, start: int, stop: int) -> np.ndarray: ...


class CheckpointTensor(SlicedTensor):
    """An initializer computed from the checkpoint a range of rows at a time (:class:`SlicedTensor`)."""

    def __init__(self, source: RowSource, dtype: ir.DataType, name: str):
        super().__init__(dtype, source.shape, name)
        self.source = source

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self.source.rows(start, stop)

    def _whole(self) -> np.ndarray:
        if not self.source.shape:
            return self.source.rows(0, 1)
        return super()._whole()


class Mxfp4CheckpointTensor(CheckpointTensor):
    """An expert weight [E, K, N] stored as MXFP4 in the checkpoint: read as float like any other, and as stored
    (:class:`moe_onnx.ops.qmoe.StoredMxfp4`), so that quantize keeps the checkpoint's bytes."""

    def mxfp4_expert(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        return self.source.mxfp4.mxfp4_expert(e)


def attach(model: ir.Model, prefix: str, parameters: Mapping[str, RowSource], buffers: Mapping[str, np.ndarray],
           on_mismatch: Callable[[str], Exception]) -> None:
    """Give each initializer of ``model`` (named ``prefix`` + a parameter's or buffer's name, without data after a
    trace on the meta device) its value: a lazy tensor over the checkpoint for a parameter, the array for a
    buffer. ``on_mismatch(message)`` makes the error raised for an initializer whose name, type or shape no
    source gives."""
    for name, value in model.graph.initializers.items():
        key = name[len(prefix):] if name.startswith(prefix) else None
        if key in parameters:
            source = parameters[key]
            dtype = ir.DataType.from_numpy(source.dtype)
            tensor_class = Mxfp4CheckpointTensor if source.mxfp4 is not None else CheckpointTensor
            tensor = tensor_class(source, dtype, name)
        elif key in buffers:
            tensor = ir.tensor(buffers[key], name=name)
        else:
            raise on_mismatch(f"initializer {name} of the traced graph is neither a parameter nor a buffer of the "
                              f"model")
        expected = value.const_value
        if expected is not None and (tensor.dtype != expected.dtype or tuple(tensor.shape) != tuple(expected.shape)):
            raise on_mismatch(f"initializer {name} is {expected.dtype.name} {list(expected.shape)} in the traced "
                              f"graph; the checkpoint gives {tensor.dtype.name} {list(tensor.shape)}")
        value.const_value = tensor
