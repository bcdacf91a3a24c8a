"""The C++ communication layer (custom_ops/src/comm/comm.cc, libmoe_onnx_mpi) and tensor parallelism in the
C++ MOE and MoeRowParallelLinear kernels (docs/distributed.md).

One-process checks run each in a fresh interpreter (MPI, once started, stays for the process); the
multi-rank ones run tests/mpi/*_driver.py under ONE mpirun launch per rank count. They need Open MPI's
mpirun and mpi4py (the project's CI installs both) and fail, saying so, without them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from backends import kernel_message, run_case
from cases import Case
from cases import moe as moe_cases
from cases import row_parallel_linear as rpl_cases

import moe_onnx
from moe_onnx.ops import MoeOpError

ROOT = Path(__file__).resolve().parents[1]
DRIVERS = ROOT / "tests" / "mpi"

# A 2-rank TP MOE node (this process as TP rank 0), created and run in a fresh interpreter, once per value
# of MOE_ONNX_COMM_TIMEOUT_S given after the tests dir and tp ("-": the environment's own); prints, per value,
# the error, or "ran", then the MPI libraries the process has loaded by then.
TWO_RANK_SESSION = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[1])
    from cases import Case
    from cases import moe as moe_cases
    from moe_onnx.runtime import run, session
    tp = int(sys.argv[2])
    inputs = moe_cases.make_inputs(tokens=3, inter=4, expert_type=moe_cases.GEMM3)
    case = Case(op="MOE", name="tp", inputs=inputs, constant=(3, 5, 7),
                attrs={"expert_type": moe_cases.GEMM3, "tp_world_size": tp, "tp_rank_id": 0})
    for timeout in sys.argv[3:] or ["-"]:
        if timeout != "-":
            os.environ["MOE_ONNX_COMM_TIMEOUT_S"] = timeout
        try:
            run(session(case.model(), backend="cpp"), case.feeds())
            print("ran")
        except Exception as error:
            print(str(error).split("Status Message: ")[-1])
        print(sorted({line.split()[-1].rsplit("/", 1)[-1] for line in open("/proc/self/maps")
                      if "libmpi" in line or "moe_onnx_mpi" in line}), "mpi4py" in sys.modules)
""")


