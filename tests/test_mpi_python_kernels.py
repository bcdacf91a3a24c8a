"""The Python backend's per-rank kernels under mpirun (2 and 4 ranks) against the all-ranks references,
and the one-process path without MPI.

One mpirun launch per rank count runs every configuration (tests/mpi/check_python_kernels.py). Without
mpirun or mpi4py these tests fail, with what is missing: CI installs both (docs/distributed.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "mpi" / "check_python_kernels.py"


def mpi_env() -> dict[str, str]:
    """The environment of an mpirun launch: this checkout importable, one thread per rank, as root if need be."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1",
            "MOE_ONNX_COMM_TIMEOUT_S": "60"}


def require_mpi() -> str:
    """mpirun's path; fails (not skips) when mpirun or mpi4py is missing."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("mpirun is not on PATH: install Open MPI (apt-get install openmpi-bin libopenmpi-dev); the "
                    "multi-rank tests need it")
    if importlib.util.find_spec("mpi4py") is None:
        pytest.fail("mpi4py is not installed in this Python (pip install mpi4py): the multi-rank tests need it")
    return mpirun


@pytest.mark.parametrize("ranks", [2, 4])
def test_python_kernels_under_mpirun_match_the_all_ranks_references(ranks):
    mpirun = require_mpi()
    done = subprocess.run([mpirun, "--oversubscribe", "-n", str(ranks), sys.executable, str(DRIVER)],
                          capture_output=True, text=True, env=mpi_env(), timeout=540)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and len(lines) == 1, \
        f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    report = json.loads(lines[0][len("RESULT "):])
    assert report["ranks"] == ranks
    names = [r["config"] for r in report["results"]]
    for family in ("dispatch_combine ep1", f"dispatch_combine ep{ranks}", "MOE tp2", "MoeRowParallelLinear tp2",
                   "comm timeout"):
        assert any(name.startswith(family) for name in names), f"no configuration {family}"
    failed = {r["config"]: r["problems"] for r in report["results"] if not r["ok"]}
    assert not failed, json.dumps(failed, indent=1)[:6000]


ONE_RANK_SESSION = """
import sys
import numpy as np
sys.path.insert(0, "tests")
from cases import ALL_CASES
from backends import run_case
for case in ALL_CASES:
    if case.error is None and case.op in ("MoeDistributeDispatch", "MoeDistributeCombine", "MOE",
                                          "MoeRowParallelLinear"):
        run_case(case, "python")
print("mpi4py" in sys.modules)
"""


def test_one_rank_never_imports_mpi4py():
    done = subprocess.run([sys.executable, "-c", ONE_RANK_SESSION], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"


TWO_RANK_NODE_ALONE = """
import sys
if sys.argv[1:] == ["no-mpi4py"]:
    sys.modules["mpi4py"] = None  # as if it were not installed
sys.path.insert(0, "tests")
import numpy as np
from cases import Case
from backends import run_case
x, ids = np.zeros((2, 4), np.float32), np.array([[0, 1], [2, 3]])
try:
    run_case(Case("MoeDistributeDispatch", "alone", [x, ids], dict(num_experts=4, ep_world_size=2, ep_rank_id=1)),
             "python")
except Exception as error:
    print(error)
"""


def test_a_two_rank_node_in_one_process_says_how_to_run_it():
    require_mpi()
    done = subprocess.run([sys.executable, "-c", TWO_RANK_NODE_ALONE], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "MoeDistributeDispatch node 'MoeDistributeDispatch_node': attributes 'ep_world_size' and 'tp_world_size' " \
           "are 2 and 1: this node is one of 2 ranks and runs only with its group (under MPI, docs/distributed.md), " \
           "not on one process" in done.stdout, done.stdout + done.stderr


def test_a_two_rank_node_without_mpi4py_says_what_is_missing():
    done = subprocess.run([sys.executable, "-c", TWO_RANK_NODE_ALONE, "no-mpi4py"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "MoeDistributeDispatch node 'MoeDistributeDispatch_node': needs 2 MPI ranks (ep_world_size 2 x " \
           "tp_world_size 1), but mpi4py does not import (" in done.stdout, done.stdout + done.stderr
    assert "install mpi4py and an MPI library (docs/distributed.md)" in done.stdout


# Rank 0's all-reduce times out (rank 1 never comes: it sleeps far past the test's bound); rank 0 catches the
# error and leaves Python normally. MPI_Finalize would wait for the lost collective, i.e. for rank 1.
TIMED_OUT_THEN_EXIT = """
import sys, time
import numpy as np
from mpi4py import MPI
from moe_onnx.ops.layout import Layout
from moe_onnx.distributed.comm import CommError, groups
rank = MPI.COMM_WORLD.Get_rank()
tp = groups(Layout(tp_size=2, tp_rank=rank), "probe").tp
if rank == 1:
    time.sleep(600)
try:
    tp.all_reduce_sum(np.ones(4, np.float32), "probe", "ones")
except CommError as error:
    print("TIMED OUT", error, flush=True)
"""


def test_a_process_whose_collective_timed_out_ends_the_job_at_exit():
    """After a timeout the process cannot finalize MPI: it aborts the job at exit instead (as the C++ layer
    skips MPI_Finalize), so the launch ends within seconds instead of waiting for the rank that never came."""
    mpirun = require_mpi()
    start = time.monotonic()
    done = subprocess.run([mpirun, "--oversubscribe", "-n", "2", sys.executable, "-c", TIMED_OUT_THEN_EXIT],
                          capture_output=True, text=True, env={**mpi_env(), "MOE_ONNX_COMM_TIMEOUT_S": "2"},
                          timeout=120)
    seconds = time.monotonic() - start
    assert "TIMED OUT probe: the all-reduce of ones over the TP group (world ranks [0, 1]) did not complete within " \
           "2 s" in done.stdout, done.stdout + done.stderr
    assert done.returncode != 0
    assert seconds < 30, f"the job took {seconds:.0f} s to end"
