"""Shared pieces of the fusion rules: the rule base class and its check idiom, constant lookup and
MOE emission. The router, the activations and the Linear layers have their own modules (``_router``,
``_activation``, ``_linear``); the weights behind layout ops are ``moe_onnx._ir.weights``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchingTracer, MatchResult, RewriteRule, RewriteRuleClassBase
from onnxscript.rewriter._pattern_ir import (  # pinned onnxscript 0.7 (pyproject)
    GraphPattern, StringConstantPattern, _to_graph_pattern)

from .._ir.nodes import constant, standard
from ..ops import IN_OUR_DOMAIN


class MatchFailure(Exception):
    """A check of a fusion failed; the message names the value that did not match and what was expected."""


def require(ok: bool, reason: str) -> None:
    """Fails the match being checked with ``reason`` unless ``ok``."""
    if not ok:
        raise MatchFailure(reason)


@contextlib.contextmanager
def failing_in(where: str) -> Iterator[None]:
    """Prefixes ``where`` (for example which loop branch) to the reason of a MatchFailure raised inside."""
    try:
        yield
    except MatchFailure as failure:
        raise MatchFailure(f"{where}: {failure}") from None


#: each fusion class's traced pattern graph (:meth:`MoeFusion.as_rule`)
_PATTERNS: dict[type, GraphPattern] = {}


class MoeFusion(RewriteRuleClassBase):
    """A fusion rule: an onnxscript ``pattern``, then ``read`` and ``emit``; ``notes`` for the report.

    ``read(context, **bindings)`` reads the matched block into what ``emit`` needs (a small object:
    weights, attributes, the MOE's inputs) or raises :class:`MatchFailure` (``require``), whose
    reason the report shows as a near-miss. ``check`` runs ``read`` and keeps its result;
    onnxscript calls ``rewrite`` right after a successful ``check`` of the same match, and
    ``rewrite`` hands that result to ``emit(op, block)``: each match is read once. ``notes``
    collects remarks about fused blocks (for example experts missing from a loop export).
    """

    #: onnxscript's matcher class for this pattern (None: its default); False keeps the matched nodes for the
    #: rule set to drop once it is done (a chain whose earlier links must not be matched again)
    matcher: type | None = None
    removes_matched_nodes = True

    def __init__(self) -> None:
        super().__init__(name=type(self).__name__, remove_nodes=self.removes_matched_nodes)
        self.notes: list[str] = []
        self.fused = 0  # the blocks this instance has rewritten
        self._block: Any = None

    def as_rule(self, tracer: MatchingTracer | None = None) -> RewriteRule:
        """This fusion as onnxscript's rule, logging every match it tries to ``tracer`` while its rule set
        rewrites. Its pattern graph is traced once per class (``pattern`` reads nothing from the instance)."""
        pattern = _PATTERNS.get(type(self))
        if pattern is None:
            pattern = _PATTERNS[type(self)] = _to_graph_pattern(self.pattern)
        return _TracedRule(pattern, self.rewrite, self.check, matcher=self.matcher, name=self.name,
                           remove_nodes=self.remove_nodes, as_function=self.as_function, tracer=tracer)

    def read(self, context, **bindings) -> Any:
        raise NotImplementedError

    def emit(self, op, block: Any) -> ir.Value:
        raise NotImplementedError

    def check(self, context, **bindings) -> MatchResult:
        try:
            self._block = self.read(context, **bindings)
        except MatchFailure as failure:
            return MatchResult().fail(str(failure))
        return MatchResult()

    def rewrite(self, op, **_) -> ir.Value:
        block, self._block = self._block, None
        self.fused += 1
        return self.emit(op, block)


class _TracedRule(RewriteRule):
    """A rule that logs its matches to its own tracer: given to a rule set, onnxscript's tracer turns rewriting off.

    A node of another op type than the pattern's first output node is not tried: onnxscript's matcher (every
    fusion's matcher is one, or a subclass that only fails more) roots the pattern there and fails such a node at
    its first check, with nothing matched, which is no near-miss. The rule set tries every rule on every node:
    most tries end here, without the matcher's set-up and the tracer's log."""

    def __init__(self, pattern: GraphPattern, *args, tracer: MatchingTracer | None, **kwargs) -> None:
        super().__init__(pattern, *args, **kwargs)
        self._tracer = tracer
        root = pattern.output_nodes[0].op if pattern.output_nodes else None
        self._root_op = root.value() if isinstance(root, StringConstantPattern) else None

    def try_rewrite(self, model, graph_or_function, node, *, verbose=None, tracer=None):
        if self._root_op is not None and node.op_type != self._root_op:
            return None
        return super().try_rewrite(model, graph_or_function, node, verbose=verbose, tracer=tracer or self._tracer)


# ----------------------------------------------------------------------------- nodes and constants
# What several forms' readers check on a node: its op (``_ir.nodes.standard``), its axes, its producer chain.

def producer(value: ir.Value | None, op_type: str, what: str) -> ir.Node:
    """The node computing ``value``, which must be a standard ``op_type`` (else the match fails naming ``what``)."""
    node = None if value is None else value.producer()
    require(standard(node, op_type),
            f"{what} is not computed by {op_type} (found {'no node' if node is None else node.op_type})")
    return node


def ints_input_or_attr(node: ir.Node, index: int, name: str) -> list[int] | None:
    """An int-list operand given as input ``index`` (recent opsets) or attribute ``name`` (older)."""
    if len(node.inputs) > index and node.inputs[index] is not None:
        return constant_ints(node.inputs[index])
    attr = node.attributes.get(name)
    return None if attr is None else list(attr.as_ints())


def axes(node: ir.Node, rank: int) -> list[int] | None:
    """The (non-negative) axes of a Squeeze, Unsqueeze or ReduceSum; ``rank`` normalizes negatives."""
    found = ints_input_or_attr(node, 1, "axes")
    return None if found is None else sorted(a % rank for a in found)


def static_shape(value: ir.Value) -> tuple[int | None, ...] | None:
    """The shape of ``value`` with None for each dim that is not a known int (None when the rank is unknown)."""
    if value.shape is None:
        return None
    return tuple(d if isinstance(d, int) else None for d in value.shape)


def static_last_dim(value: ir.Value) -> int | None:
    """The last dim of ``value`` when it is a known int (None when unknown or a scalar)."""
    shape = static_shape(value)
    return shape[-1] if shape else None


def unsqueezed_last(value: ir.Value, rank: int, what: str) -> ir.Value:
    """x of ``value = Unsqueeze(x, -1)`` with a result of ``rank``."""
    unsqueeze = producer(value, "Unsqueeze", what)
    require(axes(unsqueeze, rank) == [rank - 1], f"{what} is not unsqueezed on its last axis")
    return unsqueeze.inputs[0]


def nonzero_of(value: ir.Value, what: str) -> ir.Value:
    """The input of ``Transpose(NonZero(x), perm=[1, 0])`` (the exporter's torch.where/nonzero)."""
    transpose = producer(value, "Transpose", what)
    require(list(transpose.attributes.get_ints("perm", [])) == [1, 0], f"{what}: Transpose perm is not [1, 0]")
    return producer(transpose.inputs[0], "NonZero", what).inputs[0]


def constant_ints(value: ir.Value | None) -> list[int] | None:
    """The elements of an integer constant, flattened (None when not an integer constant)."""
    array = constant(value)
    return None if array is None or array.dtype.kind not in "iu" else [int(v) for v in array.reshape(-1)]


def constant_scalar(value: ir.Value | None) -> float | None:
    """A constant with exactly one element, as a float."""
    array = constant(value)
    return None if array is None or array.size != 1 else float(array.reshape(-1)[0])


def constant_text(value: ir.Value | None) -> str:
    """A constant for a near-miss message: its value when scalar, else its shape or "(not a constant)"."""
    array = constant(value)
    if array is None:
        return "(not a constant)"
    return f"{array.reshape(-1)[0]}" if array.size == 1 else f"a tensor of shape {list(array.shape)}"


def is_zeros(value: ir.Value) -> bool:
    """A zero constant, ConstantOfShape(0), or an Expand of either."""
    array = constant(value)
    if array is not None:
        return not array.any()
    node = value.producer()
    if node is None:
        return False
    if node.op_type == "ConstantOfShape":
        fill = node.attributes.get_tensor("value")
        return fill is None or not fill.numpy().any()
    return node.op_type == "Expand" and is_zeros(node.inputs[0])


def fill_value(value: ir.Value) -> float | None:
    """The one value a constant, ``ConstantOfShape`` or an ``Expand`` of either holds everywhere (None
    otherwise: not constant, or not one value)."""
    node = value.producer()
    if node is not None and node.op_type == "Expand":
        return fill_value(node.inputs[0])
    if node is not None and node.op_type == "ConstantOfShape":
        fill = node.attributes.get_tensor("value")
        return 0.0 if fill is None else _single(fill.numpy())
    array = constant(value)
    return None if array is None else _single(array)


def _single(array: np.ndarray) -> float | None:
    flat = array.reshape(-1)
    return None if flat.size == 0 or (flat != flat[0]).any() else float(flat[0])


# ----------------------------------------------------------------------------- shape arithmetic

# One element of a small int64 shape tensor: a known int, (value, axis) for a dim known only at run
# time, or None when unknown.
Dim = int | tuple[ir.Value, int] | None
_MAX_RANK = 8  # longest shape tensor that ConstantOfShape may build here
# integer ops on shape elements (ONNX's integer Div truncates toward zero)
_ARITHMETIC = {"Add": lambda x, y: x + y, "Mul": lambda x, y: x * y, "Div": lambda x, y: int(x / y)}


def shape_dims(value: ir.Value | None) -> list[Dim] | None:
    """The elements of a 0-D or 1-D shape tensor, folded through the shape arithmetic exporters emit
    (Shape, Gather, Slice, Concat, Unsqueeze/Squeeze/Reshape, Cast, ConstantOfShape, a one-element OneHot,
    Add/Mul/Div of known ints);
    None if not foldable."""
    if value is None:
        return None
    ints = constant_ints(value)
    if ints is not None:
        return ints
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Shape":
        source = node.inputs[0]
        if source.shape is None:
            return None
        rank = len(source.shape)
        start, end = (min(rank, max(0, i + rank if i < 0 else i))
                      for i in (node.attributes.get_int("start", 0), node.attributes.get_int("end", rank)))
        return [dim if isinstance(dim, int) else (source, axis)
                for axis, dim in enumerate(source.shape) if start <= axis < end]
    if node.op_type in ("Identity", "Cast", "Squeeze", "Unsqueeze", "Reshape"):
        return shape_dims(node.inputs[0])
    if node.op_type == "Concat":
        parts = [shape_dims(part) for part in node.inputs]
        return None if any(part is None for part in parts) else [dim for part in parts for dim in part]
    if node.op_type == "Gather":
        data, index = shape_dims(node.inputs[0]), constant_ints(node.inputs[1])
        if data is None or index is None or node.attributes.get_int("axis", 0) != 0:
            return None
        return [data[i] for i in index] if all(-len(data) <= i < len(data) for i in index) else None
    if node.op_type == "Slice":  # torch's size(-1) through TorchScript: Shape(x)[-1:]
        data, starts, ends = shape_dims(node.inputs[0]), constant_ints(node.inputs[1]), constant_ints(node.inputs[2])
        axes = constant_ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else [0]
        steps = constant_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
        if data is None or starts is None or ends is None or len(starts) != 1 or axes not in ([0], [-1]) \
                or steps != [1]:
            return None
        return data[starts[0]:ends[0]]
    if node.op_type == "OneHot":  # TorchScript's repeat_interleave repeats [1, k, 1]: OneHot([1], 3, [1, k])
        index, depth, values = constant_ints(node.inputs[0]), shape_dims(node.inputs[1]), shape_dims(node.inputs[2])
        if index is None or len(index) != 1 or depth is None or len(depth) != 1 or not isinstance(depth[0], int) \
                or not -depth[0] <= index[0] < depth[0] <= _MAX_RANK or values is None or len(values) != 2:
            return None
        off, on = values
        return [on if axis == index[0] % depth[0] else off for axis in range(depth[0])]
    if node.op_type in _ARITHMETIC:  # GPT-OSS's one-hot depth E + 1, torch.chunk's (2I + 1) // 2
        x, y = (shape_dims(term) for term in node.inputs)
        if x is None or y is None or not all(isinstance(d, int) for d in x + y):
            return None
        x, y = (x * len(y) if len(x) == 1 else x), (y * len(x) if len(y) == 1 else y)
        if len(x) != len(y) or (node.op_type == "Div" and 0 in y):
            return None
        return [_ARITHMETIC[node.op_type](i, j) for i, j in zip(x, y)]
    if node.op_type == "ConstantOfShape":
        length, fill = shape_dims(node.inputs[0]), node.attributes.get_tensor("value")
        if length is None or len(length) != 1 or not isinstance(length[0], int) or length[0] > _MAX_RANK:
            return None
        fill_value = 0 if fill is None else fill.numpy().reshape(-1)[0]
        return [int(fill_value)] * length[0] if float(fill_value).is_integer() else None
    return None


# ----------------------------------------------------------------------------- emission

def emit_moe(op, hidden: ir.Value, routing_weights: ir.Value, indices: ir.Value, *, expert_type: str,
             weight_0: ir.Value, weight_1: ir.Value, bias_0: ir.Value | None = None, bias_1: ir.Value | None = None,
             weight_2: ir.Value | None = None, **attributes) -> ir.Value:
    """One MOE node (inputs as docs/ops/MOE.md; absent optional inputs stay empty)."""
    inputs = [hidden, routing_weights, indices, weight_0, bias_0, weight_1, bias_1, weight_2]
    while inputs[-1] is None:
        inputs.pop()
    return op.MOE(*inputs, **IN_OUR_DOMAIN, expert_type=expert_type, **attributes)
