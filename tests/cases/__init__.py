"""Case tables: one module per op, each a list of :class:`Case` run by every backend.

Each module ``cases/<op>.py`` defines ``OP`` (the op name), ``CASES`` and ``oracle`` (an independent,
slow implementation used to check the numpy reference); :data:`ALL_CASES` and :data:`ORACLES`
collect them, :data:`VALID_CASES` holds the valid ones. :func:`covering` picks the cases a test of
a path every case takes alike (a runner, a wrapper) needs, rather than all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from moe_onnx.ops import DOMAIN, OPS
from moe_onnx.ops._common import BF16_OPERANDS, check_node_attributes, elem_of
from moe_onnx.ops.layout import several_ranks
from moe_onnx.verify import BF16_COMPUTE_TOLERANCE, BF16_ROUNDING


@dataclasses.dataclass
class Case:
    """One node of one op: inputs by position (None = absent), attributes, and what must happen.

    ``error`` is a regex the error message must match (None: the case is valid); ``runtime`` marks
    errors only the input values reveal (so shape inference cannot see them); ``session`` marks
    errors moe_onnx.session() reports before onnxruntime runs (an attribute name the op lacks:
    onnxruntime cannot list a node's attributes to its kernels, nor ONNX shape inference to the
    op's inference function); ``constant``
    names the inputs stored as initializers when the case becomes a model (weights, offsets);
    ``outputs`` is how many outputs the node has (None: all of the op's outputs);
    ``rtol``/``atol`` bound the difference between backends and the reference.
    """

    op: str
    name: str
    inputs: list[np.ndarray | None]
    attrs: dict[str, Any]
    error: str | None = None
    runtime: bool = False
    session: bool = False
    constant: tuple[int, ...] = ()
    outputs: int | None = None
    rtol: float = 1e-5
    atol: float = 1e-5

    def mutated(self, name: str, error: str | None, runtime: bool = False, **changes: Any) -> Case:
        """A copy with inputs replaced (by input name; None: absent), Case fields (``constant``,
        ``session``...) set, or attributes changed (None: removed)."""
        names = [p.name for p in OPS[self.op].inputs]
        inputs, attrs, fields = self.padded_inputs(), dict(self.attrs), {}
        for key, value in changes.items():
            if key in {"constant", "outputs", "rtol", "atol", "session"}:
                fields[key] = value
            elif key in names:
                inputs[names.index(key)] = value
            elif value is None:
                attrs.pop(key, None)
            else:
                attrs[key] = value
        return dataclasses.replace(self, name=name, inputs=inputs, attrs=attrs, error=error, runtime=runtime, **fields)

    @property
    def id(self) -> str:
        return f"{self.op}-{self.name}"

    @property
    def node_name(self) -> str:
        """The name of the node in :meth:`model` (error messages of the backends say it)."""
        return f"{self.op}_node"

    def run_reference(self, node_name: str = "") -> tuple[np.ndarray, ...]:
        """The reference's outputs; its errors name ``node_name`` as the backends name a node. The
        attributes are first checked as ONNX types them (helper.make_node infers a type from each value)."""
        check_node_attributes(OPS[self.op], node_name, self.node().attribute)
        named = [i < self.n_outputs for i in range(len(OPS[self.op].outputs))]  # the outputs model() names
        outputs = OPS[self.op].reference(*self.inputs, _node_name=node_name, _named_outputs=named, **self.attrs)
        return tuple(outputs[: self.n_outputs])

    @property
    def n_outputs(self) -> int:
        return len(OPS[self.op].outputs) if self.outputs is None else self.outputs

    def input_names(self) -> list[str]:
        return [p.name if a is not None else "" for p, a in zip(OPS[self.op].inputs, self.padded_inputs())]

    def padded_inputs(self) -> list[np.ndarray | None]:
        return list(self.inputs) + [None] * (len(OPS[self.op].inputs) - len(self.inputs))

    def feeds(self) -> dict[str, np.ndarray]:
        """Runtime inputs of the model (the non-constant ones)."""
        return {name: a for i, (name, a) in enumerate(zip(self.input_names(), self.padded_inputs()))
                if a is not None and i not in self.constant}

    def node(self) -> onnx.NodeProto:
        """The case's node, named :attr:`node_name`."""
        op = OPS[self.op]
        names = self.input_names()
        while names and not names[-1]:
            names.pop()
        out_names = [p.name for p in op.outputs[: self.n_outputs]]
        return helper.make_node(op.name, names, out_names, domain=DOMAIN, name=self.node_name, **self.attrs)

    def model(self, symbolic: bool = False) -> onnx.ModelProto:
        """A single-node model; runtime inputs keep their shapes (or get symbolic dims)."""
        node = self.node()
        out_names = list(node.output)
        graph_inputs, initializers = [], []
        for i, (name, a) in enumerate(zip(self.input_names(), self.padded_inputs())):
            if a is None:
                continue
            if i in self.constant:
                initializers.append(_tensor(a, name))
            else:
                shape = [f"{name}_d{d}" for d in range(a.ndim)] if symbolic else list(a.shape)
                graph_inputs.append(helper.make_tensor_value_info(name, onnx_elem(a), shape))
        outputs = [onnx.ValueInfoProto(name=n) for n in out_names]
        graph = helper.make_graph([node], self.id, graph_inputs, outputs, initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)],
                                  ir_version=10)
        try:  # output types as shape inference gives them
            return onnx.shape_inference.infer_shapes(model, strict_mode=True)
        except Exception:  # an invalid case: declare the outputs with the type of input 0
            fallback = onnx_elem(self.inputs[0]) if self.inputs[0] is not None else onnx.TensorProto.FLOAT
            for out in model.graph.output:
                out.CopyFrom(helper.make_tensor_value_info(out.name, fallback, None))
            return model


