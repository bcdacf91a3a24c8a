"""Shared pieces of the fusion rules: the rule base class, failing a check, constant lookup, weights and
MOE emission.

Weights are never copied while matching. A rule that needs a weight in another layout (transposed,
split, stacked) asks for a *lazy* initializer: the transform runs when the model is saved, one
tensor at a time, so models with external data are rewritten without loading every weight at once.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRule, RewriteRuleClassBase
from onnxscript.rewriter._basics import MatchFailureError

from ..ops import DOMAIN, OPSET_VERSION


class MoeFusion(RewriteRuleClassBase):
    """A fusion rule: ``pattern``/``check``/``rewrite`` as in onnxscript, plus notes for the report.

    ``check`` should fail with a reason naming the constant that did not match, so a near-miss is
    reported with it: return ``self.fail("...")``, or call ``require(ok, "...")`` from helpers
    (onnxscript turns the MatchFailureError it raises into the same failed match). ``notes``
    collects remarks about fused blocks (for example experts missing from a loop export).
    """

    def __init__(self) -> None:
        super().__init__(name=type(self).__name__)
        self.notes: list[str] = []

    def as_rule(self) -> RewriteRule:
        return RewriteRule(self.pattern, self.rewrite, self.check, name=self.name,
                           remove_nodes=self.remove_nodes, as_function=self.as_function)

    @staticmethod
    def fail(reason: str) -> MatchResult:
        return MatchResult().fail(reason)


def require(ok: bool, reason: str) -> None:
    """Fails the match being checked with ``reason`` unless ``ok``."""
    if not ok:
        raise MatchFailureError(reason)


# ----------------------------------------------------------------------------- constants

def constant(value: ir.Value | None) -> np.ndarray | None:
    """The value of an initializer or Constant output (None when not constant). Loads its data."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def constant_ints(value: ir.Value | None) -> list[int] | None:
    """The elements of an integer constant, flattened (None when not an integer constant)."""
    array = constant(value)
    return None if array is None or array.dtype.kind not in "iu" else [int(v) for v in array.reshape(-1)]


def constant_scalar(value: ir.Value | None) -> float | None:
    """A constant with exactly one element, as a float."""
    array = constant(value)
    return None if array is None or array.size != 1 else float(array.reshape(-1)[0])


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


def int64s(op, values: Sequence[int]) -> ir.Value:
    """A Constant node's 1-D int64 tensor (shapes, axes, Slice operands of emitted nodes)."""
    return op.Constant(value=ir.tensor(np.array(values, np.int64)))


def same_scalar(a: float | None, b: float, rel: float = 1e-6) -> bool:
    """Whether ``a`` is ``b`` within ``rel`` (relative, absolute below 1); False when ``a`` is None."""
    return a is not None and abs(a - b) <= rel * max(1.0, abs(b))


# ----------------------------------------------------------------------------- weights

@dataclasses.dataclass(frozen=True)
class Weight:
    """A constant tensor reached through layout-only ops (Transpose, Unsqueeze, Squeeze, Reshape, Cast,
    Identity) from one initializer; ``source`` is that initializer and ``steps`` rebuild the value."""

    source: ir.Value
    steps: tuple[Callable[[np.ndarray], np.ndarray], ...]
    shape: tuple[int, ...]
    dtype: ir.DataType

    def array(self) -> np.ndarray:
        """The value (loads the source tensor)."""
        array = self.source.const_value.numpy()
        for step in self.steps:
            array = step(array)
        return array


def _layout_step(node: ir.Node) -> Callable[[np.ndarray], np.ndarray] | None:
    op = node.op_type
    if node.domain not in ("", "ai.onnx"):
        return None
    if op == "Identity":
        return lambda a: a
    if op == "Transpose":
        perm = node.attributes.get("perm")
        return (lambda a: a.T) if perm is None else (lambda a, p=tuple(perm.as_ints()): a.transpose(p))
    if op == "Cast":
        target = ir.DataType(node.attributes["to"].as_int())
        return lambda a, t=target.numpy(): a.astype(t)
    if op in ("Unsqueeze", "Squeeze", "Reshape"):
        shape = node.outputs[0].shape
        if shape is None or not shape.is_static():
            return None
        return lambda a, s=tuple(int(d) for d in shape): a.reshape(s)
    return None


