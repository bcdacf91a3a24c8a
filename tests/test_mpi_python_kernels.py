"""The Python backend's per-rank kernels under mpirun (2 and 4 ranks) against the all-ranks references,
and the one-process path without MPI.

One mpirun launch per rank count runs every configuration (tests/mpi/check_python_kernels.py). Without
mpirun or mpi4py these tests fail, with what is missing: CI installs both (docs/distributed.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "mpi" / "check_python_kernels.py"


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_python_kernels_under_mpirun_match_the_all_ranks_references(ranks, mpirun):
    done = mpirun(ranks, sys.executable, str(DRIVER), timeout=540, MOE_ONNX_COMM_TIMEOUT_S="60")
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


# The valid cases of the ops with a per-rank kernel that cover the Python host's paths (cases.covering): what
# reaches the per-rank kernels' lookup is the node's attributes, given or defaulted, and its inputs.
ONE_RANK_SESSION = """
import sys
import numpy as np
sys.path.insert(0, "tests")
from cases import VALID_CASES, covering, transport_features
from backends import run_case
ops = ("MoeDistributeDispatch", "MoeDistributeCombine", "MOE", "MoeRowParallelLinear")
for case in covering([c for c in VALID_CASES if c.op in ops], transport_features):
    run_case(case, "python")
print("mpi4py" in sys.modules)
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_one_rank_never_imports_mpi4py():
    """One-rank nodes of every op with a per-rank kernel run on the Python backend without importing mpi4py."""
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


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_two_rank_node_in_one_process_says_how_to_run_it(mpirun):
    """(``mpirun``: the message needs mpi4py, which fails the test when missing.)"""
    done = subprocess.run([sys.executable, "-c", TWO_RANK_NODE_ALONE], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "MoeDistributeDispatch node 'MoeDistributeDispatch_node': attributes 'ep_world_size' and 'tp_world_size' " \
           "are 2 and 1: this node is one of 2 ranks and runs only with its group (under MPI, docs/distributed.md), " \
           "not on one process" in done.stdout, done.stdout + done.stderr


@pytest.mark.slow  # a fresh process or a measurement: seconds, outside the fast lane
@pytest.mark.subprocess
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


@pytest.mark.slow
@pytest.mark.mpi
def test_a_process_whose_collective_timed_out_ends_the_job_at_exit(mpirun):
    """After a timeout the process cannot finalize MPI: it aborts the job at exit instead (as the C++ layer
    skips MPI_Finalize), so the launch ends within seconds instead of waiting for the rank that never came."""
    start = time.monotonic()
    done = mpirun(2, sys.executable, "-c", TIMED_OUT_THEN_EXIT, timeout=120, MOE_ONNX_COMM_TIMEOUT_S="2")
    seconds = time.monotonic() - start
    assert "TIMED OUT probe: the all-reduce of ones over the TP group (world ranks [0, 1]) did not complete within " \
           "2 s" in done.stdout, done.stdout + done.stderr
    assert done.returncode != 0
    assert seconds < 30, f"the job took {seconds:.0f} s to end"
