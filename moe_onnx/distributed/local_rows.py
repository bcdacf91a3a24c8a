"""This rank's tokens of a sharded MoE block, with the router run on them only (slice first).

Under expert parallelism rank ``g`` of ``W`` takes the rows ``[T * g // W, T * (g + 1) // W)`` of the block's
flattened tokens (standard ops from the run-time T, so T = 0 and T < W work). A value the block reads that is
computed from the tokens row by row (the router's MatMul or Gemm, its Casts, MoeGatingTopK, a shared expert's
Sigmoid gate, the Reshapes between them) is rebuilt on this rank's rows, so each rank routes only its share;
any other value is sliced. Row by row means: every row of the output depends only on the same row of the
inputs, which are either such values or constants that broadcast along the last axis only.
"""

from __future__ import annotations

import onnx_ir as ir

from .._ir.builder import TapeBuilder, int64s
from .._ir.nodes import constant, skip_reshapes, standard
from ..ops import DOMAIN
from ..ops.layout import Layout

_UNARY = {"Identity", "Cast", "Sigmoid", "Relu", "Tanh", "Exp", "Log", "Neg", "Abs", "Sqrt", "Reciprocal", "Softplus",
          "Erf"}
_BINARY = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"}
_LAST_AXIS = {"Softmax", "LogSoftmax"}
# our ops that compute each token's row from the same row of these inputs (the rest: constants or absent)
_OURS = {"MoeGatingTopK": (0,)}


def last_dim(value: ir.Value) -> int | None:
    """The static last dim of ``value``: from its shape, or the shape a Reshape made it (None: unknown)."""
    if value.shape is not None and len(value.shape) > 0 and isinstance(value.shape[-1], int):
        return value.shape[-1]
    node = value.producer()
    return _last_entry(node.inputs[1]) if standard(node, "Reshape") else None


def _last_entry(shape: ir.Value) -> int | None:
    """The last entry of a Reshape's shape: a constant, or ``Concat(..., Slice(Shape(x), -1))``'s: x's last dim."""
    array = constant(shape)
    if array is not None:
        return int(array[-1]) if array.ndim == 1 and array.size and array[-1] > 0 else None
    source = _last_dim_source(shape)
    return last_dim(source) if source is not None else None


def _last_dim_source(shape: ir.Value) -> ir.Value | None:
    """x when the last entry of the shape ``shape`` is x's last dim: ``[Concat(..., ]Slice(Shape(x), -1)[)]``."""
    node = shape.producer()
    if standard(node, "Concat"):
        node = node.inputs[-1].producer()
    if standard(node, "Slice") and standard(node.inputs[0].producer(), "Shape"):
        starts, source = constant(node.inputs[1]), node.inputs[0].producer()
        if starts is not None and starts.tolist() == [-1] and not source.attributes:
            return source.inputs[0]
    return None


def _keeps_last_dim(reshape: ir.Node) -> bool:
    """Whether the Reshape ``reshape`` keeps its input's last dim (and so the rows of its flattened input)."""
    width = last_dim(reshape.outputs[0])
    return (width is not None and width == last_dim(reshape.inputs[0])) or \
        _last_dim_source(reshape.inputs[1]) is reshape.inputs[0]


def _rank(value: ir.Value) -> int | None:
    """``value``'s rank: from its shape, or through the row-by-row ops that keep their first input's rank."""
    if value.shape is not None:
        return len(value.shape)
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in _UNARY | _LAST_AXIS | {"MatMul", "TopK"}:
        return None
    return _rank(node.inputs[0])


def _per_row_constant(value: ir.Value) -> bool:
    """A constant that broadcasts along the last axis only (every other dim 1)."""
    array = constant(value)
    return array is not None and all(d == 1 for d in array.shape[:-1])


