"""Finding the built C++ libraries: the custom ops and the Python-kernel host."""

from __future__ import annotations

import os
import sys
from pathlib import Path

LIBRARY_ENV = "MOE_ONNX_CUSTOM_OPS_LIBRARY"
PYTHON_HOST_ENV = "MOE_ONNX_PYTHON_HOST_LIBRARY"
_LIB_NAMES = {"linux": "lib{}.so", "darwin": "lib{}.dylib", "win32": "{}.dll"}

_BUILD_HINT = ("Build it with `pip install .` (or `pip install -e .`) from the repository, or with CMake "
               "(docs/building.md), and point {env} at the built file.")


def custom_ops_library() -> str:
    """Path of the C++ custom-op library (``libmoe_onnx_ops.so``).

    ``$MOE_ONNX_CUSTOM_OPS_LIBRARY`` overrides it. Raises FileNotFoundError, saying how to build
    it, when the library is missing. Use it with plain onnxruntime:
    ``SessionOptions().register_custom_ops_library(moe_onnx.custom_ops_library())``.
    """
    return _find_library("moe_onnx_ops", LIBRARY_ENV)


def python_host_library() -> str:
    """Path of the Python-kernel host library (``libmoe_onnx_python_host.so``); see
    :func:`moe_onnx.runtime.session`. ``$MOE_ONNX_PYTHON_HOST_LIBRARY`` overrides it."""
    return _find_library("moe_onnx_python_host", PYTHON_HOST_ENV)


def _find_library(stem: str, env: str) -> str:
    override = os.environ.get(env)
    if override:
        if not os.path.isfile(override):
            raise FileNotFoundError(f"{env}={override} is not a file")
        return os.path.abspath(override)
    name = _LIB_NAMES.get(sys.platform, "lib{}.so").format(stem)
    candidates = [Path(__file__).parents[1] / "_lib" / name]  # moe_onnx/_lib
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
