"""The file-level jobs, one module each: ``optimize`` (:func:`optimize_file`), ``quantize`` (:func:`quantize_file`,
and ``moe_onnx.quantize`` in memory), ``shard`` (:func:`shard_file`) and ``genai`` (an onnxruntime-genai folder as a
job's input and output); ``_files`` holds what they share (the input read once known valid and not overwritten, the
output written). Each reads its input, runs its passes, writes the result and checks it.
"""

from shutil import SameFileError

from ._files import check_report_path
from .optimize import OptimizeResult, optimize_file
from .quantize import QuantizeResult, quantize_file
from .shard import shard_file

__all__ = ["OptimizeResult", "QuantizeResult", "SameFileError", "check_report_path", "optimize_file", "quantize_file",
           "shard_file"]