class LocalRows:
    """Rank ``layout.global_rank``'s rows of the tokens ``tokens`` ([T, H]) and of values computed from them.

    The nodes it builds go on ``op``, to be inserted before the block (the caller sorts the graph after)."""

    def __init__(self, op: TapeBuilder, tokens: ir.Value, layout: Layout):
        self._op = op
        count = op.Shape(tokens, start=0, end=1)
        self._start = op.Div(op.Mul(count, int64s(op, [layout.global_rank])), int64s(op, [layout.world_size]))
        self._end = op.Div(op.Mul(count, int64s(op, [layout.global_rank + 1])), int64s(op, [layout.world_size]))
        self._source, self._width = skip_reshapes(tokens), last_dim(tokens)
        self.tokens = self._sliced(tokens)
        self._rows: dict[ir.Value, ir.Value | None] = {}

    def _sliced(self, value: ir.Value) -> ir.Value:
        """``value``'s rows of this rank (``value`` has the tokens on its first axis)."""
        return self._op.Slice(value, self._start, self._end, int64s(self._op, [0]))

    def of(self, value: ir.Value) -> ir.Value:
        """``value`` ([T, c], a row per token) on this rank's rows: rebuilt from them when it is computed from
        the tokens row by row, else sliced."""
        rows = self._rebuilt(value)
        return rows if rows is not None else self._sliced(value)

    def _rebuilt(self, value: ir.Value) -> ir.Value | None:
        """``value``'s flattened rows ``[T_local, c]`` computed from this rank's tokens, or None."""
        if value not in self._rows:
            self._rows[value] = self._rebuild(value)
        return self._rows[value]

    def _rebuild(self, value: ir.Value) -> ir.Value | None:
        """:meth:`_rebuilt` before its memo: the tokens themselves, or a copy of ``value``'s node on rebuilt inputs."""
        width = last_dim(value)
        if width is not None and width == self._width and skip_reshapes(value) is self._source:
            return self.tokens
        node = value.producer()
        if node is None or constant(value) is not None:
            return None
        if standard(node, "Reshape"):
            return self._rebuilt(node.inputs[0]) if _keeps_last_dim(node) else None
        if node.domain in ("", "ai.onnx") and node.op_type in _UNARY | _BINARY | _LAST_AXIS | {"MatMul", "Gemm", "TopK"}:
            inputs = self._standard_inputs(node)
        elif node.domain == DOMAIN and node.op_type in _OURS:
            inputs = self._our_inputs(node)
        else:
            return None
        if inputs is None:
            return None
        attributes = {name: attr.value for name, attr in node.attributes.items()}
        if node.op_type in _LAST_AXIS | {"TopK"}:
            attributes["axis"] = -1  # the rebuilt rows are [T_local, c]
        outputs = self._op.op(node.op_type, *inputs, _domain=node.domain, _outputs=len(node.outputs), **attributes)
        outputs = [outputs] if isinstance(outputs, ir.Value) else list(outputs)
        for old, new in zip(node.outputs, outputs):
            self._rows[old] = new
        return self._rows[value]

    def _standard_inputs(self, node: ir.Node) -> list[ir.Value | None] | None:
        """The inputs of a rebuilt copy of the standard op ``node``; None when it is not row by row."""
        first = self._rebuilt(node.inputs[0])
        if node.op_type in _UNARY:
            return [first] if first is not None and len(node.inputs) == 1 else None
        if node.op_type in _LAST_AXIS | {"TopK"}:
            axis = node.attributes.get_int("axis", -1)
            last = axis == -1 or axis == (_rank(node.inputs[0]) or 0) - 1
            if first is None or not last or any(constant(v) is None for v in node.inputs[1:]):
                return None
            return [first, *node.inputs[1:]]
        if node.op_type == "MatMul":
            weight = constant(node.inputs[1])
            return [first, node.inputs[1]] if first is not None and weight is not None and weight.ndim == 2 else None
        if node.op_type == "Gemm":
            bias = node.inputs[2] if len(node.inputs) > 2 else None
            if first is None or node.attributes.get_int("transA", 0) or constant(node.inputs[1]) is None or \
                    (bias is not None and not _per_row_constant(bias)):
                return None
            return [first, *node.inputs[1:]]
        # binary: each input rebuilt, or a constant along the last axis only; at least one rebuilt
        inputs = [self._rebuilt(v) for v in node.inputs]
        if all(rows is None for rows in inputs):
            return None
        if any(rows is None and not _per_row_constant(v) for rows, v in zip(inputs, node.inputs)):
            return None
        return [rows if rows is not None else v for rows, v in zip(inputs, node.inputs)]

    def _our_inputs(self, node: ir.Node) -> list[ir.Value | None] | None:
        """The inputs of a rebuilt copy of our op ``node`` (its token inputs rebuilt, the rest constants)."""
        inputs = []
        for index, value in enumerate(node.inputs):
            if value is not None and index in _OURS[node.op_type]:
                value = self._rebuilt(value)
                if value is None:
                    return None
            elif value is not None and constant(value) is None:
                return None
            inputs.append(value)
        return inputs
