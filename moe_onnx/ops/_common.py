"""Shared machinery of the op definitions.

Each op module defines one :class:`OpDef`: its signature (formal inputs, outputs and attributes,
in ``signatures.py``, which the C++ build also reads), a ``validate`` function and a numpy
reference. ``validate`` takes a :class:`NodeView` and returns
the output types; the same function serves three callers, so a rule is written once:

* ONNX shape inference (``ContextView``, static shapes, raises on the first problem),
* ``moe-onnx check`` (``GraphView``, shapes from a model's value infos and initializers),
* the numpy reference and the kernels (``ArrayView``, concrete arrays).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, defs, helper

from .layout import Layout, tp_world_size_problem, world_size_problem
from .signatures import Signature

DOMAIN = "moe_onnx"
OPSET_VERSION = 1
#: the builder keywords of a node of our op set (``op.MOE(..., **IN_OUR_DOMAIN)``)
IN_OUR_DOMAIN = {"_domain": DOMAIN, "_version": OPSET_VERSION}

Dim = int | str | None  # a known size, a symbolic name, or unknown


class MoeOpError(ValueError):
    """An input or attribute of a moe_onnx op does not meet the op's contract."""


# ----------------------------------------------------------------------------- types

_ELEM_NAMES = {
    TensorProto.FLOAT: "float32",
    TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16",
    TensorProto.INT8: "int8",
    TensorProto.INT32: "int32",
    TensorProto.INT64: "int64",
    TensorProto.DOUBLE: "float64",
    TensorProto.UINT8: "uint8",
    TensorProto.BOOL: "bool",
}


def elem_name(elem_type: int) -> str:
    """Readable name of an ONNX element type, as used in error messages."""
    return _ELEM_NAMES.get(elem_type) or TensorProto.DataType.Name(elem_type).lower()


def elem_of_type_str(type_str: str) -> int:
    """ONNX element type of a "tensor(...)" type string ("tensor(float16)" -> TensorProto.FLOAT16)."""
    return getattr(TensorProto, type_str[len("tensor("):-1].upper())


def elem_of(array: np.ndarray) -> int:
    """ONNX element type of a numpy array (bfloat16 through ml_dtypes); UNDEFINED when ONNX has none."""
    try:
        return helper.np_dtype_to_tensor_dtype(array.dtype)
    except (KeyError, TypeError, ValueError):
        return TensorProto.UNDEFINED


def np_dtype(elem_type: int) -> np.dtype:
    """Numpy dtype of an ONNX element type (bfloat16 through ml_dtypes)."""
    if elem_type == TensorProto.BFLOAT16:
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """float16 and bfloat16 are computed in float32; float32 stays float32."""
    return np.dtype(np.float32) if dtype.kind == "f" or dtype == ml_dtypes.bfloat16 else dtype


def as_rows(array: np.ndarray) -> np.ndarray:
    """``array`` [..., H] as [rows, H], rows the product of its leading dims (also when H is 0)."""
    return array.reshape(math.prod(array.shape[:-1]), array.shape[-1])


# ----------------------------------------------------------------------------- formal parts

_ATTR_TYPES = {
    "int": defs.OpSchema.AttrType.INT,
    "float": defs.OpSchema.AttrType.FLOAT,
    "string": defs.OpSchema.AttrType.STRING,
    "ints": defs.OpSchema.AttrType.INTS,
}


# The ONNX type of an attribute of each kind (signatures.Attr.kind).
_ATTR_PROTO_TYPES = {"int": AttributeProto.INT, "float": AttributeProto.FLOAT, "string": AttributeProto.STRING,
                     "ints": AttributeProto.INTS}


def node_where(op_name: str, node_name: str) -> str:
    """"MOE node 'name'" (or "MOE" for an unnamed node): how errors name a node."""
    return f"{op_name} node '{node_name}'" if node_name else op_name