def bf16_product_bound(a: np.ndarray, w: np.ndarray) -> float:
    """The most any element of ``a @ w`` (a [M, K], w [K, N]) computed from ``bf16(a) @ bf16(w)`` in float32
    can differ from the exact product: rounding to nearest even moves each operand by at most 2^-9 of itself
    (BF16_ROUNDING), so each of the K products by (2 * 2^-9 + 2^-18) |a w|, and the element by that times
    sum_k |a_k| |w_k| (<= K max|a| max|w|). The float32 accumulation's own error is level 0's, in the case's
    tolerance already. Values that are not finite count as 0 (they make the same inf/nan either way)."""
    magnitude = _finite_abs(a) @ _finite_abs(w)
    return (2 * BF16_ROUNDING + BF16_ROUNDING ** 2) * float(magnitude.max(initial=0.0))


def _finite_abs(a: np.ndarray) -> np.ndarray:
    a = np.abs(a.astype(np.float64))
    return np.where(np.isfinite(a), a, 0.0)


def _finite_max(a: np.ndarray) -> float:
    """The largest finite |value| of an array (0 when it has none or is not floating-point)."""
    return float(_finite_abs(a).max(initial=0.0)) if a.dtype.kind in "fV" else 0.0


def bf16_tolerance(case: Case, outputs) -> float:
    """The absolute error accuracy_level 3 (bfloat16 GEMM operands) may add to the outputs of ``case`` (valid;
    ``outputs``: its reference's). MoeRowParallelLinear, one GEMM: :func:`bf16_product_bound` of X and each
    expert's W (B stays float32). MOE and QMOE, two GEMMs with an activation between: that worst case,
    carried through both GEMMs, is several times the outputs of random data, so the bound is the one
    ``moe-onnx optimize --verify`` holds each block to, BF16_COMPUTE_TOLERANCE (6 * 2^-9, derived in
    moe_onnx/verify.py) of the largest finite |output|: K terms of either sign add like sqrt(K), and so do
    their roundings' errors."""
    if case.op == "MoeRowParallelLinear":
        x, _, w = case.padded_inputs()[:3]
        if x.size == 0 or w.size == 0:
            return 0.0
        rows = x.reshape(-1, w.shape[-1])
        return max(bf16_product_bound(rows, expert.T) for expert in w)
    return BF16_COMPUTE_TOLERANCE * max((_finite_max(out) for out in outputs), default=0.0)


