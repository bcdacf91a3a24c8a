"""Finding the built C++ libraries (the custom ops and the Python-kernel host), and what the custom
ops' ISA table chose on this machine."""

from __future__ import annotations

import ctypes
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


def kernel_report() -> dict[str, str]:
    """The C++ library's ISA table on this machine (docs/building.md, "Instruction-set levels"): the level
    in use (``level``), the kernel of every slot (``gemm_panels``, ``int8_gemm``, ``quant_dots``, ...; "none"
    for an unfilled one), the capabilities (``avx512_vnni``, ``avx512_bf16``, ``amx_int8``, ``amx_bf16``:
    "yes"/"no") and where the AMX slots run (``amx``: "usable", "modelled", "off", "capped",
    "not-in-cpu", "not-in-build", "refused"; ``amx_reason``: why).

    The table is filled once per process, from ``MOE_ONNX_GEMM`` and ``MOE_ONNX_AMX`` as they are then.
    Raises ValueError, in the library's words, when either is invalid.
    """
    lib = ctypes.CDLL(custom_ops_library())
    lib.MoeOnnxKernelReport.restype = ctypes.c_char_p
    text = lib.MoeOnnxKernelReport().decode()
    if text.startswith("error="):
        raise ValueError(text.removeprefix("error="))
    return dict(item.split("=", 1) for item in text.split(";"))


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
