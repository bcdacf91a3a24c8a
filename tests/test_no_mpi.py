"""Without MPI everything of one process installs and runs: in a process where mpi4py cannot be
imported, moe_onnx imports, optimizes and runs sessions on both backends without trying to import
mpi4py or loading an MPI library, and a node of several ranks fails with an error that says what it needs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess

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

#: A MoeDistributeDispatch of 2 EP ranks run in one process, outside mpirun, on `backend`.
TWO_RANK_NODE = NO_MPI4PY + """
import numpy as np
from onnx import TensorProto, helper
import moe_onnx

node = helper.make_node("MoeDistributeDispatch", ["x", "expert_ids"], ["expand_x", "expert_offset", "assist_info"],
                        name="dispatch", domain="moe_onnx", num_experts=2, ep_world_size=2, ep_rank_id=0)
graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4]),
                                        helper.make_tensor_value_info("expert_ids", TensorProto.INT64, [3, 1])],
                          [helper.make_tensor_value_info(n, t, None) for n, t in
                           [("expand_x", TensorProto.FLOAT), ("expert_offset", TensorProto.INT64),
                            ("assist_info", TensorProto.INT64)]])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("moe_onnx", 1)],
                           ir_version=10)
feeds = {"x": np.ones((3, 4), np.float32), "expert_ids": np.array([[0], [1], [1]], np.int64)}
try:
    moe_onnx.session(model, backend=sys.argv[1]).run(None, feeds)
except Exception as error:
    print("error:", str(error).splitlines()[-1] if str(error).strip() else repr(error))
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_single_process_never_imports_mpi4py_nor_loads_mpi():
    out = _run(SINGLE_PROCESS)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "single process ok" in out.stdout.splitlines(), out.stdout


@pytest.mark.slow  # a fresh process or a measurement: seconds, outside the fast lane
def test_a_node_of_two_ranks_says_what_it_needs():
    """python: the node needs 2 MPI ranks and mpi4py does not import; cpp: the node needs 2 ranks, which a build
    without MPI cannot give and a process outside mpirun (an MPI world of one) does not have."""
    out = _run(TWO_RANK_NODE, "python")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert ("MoeDistributeDispatch node 'dispatch': needs 2 MPI ranks (ep_world_size 2 x tp_world_size 1), but "
            "mpi4py does not import (No module named 'mpi4py'); install mpi4py and an MPI library") in out.stdout, \
        out.stdout
    out = _run(TWO_RANK_NODE, "cpp")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    without_mpi = ("MoeDistributeDispatch node 'dispatch': needs 2 MPI ranks (ep_world_size 2 x tp_world_size 1), "
                   "but this build has no MPI support")
    world_of_one = ("MoeDistributeDispatch node 'dispatch': attributes 'ep_world_size' and 'tp_world_size' are 2 "
                    "and 1: this node is one of 2 ranks and runs only with its group (under MPI")
    assert without_mpi in out.stdout or world_of_one in out.stdout, out.stdout