def bf16_compute(case: Case, name: str) -> Case:
    """``case`` at accuracy_level 3 (bfloat16 GEMM operands allowed): the reference's exact result within the
    case's atol plus :func:`bf16_tolerance`. The kernels round where the CPU has AMX-BF16 or AVX512-BF16 and
    compute exactly elsewhere; both must pass."""
    return case.mutated(name, None, accuracy_level=BF16_OPERANDS,
                        atol=case.atol + bf16_tolerance(case, case.run_reference()))


def onnx_elem(array: np.ndarray) -> int:
    """ONNX element type of any array, also of dtypes no op allows (int16, uint64, complex64...)."""
    return elem_of(array) or helper.np_dtype_to_tensor_dtype(array.dtype)


def _tensor(array: np.ndarray, name: str) -> onnx.TensorProto:
    if elem_of(array) == onnx.TensorProto.BFLOAT16:
        return helper.make_tensor(name, onnx.TensorProto.BFLOAT16, array.shape,
                                  array.view(np.uint16).tobytes(), raw=True)
    return onnx.numpy_helper.from_array(array, name)


def _collect() -> tuple[list[Case], dict]:
    import importlib
    import pkgutil

    cases, oracles = [], {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        cases += module.CASES
        oracles[module.OP] = module.oracle
    return cases, oracles


def __getattr__(name: str):
    """``ALL_CASES``, ``ORACLES`` and ``VALID_CASES``, made from every op's module on first use: a process that
    needs one op's table (an MPI rank's driver: ``from cases import moe``) imports only that module."""
    if name not in ("ALL_CASES", "ORACLES", "VALID_CASES"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cases, oracles = _collect()
    globals().update(ALL_CASES=cases, ORACLES=oracles, VALID_CASES=[c for c in cases if c.error is None])
    return globals()[name]


def covering(cases: Sequence[Case], features: Callable[[Case], Iterable[Hashable]]) -> list[Case]:
    """The cases, in table order, that each bring a feature no earlier one has: together they have
    every feature any case has."""
    seen: set = set()
    chosen = []
    for case in cases:
        new = set(features(case)) - seen
        if new:
            chosen.append(case)
            seen |= new
    return chosen


def error_kind(case: Case) -> str | None:
    """How a case fails: None (valid), "session" (moe_onnx.session() refuses it), "attribute" (an
    attribute's type or name), "runtime" (only the input values show it) or "static" (types, shapes,
    attribute values: shape inference sees it)."""
    if case.error is None:
        return None
    if case.session:
        return "session"
    if case.name.startswith("attr_"):
        return "attribute"
    return "runtime" if case.runtime else "static"


def transport_features(case: Case) -> set[tuple]:
    """What a runner that hands a node to the op's reference (onnxruntime's Python-kernel host, onnx's
    ReferenceEvaluator) treats differently: the op and how the case fails; whether the node is one of
    several ranks (the host looks up a per-rank kernel); per input position its element type or its absence;
    every element type at all; how many outputs the node names; each attribute given or left to its default;
    and, for a valid case, the combination of its input types (the variant the host runs)."""
    op = OPS[case.op]
    types = tuple(None if a is None else str(a.dtype) for a in case.padded_inputs())
    features = {("kind", case.op, error_kind(case)), ("outputs", case.op, case.n_outputs),
                ("several ranks", case.op, several_ranks(case.attrs))}
    features |= {("input", case.op, i, t) for i, t in enumerate(types)} | {("type", t) for t in types}
    if case.error is None:
        features.add(("variant", case.op, types))
        features |= {("attribute", case.op, a.name, a.name in case.attrs) for a in op.attributes}
    return features


def lanes(cases: Sequence[Case], features: Callable[[Case], Iterable[Hashable]] = lambda c: {(c.op, error_kind(c))}
          ) -> list:
    """``cases`` as pytest parameters (ids: ``Case.id``): the fast lane (``pytest -m "not slow"``) runs the
    cases ``covering(cases, features)`` picks (by default one per op and way of failing), the others are
    marked slow."""
    fast = {id(case) for case in covering(cases, features)}
    return [pytest.param(case, id=case.id, marks=() if id(case) in fast else pytest.mark.slow) for case in cases]
