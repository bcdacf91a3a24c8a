"""Running a :class:`cases.Case` on the onnxruntime backends and reading their errors, shared by
the kernel tests (tests/test_kernels.py) and the fuzzer (tests/test_fuzz.py)."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import onnxruntime as ort
from cases import Case

from moe_onnx.runtime import run, session


def as_float64(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float64) if a.dtype.kind == "f" or a.dtype == ml_dtypes.bfloat16 else a


def options(threads: int) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    return opts


def run_case(case: Case, backend: str, threads: int = 2, valid: bool | None = None) -> list[np.ndarray]:
    """The outputs of ``case`` on ``backend``; ``valid`` (default: the case has no ``error``) keeps
    the output types shape inference gives the node."""
    model = case.model()
    if not (case.error is None if valid is None else valid):
        # Case.model() declares the outputs of an invalid node with input 0's type; leave them
        # untyped so the kernel, not onnxruntime's graph type check, reports what is wrong.
        for out in model.graph.output:
            out.ClearField("type")
    sess = session(model, backend=backend, sess_options=options(threads))
    return run(sess, case.feeds())


# What onnxruntime puts before a kernel's message: a failed Compute, or a failed kernel creation.
ORT_PREFIX = re.compile(r"\[ONNXRuntimeError\] : \d+ : (\w+) : (Non-zero status code returned while running \S+ "
                        r"node\. Name:'[^']*' Status Message: |Exception during initialization: )")


KERNEL_CREATION = "RUNTIME_EXCEPTION (kernel creation)"


def kernel_error(error: Exception) -> tuple[str, str] | None:
    """(onnxruntime status name, the kernel's own message) of an error a kernel raised; None when
    the error does not come from a kernel (no onnxruntime kernel prefix). onnxruntime reports any
    exception of a kernel's constructor as RUNTIME_EXCEPTION, whatever its code: that status is
    :data:`KERNEL_CREATION`."""
    text = str(error)
    prefix = ORT_PREFIX.match(text)
    if prefix is None:
        return None
    status = KERNEL_CREATION if prefix.group(2).startswith("Exception during") else prefix.group(1)
    return status, text[prefix.end():]


def kernel_message(error: Exception) -> str:
    """The kernel's own message in an onnxruntime error (onnxruntime's prefix removed)."""
    found = kernel_error(error)
    assert found, f"no onnxruntime prefix in {str(error)!r}"
    return found[1]
