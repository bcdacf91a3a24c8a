"""Expert weights: finding them behind layout ops, and emitting them in another layout lazily.

Weights are never copied while matching. A rule that needs a weight in another layout (transposed,
split, stacked) asks for a *lazy* initializer: the transform runs when the model is saved, one
expert (one slice of the first axis) at a time, so models with external data are rewritten without
loading every weight at once. Each expert's slice is read from the source through the layout ops
with the expert index applied first wherever the op allows it (Cast, Transpose, a Reshape that
keeps the expert axis), so a step is applied to one expert's data, not to the whole source.

Reading a source tensor's data is cheap for external data (a memory map) and for a tensor made from
a numpy array, but a tensor deserialized from a proto converts (copies) all of its bytes on every
read; while a lazy initializer is written, each source is therefore converted at most once
(:func:`_source_array`), so an in-memory model is rewritten in about its own size of memory.

A source may itself be lazy: a :class:`SlicedTensor` (an exported checkpoint's tensor, a rewritten weight)
computes any range of its first axis alone, so a weight behind layout ops is read a range at a time from it
(:meth:`Weight.expert`, :meth:`Weight.rows`) and never whole.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import onnx_ir as ir


@dataclasses.dataclass(frozen=True)
class _Layout:
    """One layout-only op on the way from the source initializer to a weight.

    ``kind`` is "identity", "cast" (``to``), "transpose" (``perm``), "reshape" (Reshape, Squeeze and
    Unsqueeze, to ``shape``) or "select" (a Gather of one constant ``index`` on axis 0: one expert of a
    stacked tensor, as the dynamo exporter leaves ``weight[e]`` above its folding size limit);
    ``input_shape`` is the op's static input shape (None if unknown).
    """

    kind: str
    input_shape: tuple[int, ...] | None
    perm: tuple[int, ...] | None = None
    to: np.dtype | None = None
    shape: tuple[int, ...] | None = None
    index: int | None = None

    def whole(self, a: np.ndarray) -> np.ndarray:
        if self.kind == "cast":
            return a.astype(self.to)
        if self.kind == "transpose":
            return a.transpose(self.perm or tuple(reversed(range(a.ndim))))
        if self.kind == "reshape":
            return a.reshape(self.shape)
        if self.kind == "select":
            return a[self.index]
        return a

    def indexed(self, axis: int) -> tuple[int, Callable[[np.ndarray], np.ndarray]] | None:
        """How to take index ``e`` on ``axis`` of this op's output from its input indexed first:
        ``(input axis, finish)`` with ``output[e on axis] = finish(input[e on input axis])``; None when
        this op must see its whole input (a Reshape that moves the expert axis, a Transpose of unknown
        rank)."""
        if self.kind == "identity":
            return axis, lambda a: a
        if self.kind == "cast":
            return axis, lambda a: a.astype(self.to)
        if self.kind == "select":  # output[.., e on axis] = input[index, .., e on axis + 1]
            return axis + 1, lambda a: a[self.index]
        if self.kind == "transpose":
            if self.perm is None and self.input_shape is None:
                return None
            perm = self.perm or tuple(reversed(range(len(self.input_shape))))
            source = perm[axis]
            rest = [p - (p > source) for j, p in enumerate(perm) if j != axis]
            return source, lambda a: a.transpose(rest)
        if axis == 0 and self.input_shape is not None and self.input_shape[:1] == self.shape[:1]:
            return 0, lambda a: a.reshape(self.shape[1:])  # row-major: each leading block stays whole
        return None

    def ranged(self, axis: int) -> tuple[int, Callable[[np.ndarray, slice], np.ndarray]] | None:
        """Like :meth:`indexed` for a range of ``axis`` (kept): ``(input axis, finish)`` with ``output[range on
        axis] = finish(input[range on input axis], range)``; None when this op must see its whole input."""
        if self.kind in ("identity", "cast", "select"):
            plan = self.indexed(axis)
            return plan[0], lambda a, rows: plan[1](a)
        if self.kind == "transpose":
            if self.perm is None and self.input_shape is None:
                return None
            perm = self.perm or tuple(reversed(range(len(self.input_shape))))
            return perm[axis], lambda a, rows: a.transpose(perm)
        if axis == 0 and self.input_shape is not None and self.input_shape[:1] == self.shape[:1]:
            return 0, lambda a, rows: a.reshape((len(range(self.shape[0])[rows]), *self.shape[1:]))
        return None


def _layout(node: ir.Node) -> _Layout | None:
    if node.domain not in ("", "ai.onnx"):
        return None
    source = node.inputs[0]
    input_shape = tuple(int(d) for d in source.shape) if source.shape is not None and source.shape.is_static() \
        else None
    if node.op_type == "Identity":
        return _Layout("identity", input_shape)
    if node.op_type == "Transpose":
        perm = node.attributes.get("perm")
        return _Layout("transpose", input_shape, perm=None if perm is None else tuple(perm.as_ints()))
    if node.op_type == "Cast":
        return _Layout("cast", input_shape, to=ir.DataType(node.attributes["to"].as_int()).numpy())
    if node.op_type == "Gather" and node.attributes.get_int("axis", 0) == 0:
        index = node.inputs[1].const_value if node.inputs[1] is not None else None
        if index is None or index.shape != () or index.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
            return None
        return _Layout("select", input_shape, index=int(index.numpy()))
    if node.op_type in ("Unsqueeze", "Squeeze", "Reshape"):
        shape = node.outputs[0].shape
        if shape is None or not shape.is_static():
            return None
        return _Layout("reshape", input_shape, shape=tuple(int(d) for d in shape))
    return None


@dataclasses.dataclass(frozen=True)
class Weight:
    """A constant tensor reached through layout-only ops (Transpose, Unsqueeze, Squeeze, Reshape, Cast,
    Identity, Gather of one constant index on axis 0) from one initializer; ``source`` is that
    initializer and ``steps`` rebuild the value."""

    source: ir.Value
    steps: tuple[_Layout, ...]
    shape: tuple[int, ...]
    dtype: ir.DataType

    def array(self) -> np.ndarray:
        """The whole value (loads the source tensor)."""
        return self._whole(len(self.steps))

    def expert(self, e: int) -> np.ndarray:
        """Slice ``e`` of the first axis, read from the source with the index applied as early as the
        layout steps allow (for the usual steps: a view of one expert of the source, then the steps)."""
        return self._indexed(len(self.steps), 0, e)

    def rows(self, axis: int, start: int, stop: int) -> np.ndarray:
        """The value restricted to ``[start, stop)`` on ``axis`` (the axis kept), read from the source with the
        range applied as early as the layout steps allow: a lazy source computes that range alone."""
        return self._ranged(len(self.steps), axis, slice(start, stop))

    def _whole(self, level: int) -> np.ndarray:
        """The value after the first ``level`` steps."""
        array = _source_array(self.source.const_value)
        for step in self.steps[:level]:
            array = step.whole(array)
        return array

    def _indexed(self, level: int, axis: int, e: int) -> np.ndarray:
        """The value after the first ``level`` steps, indexed with ``e`` on ``axis``."""
        if level == 0 and axis == 0 and isinstance(self.source.const_value, SlicedTensor):
            return self.source.const_value.rows(e, e + 1)[0]
        plan = None if level == 0 else self.steps[level - 1].indexed(axis)
        if plan is None:  # the source itself, or a step that needs its whole input
            return self._whole(level)[(slice(None),) * axis + (e,)]
        input_axis, finish = plan
        return finish(self._indexed(level - 1, input_axis, e))

    def _ranged(self, level: int, axis: int, rows: slice) -> np.ndarray:
        """The value after the first ``level`` steps, restricted to ``rows`` on ``axis``."""
        if level == 0 and axis == 0 and isinstance(self.source.const_value, SlicedTensor):
            return self.source.const_value.rows(rows.start, rows.stop)
        plan = None if level == 0 else self.steps[level - 1].ranged(axis)
        if plan is None:
            return self._whole(level)[(slice(None),) * axis + (rows,)]
        input_axis, finish = plan
        return finish(self._ranged(level - 1, input_axis, rows), rows)


def weight(value: ir.Value | None) -> Weight | None:
    """Follow layout-only ops back to one initializer; None when the value is not such a constant.

    The shape comes from the value's static shape (shape inference must have run), so nothing is loaded.
    """
    steps = []
    current = value
    while current is not None and current.const_value is None:
        node = current.producer()
        step = None if node is None else _layout(node)
        if step is None:
            return None
        steps.append(step)
        current = node.inputs[0]
    if current is None or value.shape is None or not value.shape.is_static():
        return None
    dtype = value.dtype if value.dtype is not None else current.const_value.dtype
    return Weight(current, tuple(reversed(steps)), tuple(int(d) for d in value.shape), dtype)


def fresh_name(graph: ir.Graph | None, base: str) -> str:
    """``base``, or ``base_1``, ``base_2``, ...: the first that names no initializer of ``graph``.

    Names so depend only on the graph being rewritten (a rule set registers a rewrite's
    initializers before it tries the next node), not on what the process rewrote before.
    """
    taken = set() if graph is None else graph.initializers.keys()
    name, suffix = base, 0
    while name in taken:
        suffix += 1
        name = f"{base}_{suffix}"
    return name


#: while a lazy initializer is written: the source tensors converted so far and their arrays, by id
_CONVERTED: contextvars.ContextVar[dict[int, tuple[ir.TensorProtocol, np.ndarray]] | None] = \
    contextvars.ContextVar("moe_onnx_converted_sources", default=None)


def _source_array(tensor: ir.TensorProtocol) -> np.ndarray:
    """``tensor.numpy()``; while a lazy initializer is written, converted once and kept until that write ends
    (a tensor deserialized from a proto copies all its bytes on every ``numpy()``). External and sliced tensors
    are not kept: mapping them again is cheap (the writer unmaps them after each expert), and a sliced tensor is
    read by ranges where it matters."""
    converted = _CONVERTED.get()
    if converted is None or isinstance(tensor, (ir.ExternalTensor, SlicedTensor)):
        return tensor.numpy()
    if id(tensor) not in converted:
        converted[id(tensor)] = (tensor, tensor.numpy())  # the tensor, so that its id is not reused
    return converted[id(tensor)][1]


@contextlib.contextmanager
def _converting_sources_once() -> Iterator[None]:
    """The scope of one write: :func:`_source_array` converts each source once inside it (the outermost
    write's scope holds when a lazy initializer reads another)."""
    if _CONVERTED.get() is not None:
        yield
        return
    token = _CONVERTED.set({})
    try:
        yield
    finally:
        _CONVERTED.reset(token)


#: a sliced tensor is written (and read whole) in ranges of its first axis of about this many bytes
WRITE_CHUNK_BYTES = 16 << 20


class SlicedTensor(ir.LazyTensor):
    """A lazy tensor that computes any range of its first axis alone (:meth:`rows`), and is written (or read
    whole) a range of about :data:`WRITE_CHUNK_BYTES` at a time: its whole value is never held to be saved."""

    def __init__(self, dtype: ir.DataType, shape: Sequence[int], name: str):
        super().__init__(lambda: ir.tensor(self._whole(), dtype=dtype, name=name), dtype=dtype,
                         shape=ir.Shape(shape), name=name)

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of the first axis, of this tensor's numpy type."""
        raise NotImplementedError

    def _chunk_rows(self) -> int:
        """Rows per write: about WRITE_CHUNK_BYTES of them, at least one."""
        row_bytes = max(1, math.prod(self.shape.numpy()[1:]) * self.dtype.itemsize)
        return max(1, int(WRITE_CHUNK_BYTES // row_bytes))

    def _chunks(self) -> Iterator[np.ndarray]:
        count, step = self.shape[0], self._chunk_rows()
        for start in range(0, count, step):
            yield self.rows(start, min(count, start + step))

    def _whole(self) -> np.ndarray:
        shape = tuple(self.shape.numpy())
        if not shape:
            raise NotImplementedError(f"{self.name}: a scalar has no rows; subclasses read it whole")
        whole = np.empty(shape, dtype=self.dtype.numpy())
        start = 0
        for chunk in self._chunks():
            whole[start:start + len(chunk)] = chunk
            start += len(chunk)
        return whole

    def tofile(self, file) -> None:
        for chunk in self._chunks():
            write_array(file, np.ascontiguousarray(chunk, dtype=self.dtype.numpy()))


class _StreamedTensor(SlicedTensor):
    """A lazy tensor computed and written one slice of its first axis (one expert) at a time.

    After each slice the memory-mapped source tensors are released, so saving a transformed
    multi-GB weight holds about one expert's worth of data at a time; an in-memory source is converted
    once per write (:func:`_source_array`).
    """

    def __init__(self, expert_slice: Callable[[int], np.ndarray], dtype: ir.DataType, shape: Sequence[int],
                 name: str, sources: Sequence[ir.Value]):
        super().__init__(dtype, shape, name)
        self._expert_slice, self._sources = expert_slice, tuple(sources)

    def rows(self, start: int, stop: int) -> np.ndarray:
        if stop - start == 1:
            return self._slice(start)[None]
        with _converting_sources_once():
            return np.stack([self._slice(i) for i in range(start, stop)]) if stop > start else \
                np.zeros((0, *self.shape.numpy()[1:]), dtype=self.dtype.numpy())

    def _slice(self, index: int) -> np.ndarray:
        part = np.ascontiguousarray(self._expert_slice(index), dtype=self.dtype.numpy())
        expected = tuple(self.shape.numpy())[1:]
        if part.shape != expected:
            raise ValueError(f"moe_onnx rewrite: {self.name}[{index}] has shape {part.shape}, expected {expected}")
        return part

    def _release_sources(self) -> None:
        release_external(self._sources)

    def _whole(self) -> np.ndarray:
        with _converting_sources_once():
            whole = np.stack([self._slice(i) for i in range(self.shape[0])]) if self.shape[0] else \
                np.zeros(tuple(self.shape.numpy()), dtype=self.dtype.numpy())
        self._release_sources()
        return whole

    def tofile(self, file) -> None:
        with _converting_sources_once():
            for index in range(self.shape[0]):
                write_array(file, self._slice(index))
                self._release_sources()


def write_array(file, array: np.ndarray) -> None:
    """Write a C-contiguous array's bytes to ``file`` without copying them."""
    file.write(array.reshape(-1).view(np.uint8).data)


@contextlib.contextmanager
def sliced_as_references(model: ir.Model) -> Iterator[None]:
    """While the block runs, each sliced initializer of ``model``'s main graph stands as an external-data
    reference (nothing to read, its type and shape kept): the model serializes without computing its lazy
    weights (for onnx shape inference, which needs no large tensor's data)."""
    swapped = [(value, value.const_value) for value in model.graph.initializers.values()
               if isinstance(value.const_value, SlicedTensor)]
    for value, tensor in swapped:
        value.const_value = ir.ExternalTensor(f"unread:{tensor.name}", offset=None, length=None, dtype=tensor.dtype,
                                              shape=tensor.shape, name=tensor.name)
    try:
        yield
    finally:
        for value, tensor in swapped:
            value.const_value = tensor


def release_external(values: Iterable[ir.Value]) -> None:
    """Unmap the data of the initializers among ``values`` that are external (memory-mapped when read)."""
    for value in values:
        if isinstance(value.const_value, ir.ExternalTensor):
            value.const_value.release()


def initializer_expert(value: ir.Value, e: int) -> np.ndarray:
    """Slice ``e`` of the first axis of an initializer; a sliced one computes that slice alone, any other is
    read with :func:`_source_array`."""
    tensor = value.const_value
    if isinstance(tensor, _StreamedTensor):
        return tensor._slice(e)
    return tensor.rows(e, e + 1)[0] if isinstance(tensor, SlicedTensor) else _source_array(tensor)[e]


def streamed_initializer(graph: ir.Graph, name: str, expert_slice: Callable[[int], np.ndarray], dtype: ir.DataType,
                         shape: Sequence[int], sources: Sequence[ir.Value]) -> ir.Value:
    """A new initializer of ``graph`` like :func:`lazy_initializer`'s, made outside a rewrite rule."""
    unique = fresh_name(graph, name)
    tensor = _StreamedTensor(expert_slice, dtype, shape, unique, sources)
    value = ir.Value(name=unique, shape=ir.Shape(shape), type=ir.TensorType(dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


def lazy_initializer(op, name: str, expert_slice: Callable[[int], np.ndarray], dtype: ir.DataType,
                     shape: Sequence[int], sources: Sequence[ir.Value]) -> ir.Value:
    """A new initializer computed when the model is saved (or read): ``expert_slice(e)`` gives its
    slice ``e`` along the first axis; ``sources`` are the initializers those slices read (at least
    one; the graph they belong to makes ``name`` unique)."""
    unique = fresh_name(sources[0].graph, name)
    return op.initializer(_StreamedTensor(expert_slice, dtype, shape, unique, sources), name=unique)


def weight_value(op, w: Weight, name: str, transform: Callable[[np.ndarray], np.ndarray] | None = None,
                 shape: Sequence[int] | None = None) -> ir.Value:
    """An initializer holding ``w`` with ``transform`` applied to each expert's slice: the source itself
    when nothing changes, else a lazy one named after ``name``. ``shape`` is the result's shape
    (default: ``w``'s)."""
    if transform is None and not w.steps:
        return w.source
    per_expert = transform or (lambda a: a)
    return lazy_initializer(op, name, lambda e: per_expert(w.expert(e)), w.dtype,
                            w.shape if shape is None else shape, sources=[w.source])