def one_process(tp: int, timeouts: tuple[str, ...] = (), **env: str) -> list[tuple[str, str]]:
    """Per value of ``timeouts`` (none: the environment's MOE_ONNX_COMM_TIMEOUT_S), in one fresh process: (the
    node's error or "ran", the MPI libraries loaded and whether mpi4py was imported)."""
    result = subprocess.run([sys.executable, "-c", TWO_RANK_SESSION, str(ROOT / "tests"), str(tp), *timeouts],
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    return list(zip(lines[::2], lines[1::2]))


@pytest.mark.slow  # a fresh process or a measurement: seconds, outside the fast lane
@pytest.mark.subprocess
def test_one_rank_layout_loads_no_mpi():
    [(outcome, loaded)] = one_process(1)
    assert outcome == "ran"
    assert loaded == "[] False"


@pytest.mark.slow
@pytest.mark.subprocess
def test_missing_mpi_library_is_named(tmp_path):
    copy = tmp_path / "libmoe_onnx_ops.so"
    shutil.copy(moe_onnx.custom_ops_library(), copy)
    [(outcome, loaded)] = one_process(2, MOE_ONNX_CUSTOM_OPS_LIBRARY=str(copy))
    assert outcome == (f"MOE node 'MOE_node': needs 2 MPI ranks (ep_world_size 1 x tp_world_size 2), but this build "
                       f"has no MPI support (libmoe_onnx_mpi.so not found beside {copy.resolve()}); rebuild with MPI "
                       "(docs/building.md)")
    assert loaded == "[] False"


@pytest.mark.slow
@pytest.mark.subprocess
def test_bad_timeout_is_refused_before_mpi_is_loaded():
    """Each bad value, one after another in one process (the kernel reads the variable at each node's creation):
    refused, and MPI still not loaded after it."""
    values = ("abc", "0", "-2", "inf", "0x10")
    got = dict(zip(values, one_process(2, values)))
    assert got == {value: (f"MOE node 'MOE_node': environment variable MOE_ONNX_COMM_TIMEOUT_S is '{value}'; "
                           "expected a number of seconds > 0 (default 300)", "[] False") for value in values}


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_world_of_one_rank_refuses_as_the_reference():
    [(outcome, _)] = one_process(2)  # MPI starts as a singleton: a world of 1
    case = Case(op="MOE", name="tp", inputs=moe_cases.make_inputs(tokens=3, inter=4, expert_type=moe_cases.GEMM3),
                attrs={"expert_type": moe_cases.GEMM3, "tp_world_size": 2, "tp_rank_id": 0})
    with pytest.raises(MoeOpError) as reference:
        case.run_reference(case.node_name)
    assert outcome == str(reference.value) == (
        "MOE node 'MOE_node': attribute 'tp_world_size' is 2: this node is one of 2 ranks and runs only with its "
        "group (under MPI, docs/distributed.md), not on one process")


LAYOUT_ERRORS = [
    ("MOE", {"tp_world_size": 0}, r"attribute 'tp_world_size' is 0; expected >= 1"),
    ("MOE", {"tp_world_size": 2, "tp_rank_id": 2}, r"attribute 'tp_rank_id' is 2; expected 0 <= tp_rank_id < "
                                                   r"tp_world_size = 2"),
    ("MoeRowParallelLinear", {"tp_world_size": 3, "tp_rank_id": -1},
     r"attribute 'tp_rank_id' is -1; expected 0 <= tp_rank_id < tp_world_size = 3"),
]


@pytest.mark.parametrize("op,attrs,error", LAYOUT_ERRORS, ids=["moe-size", "moe-rank", "rpl-rank"])
def test_layout_attributes_are_checked_before_mpi(op, attrs, error):
    if op == "MOE":
        case = Case(op=op, name="layout", inputs=moe_cases.make_inputs(expert_type=moe_cases.GEMM3),
                    attrs={"expert_type": moe_cases.GEMM3, **attrs})
    else:
        case = Case(op=op, name="layout", inputs=rpl_cases.make_inputs(), attrs=attrs)
    with pytest.raises(MoeOpError) as reference:
        case.run_reference(case.node_name)
    with pytest.raises(Exception) as cpp:
        run_case(case, "cpp")
    assert re.search(error, str(reference.value))
    assert kernel_message(cpp.value) == str(reference.value)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_tensor_parallel_kernels_match_one_process(ranks, tmp_path, mpirun):
    launch = mpirun(ranks, sys.executable, str(DRIVERS / "tp_driver.py"), str(tmp_path), timeout=300)
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    for rank in range(ranks):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        failed = [r for r in results if not r["ok"]]
        assert not failed, f"rank {rank}: {failed[:5]}"
        assert {r["name"].split("-")[0] for r in results} == {"MOE", "RPL", "layout"}
        # 2 layout errors; per TP group size: 60 MOE, 32 MoeRowParallelLinear, 2 slices that do not add up
        assert len(results) == 2 + 94 * len({2, ranks})
        assert max(r["max_error"] for r in results if "float16" not in r["name"]) <= 1e-5


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("node,collective", [
    ("moe", "MOE node 'MOE_node': the all-reduce of the partial outputs over the TP group"),
    ("combine", "MoeDistributeCombine node 'MoeDistributeCombine_node': the all-to-all-v of the expert outputs "
                "back to their tokens over the EP group")])
def test_a_rank_that_never_comes_fails_the_collective_within_the_timeout(node, collective, tmp_path, mpirun):
    launch = mpirun(2, sys.executable, str(DRIVERS / "timeout_driver.py"), str(tmp_path), node, timeout=90,
                    MOE_ONNX_COMM_TIMEOUT_S="3")
    assert launch.returncode != 0  # rank 0 aborts the job
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["error"] is not None
    assert result["error"].endswith(
        f"{collective} (world ranks [0, 1]) did not complete within 3 s (MOE_ONNX_COMM_TIMEOUT_S): a rank of the "
        "group failed or never reached it")
    assert 3 <= result["seconds"] < 10
