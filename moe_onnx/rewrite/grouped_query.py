"""Grouped-query attention without the repeated keys and values: a pass over the exported attention.

transformers' eager attention repeats each of the Hkv cached key and value heads for its G = H / Hkv query heads
(``repeat_kv``) before its two MatMuls; exported, that is ``Reshape(Expand(Unsqueeze(kv, 2)), [B, H, L, D])``: a
copy of the whole cache, G times over, at every step (16% of an int4 decode step of the Qwen3-30B-A3B shape,
docs/benchmarks.md). The query heads of one kv head are adjacent (head h reads kv head h // G), so the same
products come from the unrepeated cache with the query's G heads of a kv head taken as G x S rows:

    scores = Reshape(Q [B, H, S, D] -> [B, Hkv, G*S, D]) @ K^T   [B, Hkv, G*S, L] -> [B, H, S, L]
    output = Reshape(P [B, H, S, L] -> [B, Hkv, G*S, L]) @ V     [B, Hkv, G*S, Dv] -> [B, H, S, Dv]

Each Reshape only renames the dims of contiguous data, so nothing is copied, and what lies between the two
MatMuls (scaling, mask, soft-capping, sinks, softmax) is untouched. Standard ONNX ops only: every target and
onnxruntime-genai run the result. A repeat this pass does not recognize (another layout, shapes it cannot read)
stays as exported. The kv heads, groups and head size are checked on the inferred shapes; the Expand's batch and
length dims are taken to be the kv's own, as repeat_kv reads them from the kv's shape (the exporter's symbols
cannot tell them apart statically).
"""

from __future__ import annotations

import onnx_ir as ir

from .._ir.builder import TapeBuilder, int64s, replace
from .._ir.nodes import attribute_value, standard
from .._ir.passes import RewritePass, RewriteResult, rewritten
from ._match import MatchFailure, axes, producer, require, static_shape

RULE = "GroupedQueryMatMul"


def _unrepeated(value: ir.Value) -> tuple[ir.Value, int, int]:
    """(kv [B, Hkv, L, D], Hkv, G) of ``value = Reshape(Expand(Unsqueeze(kv, 2), [B, Hkv, G, L, D]), [B, Hkv*G, L,
    D])``, transformers' repeat_kv; the head counts and head size must be known ints."""
    reshape = producer(value, "Reshape", "the repeated heads")
    expand = producer(reshape.inputs[0], "Expand", "the repeated heads' Reshape input")
    unsqueeze = producer(expand.inputs[0], "Unsqueeze", "the repeated heads' Expand input")
    kv = unsqueeze.inputs[0]
    kv_shape, expanded, repeated = (static_shape(v) for v in (kv, expand.outputs[0], value))
    require(kv_shape is not None and len(kv_shape) == 4 and axes(unsqueeze, 5) == [2],
            "the repeated heads are not Unsqueeze(kv [B, Hkv, L, D], axes=[2])")
    heads, size = kv_shape[1], kv_shape[3]
    require(heads is not None and size is not None, "the kv heads or head size are not known ints")
    require(expanded is not None and len(expanded) == 5 and expanded[1] == heads and expanded[4] == size
            and expanded[2] is not None and expanded[2] > 1,
            f"the Expand does not repeat {heads} kv heads of size {size} on axis 2 (its shape: {expanded})")
    groups = expanded[2]
    require(repeated is not None and len(repeated) == 4 and repeated[1] == heads * groups and repeated[3] == size,
            f"the Reshape does not merge {heads} x {groups} heads (its shape: {repeated})")
    return kv, heads, groups


def _rewrite(matmul: ir.Node, kv: ir.Value, heads: int, transpose: ir.Node | None) -> None:
    """``matmul`` (rows [B, H, S, X] times the repeated kv, behind ``transpose`` for the keys) as rows
    [B, Hkv, G*S, X] times ``kv``, its result back to [B, H, S, Y]."""
    op = TapeBuilder()
    rows = op.Reshape(matmul.inputs[0], int64s(op, [0, heads, -1, 0]))
    other = kv if transpose is None else op.Transpose(kv, perm=list(transpose.attributes.get_ints("perm")))
    product = op.MatMul(rows, other)
    all_heads = static_shape(matmul.inputs[0])[1]
    replace(matmul, op.Reshape(product, int64s(op, [0, all_heads, -1, 0])), op)


def _reading_matmuls(value: ir.Value) -> list[tuple[ir.Node, ir.Node | None]]:
    """The MatMuls reading ``value`` as their second input, directly or through Transpose(perm=[0, 1, 3, 2])
    (the keys); (matmul, the Transpose or None)."""
    found = []
    for node, index in value.uses():
        if standard(node, "MatMul") and index == 1:
            found.append((node, None))
        elif standard(node, "Transpose") and list(attribute_value(node, "perm", [])) == [0, 1, 3, 2]:
            found += [(user, node) for user, at in node.outputs[0].uses() if standard(user, "MatMul") and at == 1]
    return found


def _rows_shape_fits(matmul: ir.Node, heads: int, groups: int) -> bool:
    rows = static_shape(matmul.inputs[0])
    return rows is not None and len(rows) == 4 and rows[1] == heads * groups


class UngroupRepeatedKv(RewritePass):
    """Rewrite every MatMul that reads transformers' repeated kv heads to read the cache itself (see the module's
    doc); the notes: the MatMuls rewritten, and each repeat left as exported with the reason."""

    stage = "attention reading the kv heads unrepeated"

    def call(self, model: ir.Model) -> RewriteResult:
        count, notes = 0, []
        expands = [node for node in ir.traversal.RecursiveGraphIterator(model.graph)
                   if standard(node, "Expand") and standard(node.inputs[0].producer(), "Unsqueeze")]
        for expand in expands:
            for repeated in [user.outputs[0] for user, _ in expand.outputs[0].uses() if standard(user, "Reshape")]:
                readers = _reading_matmuls(repeated)
                if not readers:
                    continue
                try:
                    kv, heads, groups = _unrepeated(repeated)
                except MatchFailure as failure:
                    notes.append(f"{RULE}: the repeated kv heads '{repeated.name}' stay: {failure}")
                    continue
                for matmul, transpose in readers:
                    if _rows_shape_fits(matmul, heads, groups):
                        _rewrite(matmul, kv, heads, transpose)
                        count += 1
                    else:
                        notes.append(f"{RULE}: MatMul '{matmul.name}' keeps the repeated kv heads: its first input's "
                                     f"shape {static_shape(matmul.inputs[0])} is not [B, {heads * groups}, S, X]")
        if count:
            notes.insert(0, f"{RULE}: {count} attention MatMul{'s' if count != 1 else ''} read the kv heads "
                            "unrepeated")
        # the count is a note, not a fused block: the report's blocks are MoE blocks
        return rewritten(model, notes=notes, modified=count > 0)