def weight(value: ir.Value | None) -> Weight | None:
    """Follow layout-only ops back to one initializer; None when the value is not such a constant.

    The shape comes from the value's static shape (shape inference must have run), so nothing is loaded.
    """
    steps = []
    current = value
    while current is not None and current.const_value is None:
        node = current.producer()
        step = None if node is None else _layout_step(node)
        if step is None:
            return None
        steps.append(step)
        current = node.inputs[0]
    if current is None or value.shape is None or not value.shape.is_static():
        return None
    dtype = value.dtype if value.dtype is not None else current.const_value.dtype
    return Weight(current, tuple(reversed(steps)), tuple(int(d) for d in value.shape), dtype)


_names = itertools.count()


class _StreamedTensor(ir.LazyTensor):
    """A lazy tensor computed and written one slice of its first axis (one expert) at a time.

    After each slice the memory-mapped source tensors are released, so saving a transformed
    multi-GB weight holds about one expert's worth of data at a time.
    """

    def __init__(self, expert_slice: Callable[[int], np.ndarray], dtype: ir.DataType, shape: Sequence[int],
                 name: str, sources: Sequence[ir.Value]):
        super().__init__(lambda: ir.tensor(self._whole(), dtype=dtype, name=name), dtype=dtype,
                         shape=ir.Shape(shape), name=name)
        self._expert_slice, self._sources = expert_slice, tuple(sources)

    def _slice(self, index: int) -> np.ndarray:
        part = np.ascontiguousarray(self._expert_slice(index), dtype=self.dtype.numpy())
        expected = tuple(self.shape.numpy())[1:]
        if part.shape != expected:
            raise ValueError(f"moe_onnx rewrite: {self.name}[{index}] has shape {part.shape}, expected {expected}")
        return part

    def _release_sources(self) -> None:
        for value in self._sources:
            if isinstance(value.const_value, ir.ExternalTensor):
                value.const_value.release()

    def _whole(self) -> np.ndarray:
        whole = np.stack([self._slice(i) for i in range(self.shape[0])]) if self.shape[0] else \
            np.zeros(tuple(self.shape.numpy()), dtype=self.dtype.numpy())
        self._release_sources()
        return whole

    def tofile(self, file) -> None:
        for index in range(self.shape[0]):
            file.write(self._slice(index).tobytes())
            self._release_sources()


def lazy_initializer(op, name: str, expert_slice: Callable[[int], np.ndarray], dtype: ir.DataType,
                     shape: Sequence[int], sources: Sequence[ir.Value] = ()) -> ir.Value:
    """A new initializer computed when the model is saved (or read): ``expert_slice(e)`` gives its
    slice ``e`` along the first axis; ``sources`` are the initializers those slices read."""
    unique = f"{name}__moe{next(_names)}"
    return op.initializer(_StreamedTensor(expert_slice, dtype, shape, unique, sources), name=unique)


def weight_value(op, w: Weight, name: str, transform: Callable[[np.ndarray], np.ndarray] | None = None,
                 shape: Sequence[int] | None = None) -> ir.Value:
    """An initializer holding ``transform(w)``: the source itself when nothing changes, else a lazy one.

    ``transform`` must keep the first axis (the experts) and should return a view (a transpose or
    slice): each expert's slice is then taken from it without copying the whole weight.
    """
    if transform is None and not w.steps:
        return w.source
    fn = transform or (lambda a: a)
    return lazy_initializer(op, name, lambda e: fn(w.array())[e], w.dtype, w.shape if shape is None else shape,
                            sources=[w.source])


# ----------------------------------------------------------------------------- emission

def emit_moe(op, hidden: ir.Value, routing_weights: ir.Value, indices: ir.Value, *, expert_type: str,
             weight_0: ir.Value, weight_1: ir.Value, bias_0: ir.Value | None = None, bias_1: ir.Value | None = None,
             weight_2: ir.Value | None = None, **attributes) -> ir.Value:
    """One MOE node (inputs as docs/ops/MOE.md; absent optional inputs stay empty)."""
    inputs = [hidden, routing_weights, indices, weight_0, bias_0, weight_1, bias_1, weight_2]
    while inputs[-1] is None:
        inputs.pop()
    return op.MOE(*inputs, _domain=DOMAIN, _version=OPSET_VERSION, expert_type=expert_type, **attributes)
