"""Inline weights held once: a session on a model whose large initializers are inside the .onnx gets them
from a temporary external data file instead. onnxruntime copies inline initializers into memory of its own,
which a packed kernel cannot release (a second copy beside the packed one); external data it maps from the
file, so the kernels release the pages they have packed (``ConstantExperts``,
custom_ops/src/packing/constant_experts.h)."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import onnx

from .._ir.graph import graphs

#: inline initializers of at least this many bytes are moved to the file (4-bit elements counted as bytes)
INLINE_WEIGHTS_TO_FILE = 1 << 20
_PAGE = 4096  # external data offsets: page aligned, as onnxruntime maps them
_Session = TypeVar("_Session")


def inline_weights_to_map(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The initializers of ``proto`` (subgraphs included) whose raw data, inside the model, is at least
    :data:`INLINE_WEIGHTS_TO_FILE` bytes; none when the model has external data (its locations name files
    beside the model, which a model written elsewhere would not find)."""
    initializers = [t for graph in graphs(proto.graph) for t in graph.initializer]
    constants = [a.t for graph in graphs(proto.graph) for node in graph.node for a in node.attribute
                 if a.HasField("t")]
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in initializers + constants):
        return []
    return [t for t in initializers if t.HasField("raw_data") and t.data_type != onnx.TensorProto.STRING
            and math.prod(t.dims) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
            >= INLINE_WEIGHTS_TO_FILE]


def with_weights_in_file(proto: onnx.ModelProto, create: Callable[[str], _Session]) -> _Session:
    """``create(path)`` of ``proto`` written to a temporary folder with its :func:`inline_weights_to_map` moved
    there, in place, to an external data file at page-aligned offsets, synced to disk (clean pages: onnxruntime
    maps them, and those a packed kernel has read can be reclaimed); the folder is deleted when ``create``
    returns (a mapping keeps the file's data until it is unmapped)."""
    with tempfile.TemporaryDirectory(prefix="moe-onnx-weights-") as folder:
        folder = Path(folder)
        with (folder / "weights.data").open("wb") as data:
            for tensor in inline_weights_to_map(proto):
                data.write(b"\0" * (-data.tell() % _PAGE))
                offset = data.tell()
                data.write(tensor.raw_data)
                tensor.ClearField("raw_data")
                tensor.data_location = onnx.TensorProto.EXTERNAL
                for key, value in (("location", "weights.data"), ("offset", str(offset)),
                                   ("length", str(data.tell() - offset))):
                    tensor.external_data.add(key=key, value=value)
            data.flush()
            os.fsync(data.fileno())
        (folder / "model.onnx").write_bytes(proto.SerializeToString())
        return create(os.fspath(folder / "model.onnx"))
