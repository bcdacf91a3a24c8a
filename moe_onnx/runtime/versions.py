"""The newest IR version and ai.onnx opset the installed onnxruntime loads. It refuses newer ones, which
onnx's helper may write by default (onnx 1.23.2's ``make_model`` writes IR 14 and opset 28; onnxruntime
1.31.1 loads up to IR 13 and opset 26)."""

from __future__ import annotations

import functools

import onnx
import onnxruntime as ort
from onnx import TensorProto, helper


@functools.cache
def onnxruntime_versions() -> tuple[int, int]:
    """(IR version, ai.onnx opset): the newest of each an Identity model may declare and load here."""
    ir_version = next(v for v in range(onnx.IR_VERSION, 3, -1) if _loads(v, 7))
    opset = next(v for v in range(onnx.defs.onnx_opset_version(), 6, -1) if _loads(ir_version, v))
    return ir_version, opset


def _loads(ir_version: int, opset: int) -> bool:
    tensor = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1]) for name in ("x", "y")]
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", tensor[:1], tensor[1:])
    model = helper.make_model(graph, ir_version=ir_version, opset_imports=[helper.make_opsetid("", opset)])
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 -- onnxruntime's errors share no base class
        return False
    return True
