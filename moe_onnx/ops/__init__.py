"""The moe_onnx op set: one module per op, each an :class:`OpDef` (schema, validation, reference).

Importing this package registers every op's ``onnx.defs.OpSchema`` in :data:`DOMAIN`, so the
onnx checker and shape inference validate models that use them.
"""

from __future__ import annotations

import numpy as np
from onnx import defs
from onnx.reference.op_run import OpRun

from ._common import DOMAIN, IN_OUR_DOMAIN, OPSET_VERSION, MoeOpError, OpDef, check_node_attributes
from .distribute_combine import MOE_DISTRIBUTE_COMBINE
from .distribute_dispatch import MOE_DISTRIBUTE_DISPATCH
from .finalize_routing import MOE_FINALIZE_ROUTING
from .gating_topk import MOE_GATING_TOPK
from .init_routing import MOE_INIT_ROUTING
from .moe import MOE
from .qmoe import QMOE
from .row_parallel_linear import ROW_PARALLEL_LINEAR

OPS: dict[str, OpDef] = {op.name: op for op in (MOE, MOE_INIT_ROUTING, ROW_PARALLEL_LINEAR, MOE_FINALIZE_ROUTING,
                                                MOE_GATING_TOPK, QMOE, MOE_DISTRIBUTE_DISPATCH,
                                                MOE_DISTRIBUTE_COMBINE)}


def _register_schemas() -> None:
    for op in OPS.values():
        if not defs.has(op.name, OPSET_VERSION, DOMAIN):
            defs.register_schema(op.schema())


def _evaluator_class(op: OpDef) -> type[OpRun]:
    """An onnx.reference op class that runs ``op.reference`` inside ReferenceEvaluator."""

    def _run(self, *inputs, **attributes):
        check_node_attributes(op, self.onnx_node.name, self.onnx_node.attribute)
        attributes = {k: v for k, v in attributes.items() if v is not None}
        named = [bool(name) for name in self.onnx_node.output]
        outputs = op.reference(*inputs, _node_name=self.onnx_node.name, _named_outputs=named, **attributes)
        # ReferenceEvaluator wants an array at every position, also where the node names no output ("")
        return tuple(out if is_named else np.empty(0) for out, is_named in zip(outputs, named))

    return type(op.name, (OpRun,), {"op_domain": DOMAIN, "_run": _run, "__doc__": op.doc})


REFERENCE_OPS: list[type[OpRun]] = [_evaluator_class(op) for op in OPS.values()]

_register_schemas()

__all__ = ["DOMAIN", "IN_OUR_DOMAIN", "OPSET_VERSION", "OPS", "REFERENCE_OPS", "MoeOpError", "OpDef"]
