"""moe_onnx.session / custom_ops_library: model forms, options pass-through, both backends,
Python kernels' dtypes, optional inputs and exceptions."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cases import ALL_CASES, Case
from cases.moe import BF16, GEMM2, GEMM3, make_inputs

import moe_onnx
from moe_onnx import runtime
from moe_onnx.ops import OPS
from moe_onnx.runtime import run, session

BASE = next(c for c in ALL_CASES if c.id == "MOE-gemm2_fp32")


def moe_case(**kw) -> Case:
    expert_type = kw.pop("expert_type", GEMM2)
    attrs = {"expert_type": expert_type, **({"expert_alpha": 1.702, "expert_beta": 7.0} if expert_type == GEMM2 else {})}
    return Case("MOE", "t", make_inputs(expert_type=expert_type, **kw), attrs, constant=(3, 4, 5, 6, 7),
                rtol=5e-2, atol=5e-2)


def test_library_paths_exist():
    assert os.path.isfile(moe_onnx.custom_ops_library())
    assert os.path.isfile(runtime.python_host_library())
    assert runtime.kernel_report()["gemm_panels"] in ("avx512", "avx2", "neon", "portable")


def test_library_missing_says_how_to_build(monkeypatch):
    monkeypatch.setenv(runtime.LIBRARY_ENV, "/nonexistent/libmoe_onnx_ops.so")
    with pytest.raises(FileNotFoundError, match="MOE_ONNX_CUSTOM_OPS_LIBRARY"):
        moe_onnx.custom_ops_library()


@pytest.mark.parametrize("backend", ["cpp", "python"])
@pytest.mark.parametrize("form", ["proto", "bytes", "path"])
def test_model_forms(tmp_path, backend, form):
    model = BASE.model()
    if form == "bytes":
        model = model.SerializeToString()
    elif form == "path":
        path = tmp_path / "moe.onnx"
        onnx.save(model, path)
        model = str(path)
    got = session(model, backend=backend).run(None, BASE.feeds())[0]
    np.testing.assert_allclose(got, BASE.run_reference()[0], rtol=1e-5, atol=1e-5)


def test_plain_onnxruntime_with_the_library():
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(moe_onnx.custom_ops_library())
    sess = ort.InferenceSession(BASE.model().SerializeToString(), opts, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, BASE.feeds())[0], BASE.run_reference()[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_sess_options_kept(backend):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.use_env_allocators", "0")
    sess = session(BASE.model(), backend=backend, sess_options=opts, providers=["CPUExecutionProvider"])
    assert sess.get_session_options().intra_op_num_threads == 1
    assert sess.get_session_options().log_severity_level == 3
    assert sess.get_providers() == ["CPUExecutionProvider"]
    sess.run(None, BASE.feeds())


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        session(BASE.model(), backend="cuda")


@pytest.mark.parametrize("backend", ["cpp", "python"])
@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("expert_type", [GEMM2, GEMM3])
def test_half_types(backend, dtype, expert_type):
    case = moe_case(dtype=dtype, expert_type=expert_type)
    got = run(session(case.model(), backend=backend), case.feeds())[0]
    expected = case.run_reference()[0]
    assert got.dtype == expected.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_optional_inputs_absent_in_the_middle(backend):
    case = moe_case(bias=False)  # bias_0 and bias_1 absent: "" in the middle of the inputs
    model = case.model()
    assert list(model.graph.node[0].input)[4] == ""
    got = session(model, backend=backend).run(None, case.feeds())[0]
    np.testing.assert_allclose(got, case.run_reference()[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_errors_name_op_and_input(backend):
    x, w, idx, *weights = BASE.inputs
    bad = Case("MOE", "bad", [x, w, np.where(idx == idx[3, 1], 40, idx), *weights], BASE.attrs,
               constant=BASE.constant)
    sess = session(bad.model(), backend=backend)
    with pytest.raises(Exception, match=r"MOE node 'MOE_node': router_topk_output_indices\[\d+, \d+\] = 40 is "
                                        r"outside \[0, 4\) \(num_experts from weight_0\)") as info:
        sess.run(None, bad.feeds())
    assert "INVALID_ARGUMENT" in str(info.value)


def test_python_exception_becomes_ort_error(monkeypatch):
    """Any Python exception in a Python kernel is raised from session.run, process intact."""
    def broken(*args, **kwargs):
        raise ZeroDivisionError("kernel bug")

    sess = session(BASE.model(), backend="python")
    original = OPS["MOE"]
    monkeypatch.setitem(OPS, "MOE", dataclasses.replace(original, reference=broken))
    with pytest.raises(Exception, match=r"MOE node 'MOE_node': Python kernel raised ZeroDivisionError: kernel bug"):
        sess.run(None, BASE.feeds())
    monkeypatch.setitem(OPS, "MOE", original)
    np.testing.assert_allclose(sess.run(None, BASE.feeds())[0], BASE.run_reference()[0], rtol=1e-5, atol=1e-5)


def test_python_kernel_wrong_output_type(monkeypatch):
    original = OPS["MOE"]

    def float64_output(*args, **kwargs):
        return tuple(y.astype(np.float64) for y in original.reference(*args, **kwargs))

    monkeypatch.setitem(OPS, "MOE", dataclasses.replace(original, reference=float64_output))
    sess = session(BASE.model(), backend="python")
    with pytest.raises(Exception, match=r"output 0 has type float64; expected float32"):
        sess.run(None, BASE.feeds())


def test_python_kernel_inputs_are_not_copied(monkeypatch):
    original = OPS["MOE"]
    seen = {}

    def spy(*args, **kwargs):
        seen["writeable"] = args[0].flags.writeable
        seen["is_view"] = args[0].base is not None
        return original.reference(*args, **kwargs)

    monkeypatch.setitem(OPS, "MOE", dataclasses.replace(original, reference=spy))
    session(BASE.model(), backend="python").run(None, BASE.feeds())
    assert seen == {"writeable": False, "is_view": True}  # a read-only view of onnxruntime's buffer


def test_python_kernel_from_concurrent_threads():
    """One session run from three Python threads at once (the binding releases the GIL during run):
    the host takes the GIL itself."""
    import threading

    sess = session(BASE.model(), backend="python")
    errors = []

    def work():
        try:
            for _ in range(5):
                sess.run(None, BASE.feeds())
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_bfloat16_run_helper_roundtrip():
    case = moe_case(dtype=ml_dtypes.bfloat16)
    out = run(session(case.model()), case.feeds())[0]
    assert out.dtype == ml_dtypes.bfloat16 and out.shape == case.inputs[0].shape


def test_sess_options_reused():
    opts = ort.SessionOptions()
    first = session(BASE.model(), sess_options=opts)
    second = session(BASE.model(), sess_options=opts)
    for sess in (first, second):
        np.testing.assert_allclose(sess.run(None, BASE.feeds())[0], BASE.run_reference()[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="already carry the 'cpp' backend"):
        session(BASE.model(), backend="python", sess_options=opts)


def test_python_sessions_register_the_variants_of_their_model():
    """The host registers the Python kernels the model runs (a session starts ~20x faster than with all ~260):
    the same options serve that model again, and refuse a model of other ops in one line."""
    opts = ort.SessionOptions()
    for _ in range(2):
        sess = session(BASE.model(), backend="python", sess_options=opts)
        np.testing.assert_allclose(sess.run(None, BASE.feeds())[0], BASE.run_reference()[0], rtol=1e-5, atol=1e-5)
    assert opts.get_session_config_entry(runtime.VARIANTS_KEY) == "MOE__1"
    other = next(c for c in ALL_CASES if c.op != "MOE" and c.error is None)
    with pytest.raises(ValueError, match=f"carry the Python kernels of another model \\(not {other.op}__"):
        session(other.model(), backend="python", sess_options=opts)


def test_the_python_host_refuses_a_variant_it_does_not_have():
    opts = ort.SessionOptions()
    opts.add_session_config_entry(runtime.VARIANTS_KEY, "MOE__1,NoSuchOp__1")
    with pytest.raises(Exception, match="names an op the host does not have: NoSuchOp__1"):
        opts.register_custom_ops_library(runtime.python_host_library())


def run_python(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh Python process (tests/ importable): a crash fails a test, not pytest."""
    return subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow  # a fresh process or a measurement: seconds, outside the fast lane
