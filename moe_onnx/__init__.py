"""moe-onnx: fused Mixture-of-Experts ops for ONNX.

Public API: :data:`DOMAIN`, :func:`session` (an onnxruntime session running the ops on the C++ or
the Python kernels), :func:`custom_ops_library` (path of the C++ library for plain onnxruntime).
Importing the package registers the op schemas with onnx.
"""

from .ops import DOMAIN, OPSET_VERSION, MoeOpError
from .runtime import custom_ops_library, session

__all__ = ["DOMAIN", "OPSET_VERSION", "MoeOpError", "session", "custom_ops_library"]
__version__ = "0.1.0"
