"""Without MPI everything of one process installs and runs: in a process where mpi4py cannot be
imported, moe_onnx imports, optimizes and runs sessions on both backends without trying to import
mpi4py or loading an MPI library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Makes mpi4py unimportable, as in an environment without it, and records every attempt to import it.
NO_MPI4PY = """
import sys

class NoMpi4py:
    attempts = []

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "mpi4py" or name.startswith("mpi4py."):
            cls.attempts.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoMpi4py)


def mpi_libraries():
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "/libmpi" in line})
"""

SINGLE_PROCESS = NO_MPI4PY + """
import numpy as np
import moe_onnx
from moe_onnx.cli import main

model, report = moe_onnx.optimize("models/fixtures/qwen3_moe_batched_mm_small.onnx")
assert "moe_onnx::MOE" in report.summary(), report.summary()
x = np.random.default_rng(0).standard_normal((2, 5, 64)).astype(np.float32)
outputs = [moe_onnx.session(model, backend=backend).run(None, {"hidden_states": x})[0] for backend in ("cpp", "python")]
np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)
assert main(["check", "models/fixtures/qwen3_moe_batched_mm_small.onnx"]) == 0
assert NoMpi4py.attempts == [], NoMpi4py.attempts
assert mpi_libraries() == [], mpi_libraries()
try:
    from mpi4py import MPI
except ModuleNotFoundError:
    print("single process ok")

"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_single_process_never_imports_mpi4py_nor_loads_mpi():
    out = _run(SINGLE_PROCESS)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "single process ok" in out.stdout.splitlines(), out.stdout
