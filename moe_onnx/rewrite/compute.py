"""``compute``: the accuracy the expert GEMMs of an optimized model may use, recorded on its nodes.

``"bf16"`` sets ``accuracy_level`` 3 on every MOE, QMOE and MoeRowParallelLinear node at 0: each GEMM may
round both operands to bfloat16 and accumulate in float32 (docs/ops/MOE.md); the kernels do so where the
CPU has AMX-BF16 or AVX512-BF16. ``"fp32"`` (the default) sets 0 on those at 3: exact float32. The level
is an attribute of each node, so every session runs the model the same way. Two kinds of node keep their
level: a QMOE at 4 (int8 activations, chosen when quantizing: already below bf16's accuracy) and an int8
MoeRowParallelLinear (0: its int32 product is exact, and 3 is an error there).
"""

from __future__ import annotations

import collections

import onnx_ir as ir

from .._ir.nodes import attribute_value
from .._ir.passes import RewritePass, RewriteResult, rewritten
from ..ops import DOMAIN
from ..ops._common import BF16_OPERANDS, EXACT
from ..ops.moe import MOE
from ..ops.qmoe import QMOE
from ..ops.row_parallel_linear import ROW_PARALLEL_LINEAR
from .targets import COMPUTES

#: each ``compute`` value's accuracy_level
LEVELS = dict(zip(COMPUTES, (EXACT, BF16_OPERANDS)))
ATTRIBUTE = "accuracy_level"
_OPS = (MOE.name, QMOE.name, ROW_PARALLEL_LINEAR.name)


def _nodes(model: ir.Model):
    """Our nodes that take an accuracy_level, subgraphs included."""
    return (node for node in ir.traversal.RecursiveGraphIterator(model.graph)
            if node.domain == DOMAIN and node.op_type in _OPS)


def _keeps_its_level(node: ir.Node) -> bool:
    """An int8 MoeRowParallelLinear (exact) or a node at a level other than 0 and 3 (QMOE's int8 activations)."""
    if node.op_type == ROW_PARALLEL_LINEAR.name and node.inputs[0] is not None \
            and node.inputs[0].dtype == ir.DataType.INT8:
        return True
    return attribute_value(node, ATTRIBUTE, EXACT) not in LEVELS.values()


def check_compute(compute: str) -> None:
    """ValueError for a ``compute`` that is not one of :data:`COMPUTES`."""
    if compute not in LEVELS:
        raise ValueError(f"optimize: compute is {compute!r}; expected one of {', '.join(COMPUTES)}")


class ApplyCompute(RewritePass):
    """Give every MOE, QMOE and MoeRowParallelLinear node the accuracy_level of ``compute`` (see the module's
    doc); the notes name the nodes that keep theirs and, for fp32, the nodes reset from bf16. Raises ValueError
    for an unknown ``compute``."""

    def __init__(self, compute: str) -> None:
        check_compute(compute)
        self.compute = compute

    def call(self, model: ir.Model) -> RewriteResult:
        level = LEVELS[self.compute]
        changed: collections.Counter[str] = collections.Counter()
        kept = []
        for node in _nodes(model):
            current = attribute_value(node, ATTRIBUTE, EXACT)
            if current == level:
                continue
            if _keeps_its_level(node):
                kept.append(node)
                continue
            if level == EXACT:
                node.attributes.pop(ATTRIBUTE, None)  # the default
            else:
                node.attributes[ATTRIBUTE] = ir.AttrInt64(ATTRIBUTE, level)
            changed[node.op_type] += 1
        notes = [f"compute {self.compute}: {node.op_type} node '{node.name}' keeps accuracy_level "
                 f"{attribute_value(node, ATTRIBUTE, EXACT)} ("
                 + ("int8 X: its int32 product is exact" if node.op_type == ROW_PARALLEL_LINEAR.name
                    else "int8 activations") + ")"
                 for node in kept if level != EXACT]
        if changed and level == EXACT:
            notes.append("compute fp32: accuracy_level 3 (bf16 operands) reset to 0 on "
                         + ", ".join(f"{count} {op_type}" for op_type, count in sorted(changed.items())))
        # levels are no fused blocks: the result counts none
        return rewritten(model, notes=notes, modified=bool(changed))


def bf16_blocks(model: ir.Model) -> int:
    """The expert blocks of ``model`` that may compute with bfloat16 operands: MOE and QMOE nodes at
    accuracy_level 3, and grouped chains whose down MoeRowParallelLinear (the one MoeFinalizeRouting
    reads) is at 3."""
    count = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain != DOMAIN:
            continue
        if node.op_type in (MOE.name, QMOE.name):
            count += attribute_value(node, ATTRIBUTE, EXACT) == BF16_OPERANDS
        elif node.op_type == "MoeFinalizeRouting" and node.inputs[0] is not None:
            down = node.inputs[0].producer()
            count += (down is not None and down.domain == DOMAIN and down.op_type == ROW_PARALLEL_LINEAR.name
                      and attribute_value(down, ATTRIBUTE, EXACT) == BF16_OPERANDS)
    return count
