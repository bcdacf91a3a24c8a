"""onnxruntime sessions that run the moe_onnx ops, on the C++ kernels or on the Python kernels.

``session(model, backend="cpp")`` registers the C++ custom-op library (``custom_ops_library()``);
``backend="python"`` registers the Python-kernel host, a small C++ library that runs each op's
numpy reference (``moe_onnx.ops.OPS[name].reference``) under the GIL inside the same session; the
session runs a copy of the model whose moe_onnx nodes are moved to the host's private domain
(``moe_onnx.python``), each as the variant with the output types ONNX shape inference gives it.

Where the parts live: finding the libraries (and ``kernel_report()``, the C++ kernels chosen on this
machine) in ``library``, the private-domain copies of a model in ``private_domain``, the host's Python
side in ``python_host``, the packed-weights files a C++ session maps (``pack_weights``) in ``packed_weights``.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort

from .._ir.graph import walk
from ..ops import DOMAIN, OPS
from ..ops._common import check_attribute_names
from .library import LIBRARY_ENV, PYTHON_HOST_ENV, custom_ops_library, kernel_report, python_host_library
from .packed_weights import DEFAULT, DIRECTORY_KEY, config_entries, pack_weights, session_directory
from .private_domain import cpp_model, python_model, structure
from .python_host import PYTHON_DOMAIN
from .weights_file import inline_weights_to_map, with_weights_in_file


__all__ = ["session", "run", "pack_weights", "custom_ops_library", "python_host_library", "kernel_report",
           "BACKENDS", "LIBRARY_ENV", "PYTHON_HOST_ENV"]

BACKENDS = ("cpp", "python")


def session(model: str | os.PathLike | bytes | onnx.ModelProto, backend: str = "cpp",
            sess_options: ort.SessionOptions | None = None, providers: Sequence[Any] | None = None,
            packed_weights: str | os.PathLike | None = DEFAULT, **kwargs: Any) -> ort.InferenceSession:
    """An ``onnxruntime.InferenceSession`` on ``model`` with the moe_onnx ops registered.

    ``model`` is a path, the serialized bytes or an ``onnx.ModelProto``. ``backend`` is ``"cpp"``
    (the C++ kernels, the default) or ``"python"`` (the numpy references run as kernels; the model
    is copied with its moe_onnx nodes moved to the host's domain, external data must be loadable).
    ``sess_options`` is used as given (the library is registered on it once, its other settings
    are kept; one SessionOptions serves one backend, and for ``"python"`` the Python kernels of the first
    model's ops: a model with other ops needs a new one); ``providers`` (default
    ``["CPUExecutionProvider"]``) and other keyword arguments go to ``InferenceSession``. ``"cpp"`` on a model
    whose large initializers are inline (inside the .onnx) creates the session from a temporary copy with them
    in an external data file, deleted once the session exists, so that the weights are held once
    (:mod:`moe_onnx.runtime.weights_file`).
    ``packed_weights`` (``"cpp"`` only): the folder of packed-weights files (:func:`pack_weights`, ``moe-onnx
    pack``) whose panels the expert ops map instead of packing; by default ``<model path>.packed`` when ``model``
    is a path and that folder exists; None or False for none. A node whose file is missing or does not match its
    weights packs them itself and logs why (:mod:`moe_onnx.runtime.packed_weights`). The folder is set when the
    library is registered: a ``sess_options`` registered with another folder raises ValueError.
    Raises ValueError for an unknown backend; :class:`moe_onnx._ir.model_files.ModelFileError` (a ValueError)
    for a path that cannot be read as a model (missing, a folder, empty, not ONNX) or whose external data is
    missing or short, with the message ``moe-onnx optimize`` gives; FileNotFoundError when the library is not
    built and MoeOpError for a moe_onnx node with an attribute its op does not have (onnxruntime does not show
    kernels the names of a node's attributes, so the kernels cannot report it); onnxruntime's exceptions come
    through unchanged.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    proto = None
    packed_directory = session_directory(model, packed_weights) if backend == "cpp" else None
    if isinstance(model, (str, os.PathLike)):
        from .._ir import model_files  # onnx_ir is imported only when a session reads a file

        proto = model_files.read_complete(model)
    options = sess_options if sess_options is not None else ort.SessionOptions()
    if backend == "python":
        if proto is not None:
            model = model_files.with_data(proto, model)
        elif isinstance(model, bytes):
            model = onnx.ModelProto.FromString(model)
        else:  # the caller's model: rewrite a copy
            model = onnx.ModelProto.FromString(model.SerializeToString())
        _check_attribute_names(model)
        model = python_model(model)
        _register_python_host(options, _variants(model))
    else:
        caller_model = model
        proto = structure(model) if proto is None else proto
        _check_attribute_names(proto)
        model = cpp_model(model, proto)
        _register(options, backend, custom_ops_library(), config_entries(packed_directory))
        owned = model if isinstance(model, onnx.ModelProto) else proto
        if inline_weights_to_map(owned):  # held once: mapped from a file, then packed
            if owned is caller_model:  # the caller's model stays as it is
                owned = onnx.ModelProto.FromString(owned.SerializeToString())
            return with_weights_in_file(owned, lambda path: _inference_session(path, options, providers, kwargs))
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    elif isinstance(model, os.PathLike):
        model = os.fspath(model)
    return _inference_session(model, options, providers, kwargs)


def _inference_session(model: str | bytes, options: ort.SessionOptions, providers: Sequence[Any] | None,
                       kwargs: dict[str, Any]) -> ort.InferenceSession:
    return ort.InferenceSession(model, sess_options=options,
                                providers=list(providers) if providers is not None else ["CPUExecutionProvider"],
                                **kwargs)


def _check_attribute_names(model: onnx.ModelProto) -> None:
    """MoeOpError for the first moe_onnx node (subgraphs included) with an attribute its op lacks."""
    for node, _ in walk(model.graph):
        if node.domain == DOMAIN and node.op_type in OPS:
            check_attribute_names(OPS[node.op_type], node.name, [a.name for a in node.attribute])


_REGISTERED_KEY = "moe_onnx.registered_backend"  # a session config entry onnxruntime ignores


def _config_entry(options: ort.SessionOptions, key: str) -> str | None:
    try:
        return options.get_session_config_entry(key)
    except RuntimeError:  # no such entry
        return None


def _register(options: ort.SessionOptions, backend: str, library: str, entries: dict[str, str] | None = None) -> None:
    """Registers ``library`` on ``options`` once, with the session config ``entries`` it reads when registered
    (the packed-weights folder: packed_weights.config_entries): a SessionOptions may serve several sessions
    with the same entries."""
    entries = entries or {}
    registered = _config_entry(options, _REGISTERED_KEY)
    if registered == backend:
        directory, wanted = _config_entry(options, DIRECTORY_KEY), entries.get(DIRECTORY_KEY)
        if directory != wanted:
            raise ValueError(f"these SessionOptions were registered with packed_weights={directory!r}; use a new "
                             f"SessionOptions for packed_weights={wanted!r}")
        return
    if registered is not None:
        raise ValueError(f"these SessionOptions already carry the {registered!r} backend's ops; "
                         f"use a new SessionOptions for backend={backend!r}")
    for key, value in entries.items():
        options.add_session_config_entry(key, value)
    options.register_custom_ops_library(library)
    options.add_session_config_entry(_REGISTERED_KEY, backend)


VARIANTS_KEY = "moe_onnx.python.variants"  # kVariantsKey in custom_ops/src/host/python_host.cc


def _variants(model: onnx.ModelProto) -> set[str]:
    """The Python host's variants that ``model`` (moved to its domain) runs."""
    return {node.op_type for node, _ in walk(model.graph) if node.domain == PYTHON_DOMAIN}


def _register_python_host(options: ort.SessionOptions, variants: set[str]) -> None:
    """Registers the Python-kernel host on ``options`` with the ``variants`` a model runs: onnxruntime builds a
    schema and a kernel definition per registered op for every session, so a session of a few variants starts
    some 20x faster than one of all of them. The first registration fixes the set: a later session on the same
    options whose model runs other variants raises ValueError."""
    try:
        registered = set(filter(None, options.get_session_config_entry(VARIANTS_KEY).split(",")))
    except RuntimeError:  # not registered for the Python host yet
        registered = None
    if registered is not None and not variants <= registered:
        raise ValueError(f"these SessionOptions carry the Python kernels of another model (not "
                         f"{', '.join(sorted(variants - registered))}); use a new SessionOptions for this model")
    if registered is None:
        options.add_session_config_entry(VARIANTS_KEY, ",".join(sorted(variants)))
    _register(options, "python", python_host_library())


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
