"""moe-onnx: fused Mixture-of-Experts ops for ONNX.

Public API:

* :data:`DOMAIN`: the ops' domain; importing the package registers their onnx schemas.
* :func:`session`: an onnxruntime session running the ops on the C++ or the Python kernels.
* :func:`custom_ops_library`: path of the C++ library, for plain onnxruntime.
* :func:`optimize`: fuse the MoE blocks of an exported model into these ops; :data:`TARGETS` lists
  the forms it can make.
"""

from .ops import DOMAIN, OPSET_VERSION, MoeOpError
from .runtime import custom_ops_library, session

__all__ = ["DOMAIN", "OPSET_VERSION", "TARGETS", "MoeOpError", "custom_ops_library", "optimize", "session"]
__version__ = "0.1.0"

#: the ``target`` values of :func:`optimize` (defined here, not in ``rewrite``, so that reading them,
#: e.g. for the CLI's choices, does not import onnxscript)
TARGETS = ("moe", "grouped")


def optimize(model, target: str = "moe", *, fuse_routers: bool = True, portable: bool = False):
    """Fuse the MoE blocks of an exported model; returns ``(optimized_model, report)``.

    ``model`` is a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model`` (a path or ModelProto gives a
    ModelProto back). ``target="moe"`` makes one MOE node per block, ``"grouped"`` the chain
    MoeInitRouting -> MoeRowParallelLinear -> activation -> MoeRowParallelLinear -> MoeFinalizeRouting.
    ``fuse_routers`` (default) also makes each fused block's router one MoeGatingTopK node where its
    chain is a known one (softmax -> top-k, top-k -> softmax, DeepSeek-V3's group-limited sigmoid
    router); the report notes the routers left as exported, with the reason. ``fuse_routers=False``
    keeps every router as exported. ``portable=True`` also writes each moe_onnx node's function body
    (standard ONNX ops, :mod:`moe_onnx.portable`) into the model as a model-local function, so it runs
    on plain onnxruntime and onnx.reference.ReferenceEvaluator too (slower, the same numbers); where our
    library is registered onnxruntime still runs our kernels. The report
    (:class:`moe_onnx.rewrite.OptimizeReport`) lists fused blocks per rule, near-misses with the check
    that failed, notes, and nodes and parameters before and after. Raises ValueError for an unknown
    target.
    """
    from .rewrite import optimize as _optimize  # onnxscript is imported only when needed

    return _optimize(model, target, fuse_routers=fuse_routers, portable=portable)
