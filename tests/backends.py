"""Running a :class:`cases.Case` on the onnxruntime backends and reading their errors, shared by
the kernel tests (tests/test_kernels.py) and the fuzzer (tests/test_fuzz.py); and the sessions the tests
build (:func:`cached_session`: a model run again soon after is not built again; :func:`options`)."""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from cases import Case

from moe_onnx.runtime import BACKENDS, run, session


def as_float64(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float64) if a.dtype.kind == "f" or a.dtype == ml_dtypes.bfloat16 else a


def options(threads: int | None = None) -> ort.SessionOptions:
    """Session options with ``threads`` intra-op threads (None: onnxruntime's default)."""
    opts = ort.SessionOptions()
    if threads is not None:
        opts.intra_op_num_threads = threads
    return opts


ONNXRUNTIME_SESSION_CLASSES = (ort.SessionOptions, ort.InferenceSession)  # before sessions_do_not_spin


class _NoSpinOptions(ort.SessionOptions):
    """Session options whose intra-op pool threads sleep when out of work instead of spinning for it
    (onnxruntime's default)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_session_config_entry("session.intra_op.allow_spinning", "0")


class _NoSpinSession(ort.InferenceSession):
    """A session built without options gets :class:`_NoSpinOptions`."""

    def __init__(self, path_or_bytes, sess_options=None, *args, **kwargs) -> None:
        super().__init__(path_or_bytes, _NoSpinOptions() if sess_options is None else sess_options, *args, **kwargs)


def sessions_do_not_spin() -> None:
    """From now on every onnxruntime session of this process, moe_onnx's and plain onnxruntime's, with options
    made by ``ort.SessionOptions()`` or none, does not spin. The suite runs a worker per core: a pool spinning
    after each run of a small model takes the core the other worker's test needs (measured: the kernel tables
    ran 2x as long; the export, generation and packing tests took ~25% more CPU time)."""
    ort.SessionOptions, ort.InferenceSession = _NoSpinOptions, _NoSpinSession


def sessions_as_onnxruntime_makes_them(monkeypatch) -> None:
    """For one test (``monkeypatch``): onnxruntime's own session classes again, for a test of the options our code
    sets (spinning included)."""
    monkeypatch.setattr(ort, "SessionOptions", ONNXRUNTIME_SESSION_CLASSES[0])
    monkeypatch.setattr(ort, "InferenceSession", ONNXRUNTIME_SESSION_CLASSES[1])


PLAIN = "plain"  # onnxruntime without our library
# The sessions kept, per backend (the least recently used are dropped): enough for a test, or the tests
# next to it, to run a model it ran before. Not more: sessions kept alive slowed the building of the next
# ones (measured: holding a thousand C++ sessions made the kernel tables ~25% slower than building them
# again), and a Python-kernel session holds about 7 MB.
SESSION_LIMITS = {"cpp": 16, "python": 4, PLAIN: 16}
_SESSIONS: dict[str, OrderedDict] = {backend: OrderedDict() for backend in SESSION_LIMITS}


def cached_session(model: onnx.ModelProto, backend: str = "cpp", threads: int | None = None) -> ort.InferenceSession:
    """A session on ``model`` (:func:`options`): ``moe_onnx.session(model, backend)`` for a backend of
    ``moe_onnx.runtime.BACKENDS``, plain onnxruntime on the CPU for :data:`PLAIN`; the one built before
    for an equal model (the serialized bytes), backend and ``threads`` while it is among the last
    SESSION_LIMITS[backend] used. Sessions keep no state between runs: a test may run one another built."""
    data = model.SerializeToString()
    key = (hashlib.blake2b(data, digest_size=20).digest(), threads)
    sessions = _SESSIONS[backend]
    if key in sessions:
        sessions.move_to_end(key)
        return sessions[key]
    if backend == PLAIN:
        sess = ort.InferenceSession(data, options(threads), providers=["CPUExecutionProvider"])
    else:
        assert backend in BACKENDS, backend
        sess = session(model, backend=backend, sess_options=options(threads))
    sessions[key] = sess
    if len(sessions) > SESSION_LIMITS[backend]:
        sessions.popitem(last=False)
    return sess


def run_case(case: Case, backend: str, threads: int = 2, valid: bool | None = None,
             model: onnx.ModelProto | None = None) -> list[np.ndarray]:
    """The outputs of ``case`` on ``backend`` (a cached session); ``valid`` (default: the case has no
    ``error``) keeps the output types shape inference gives the node. ``model``: a model of the case's
    node to run instead of ``case.model()`` (one session for cases that differ only in runtime inputs)."""
    if model is None:
        model = case.model()
        if not (case.error is None if valid is None else valid):
            # Case.model() declares the outputs of an invalid node with input 0's type; leave them
            # untyped so the kernel, not onnxruntime's graph type check, reports what is wrong.
            for out in model.graph.output:
                out.ClearField("type")
    return run(cached_session(model, backend, threads), case.feeds())


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
