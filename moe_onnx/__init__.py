"""moe-onnx: fused Mixture-of-Experts ops for ONNX.

Public API: :data:`DOMAIN`, :func:`session`, :func:`custom_ops_library`, :func:`optimize`.
Importing the package registers the op schemas with onnx.
"""

from .ops import DOMAIN, OPSET_VERSION, MoeOpError

__all__ = ["DOMAIN", "OPSET_VERSION", "MoeOpError"]
__version__ = "0.1.0"