def check_attribute_names(op: Signature, node_name: str, names: Sequence[str]) -> None:
    """Raise MoeOpError for the first of ``names`` that is not an attribute of ``op``."""
    known = [a.name for a in op.attributes]
    for name in names:
        if name not in known:
            expected = ", ".join(f"'{k}'" for k in known)
            raise MoeOpError(f"{node_where(op.name, node_name)}: attribute '{name}' is not an attribute of "
                             f"{op.name}; expected one of {expected}")


def check_attribute_types(op: Signature, node_name: str, attributes: Sequence[onnx.AttributeProto]) -> None:
    """Raise MoeOpError for the first attribute of ``op``, in signature order, that the node gives with
    another ONNX type than its kind (an INT for a float attribute...). Names ``op`` lacks are skipped."""
    given = {a.name: a for a in attributes}
    for spec in op.attributes:
        proto, expected = given.get(spec.name), _ATTR_PROTO_TYPES[spec.kind]
        if proto is not None and proto.type != expected:
            name_of = AttributeProto.AttributeType.Name
            raise MoeOpError(f"{node_where(op.name, node_name)}: attribute '{spec.name}' has type "
                             f"{name_of(proto.type)}; expected {name_of(expected)}")


def check_node_attributes(op: Signature, node_name: str, attributes: Sequence[onnx.AttributeProto]) -> None:
    """The checks of a node's attributes as ONNX gives them: names first, then types
    (MoeOpError). The kernels check types at creation; moe_onnx.session() checks names."""
    check_attribute_names(op, node_name, [a.name for a in attributes])
    check_attribute_types(op, node_name, attributes)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Element type and shape of a value; ``shape`` is None when the rank is unknown."""

    elem_type: int
    shape: tuple[Dim, ...] | None


@dataclasses.dataclass(frozen=True)
class OpDef(Signature):
    """Everything that defines one op: the single source every backend follows."""

    validate: Callable[[NodeView], list[TensorInfo | None]]
    reference: Callable[..., Any]
    body: Callable[..., dict[str, Any]] | None = None
    """The op as standard ONNX ops (``moe-onnx optimize --portable``): ``body(op, config, inputs)`` builds
    one configuration with the builder ``op`` and returns each formal output's value (moe_onnx/ops/_body.py)."""
    no_body: str = ""
    """Why standard ONNX ops cannot express the op, where it has no ``body``: ``--portable`` refuses it so."""
    checked_only: tuple[str, ...] = ()
    """Attributes the function body never computes with (checked only): those that restate what the inputs
    say, and an ``accuracy_level`` the body computes exactly at every level. Nodes that differ only there
    share a body."""

    @classmethod
    def of(cls, signature: Signature, validate: Callable[[NodeView], list[TensorInfo | None]],
           reference: Callable[..., Any], *, body: Callable[..., dict[str, Any]] | None = None, no_body: str = "",
           checked_only: tuple[str, ...] = ()) -> OpDef:
        """The op of ``signature`` (moe_onnx/ops/signatures.py) with its validation, reference and either
        its function body or the reason it has none."""
        if (body is None) == (not no_body):
            raise ValueError(f"{signature.name}: OpDef.of takes its function body (body) or the reason it has "
                             "none (no_body): exactly one")
        formal = {f.name: getattr(signature, f.name) for f in dataclasses.fields(Signature)}
        return cls(**formal, validate=validate, reference=reference, body=body, no_body=no_body,
                   checked_only=checked_only)

    def input_elems(self, i: int) -> tuple[int, ...]:
        """The ONNX element types input i may have, in the order of its signature."""
        return tuple(elem_of_type_str(t) for t in self.allowed_types(self.inputs[i]))

    def schema(self) -> defs.OpSchema:
        """The onnx OpSchema, with the shared validation as its inference function."""
        S = defs.OpSchema
        option = {False: S.FormalParameterOption.Single, True: S.FormalParameterOption.Optional}
        attributes = []
        for a in self.attributes:
            if a.required or a.default is None:
                attributes.append(S.Attribute(a.name, _ATTR_TYPES[a.kind], a.doc, required=a.required))
            else:
                attributes.append(S.Attribute(a.name, helper.make_attribute(a.name, a.default), a.doc))
        schema = S(
            self.name,
            DOMAIN,
            OPSET_VERSION,
            self.doc,
            inputs=[S.FormalParameter(p.name, p.type_str, p.doc, param_option=option[p.optional]) for p in self.inputs],
            outputs=[S.FormalParameter(p.name, p.type_str, p.doc, param_option=option[p.optional]) for p in self.outputs],
            type_constraints=[(n, list(t), d) for n, t, d in self.type_constraints],
            attributes=attributes,
        )
        schema.set_type_and_shape_inference_function(self._infer)
        return schema

    def _infer(self, ctx: Any) -> None:
        view = ContextView(self, ctx)
        for i, info in enumerate(self.validate(view)):
            if info is not None and i < ctx.get_num_outputs() and ctx.has_output(i):
                ctx.set_output_type(i, _type_proto(info))


