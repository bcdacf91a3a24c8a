"""Fusing the MoE blocks of exported models into moe_onnx ops.

``ort_import`` first turns onnxruntime's com.microsoft::MoE/QMoE nodes into MOE/QMOE. One module per export form
(``tiled``, ``batched_mm``, ``loop``, ``loop_dynamo``, ``parallel_experts``), each a list of ``FUSIONS`` (onnxscript
rewrite rules); passes over the fused graph: ``gating`` turns the routers into MoeGatingTopK, ``shared_expert`` folds
shared experts into their MOE, ``grouped_query`` makes attention read the kv heads without repeat_kv's copy,
``grouped`` turns MOE nodes into the routed chain, ``ort_export`` MOE/QMOE nodes into onnxruntime's
com.microsoft::MoE/QMoE, ``compute`` sets the accuracy_level of our expert nodes, ``portable`` writes the function
bodies, ``quantize`` makes the MOE nodes QMOE (and linears MatMulNBits; the quantize job runs it). Every pass speaks
one protocol (``moe_onnx._ir.passes``: onnx_ir's in-place pass with one result type); ``_driver`` lists them in order
(``optimize_passes``), runs them and adds up their results. What the forms share, each in one place: ``_match`` (the
rule base class and its check idiom, constants, the producer/axes/shape checks), ``_unrolled`` (the block and MOE of
the unrolled loops, ``loop`` and ``loop_dynamo``), ``_router`` (the MOE's routing inputs), ``_activation`` (SwiGLU and
GPT-OSS's clamped SwiGLU), ``_linear`` (Linear layers), ``_ort_contrib`` (the contrib ops' terms in ours, for
``ort_import`` and ``ort_export``); weights behind layout ops and lazy initializers are ``moe_onnx._ir.weights``, the
node builder and the one replace ``moe_onnx._ir.builder``. ``_unfused`` reports every MoE block (found by its router)
that no rule fused or reported. ``targets`` names the forms ``optimize`` makes and the computes it records.

Importing this package is cheap (``moe_onnx.rewrite.targets`` does not import onnxscript): the
names below load the driver when first used.
"""

__all__ = ["OptimizeReport", "optimize", "optimize_ir"]


def __getattr__(name: str):
    if name in __all__:
        from . import _driver

        return getattr(_driver, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
