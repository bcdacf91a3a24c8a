"""onnxruntime sessions that run the moe_onnx ops, on the C++ kernels or on the Python kernels.

``session(model, backend="cpp")`` registers the C++ custom-op library (``custom_ops_library()``);
``backend="python"`` registers the Python-kernel host, a small C++ library that runs each op's
numpy reference (``moe_onnx.ops.OPS[name].reference``) under the GIL inside the same session; the
session runs a copy of the model whose moe_onnx nodes are moved to the host's private domain
(``moe_onnx.python``), each as the variant with the output types ONNX shape inference gives it.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort

from .ops import DOMAIN, OPS, MoeOpError
from .ops._common import np_dtype

__all__ = ["session", "run", "custom_ops_library", "python_host_library", "BACKENDS"]

BACKENDS = ("cpp", "python")
LIBRARY_ENV = "MOE_ONNX_CUSTOM_OPS_LIBRARY"
PYTHON_HOST_ENV = "MOE_ONNX_PYTHON_HOST_LIBRARY"
_LIB_NAMES = {"linux": "lib{}.so", "darwin": "lib{}.dylib", "win32": "{}.dll"}

_BUILD_HINT = ("Build it with `pip install .` (or `pip install -e .`) from the repository, or with CMake "
               "(docs/building.md), and point {env} at the built file.")


def _lib_file(stem: str) -> str:
    return _LIB_NAMES.get(sys.platform, "lib{}.so").format(stem)


def _find_library(stem: str, env: str) -> str:
    override = os.environ.get(env)
    if override:
        if not os.path.isfile(override):
            raise FileNotFoundError(f"{env}={override} is not a file")
        return os.path.abspath(override)
    name = _lib_file(stem)
    candidates = [Path(__file__).parent / "_lib" / name]
    # The source tree can shadow the installed package (e.g. `python` started in the repository):
    # then look for the library in the installed copies of the package too.
    for entry in sys.path:
        if entry:
            candidates.append(Path(entry) / "moe_onnx" / "_lib" / name)
    for path in candidates:
        if path.is_file():
            return str(path.resolve())
    raise FileNotFoundError(f"moe_onnx: {name} not found (looked in {candidates[0].parent} and the installed "
                            "moe_onnx packages). " + _BUILD_HINT.format(env=env))


def custom_ops_library() -> str:
    """Path of the C++ custom-op library (``libmoe_onnx_ops.so``).

    ``$MOE_ONNX_CUSTOM_OPS_LIBRARY`` overrides it. Raises FileNotFoundError, saying how to build
    it, when the library is missing. Use it with plain onnxruntime:
    ``SessionOptions().register_custom_ops_library(moe_onnx.custom_ops_library())``.
    """
    return _find_library("moe_onnx_ops", LIBRARY_ENV)


def python_host_library() -> str:
    """Path of the Python-kernel host library (``libmoe_onnx_python_host.so``); see :func:`session`."""
    return _find_library("moe_onnx_python_host", PYTHON_HOST_ENV)


def session(model: str | os.PathLike | bytes | onnx.ModelProto, backend: str = "cpp",
            sess_options: ort.SessionOptions | None = None, providers: Sequence[Any] | None = None,
            **kwargs: Any) -> ort.InferenceSession:
    """An ``onnxruntime.InferenceSession`` on ``model`` with the moe_onnx ops registered.

    ``model`` is a path, the serialized bytes or an ``onnx.ModelProto``. ``backend`` is ``"cpp"``
    (the C++ kernels, the default) or ``"python"`` (the numpy references run as kernels; the model
    is copied with its moe_onnx nodes moved to the host's domain, external data must be loadable).
    ``sess_options`` is used as given (the library is registered on it once, its other settings
    are kept; one SessionOptions serves one backend); ``providers`` (default
    ``["CPUExecutionProvider"]``) and other keyword arguments go to ``InferenceSession``.
    Raises ValueError for an unknown backend and FileNotFoundError when the library is not built;
    onnxruntime's exceptions come through unchanged.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    library = custom_ops_library() if backend == "cpp" else python_host_library()
    options = sess_options if sess_options is not None else ort.SessionOptions()
    _register(options, backend, library)
    if backend == "python":
        if isinstance(model, (str, os.PathLike)):
            model = onnx.load(os.fspath(model))
        elif isinstance(model, bytes):
            model = onnx.ModelProto.FromString(model)
        else:  # the caller's model: rewrite a copy
            model = onnx.ModelProto.FromString(model.SerializeToString())
        model = _python_model(model)
    else:
        model = _cpp_model(model)
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    elif isinstance(model, os.PathLike):
        model = os.fspath(model)
    return ort.InferenceSession(model, sess_options=options,
                                providers=list(providers) if providers is not None else ["CPUExecutionProvider"],
                                **kwargs)


_REGISTERED_KEY = "moe_onnx.registered_backend"  # a session config entry onnxruntime ignores


def _register(options: ort.SessionOptions, backend: str, library: str) -> None:
    """Registers ``library`` on ``options`` once: a SessionOptions may serve several sessions."""
    try:
        registered = options.get_session_config_entry(_REGISTERED_KEY)
    except RuntimeError:  # no such entry: not registered yet
        registered = None
    if registered == backend:
        return
    if registered is not None:
        raise ValueError(f"these SessionOptions already carry the {registered!r} backend's ops; "
                         f"use a new SessionOptions for backend={backend!r}")
    options.register_custom_ops_library(library)
    options.add_session_config_entry(_REGISTERED_KEY, backend)


def run(sess: ort.InferenceSession, feeds: dict[str, np.ndarray],
        output_names: Sequence[str] | None = None) -> list[np.ndarray]:
    """``sess.run`` that also takes and returns bfloat16 arrays (ml_dtypes), which onnxruntime's
    numpy conversion does not know. Other dtypes pass through as with ``sess.run``."""
    values = {}
    for name, value in feeds.items():
        value = value if value.flags.c_contiguous else value.copy(order="C")  # keeps 0-d arrays 0-d
        if value.dtype == ml_dtypes.bfloat16:
            values[name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(value.view(np.uint16),
                                                                           onnx.TensorProto.BFLOAT16)
        else:
            values[name] = ort.OrtValue.ortvalue_from_numpy(value)
    result = []
    for out in sess.run_with_ort_values(output_names, values):
        if out.data_type() == "tensor(bfloat16)":
            shape = tuple(out.shape())
            n = int(np.prod(shape))
            raw = (ctypes.c_uint16 * n).from_address(out.data_ptr()) if n else []
            result.append(np.array(np.frombuffer(raw, dtype=np.uint16) if n else np.zeros(0, np.uint16))
                          .view(ml_dtypes.bfloat16).reshape(shape))
        else:
            result.append(out.numpy())
    return result


# ----------------------------------------------------------------------------- C++ library's private domain

CPP_PRIVATE_DOMAIN = "moe_onnx.cpp"  # custom_ops/src/ops.cc


def _graphs(graph: onnx.GraphProto):
    """The graph and its subgraphs, depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else list(attr.graphs)):
                yield from _graphs(sub)


def _quantizing_init_routing(node: onnx.NodeProto) -> bool:
    quant = next((a.i for a in node.attribute if a.name == "quant_mode"), -1)
    return node.domain == DOMAIN and node.op_type == "MoeInitRouting" and quant in (0, 1)


def _cpp_model(model: str | os.PathLike | bytes | onnx.ModelProto):
    """``model``, or a copy whose quantizing MoeInitRouting nodes are in the C++ library's private
    domain: their expanded_x is int8 whatever x is, and onnxruntime takes output types from the
    registration that matches the input types, so these nodes need a registration of their own."""
    proto = model
    if isinstance(model, (str, os.PathLike)):
        proto = onnx.load(os.fspath(model), load_external_data=False)
    elif isinstance(model, bytes):
        proto = onnx.ModelProto.FromString(model)
    if not any(_quantizing_init_routing(n) for g in _graphs(proto.graph) for n in g.node):
        return model
    if isinstance(model, (str, os.PathLike)):
        onnx.load_external_data_for_model(proto, os.path.dirname(os.path.abspath(os.fspath(model))))
    elif proto is model:
        proto = onnx.ModelProto.FromString(model.SerializeToString())
    for graph in _graphs(proto.graph):
        for node in graph.node:
            if _quantizing_init_routing(node):
                node.domain = CPP_PRIVATE_DOMAIN
    if not any(o.domain == CPP_PRIVATE_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid(CPP_PRIVATE_DOMAIN, 1))
    return proto


# ----------------------------------------------------------------------------- python host protocol
# Used by the host library (custom_ops/src/python_host.cc); private.

PYTHON_DOMAIN = "moe_onnx.python"
# Output element types a variant may have when the op's output type is a constraint (not fixed).
_VARIANT_TYPES = (1, 10, 16, 11, 3, 2, 5, 4, 6, 12, 7, 13, 9)  # every numeric TensorProto type
_MAX_VARIANTS = 256


def _output_choices(op) -> list[tuple[int, ...]]:
    """Per output of ``op``: the element types its variants cover."""
    choices = []
    for p in op.outputs:
        if p.type_str.startswith("tensor("):
            choices.append((_elem_of_type_str(p.type_str),))
        else:
            choices.append(_VARIANT_TYPES)
    total = 1
    for c in choices:
        total *= len(c)
    if total > _MAX_VARIANTS:  # keep to the types the op's constraints allow
        allowed = {name: types for name, types, _ in op.type_constraints}
        choices = [c if len(c) == 1 else tuple(_elem_of_type_str(t) for t in allowed[p.type_str])
                   for c, p in zip(choices, op.outputs)]
    return choices


def _elem_of_type_str(type_str: str) -> int:
    name = type_str[len("tensor("):-1]
    return {"float": 1, "float16": 10, "bfloat16": 16, "double": 11}.get(name) or \
        onnx.helper.np_dtype_to_tensor_dtype(np.dtype(name))


def _variant_name(op_name: str, types: Sequence[int]) -> str:
    return f"{op_name}__{'_'.join(str(t) for t in types)}"


def _python_op_specs() -> list[tuple]:
    """Per variant: its name, the op's name, optional flags of inputs and outputs, output types, attributes."""
    import itertools

    specs = []
    for op in OPS.values():
        for types in itertools.product(*_output_choices(op)):
            specs.append((_variant_name(op.name, types), op.name, [p.optional for p in op.inputs],
                          [p.optional for p in op.outputs], list(types), [(a.name, a.kind) for a in op.attributes]))
    return specs


def _python_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, rewritten in place, with its moe_onnx nodes on the Python host: each becomes the
    variant (domain ``moe_onnx.python``) whose output types shape inference gives it; where
    inference cannot tell (an invalid node), the declared type, else the type of input 0, else float."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # an invalid node: the kernel will say what is wrong
        inferred = model
    types: dict[str, int] = {}
    graphs = [inferred.graph]
    while graphs:
        g = graphs.pop()
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                types.setdefault(vi.name, vi.type.tensor_type.elem_type)
        for init in g.initializer:
            types.setdefault(init.name, init.data_type)
        for node in g.node:
            for attr in node.attribute:
                graphs.extend([attr.g] if attr.HasField("g") else list(attr.graphs))

    def rewrite(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            for attr in node.attribute:
                for sub in ([attr.g] if attr.HasField("g") else list(attr.graphs)):
                    rewrite(sub)
            if node.domain != DOMAIN or node.op_type not in OPS:
                continue
            op = OPS[node.op_type]
            choices = _output_choices(op)
            first = types.get(node.input[0]) if node.input else None
            out_types = []
            for i, options in enumerate(choices):
                t = types.get(node.output[i]) if i < len(node.output) and node.output[i] else None
                if t not in options:
                    t = first if first in options else options[0]
                out_types.append(t)
            node.op_type = _variant_name(op.name, out_types)
            node.domain = PYTHON_DOMAIN

    rewrite(model.graph)
    if not any(o.domain == PYTHON_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(PYTHON_DOMAIN, 1))
    return model


def _python_compute(op_name: str, node_name: str, inputs: list, attrs: dict, n_outputs: int) -> list:
    """Runs one node: inputs are (memoryview, elem_type, shape) or None; returns (elem_type, shape, bytes view)."""
    arrays = [None if item is None else np.frombuffer(item[0], dtype=np_dtype(item[1])).reshape(item[2])
              for item in inputs]
    while arrays and arrays[-1] is None:
        arrays.pop()
    op = OPS[op_name]
    outputs = op.reference(*arrays, _node_name=node_name, **attrs)
    if not isinstance(outputs, (tuple, list)) or len(outputs) < n_outputs:
        raise MoeOpError(f"{op_name}: the Python kernel returned {type(outputs).__name__} "
                         f"of length {len(outputs) if isinstance(outputs, (tuple, list)) else '?'}; "
                         f"expected a tuple of at least {n_outputs} arrays")
    result = []
    for i, out in enumerate(outputs[:n_outputs]):
        if not isinstance(out, np.ndarray):
            raise MoeOpError(f"{op_name}: the Python kernel's output {i} is {type(out).__name__}; expected an array")
        elem = onnx.helper.np_dtype_to_tensor_dtype(out.dtype) if out.dtype.name != "bfloat16" else \
            onnx.TensorProto.BFLOAT16
        shape = tuple(int(d) for d in out.shape)
        result.append((int(elem), shape, np.ascontiguousarray(out).reshape(-1).view(np.uint8)))
    return result