# ----------------------------------------------------------------------------- node views

class NodeView:
    """What validation may know about one node: input types/shapes, constants, attributes."""

    op: OpDef
    node_name: str
    _attributes_checked = False

    def input(self, i: int) -> TensorInfo | None:
        """Type and shape of input i, or None when the input is absent."""
        raise NotImplementedError

    def const(self, i: int) -> np.ndarray | None:
        """Value of input i when it is known (an initializer or a concrete array)."""
        raise NotImplementedError

    def _raw_attr(self, name: str) -> Any:
        raise NotImplementedError

    def has_output(self, i: int) -> bool:
        raise NotImplementedError

    def _check_attributes(self) -> None:
        """Check the node's attributes as a whole (names, ONNX types) where the view knows them."""

    # -- helpers built on the primitives

    def has(self, i: int) -> bool:
        return self.input(i) is not None

    def attr(self, name: str) -> Any:
        """Attribute value, with the default of the OpDef applied (the first call checks them all)."""
        if not self._attributes_checked:
            self._attributes_checked = True
            self._check_attributes()
        spec = self.op.attr_spec(name)
        value = _normalize_attr(self._raw_attr(name))
        if value is None:
            if spec.required:
                self.fail(f"attribute '{name}'", "is required")
            return list(spec.default) if isinstance(spec.default, (list, tuple)) else spec.default
        return value

    def where(self) -> str:
        return node_where(self.op.name, self.node_name)

    def fail(self, subject: str, message: str) -> None:
        raise MoeOpError(f"{self.where()}: {subject} {message}")

    def input_name(self, i: int) -> str:
        return f"input '{self.op.inputs[i].name}'"

    def require(self, i: int) -> TensorInfo:
        info = self.input(i)
        if info is None:
            self.fail(self.input_name(i), "is required")
        return info

    def expect_elem(self, i: int) -> int:
        """Input i's element type, after checking it is one its signature allows."""
        info = self.require(i)
        if info.elem_type not in self.op.input_elems(i) and info.elem_type != TensorProto.UNDEFINED:
            self.fail_elem(i, elem_name(info.elem_type))
        return info.elem_type

    def fail_elem(self, i: int, type_name: str) -> None:
        """Input i has the element type ``type_name``, which its signature does not allow."""
        names = ", ".join(elem_name(e) for e in self.op.input_elems(i))
        self.fail(self.input_name(i), f"has type {type_name}; expected {names}")

    def expect_same_elem(self, i: int, ref: int) -> None:
        """Input i must have the element type of input ``ref``."""
        a, b = self.input(i), self.input(ref)
        if a is None or b is None or TensorProto.UNDEFINED in (a.elem_type, b.elem_type):
            return
        if a.elem_type != b.elem_type:
            self.fail(self.input_name(i), f"has type {elem_name(a.elem_type)}; expected {elem_name(b.elem_type)}, "
                      f"the type of {self.input_name(ref)}")

    def expect_rank(self, i: int, rank: int | None = None, min_rank: int | None = None) -> tuple[Dim, ...] | None:
        """The shape of input i after checking its rank (None when the rank is unknown)."""
        shape = self.require(i).shape
        if shape is None:
            return None
        if rank is not None and len(shape) != rank:
            self.fail(self.input_name(i), f"has rank {len(shape)} (shape {fmt_shape(shape)}); expected rank {rank}")
        if min_rank is not None and len(shape) < min_rank:
            self.fail(self.input_name(i), f"has rank {len(shape)} (shape {fmt_shape(shape)}); expected rank >= {min_rank}")
        return shape


