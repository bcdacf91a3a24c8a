"""The Python side of the Python-kernel host (custom_ops/src/host/python_host.cc).

The host registers one kernel per *variant*: an op with concrete output element types, which
onnxruntime must know before it runs (they may depend on attributes), in the private domain
``moe_onnx.python``. It asks :func:`op_specs` for the variants once, and calls :func:`compute` for
each node it runs: the op's numpy reference, or for a node of more than one rank its per-rank kernel
(``distributed/kernels.py``, imported only when such a node runs, so a session of one process never
loads the MPI layer). The host (``kHostModule`` in python_host.cc) looks up both here by name, and
``MoeOpError`` (the exception it reports as ORT_INVALID_ARGUMENT).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from ..ops import OPS, MoeOpError, OpDef
from ..ops._common import elem_of, elem_of_type_str, np_dtype
from ..ops.layout import several_ranks

PYTHON_DOMAIN = "moe_onnx.python"  # kDomain in python_host.cc
# Output element types a variant may have when the op's output type is a constraint (not fixed).
_VARIANT_TYPES = (1, 10, 16, 11, 3, 2, 5, 4, 6, 12, 7, 13, 9)  # every numeric TensorProto type
_MAX_VARIANTS = 256


def output_choices(op: OpDef) -> list[tuple[int, ...]]:
    """Per output of ``op``: the element types its variants cover."""
    choices = []
    for p in op.outputs:
        if p.type_str.startswith("tensor("):
            choices.append((elem_of_type_str(p.type_str),))
        else:
            choices.append(_VARIANT_TYPES)
    total = 1
    for c in choices:
        total *= len(c)
    if total > _MAX_VARIANTS:  # keep to the types the op's constraints allow
        choices = [c if len(c) == 1 else tuple(elem_of_type_str(t) for t in op.allowed_types(p))
                   for c, p in zip(choices, op.outputs)]
    return choices


def variant_name(op_name: str, types: Sequence[int]) -> str:
    """The op type of ``op_name``'s variant with output element types ``types``."""
    return f"{op_name}__{'_'.join(str(t) for t in types)}"


def op_specs() -> list[tuple]:
    """Per variant: its name, the op's name, optional flags of inputs and outputs, output types, attributes."""
    specs = []
    for op in OPS.values():
        for types in itertools.product(*output_choices(op)):
            specs.append((variant_name(op.name, types), op.name, [p.optional for p in op.inputs],
                          [p.optional for p in op.outputs], list(types), [(a.name, a.kind) for a in op.attributes]))
    return specs


def compute(op_name: str, node_name: str, inputs: list, attrs: dict, named_outputs: Sequence[bool]) -> list:
    """Runs one node: inputs are (memoryview, elem_type, shape) or None, ``named_outputs`` says which outputs
    the node names; returns per output (elem_type, shape, bytes view), None for an output the node does not name."""
    arrays = [None if item is None else np.frombuffer(item[0], dtype=np_dtype(item[1])).reshape(item[2])
              for item in inputs]
    kernel = _rank_kernel(op_name, attrs) or OPS[op_name].reference
    n_outputs = len(named_outputs)
    outputs = kernel(*arrays, _node_name=node_name, _named_outputs=named_outputs, **attrs)
    if not isinstance(outputs, (tuple, list)) or len(outputs) < n_outputs:
        raise MoeOpError(f"{op_name}: the Python kernel returned {type(outputs).__name__} "
                         f"of length {len(outputs) if isinstance(outputs, (tuple, list)) else '?'}; "
                         f"expected a tuple of at least {n_outputs} arrays")
    result = []
    for i, (out, named) in enumerate(zip(outputs, named_outputs)):
        if not named:
            result.append(None)
            continue
        if not isinstance(out, np.ndarray):
            raise MoeOpError(f"{op_name}: the Python kernel's output {i} is {type(out).__name__}; expected an array")
        elem = elem_of(out)
        shape = tuple(int(d) for d in out.shape)
        result.append((int(elem), shape, np.ascontiguousarray(out).reshape(-1).view(np.uint8)))
    return result


def _rank_kernel(op_name: str, attrs: dict):
    """The per-rank kernel of a node of several ranks, which runs its part
    (:func:`moe_onnx.distributed.kernels.kernel_for`); None for every other node, without importing the
    MPI layer."""
    if not several_ranks(attrs):
        return None
    from ..distributed.kernels import kernel_for

    return kernel_for(op_name, attrs)