@pytest.mark.subprocess
def test_python_exception_message_not_utf8_encodable():
    """A kernel's message with a lone surrogate becomes an onnxruntime error (escaped), not a crash."""
    code = r"""
import dataclasses, sys
sys.path.insert(0, sys.argv[1])
from test_runtime import BASE
from moe_onnx.ops import OPS, MoeOpError
from moe_onnx.runtime import session

def broken(*args, **kwargs):
    raise MoeOpError("bad \udcff text")

sess = session(BASE.model(), backend="python")
OPS["MOE"] = dataclasses.replace(OPS["MOE"], reference=broken)
try:
    sess.run(None, BASE.feeds())
except Exception as error:
    print(type(error).__name__, str(error).encode("ascii", "backslashreplace").decode())
"""
    out = run_python(code)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    assert "INVALID_ARGUMENT" in out.stdout and "bad \\udcff text" in out.stdout, out.stdout


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_registrations_do_not_grow_memory(backend):
    """Registering the library on many SessionOptions keeps no memory per registration (the custom-op
    domains are made once)."""
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("AddressSanitizer's allocator keeps freed memory (quarantine, caches): resident size tells nothing")
    code = f"""
import gc
import onnxruntime as ort
from moe_onnx.runtime import custom_ops_library, python_host_library

library = custom_ops_library() if {backend!r} == "cpp" else python_host_library()

def register(times):
    for _ in range(times):
        ort.SessionOptions().register_custom_ops_library(library)
    gc.collect()

def resident_kib():
    return int(open("/proc/self/statm").read().split()[1]) * 4

register(200)  # allocator pools and caches settle
before = resident_kib()
register(4000)
print(resident_kib() - before)
"""
    out = run_python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) < 256, f"{out.stdout.split()[-1]} KiB more after 4000 registrations"