def fmt_shape(shape: Sequence[Dim] | None) -> str:
    if shape is None:
        return "[?]"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


class DimBinder:
    """Binds named sizes (E, H, k...) to the first known value and reports disagreements."""

    def __init__(self, view: NodeView):
        self.view = view
        self.values: dict[str, tuple[Dim, str]] = {}

    def bind(self, symbol: str, value: Dim, source: str) -> Dim:
        """Record ``symbol = value`` (seen at ``source``); raise when a known value disagrees."""
        if value is None:
            return self.values.get(symbol, (None, ""))[0]
        old = self.values.get(symbol)
        if old is None or old[0] is None:
            self.values[symbol] = (value, source)
            return value
        if isinstance(old[0], int) and isinstance(value, int) and old[0] != value:
            self.view.fail(source, f"is {value}; expected {symbol} = {old[0]} (from {old[1]})")
        if isinstance(old[0], str) and isinstance(value, int):
            self.values[symbol] = (value, source)
            return value
        return old[0]

    def get(self, symbol: str) -> Dim:
        return self.values.get(symbol, (None, ""))[0]

    def shape(self, i: int, symbols: Sequence[str], shape: tuple[Dim, ...] | None) -> None:
        """Bind each dim of input i to its symbol: "" skips a dim, "2X" binds X to half an even dim."""
        if shape is None:
            return
        name = self.view.op.inputs[i].name
        for axis, (symbol, dim) in enumerate(zip(symbols, shape)):
            if not symbol:
                continue
            if symbol.startswith("2") and len(symbol) > 1:
                if is_known(dim) and dim % 2:
                    self.view.fail(self.view.input_name(i), f"dim {axis} is {dim}; expected an even size ({symbol})")
                self.bind(symbol[1:], dim // 2 if is_known(dim) else None, f"input '{name}' dim {axis} (= {symbol})")
            else:
                self.bind(symbol, dim, f"input '{name}' dim {axis}")


def dim_product(dims: Sequence[Dim]) -> Dim:
    """Product of dims, None when any is unknown."""
    total = 1
    for d in dims:
        if not isinstance(d, int):
            return None
        total *= d
    return total


def is_known(*dims: Dim) -> bool:
    return all(isinstance(d, int) for d in dims)


class ContextView(NodeView):
    """A node seen through ONNX shape inference."""

    def __init__(self, op: OpDef, ctx: Any):
        self.op, self.ctx = op, ctx
        display = ctx.get_display_name()  # 'node MOE[moe_onnx] (name)'
        self.node_name = display[display.rfind("(") + 1:-1] if display.endswith(")") else ""

    def input(self, i: int) -> TensorInfo | None:
        if i >= self.ctx.get_num_inputs() or not self.ctx.has_input(i):
            return None
        tp = self.ctx.get_input_type(i)
        if tp is None or not tp.HasField("tensor_type"):
            return TensorInfo(TensorProto.UNDEFINED, None)
        return tensor_info_from_type(tp)

    def const(self, i: int) -> np.ndarray | None:
        if i >= self.ctx.get_num_inputs() or not self.ctx.has_input(i):
            return None
        data = self.ctx.get_input_data(i)
        return None if data is None else onnx.numpy_helper.to_array(data)

    def _raw_attr(self, name: str) -> Any:
        proto = self.ctx.get_attribute(name)
        return None if proto is None else helper.get_attribute_value(proto)

    def has_output(self, i: int) -> bool:
        return i < self.ctx.get_num_outputs() and self.ctx.has_output(i)

    def _check_attributes(self) -> None:  # inference shows the op's attributes only: their types
        given = [self.ctx.get_attribute(a.name) for a in self.op.attributes]
        check_attribute_types(self.op, self.node_name, [p for p in given if p is not None])


class ArrayView(NodeView):
    """A node seen through concrete numpy arrays (references and kernels).

    ``named_outputs`` says which outputs the node names, by position (None: all of them).
    """

    def __init__(self, op: OpDef, inputs: Sequence[np.ndarray | None], attrs: dict[str, Any],
                 node_name: str = "", named_outputs: Sequence[bool] | None = None):
        self.op, self.node_name = op, node_name
        self.arrays = list(inputs) + [None] * (len(op.inputs) - len(inputs))
        check_attribute_names(op, node_name, list(attrs))
        self.attrs = {k: v for k, v in attrs.items() if v is not None}
        self.named_outputs = [True] * len(op.outputs) if named_outputs is None else [bool(n) for n in named_outputs]
        for i, arr in enumerate(self.arrays):
            if arr is None:
                continue
            if not isinstance(arr, np.ndarray):
                raise MoeOpError(f"{self.where()}: {self.input_name(i)} must be a numpy array, got {type(arr).__name__}")
            if elem_of(arr) == TensorProto.UNDEFINED:  # a concrete array always has a type: none ONNX knows
                self.fail_elem(i, str(arr.dtype))

    def input(self, i: int) -> TensorInfo | None:
        arr = self.arrays[i] if i < len(self.arrays) else None
        if arr is None:
            return None
        return TensorInfo(elem_of(arr), tuple(int(d) for d in arr.shape))

    def const(self, i: int) -> np.ndarray | None:
        return self.arrays[i] if i < len(self.arrays) else None

    def _raw_attr(self, name: str) -> Any:
        return self.attrs.get(name)

    def has_output(self, i: int) -> bool:
        return i < len(self.named_outputs) and self.named_outputs[i]


class GraphView(NodeView):
    """A node of a model, with shapes from (inferred) value infos and constants from initializers."""

    def __init__(self, op: OpDef, node: onnx.NodeProto, types: dict[str, onnx.TypeProto],
                 constants: dict[str, Callable[[], np.ndarray]]):
        self.op, self.node, self.node_name = op, node, node.name
        self.types, self.constants = types, constants
        self.attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def _name(self, i: int) -> str:
        return self.node.input[i] if i < len(self.node.input) else ""

    def input(self, i: int) -> TensorInfo | None:
        name = self._name(i)
        if not name:
            return None
        tp = self.types.get(name)
        if tp is None or not tp.HasField("tensor_type"):
            return TensorInfo(TensorProto.UNDEFINED, None)
        return tensor_info_from_type(tp)

    def const(self, i: int) -> np.ndarray | None:
        load = self.constants.get(self._name(i))
        return None if load is None else load()

    def _raw_attr(self, name: str) -> Any:
        return self.attrs.get(name)

    def has_output(self, i: int) -> bool:
        return i < len(self.node.output) and bool(self.node.output[i])

    def _check_attributes(self) -> None:
        check_node_attributes(self.op, self.node_name, self.node.attribute)


def _normalize_attr(value: Any) -> Any:
    if isinstance(value, bytes):  # invalid UTF-8 as U+FFFD, as the Python-kernel host and the C++ messages have it
        return value.decode(errors="replace")
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_normalize_attr(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def tensor_info_from_type(tp: onnx.TypeProto) -> TensorInfo:
    tt = tp.tensor_type
    if not tt.HasField("shape"):
        return TensorInfo(tt.elem_type, None)
    dims: list[Dim] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return TensorInfo(tt.elem_type, tuple(dims))


def _type_proto(info: TensorInfo) -> onnx.TypeProto:
    shape = None if info.shape is None else [d if isinstance(d, (int, str)) else None for d in info.shape]
    return helper.make_tensor_type_proto(info.elem_type, shape)


# ----------------------------------------------------------------------------- value checks

def check_float_attr(view: NodeView, name: str, *, positive: bool = False, allow_inf: bool = False) -> float:
    """A float attribute that must be finite (or +inf when allowed) and optionally > 0."""
    value = float(view.attr(name))
    if math.isnan(value) or (math.isinf(value) and not (allow_inf and value > 0)):
        view.fail(f"attribute '{name}'", f"is {value}; expected a finite number" + (" or inf" if allow_inf else ""))
    if positive and not value > 0:
        view.fail(f"attribute '{name}'", f"is {value}; expected a value > 0")
    return value


#: ``accuracy_level`` (MOE, QMOE, MoeRowParallelLinear; as onnxruntime's MatMulNBits): the least accuracy a
#: node's GEMMs may use. EXACT: float32 (int32 for int8); BF16_OPERANDS: both operands of each GEMM may be
#: rounded to bfloat16 (round to nearest even), float32 accumulation. The references and the function
#: bodies compute EXACT at every level: exact is within what any level allows.
EXACT, BF16_OPERANDS = 0, 3
FLOAT_ACCURACY_LEVELS = (EXACT, BF16_OPERANDS)


def check_choice(view: NodeView, name: str, choices: Sequence[Any] | None = None) -> Any:
    """The attribute's value after checking it is one of ``choices`` (by default the values its
    signature declares: ``Attr.choices``)."""
    if choices is None:
        choices = view.op.attr_spec(name).choices
    value = view.attr(name)
    if value not in choices:
        view.fail(f"attribute '{name}'", f"is {value!r}; expected one of {', '.join(map(repr, choices))}")
    return value


def check_group_attrs(view: NodeView, size_name: str, rank_name: str) -> tuple[int, int]:
    """A group's size attribute (>= 1) and this rank's index in it ([0, size)); returns both."""
    size, rank = int(view.attr(size_name)), int(view.attr(rank_name))
    if size < 1:
        view.fail(f"attribute '{size_name}'", f"is {size}; expected >= 1")
    if not 0 <= rank < size:
        view.fail(f"attribute '{rank_name}'", f"is {rank}; expected 0 <= {rank_name} < {size_name} = {size}")
    return size, rank


def refuse_without_group(view: NodeView, layout: Layout, tp_only: bool = False) -> None:
    """The numpy reference runs in one process, a world of one rank: a node of a larger group is refused
    in the words the backends use on one process (MoeOpError). ``tp_only``: the node names only its TP
    group (MOE, MoeRowParallelLinear)."""
    if tp_only:
        problem = tp_world_size_problem(view.where(), 1, layout.tp_size)
    else:
        problem = world_size_problem(view.where(), 1, layout)
    if problem:
        raise MoeOpError(problem)


def drop_group_attrs(op_name: str, attrs: dict, ranks: int, what: str) -> None:
    """An all-ranks reference's attributes, tp_world_size and tp_rank_id removed in place: the number of
    ``what`` given is the group size (tp_world_size, if given, must equal it) and the q-th is TP rank q."""
    given = {name: attrs.pop(name) for name in ("tp_world_size", "tp_rank_id") if name in attrs}
    if given.get("tp_world_size", ranks) != ranks or "tp_rank_id" in given:
        raise MoeOpError(f"{op_name}: attributes {given} do not fit {ranks} {what}; expected tp_world_size = "
                         f"{ranks} (or none) and no tp_rank_id: the q-th of {what} is TP rank q")
